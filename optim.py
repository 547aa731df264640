"""Builds the optimizer a TrainConfig names, and the learning-rate schedules.

mars  -- mars.MARS over model.param_groups, constructed as the paper's reference code does
         (MARS/train_mars.py + its model's configure_optimizers): the two weight-decay groups,
         lr=learning_rate, betas=(beta1, beta2) and the MARS keys; 1-D tensors take lr_1d.
adamw -- torch.optim.AdamW over the same two groups, betas=(beta1, beta2), fused on CUDA.
muon  -- torch.optim.Muon on the hidden 2-D matrices (lr muon_lr, weight decay 0) chained with AdamW
         on embeddings, head and 1-D tensors (lr muon_adamw_lr, betas=(beta1, beta2), weight_decay),
         as one object.

Every group keeps 'initial_lr'; set_lr(optimizer, lr_factor(it, cfg)) applies the schedule to all of
them, so MARS's 1-D lr and both halves of Muon follow the same curve.
"""

import math

import torch

from model import hidden_matrix_params, param_groups


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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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


def _muon(model, cfg, fused):
    hidden, other = hidden_matrix_params(model)
    if any(p.ndim != 2 for p in hidden):
        raise ValueError("hidden_matrix_params returned a tensor that is not 2-D; Muon takes matrices only")
    # The reference's Muon (modded-nanogpt) scales each update by sqrt(max(1, rows/cols));
    # torch's adjust_lr_fn="original" is that rule ("match_rms_adamw" would change the lr scale).
    muon = torch.optim.Muon(
        hidden, lr=cfg.muon_lr, weight_decay=0.0, momentum=0.95, nesterov=True, adjust_lr_fn="original"
    )
    # As the Muon baseline: AdamW decays everything it holds (embeddings, head, 1-D tensors).
    # The reference's Muon also took the embeddings, leaving AdamW only the 1-D tensors, at the same 0.1.
    adamw = torch.optim.AdamW(
        other, lr=cfg.muon_adamw_lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, fused=fused
    )
    return ChainedOptimizer(muon, adamw)


def build_optimizer(model, cfg, device_type):
    """The optimizer cfg.optimizer_name names, over model's parameters (already on their device)."""
    fused = device_type == "cuda"
    if cfg.optimizer_name == "mars":
        from mars import MARS

        optimizer = MARS(
            param_groups(model, cfg.weight_decay),
            lr=cfg.learning_rate,
            betas=(cfg.beta1, cfg.beta2),
            gamma=cfg.gamma,
            is_approx=cfg.is_approx,
            mars_type=cfg.mars_type,
            optimize_1d=cfg.optimize_1d,
            lr_1d=cfg.lr_1d,
            betas_1d=tuple(cfg.betas_1d),
            weight_decay_1d=cfg.weight_decay_1d,
            last_grad_dtype=getattr(torch, cfg.last_grad_dtype),
        )
    elif cfg.optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused
        )
    elif cfg.optimizer_name == "muon":
        optimizer = _muon(model, cfg, fused)
    else:
        raise ValueError(f"optimizer_name={cfg.optimizer_name!r} is not one of: mars, adamw, muon")
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


def lr_factor(it, cfg):
    """The learning rate at iteration `it` as a multiple of every group's initial lr.

    cosine   -- the reference get_lr: linear warmup from 0 (lr * it / warmup_iters), cosine from
                learning_rate down to min_lr between warmup_iters and lr_decay_iters, min_lr after.
    wsd      -- warmup, constant, then linear decay to min_lr over the last wsd_decay_frac of max_iters
                (the reference's FineWeb trainers, which decay to 0: use min_lr=0 for that).
    constant -- warmup, then constant.
    decay_lr=False -- constant learning_rate from step 0, as the reference.
    min_lr is absolute for learning_rate; other groups (lr_1d, Muon's two) get the same fraction.
    """
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:
        return it / cfg.warmup_iters
    floor = cfg.min_lr / cfg.learning_rate if cfg.learning_rate > 0 else 0.0
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay_start = (1.0 - cfg.wsd_decay_frac) * cfg.max_iters
        if it < decay_start:
            return 1.0
        remaining = max(0.0, (cfg.max_iters - it) / max(1.0, cfg.wsd_decay_frac * cfg.max_iters))
        return floor + (1.0 - floor) * remaining
    if it > cfg.lr_decay_iters:
        return floor
    decay_ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return floor + coeff * (1.0 - floor)


def set_lr(optimizer, factor):
    """Every group's lr = its initial_lr * factor."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor
