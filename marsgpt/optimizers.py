"""The optimizers train.py offers, one registry entry each: the catalogue the configuration and the trainer look
an optimizer up in. Importing it loads no torch: parsing a configuration reads it.

OPTIMIZERS holds an OptimizerEntry per optimizer, each selected by one name, the configuration's `optimizer`:
mars-adamw, mars-lion, mars-shampoo, mars-m, adamw, muon and moonlight. An entry is all the other modules know
of an optimizer: the configuration keys it reads, its named parameter groups (which parameters, which
settings), its factory, what it adds to a step (exact MARS's look-ahead), the state norms of its train line, its
one-line description, and how the paper's reference code names it (optimizer_name=mars with mars_type=mars-m:
config.py takes those keys too, through Registry.from_reference_keys). No other module names an optimizer or
tests its class: adding an optimizer is an entry here (and its keys in config.TrainConfig if it reads new ones)
with its tests. The optimizer object a run holds is built from an entry by marsgpt/training_optimizer.py.

Each optimizer is built as the paper's reference code builds it (AGI-Arena/MARS at 4831e28):

mars-adamw, mars-lion, mars-shampoo -- mars.MARS as MARS/train_mars.py and its model's configure_optimizers:
         the two weight-decay groups, lr=learning_rate, betas=(beta1, beta2) and the MARS keys; 1-D tensors
         take lr_1d.
mars-m -- as MARS_M/train_mars_m.py: mars.MARS on the blocks' matrices and its AdamW part (routing="none",
         betas_1d) on the embeddings, the tied head and the 1-D tensors, every tensor at lr=learning_rate
         and weight_decay, momentum beta1.
adamw -- torch.optim.AdamW over the same two groups, betas=(beta1, beta2), fused on CUDA.
muon  -- torch.optim.Muon (lr muon_lr, weight decay 0) chained with AdamW (lr muon_adamw_lr,
         betas=(beta1, beta2), weight_decay), as one object. muon_matrices="all", as the reference
         MARS/train_muon.py: Muon takes every 2-D tensor -- the token and position embeddings and the
         tied head included -- and AdamW the 1-D ones; "hidden": Muon takes only the blocks' matrices.
moonlight -- MARS-M's baseline, as MARS_M/train_moonlight.py: torch.optim.Muon (Nesterov, momentum beta1,
         update scaled by 0.2 sqrt(max(rows, cols)): adjust_lr_fn="match_rms_adamw") on the blocks' matrices,
         chained with AdamW (betas_1d) on the rest, both at learning_rate and weight_decay.

Every hyperparameter the configuration sets is written into the groups, at construction and again after a
resume's load_state_dict (group_hyperparameters). Each group keeps its peak lr as 'initial_lr'; scheduled_lr
gives the schedule. What builds an optimizer imports torch, mars.py and model.py where it runs. The machinery
is any trainer's, through plain arguments: Registry and OptimizerEntry (vision/train_cifar.py has a Registry of
its own).
"""

import dataclasses
import math
from collections.abc import Callable
from functools import partial

from marsgpt.optim_protocol import ChainedOptimizer

# ---------------------------------------------------------------------------------------------------
# The registry: a trainer's optimizers, each an entry that says everything about it.


def no_look_ahead(cfg: object) -> bool:
    return False


def no_state_norms(optimizer: object, parallel: object) -> dict:
    return {}


def no_check(cfg: object) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer a trainer offers, by its name. torchtitan's parameter-group rule holds: every trainable
    parameter is in exactly one group (build checks it).

    Its parameter groups have names, by which a resume pairs a checkpoint's groups with group_settings(cfg);
    split(model, cfg) returns each group's parameters in the order of those names, and build(groups, cfg,
    parallel) makes the optimizer over the groups, each torch optimizer inside through parallel.place_optimizer
    (so ZeRO-1 and FSDP2 place it: marsgpt/parallel.py).
    """

    name: str  # the value of its Registry's key that selects it
    description: str  # one line, for --help
    keys: frozenset  # the configuration keys it reads
    group_settings: Callable  # cfg -> {group name: {hyperparameter: value}}, 'lr' the group's peak lr
    split: Callable  # (model, cfg) -> one list of parameters per group
    build: Callable  # (groups, cfg, parallel) -> the optimizer
    label: Callable | None = None  # cfg -> the run's optimizer in a few words (the memory plan's first line)
    # What it adds to a step: whether the optimizer takes exact MARS's look-ahead gradient (mars.MARS's protocol:
    # update_previous_grad() after a backward pass on the next batch, update_last_grad() after the step).
    look_ahead: Callable = no_look_ahead  # cfg -> bool
    state_norms: Callable = no_state_norms  # (optimizer, parallel) -> {metrics name: 0-d tensor}
    check: Callable = no_check  # cfg -> None, or why cfg's other keys do not go with this optimizer
    # Keys it does not read that a configuration may set to the value of one it does, with no note (Muon's
    # learning_rate = muon_adamw_lr: the reference calls its AdamW part's lr learning_rate).
    aliases: dict = dataclasses.field(default_factory=dict)
    unused_hint: str = ""  # what the note naming the keys it does not read adds
    # How the paper's reference code names it, in its own keys: {"optimizer_name": "mars", "mars_type": "mars-m"}.
    reference_keys: dict = dataclasses.field(default_factory=dict)
    unused_keys: frozenset = frozenset()  # keys other entries of its Registry read and it does not (set there)


class Registry:
    """A trainer's optimizers by name: torchtitan's name-to-factory table. `key` is the configuration key whose
    value names the run's optimizer. What a trainer asks before its optimizer exists -- is the configuration
    consistent, which keys does the optimizer not read -- it asks here, by the configuration."""

    def __init__(self, *entries, key):
        read = frozenset().union(*(entry.keys for entry in entries))
        self.key = key
        self.entries = tuple(dataclasses.replace(entry, unused_keys=read - entry.keys) for entry in entries)
        self._by_name = {entry.name: entry for entry in self.entries}

    def entry(self, cfg: object) -> OptimizerEntry:
        """The entry cfg names."""
        name = getattr(cfg, self.key)
        if name not in self._by_name:
            raise ValueError(f"{self.key}={name!r} is none of: {', '.join(self._by_name)}")
        return self._by_name[name]

    def descriptions(self) -> dict[str, str]:
        """{name: its one-line description}: the key's values and its --help."""
        return {entry.name: entry.description for entry in self.entries}

    def selected_by(self, cfg: object) -> str:
        """How cfg names its optimizer: 'optimizer=muon'."""
        return f"{self.key}={getattr(cfg, self.key)}"

    def check(self, cfg: object) -> str | None:
        """None, or why cfg's other keys do not go with the optimizer it names."""
        return self.entry(cfg).check(cfg)

    def unused_keys(self, cfg: object) -> frozenset:
        """The keys some optimizer here reads and cfg's does not: a resume may change them, and a note names
        those set away from their defaults."""
        return self.entry(cfg).unused_keys

    def ignored_settings(self, cfg: object, defaults: object) -> str | None:
        """A note naming the keys set away from their `defaults` (a configuration) that cfg's optimizer does not
        read, or None. A key the entry calls an alias is exempt where it has the value of the key it stands for
        (Muon's learning_rate = muon_adamw_lr in the paper configs: the reference's name for the AdamW part's lr)."""
        entry = self.entry(cfg)
        ignored = [
            f"{key}={getattr(cfg, key)!r}"
            for key in sorted(entry.unused_keys)
            if getattr(cfg, key) != getattr(defaults, key)
            and not (key in entry.aliases and getattr(cfg, key) == getattr(cfg, entry.aliases[key]))
        ]
        if not ignored:
            return None
        hint = f" ({entry.unused_hint})" if entry.unused_hint else ""
        return f"note: {self.selected_by(cfg)} does not use {', '.join(ignored)}{hint}"

    def reference_values(self, key: str) -> list[str]:
        """The values the reference's key `key` takes here, in the entries' order."""
        return list(dict.fromkeys(e.reference_keys[key] for e in self.entries if key in e.reference_keys))

    def from_reference_keys(self, current: str, given: dict[str, str]) -> str:
        """The name of the optimizer the reference's keys `given` ({key: value}) name, where the run so far names
        `current`: the reference's keys of `current`, updated with `given`, and the first entry whose reference
        keys they match (a key they leave out matches any value: the reference's default is the first entry's).
        ValueError naming a given value the reference's key does not take here."""
        for key, value in given.items():
            values = self.reference_values(key)
            if value not in values:
                raise ValueError(f"{key}={value!r} is not one of: {', '.join(values)}")
        keys = {**self._by_name[current].reference_keys, **given}
        for entry in self.entries:
            if all(keys.get(key, value) == value for key, value in entry.reference_keys.items()):
                return entry.name
        raise ValueError(f"no optimizer here is named {', '.join(f'{k}={v!r}' for k, v in given.items())}")


def group_hyperparameters(optimizer: object, entry: OptimizerEntry, cfg: object) -> None:
    """Write every hyperparameter cfg sets into optimizer's groups, each group by its name, after
    load_state_dict restored the checkpoint's: lr and 'initial_lr' (the peak), weight decays, betas, MARS's
    gamma and 1-D settings. The schedule then sets the lr. Optimizer-internal constants (eps, Muon's
    momentum) stay."""
    from mars import lr_1d_factor

    settings = entry.group_settings(cfg)
    groups = optimizer.param_groups
    if len(groups) != len(settings):
        raise ValueError(f"{entry.name} has {len(settings)} parameter groups, this optimizer {len(groups)}")
    for group in groups:
        setting = settings.get(group.get("name"))
        if setting is None:
            raise ValueError(
                f"{entry.name}'s parameter groups are {', '.join(settings)}; this optimizer has a group "
                f"named {group.get('name')!r}"
            )
        group.update(setting, initial_lr=setting["lr"])
        if "lr_1d_factor" in group:  # MARS: the 1-D lr is lr_1d / lr times the scheduled lr (reference)
            group["lr_1d_factor"] = lr_1d_factor(setting["lr"], setting["lr_1d"])


# ---------------------------------------------------------------------------------------------------
# The learning-rate schedule.


def schedule_lengths(cfg: object) -> tuple[int, int]:
    """(warmup_iters, lr_decay_iters) the schedule runs on: as configured, or with scale_schedule fitted to
    max_iters -- the configured schedule taken as written for a run of lr_decay_iters steps, warmup scaled by
    max_iters / lr_decay_iters and the decay ending at max_iters, so a paper config shortened for a test run
    keeps its shape."""
    if not cfg.scale_schedule or cfg.lr_decay_iters == 0:
        return cfg.warmup_iters, cfg.lr_decay_iters
    return round(cfg.warmup_iters * cfg.max_iters / cfg.lr_decay_iters), cfg.max_iters


def scheduled_lr(it: int, cfg: object, peak: float) -> float:
    """The lr at iteration `it` of a group whose peak lr is `peak`: the reference get_lr
    (MARS/train_muon.py's, which takes each optimizer's base lr; train_mars.py's is the same for one).

    cosine   -- linear warmup from 0 (peak * it / warmup_iters), cosine from peak down to min_lr
                between warmup_iters and lr_decay_iters, min_lr after.
    wsd      -- warmup, constant, then linear decay to min_lr over the last wsd_decay_frac of max_iters
                (the reference's FineWeb trainers decay to 0 over the last 20%: min_lr=0, wsd_decay_frac=0.2).
    constant -- warmup, then constant.
    decay_lr=False -- constant peak from step 0, no warmup.
    min_lr is absolute and the same for every group, as in the reference, whose Muon trainer decays both
    of its optimizers to it. (MARS's 1-D tensors run at lr_1d / learning_rate times their group's lr.)
    warmup_iters and lr_decay_iters are schedule_lengths' (scale_schedule fits them to max_iters).
    """
    if not cfg.decay_lr:
        return peak
    warmup_iters, lr_decay_iters = schedule_lengths(cfg)
    if it < warmup_iters:
        return peak * it / warmup_iters
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay_start = (1.0 - cfg.wsd_decay_frac) * cfg.max_iters
        if it < decay_start:
            return peak
        remaining = max(0.0, (cfg.max_iters - it) / max(1.0, cfg.wsd_decay_frac * cfg.max_iters))
        return cfg.min_lr + remaining * (peak - cfg.min_lr)
    if it > lr_decay_iters:
        return cfg.min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return cfg.min_lr + coeff * (peak - cfg.min_lr)


def schedule_warning(cfg: object) -> str | None:
    """A warning when max_iters ends the run inside warmup or before the cosine decay ends (a paper config run
    with --max_iters=100 would train at a few percent of its learning rate and say nothing), else None."""
    if not cfg.decay_lr or cfg.scale_schedule or cfg.max_iters == 0 or cfg.eval_only:
        return None
    warmup_iters, lr_decay_iters = schedule_lengths(cfg)
    fix = "; --scale_schedule=True fits warmup and decay into max_iters"
    if cfg.max_iters < warmup_iters:
        top = (cfg.max_iters - 1) / warmup_iters
        return (
            f"warning: max_iters={cfg.max_iters:,} ends the run inside warmup_iters={warmup_iters:,}: the learning "
            f"rate never rises above {top:.1%} of its peak{fix}"
        )
    if cfg.schedule == "cosine" and cfg.max_iters < lr_decay_iters:
        done = (cfg.max_iters - 1 - warmup_iters) / (lr_decay_iters - warmup_iters)  # the last step's decay_ratio
        return (
            f"warning: max_iters={cfg.max_iters:,} stops the cosine decay (lr_decay_iters={lr_decay_iters:,}) at "
            f"{max(done, 0):.0%} of its length: the last step's learning rate is still "
            f"{0.5 * (1 + math.cos(math.pi * max(done, 0))):.0%} of the way from min_lr to its peak{fix}"
        )
    return None


# ---------------------------------------------------------------------------------------------------
# train.py's optimizers.


def _mars_settings(cfg):
    """MARS-AdamW, -Lion, -Shampoo: the reference's two weight-decay groups (model.param_groups)."""
    shared = dict(
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        gamma=cfg.gamma,
        lr_1d=cfg.lr_1d,
        betas_1d=tuple(cfg.betas_1d),
        weight_decay_1d=cfg.weight_decay_1d,
    )
    return {"decay": dict(shared, weight_decay=cfg.weight_decay), "no_decay": dict(shared, weight_decay=0.0)}


def _mars_m_settings(cfg):
    """MARS-M: the reference's one group, whose AdamW part takes the same lr and weight decay as the matrices;
    here the blocks' matrices and the rest (in the AdamW part)."""
    mars_m = dict(
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
        gamma=cfg.gamma,
        lr_1d=cfg.learning_rate,
        betas_1d=tuple(cfg.betas_1d),
        weight_decay_1d=cfg.weight_decay,
    )
    return {"matrices": mars_m, "adamw": dict(mars_m, routing="none")}


def _adamw_settings(cfg):
    shared = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
    return {"decay": dict(shared, weight_decay=cfg.weight_decay), "no_decay": dict(shared, weight_decay=0.0)}


def _muon_settings(cfg):
    return {
        "muon": dict(lr=cfg.muon_lr, weight_decay=0.0),  # the reference's muon_weight_decay
        "adamw": dict(lr=cfg.muon_adamw_lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay),
    }


def _moonlight_settings(cfg):
    return {
        "muon": dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, momentum=cfg.beta1),
        "adamw": dict(lr=cfg.learning_rate, betas=tuple(cfg.betas_1d), weight_decay=cfg.weight_decay),
    }


def _decay_split(model, cfg):
    from model import param_groups

    return [group["params"] for group in param_groups(model, cfg.weight_decay)]


def _muon_split(model, cfg):
    from model import hidden_matrix_params, matrix_params

    return {"all": matrix_params, "hidden": hidden_matrix_params}[cfg.muon_matrices](model)


def _hidden_matrix_split(model, cfg):
    from model import hidden_matrix_params

    return hidden_matrix_params(model)


def _mars(groups, cfg, parallel, rule, **options):
    """mars.MARS with the update rule `rule` (its mars_type) over the groups."""
    import torch

    from mars import MARS

    return parallel.place_optimizer(
        MARS,
        groups,
        is_approx=cfg.is_approx,
        mars_type=rule,
        last_grad_dtype=getattr(torch, cfg.last_grad_dtype),
        # The memory plan steps on the meta device, where the kernel does not run: the same state either way.
        fused=cfg.mars_fused and parallel.device_type != "meta",
        **options,
    )


def _mars_with_1d_option(groups, cfg, parallel, rule):
    """MARS-AdamW, -Lion, -Shampoo: MARS-M's options and optimize_1d, which MARS-M's reference does not have."""
    return _mars(groups, cfg, parallel, rule, optimize_1d=cfg.optimize_1d)


def _adamw(groups, cfg, parallel):
    import torch

    return parallel.place_optimizer(torch.optim.AdamW, groups, fused=parallel.device_type == "cuda")


def _muon(groups, cfg, parallel):
    import torch

    muon, adamw = groups
    # The reference Muon (MARS/optimizers/muon.py, after modded-nanogpt) scales each update by
    # sqrt(max(1, rows/cols)): torch's adjust_lr_fn="original". Its other differences from torch's Muon
    # are in the README's note.
    return ChainedOptimizer(
        parallel.place_optimizer(torch.optim.Muon, [muon], momentum=0.95, nesterov=True, adjust_lr_fn="original"),
        _adamw([adamw], cfg, parallel),
    )


def _moonlight(groups, cfg, parallel):
    import torch

    muon, adamw = groups
    # The reference Moonlight sums its momentum where torch's averages it; Newton-Schulz normalises that
    # factor away (tests/test_optimizers.py holds the two to each other).
    return ChainedOptimizer(
        parallel.place_optimizer(torch.optim.Muon, [muon], nesterov=True, adjust_lr_fn="match_rms_adamw"),
        _adamw([adamw], cfg, parallel),
    )


def _exact_mars_look_ahead(cfg):
    """Exact MARS (is_approx=False), in the reference train_mars.py's order: before step t the loop runs a
    backward pass on step t+1's batch at the current parameters, unscales and clips that gradient like any
    other, and update_previous_grad() keeps it; after the step update_last_grad() makes it g_{t-1} of the
    next step's correction. The loop then runs the step's own backward pass as usual."""
    return not cfg.is_approx


def _norm(tensors, device):
    import torch

    return torch.nn.utils.get_total_norm(tensors) if tensors else torch.zeros((), device=device)


def _moment_norms(optimizer, parallel, *, second_moment=False):
    """The norms of MARS's state the reference train_mars.py logs, {metrics name: 0-d float tensor on the
    parameters' device}: the norm of m over every tensor and, with second_moment (mars-adamw), that of v and
    their ratio (Lion's, Shampoo's and MARS-M's matrices keep no v: only the 1-D tensors' would count).

    Where each rank holds a share of the state (parallel.state_is_sharded: ZeRO-1's whole tensors, FSDP2's rows of
    each), the norms are of this rank's share (a DTensor's local rows), their squares summed over the ranks that
    hold one share each (parallel.sum_over_state_shards), which must then all call this. Nothing here reads a
    number back to the host."""
    import torch

    from marsgpt import metrics

    device = optimizer.param_groups[0]["params"][0].device
    states = [s for s in optimizer.state.values() if "exp_avg" in s]
    m = _norm(parallel.local_shards([s["exp_avg"] for s in states]), device)
    v = _norm(parallel.local_shards([s["exp_avg_sq"] for s in states if "exp_avg_sq" in s]), device)
    if parallel.state_is_sharded:
        m, v = parallel.sum_over_state_shards(torch.stack([m, v]).float() ** 2).sqrt()
    norms = {metrics.MOMENTUM_NORM: m.float()}
    if second_moment:
        norms[metrics.MOMENTUM_NORM_SQ] = v.float()
        norms[metrics.MOMENTUM_DIV] = m.float() / (v.float().sqrt() + 1e-8)  # as the reference logs it
    return norms


def _mars_label(rule):
    """The memory plan's words for MARS with update rule `rule`: 'mars-lion (exact)'."""
    return lambda cfg: f"{rule} ({'approximate' if cfg.is_approx else 'exact'})"


def _mars_check(cfg):
    if cfg.mars_fused and cfg.zero_stage == 3:
        return (
            "mars_fused=True does not apply to zero_stage=3: MARS steps FSDP2's sharded parameters with its "
            "sharded multi-tensor path (docs/mars.md); drop mars_fused"
        )
    return None


def _mars_m_check(cfg):
    if cfg.optimize_1d:
        return (
            "optimize_1d=True does not apply to optimizer=mars-m: it trains the embeddings, head and 1-D tensors "
            "with AdamW, as its reference; drop optimize_1d"
        )
    return _mars_check(cfg)


# What every MARS variant reads; MARS-M's AdamW part takes learning_rate and weight_decay where the others'
# 1-D tensors take lr_1d and weight_decay_1d.
_MARS_KEYS = frozenset(
    {"learning_rate", "weight_decay", "beta1", "beta2", "gamma", "is_approx", "betas_1d"}
    | {"last_grad_dtype", "mars_fused"}
)
_MARS_1D_KEYS = frozenset({"lr_1d", "weight_decay_1d", "optimize_1d"})


def _mars_variant(rule, description, state_norms=_moment_norms):
    """MARS-AdamW, -Lion or -Shampoo: the paper's MARS with that update rule (mars.py), named as its rule."""
    return OptimizerEntry(
        name=rule,
        description=description,
        keys=_MARS_KEYS | _MARS_1D_KEYS,
        group_settings=_mars_settings,
        split=_decay_split,
        build=partial(_mars_with_1d_option, rule=rule),
        label=_mars_label(rule),
        reference_keys={"optimizer_name": "mars", "mars_type": rule},
        look_ahead=_exact_mars_look_ahead,
        state_norms=state_norms,
        check=_mars_check,
    )


OPTIMIZERS = Registry(
    _mars_variant(
        "mars-adamw",
        "the paper's MARS: AdamW's update of the variance-reduced gradient on the 2-D tensors, AdamW on the rest",
        partial(_moment_norms, second_moment=True),
    ),
    _mars_variant("mars-lion", "MARS with Lion's sign update on the 2-D tensors, AdamW on the rest"),
    _mars_variant(
        "mars-shampoo",
        "MARS with Shampoo's update (Newton-Schulz of the momentum) on the 2-D tensors, AdamW on the rest",
    ),
    OptimizerEntry(
        name="mars-m",
        description="MARS-M (Liu et al. 2025): Newton-Schulz at AdamW's update RMS on the blocks' matrices, "
        "AdamW (betas_1d, learning_rate, weight_decay) on the embeddings, head and 1-D tensors, as its reference",
        keys=_MARS_KEYS,
        group_settings=_mars_m_settings,
        split=_hidden_matrix_split,
        build=partial(_mars, rule="mars-m"),
        label=_mars_label("mars-m"),
        look_ahead=_exact_mars_look_ahead,
        state_norms=_moment_norms,
        check=_mars_m_check,
        reference_keys={"optimizer_name": "mars", "mars_type": "mars-m"},
    ),
    OptimizerEntry(
        name="adamw",
        description="torch.optim.AdamW over the reference's decay and no-decay groups, fused on CUDA",
        keys=frozenset({"learning_rate", "weight_decay", "beta1", "beta2"}),
        group_settings=_adamw_settings,
        split=_decay_split,
        build=_adamw,
        label=lambda cfg: "AdamW",
        reference_keys={"optimizer_name": "adamw"},
    ),
    OptimizerEntry(
        name="muon",
        description="torch.optim.Muon (muon_lr, no weight decay) on the matrices muon_matrices names, AdamW "
        "(muon_adamw_lr, beta1, beta2, weight_decay) on the rest",
        keys=frozenset({"weight_decay", "beta1", "beta2", "muon_lr", "muon_adamw_lr", "muon_matrices"}),
        group_settings=_muon_settings,
        split=_muon_split,
        build=_muon,
        label=lambda cfg: "Muon + AdamW",
        aliases={"learning_rate": "muon_adamw_lr"},
        unused_hint="Muon's lrs are muon_lr and muon_adamw_lr",
        reference_keys={"optimizer_name": "muon"},
    ),
    OptimizerEntry(
        name="moonlight",
        description="MARS-M's baseline: torch.optim.Muon scaled to AdamW's update RMS on the blocks' matrices, "
        "AdamW (betas_1d) on the rest, both at learning_rate and weight_decay",
        keys=frozenset({"learning_rate", "weight_decay", "beta1", "betas_1d"}),
        group_settings=_moonlight_settings,
        split=_hidden_matrix_split,
        build=_moonlight,
        label=lambda cfg: "Moonlight (Muon + AdamW)",
        reference_keys={"optimizer_name": "moonlight"},
    ),
    key="optimizer",
)
