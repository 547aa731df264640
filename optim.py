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

import torch

from mars import MARS, lr_1d_factor
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
        self.zero.consolidate_state_dict(to=0)
        if self.zero.rank != 0:
            return None
        if self.param_groups[0]["params"][0].is_cuda:
            # consolidate_state_dict copies each rank's state to the CPU with non_blocking=True: wait for the
            # copies before anyone reads them
            torch.cuda.synchronize()
        state = self.zero.state_dict()
        self.zero._all_state_dicts = []  # the gathered copy is the caller's now: free it here
        return state

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


def _group_settings(cfg):
    """The hyperparameters cfg sets in each group, in the order build_optimizer makes the groups."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer_name == "moonlight":
        return [
            dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, momentum=cfg.beta1),
            dict(lr=cfg.learning_rate, betas=tuple(cfg.betas_1d), weight_decay=cfg.weight_decay),
        ]
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
        return [mars_m, dict(mars_m)]  # the blocks' matrices, then the rest (build_optimizer)
    if cfg.optimizer_name == "muon":
        return [
            dict(lr=cfg.muon_lr, weight_decay=0.0),  # the reference's muon_weight_decay
            dict(lr=cfg.muon_adamw_lr, betas=betas, weight_decay=cfg.weight_decay),
        ]
    shared = dict(lr=cfg.learning_rate, betas=betas)
    if cfg.optimizer_name == "mars":
        shared.update(
            gamma=cfg.gamma, lr_1d=cfg.lr_1d, betas_1d=tuple(cfg.betas_1d), weight_decay_1d=cfg.weight_decay_1d
        )
    # model.param_groups' order: the decayed matrices, then everything else
    return [dict(shared, weight_decay=cfg.weight_decay), dict(shared, weight_decay=0.0)]


def group_hyperparameters(optimizer, cfg):
    """Write every hyperparameter cfg sets into optimizer's groups (after load_state_dict, which restores
    the checkpoint's): lr and 'initial_lr' (the peak), weight decays, betas, MARS's gamma and 1-D
    settings. set_lr then schedules the lr. Optimizer-internal constants (eps, Muon's momentum) stay."""
    settings = _group_settings(cfg)
    groups = optimizer.param_groups
    if len(groups) != len(settings):
        raise ValueError(f"{cfg.optimizer_name} has {len(settings)} parameter groups, this optimizer {len(groups)}")
    for group, setting in zip(groups, settings):
        group.update(setting, initial_lr=setting["lr"])
        if "lr_1d_factor" in group:  # MARS: the 1-D lr is lr_1d / lr times the scheduled lr (reference)
            group["lr_1d_factor"] = lr_1d_factor(setting["lr"], setting["lr_1d"])


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
                [dict(params=muon_params, **settings[0])],
                momentum=0.95,
                nesterov=True,
                adjust_lr_fn="original",
            ),
            make(torch.optim.AdamW, [dict(params=adamw_params, **settings[1])], fused=fused),
        )
    elif cfg.optimizer_name == "moonlight":
        muon_params, adamw_params = hidden_matrix_params(model)
        # The reference Moonlight sums its momentum where torch's averages it; Newton-Schulz normalises
        # that factor away (tests/test_optim.py holds the two to each other).
        optimizer = ChainedOptimizer(
            make(
                torch.optim.Muon,
                [dict(params=muon_params, **settings[0])],
                nesterov=True,
                adjust_lr_fn="match_rms_adamw",
            ),
            make(torch.optim.AdamW, [dict(params=adamw_params, **settings[1])], fused=fused),
        )
    elif cfg.optimizer_name == "mars" and cfg.mars_type == "mars-m":
        matrices, adamw_params = hidden_matrix_params(model)
        groups = [dict(params=matrices, **settings[0]), dict(params=adamw_params, routing="none", **settings[1])]
        optimizer = make(
            MARS,
            groups,
            is_approx=cfg.is_approx,
            mars_type=cfg.mars_type,
            last_grad_dtype=getattr(torch, cfg.last_grad_dtype),
        )
    else:
        groups = [{**group, **setting} for group, setting in zip(param_groups(model, cfg.weight_decay), settings)]
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
    group_hyperparameters(optimizer, cfg)
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
