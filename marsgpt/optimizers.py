"""Builds the optimizer a TrainConfig names, and the learning-rate schedule.

mars  -- mars.MARS over model.param_groups, constructed as the paper's reference code does
         (MARS/train_mars.py + its model's configure_optimizers): the two weight-decay groups,
         lr=learning_rate, betas=(beta1, beta2) and the MARS keys; 1-D tensors take lr_1d.
adamw -- torch.optim.AdamW over the same two groups, betas=(beta1, beta2), fused on CUDA.
muon  -- torch.optim.Muon (lr muon_lr, weight decay 0) chained with AdamW (lr muon_adamw_lr,
         betas=(beta1, beta2), weight_decay), as one object. muon_matrices="all", as the reference
         MARS/train_muon.py: Muon takes every 2-D tensor -- the token and position embeddings and the
         tied head included -- and AdamW the 1-D ones; "hidden": Muon takes only the blocks' matrices.
mars, mars_type="mars-m" -- as MARS_M/train_mars_m.py: mars.MARS on the blocks' matrices and its AdamW part
         (routing="none", betas_1d) on the embeddings, the tied head and the 1-D tensors, every tensor at
         lr=learning_rate and weight_decay, momentum beta1.
moonlight -- MARS-M's baseline, as MARS_M/train_moonlight.py: torch.optim.Muon (Nesterov, momentum beta1,
         update scaled by 0.2 sqrt(max(rows, cols)): adjust_lr_fn="match_rms_adamw") on the blocks' matrices,
         chained with AdamW (betas_1d) on the rest, both at learning_rate and weight_decay.

Every hyperparameter the configuration sets is written into the groups by group_hyperparameters, at
construction and again after a resume's load_state_dict. Each group keeps its peak lr as 'initial_lr';
set_lr(optimizer, it, cfg) applies the schedule to every group.

ZeRO-1 (zero_stage=1 with more than one rank, see is_sharded): every torch optimizer above becomes a
ShardedOptimizer, and each DDP rank keeps the state of about 1/world_size of the parameters.
"""

import math
from functools import partial

import torch
import torch.distributed as dist

from mars import MARS, lr_1d_factor
from marsgpt import checkpoint, metrics
from model import hidden_matrix_params, matrix_params, param_groups


def closure_loss(closure):
    """torch.optim's step(closure) protocol: the loss closure() returns, computed with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class ChainedOptimizer:
    """Several torch optimizers over disjoint parameters, driven as one (state_dict holds each)."""

    def __init__(self, *optimizers):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self):
        # Recomputed on each access: load_state_dict replaces the group dicts inside each optimizer.
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure=None):
        loss = closure_loss(closure)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"state_dict holds {len(saved)} optimizers, this one chains {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)


class ShardedOptimizer:
    """ZeRO-1 (Rajbhandari et al., 2020, stage P_os) on torch's ZeroRedundancyOptimizer, which gives each rank
    whole parameters -- the largest first, each to the rank holding the fewest elements so far -- runs
    optimizer_class on that rank's share, and after step() broadcasts each rank's updated parameters to the
    others. A rule that looks at a whole tensor (MARS's clip of c_t to Frobenius norm 1, Muon's Newton-Schulz)
    therefore sees exactly what it sees unsharded. Hyperparameters written into param_groups (set_lr,
    group_hyperparameters) reach the rank's optimizer at the next step().

    What this wrapper adds:
    - state_dict() is collective (every rank calls it, like a checkpoint's other parts) and returns on rank 0
      the state in the unsharded optimizer's own format (None on the other ranks): a checkpoint resumes on
      any number of ranks, sharded or not, and readers that know nothing of sharding read it;
    - load_state_dict() takes that format and loads this rank's share through optimizer_class's own
      load_state_dict, which places each state tensor as that class wants it (fused AdamW's step counts on
      the device, for instance);
    - MARS's exact-mode calls reach the rank's optimizer.
    """

    def __init__(self, params, optimizer_class, **defaults):
        # imported here: torch.distributed.optim adds seconds to every start, and only sharded runs need it
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.zero = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **defaults)

    @property
    def param_groups(self):
        return self.zero.param_groups

    @property
    def local(self):
        """This rank's optimizer_class over its share of the parameters."""
        return self.zero.optim

    @property
    def state(self):
        """The state this rank holds: its share's."""
        return self.local.state

    def step(self, closure=None):
        return self.zero.step(closure)

    def zero_grad(self, set_to_none=True):
        self.zero.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """Collective: on rank 0 every rank's share in the unsharded format, on the other ranks None.

        Each state tensor reaches rank 0's host once, one tensor at a time: over gloo straight into its host
        tensor; over NCCL from its owner's device into a buffer of its size on rank 0's device, then to the
        host. A save therefore adds at most the largest state tensor to rank 0's GPU (memplan's "checkpoint
        save") and one copy of the state to its host. (torch's consolidate_state_dict moves each rank's whole
        share through the GPU as serialized bytes and keeps two host copies of it, one pinned.)
        """
        zero, group = self.zero, self.zero.process_group
        local = self.local.state_dict()
        root = dist.get_global_rank(group, 0)
        layouts = [None] * zero.world_size if zero.rank == 0 else None  # each rank's state, its tensors on meta
        dist.gather_object(checkpoint.map_tensors(local, lambda t: t.to("meta")), layouts, dst=root, group=group)
        # gloo moves host tensors, NCCL only device tensors
        device = torch.device("cpu") if "gloo" in dist.get_backend(group) else self.param_groups[0]["params"][0].device
        if zero.rank != 0:
            for tensor in checkpoint.tensors_of(local):
                transfer(dist.isend, tensor.detach().to(device).contiguous(), root, group)
            return None
        gathered = [checkpoint.map_tensors(local, lambda t: t.detach().to("cpu", copy=True))]
        for rank in range(1, zero.world_size):
            source = dist.get_global_rank(group, rank)
            gathered.append(
                checkpoint.map_tensors(layouts[rank], partial(received, source=source, group=group, device=device))
            )
        zero._all_state_dicts = gathered  # what consolidate_state_dict leaves there, for state_dict() to merge
        state = zero.state_dict()
        zero._all_state_dicts = []
        return checkpoint.hand_over(state)  # private host copies: the checkpoint writer need not copy them again

    def load_state_dict(self, state_dict):
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has different parameter groups than this optimizer")
        saved_index = {}  # parameter -> its index in the saved state
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            saved_index.update(zip(group["params"], saved["params"]))
        local_state, local_groups, first = {}, [], 0
        for saved, local in zip(saved_groups, self.local.param_groups):
            for i, p in enumerate(local["params"], start=first):
                if saved_index[p] in state_dict["state"]:
                    local_state[i] = state_dict["state"][saved_index[p]]
            local_groups.append({**saved, "params": list(range(first, first + len(local["params"])))})
            first += len(local["params"])
        self.local.load_state_dict({"state": local_state, "param_groups": local_groups})

    def update_previous_grad(self, inverse_scale=None):
        self.local.update_previous_grad(inverse_scale)

    def update_last_grad(self):
        self.local.update_last_grad()


def transfer(op, tensor, peer, group):
    """One isend or irecv of `tensor` with global rank `peer`, finished. Through batch_isend_irecv, which on
    NCCL uses the group's communicator; a plain send or recv would open a new one for each pair of ranks."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]):
        work.wait()


def received(like, source, group, device):
    """A host tensor shaped like the meta tensor `like`, received from global rank `source` into a buffer on
    `device` (the buffer itself when that is the CPU)."""
    buffer = torch.empty(like.shape, dtype=like.dtype, device=device)
    transfer(dist.irecv, buffer, source, group)
    return buffer.to("cpu")


def _group_settings(cfg):
    """The hyperparameters cfg sets in each parameter group, by the group's name (build_optimizer names them;
    a resume pairs the checkpoint's groups with these by name)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer_name == "moonlight":
        return {
            "muon": dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, momentum=cfg.beta1),
            "adamw": dict(lr=cfg.learning_rate, betas=tuple(cfg.betas_1d), weight_decay=cfg.weight_decay),
        }
    if cfg.optimizer_name == "mars" and cfg.mars_type == "mars-m":
        # The reference's one group: its AdamW part takes the same lr and weight decay as the matrices.
        mars_m = dict(
            lr=cfg.learning_rate,
            betas=betas,
            weight_decay=cfg.weight_decay,
            gamma=cfg.gamma,
            lr_1d=cfg.learning_rate,
            betas_1d=tuple(cfg.betas_1d),
            weight_decay_1d=cfg.weight_decay,
        )
        # the blocks' matrices, and the rest in the AdamW part (build_optimizer)
        return {"matrices": mars_m, "adamw": dict(mars_m, routing="none")}
    if cfg.optimizer_name == "muon":
        return {
            "muon": dict(lr=cfg.muon_lr, weight_decay=0.0),  # the reference's muon_weight_decay
            "adamw": dict(lr=cfg.muon_adamw_lr, betas=betas, weight_decay=cfg.weight_decay),
        }
    shared = dict(lr=cfg.learning_rate, betas=betas)
    if cfg.optimizer_name == "mars":
        shared.update(
            gamma=cfg.gamma, lr_1d=cfg.lr_1d, betas_1d=tuple(cfg.betas_1d), weight_decay_1d=cfg.weight_decay_1d
        )
    return {"decay": dict(shared, weight_decay=cfg.weight_decay), "no_decay": dict(shared, weight_decay=0.0)}


def with_settings(name, params, settings):
    """A parameter group as build_optimizer makes it: its name, its settings and its peak lr ('initial_lr')."""
    return dict(params=params, name=name, **settings[name], initial_lr=settings[name]["lr"])


def group_hyperparameters(optimizer, cfg, settings=None):
    """Write every hyperparameter cfg sets into optimizer's groups after load_state_dict, which restores
    the checkpoint's: lr and 'initial_lr' (the peak), weight decays, betas, MARS's gamma and 1-D settings,
    each group by its name. set_lr then schedules the lr. Optimizer-internal constants (eps, Muon's
    momentum) stay. `settings`: each group's hyperparameters by its name, for an optimizer another trainer
    builds (vision/train_cifar.py); by default those build_optimizer gives a TrainConfig's groups."""
    settings = _group_settings(cfg) if settings is None else settings
    groups = optimizer.param_groups
    if len(groups) != len(settings):
        raise ValueError(f"{cfg.optimizer_name} has {len(settings)} parameter groups, this optimizer {len(groups)}")
    for group in groups:
        setting = settings.get(group.get("name"))
        if setting is None:
            raise ValueError(
                f"{cfg.optimizer_name}'s parameter groups are {', '.join(settings)}; this optimizer has a group "
                f"named {group.get('name')!r}"
            )
        group.update(setting, initial_lr=setting["lr"])
        if "lr_1d_factor" in group:  # MARS: the 1-D lr is lr_1d / lr times the scheduled lr (reference)
            group["lr_1d_factor"] = lr_1d_factor(setting["lr"], setting["lr_1d"])


def load_state(optimizer, state, cfg, settings=None):
    """A checkpoint's optimizer state under this run's configuration: load_state_dict restores the moments,
    the step counts and each group's saved settings; group_hyperparameters then writes cfg's settings on top,
    so a resume with --learning_rate=1e-4 trains at 1e-4. Groups saved before they had names take the names
    of this optimizer's groups in order (build_optimizer has always made them in the same order)."""
    names = [group["name"] for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, name in zip(optimizer.param_groups, names):
        group.setdefault("name", name)
    group_hyperparameters(optimizer, cfg, settings)


def is_sharded(cfg, world_size):
    """Whether a run's optimizer state is sharded: zero_stage=1 and more than one rank to share it."""
    return cfg.zero_stage == 1 and world_size > 1


def build_optimizer(model, cfg, device_type, world_size=1):
    """The optimizer cfg.optimizer_name names, over model's parameters (already on their device); sharded
    over the default process group's world_size ranks when is_sharded (each torch optimizer a
    ShardedOptimizer)."""
    fused = device_type == "cuda"
    settings = _group_settings(cfg)

    def make(optimizer_class, groups, **kwargs):
        if is_sharded(cfg, world_size):
            return ShardedOptimizer(groups, optimizer_class=optimizer_class, **kwargs)
        return optimizer_class(groups, **kwargs)

    if cfg.optimizer_name == "muon":
        split = matrix_params if cfg.muon_matrices == "all" else hidden_matrix_params
        muon_params, adamw_params = split(model)
        # The reference Muon (MARS/optimizers/muon.py, after modded-nanogpt) scales each update by
        # sqrt(max(1, rows/cols)): torch's adjust_lr_fn="original". Its other differences from
        # torch's Muon are in the README's note.
        optimizer = ChainedOptimizer(
            make(
                torch.optim.Muon,
                [with_settings("muon", muon_params, settings)],
                momentum=0.95,
                nesterov=True,
                adjust_lr_fn="original",
            ),
            make(torch.optim.AdamW, [with_settings("adamw", adamw_params, settings)], fused=fused),
        )
    elif cfg.optimizer_name == "moonlight":
        muon_params, adamw_params = hidden_matrix_params(model)
        # The reference Moonlight sums its momentum where torch's averages it; Newton-Schulz normalises
        # that factor away (tests/test_optim.py holds the two to each other).
        optimizer = ChainedOptimizer(
            make(
                torch.optim.Muon,
                [with_settings("muon", muon_params, settings)],
                nesterov=True,
                adjust_lr_fn="match_rms_adamw",
            ),
            make(torch.optim.AdamW, [with_settings("adamw", adamw_params, settings)], fused=fused),
        )
    elif cfg.optimizer_name == "mars" and cfg.mars_type == "mars-m":
        matrices, adamw_params = hidden_matrix_params(model)
        groups = [with_settings("matrices", matrices, settings), with_settings("adamw", adamw_params, settings)]
        optimizer = make(
            MARS,
            groups,
            is_approx=cfg.is_approx,
            mars_type=cfg.mars_type,
            last_grad_dtype=getattr(torch, cfg.last_grad_dtype),
        )
    else:
        decay, no_decay = (group["params"] for group in param_groups(model, cfg.weight_decay))
        groups = [with_settings("decay", decay, settings), with_settings("no_decay", no_decay, settings)]
        if cfg.optimizer_name == "mars":
            optimizer = make(
                MARS,
                groups,
                is_approx=cfg.is_approx,
                mars_type=cfg.mars_type,
                optimize_1d=cfg.optimize_1d,
                last_grad_dtype=getattr(torch, cfg.last_grad_dtype),
            )
        elif cfg.optimizer_name == "adamw":
            optimizer = make(torch.optim.AdamW, groups, fused=fused)
        else:
            raise ValueError(f"optimizer_name={cfg.optimizer_name!r} is not one of: mars, adamw, muon, moonlight")
    return optimizer


def scheduled_lr(it, cfg, peak):
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
    """
    if not cfg.decay_lr:
        return peak
    if it < cfg.warmup_iters:
        return peak * it / cfg.warmup_iters
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay_start = (1.0 - cfg.wsd_decay_frac) * cfg.max_iters
        if it < decay_start:
            return peak
        remaining = max(0.0, (cfg.max_iters - it) / max(1.0, cfg.wsd_decay_frac * cfg.max_iters))
        return cfg.min_lr + remaining * (peak - cfg.min_lr)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    decay_ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return cfg.min_lr + coeff * (peak - cfg.min_lr)


def set_lr(optimizer, it, cfg):
    """Every group's lr at iteration `it`: the schedule from its 'initial_lr'."""
    for group in optimizer.param_groups:
        group["lr"] = scheduled_lr(it, cfg, group["initial_lr"])


# ---------------------------------------------------------------------------------------------------
# What an optimizer asks of a training step beyond backward() and step(), and what it adds to the log.


class LookAhead:
    """Exact MARS (is_approx=False), in the reference train_mars.py's order: before step t the loop runs a
    backward pass on step t+1's batch at the current parameters, unscales and clips that gradient like any
    other, and store() keeps it; after the step, after_step() makes it g_{t-1} of the next step's correction.
    The loop then runs the step's own backward pass as usual."""

    # forward and backward passes per optimizer step: the look-ahead pass, then the step's own
    passes = 2

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def store(self):
        self.optimizer.update_previous_grad()

    def after_step(self):
        self.optimizer.update_last_grad()


def look_ahead(optimizer, cfg):
    """The LookAhead the run's optimizer needs (exact MARS), or None."""
    return LookAhead(optimizer) if cfg.optimizer_name == "mars" and not cfg.is_approx else None


def step(optimizer, look_ahead=None, scaler=None):
    """One update as training makes it: through the GradScaler when there is one (it skips a step whose
    gradients hold an inf and adjusts the loss scale), then the look-ahead's after_step."""
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    if look_ahead is not None:
        look_ahead.after_step()


def _norm(tensors, device):
    return torch.nn.utils.get_total_norm(tensors) if tensors else torch.zeros((), device=device)


def state_norms(optimizer, cfg, sum_over_ranks=None):
    """The norms of optimizer state the reference train_mars.py logs, {metrics name: 0-d float tensor on the
    parameters' device}: for MARS the norm of m over every tensor and, for mars-adamw, that of v and their
    ratio (Lion's and Shampoo's matrices keep no v: only the 1-D tensors' would count); {} otherwise.

    sum_over_ranks: under ZeRO-1 each rank holds a share of the state; an all-reduce (sum) of a tensor, which
    every rank must then call. Nothing here reads a number back to the host."""
    if cfg.optimizer_name != "mars":
        return {}
    device = optimizer.param_groups[0]["params"][0].device
    states = [s for s in optimizer.state.values() if "exp_avg" in s]
    m = _norm([s["exp_avg"] for s in states], device)
    v = _norm([s["exp_avg_sq"] for s in states if "exp_avg_sq" in s], device)
    if sum_over_ranks is not None:
        m, v = sum_over_ranks(torch.stack([m, v]).float() ** 2).sqrt()
    norms = {metrics.MOMENTUM_NORM: m.float()}
    if cfg.mars_type == "mars-adamw":
        norms[metrics.MOMENTUM_NORM_SQ] = v.float()
        norms[metrics.MOMENTUM_DIV] = m.float() / (v.float().sqrt() + 1e-8)  # as the reference logs it
    return norms
