"""The optimizer a run holds: built from its registry entry (marsgpt/optimizers.py) over the model's parameter groups,
each torch optimizer in it placed by the run's parallelism, and owning what a training step needs around the
torch optimizer -- the learning-rate schedule, exact MARS's look-ahead, the GradScaler (float16's loss scaling:
scale, unscale, step or skip) and the state norms of the train line -- and a state_dict whose load_state_dict
re-applies the configuration. torchtitan's OptimizersContainer, for this trainer.
"""

import collections

import torch

from marsgpt.checkpoint_parts import ScalerState
from marsgpt.optim_protocol import ChainedOptimizer
from marsgpt.optimizers import OPTIMIZERS, OptimizerEntry, Registry, group_hyperparameters, scheduled_lr
from marsgpt.parallel import Parallelism


class TrainingOptimizer:
    """The optimizer of a run: the torch optimizer its registry entry built over the model's parameter groups
    (`torch_optimizer`: one, a ChainedOptimizer of several, each placed by `parallel`), and what a training step,
    the train line, the memory plan and a checkpoint need of it. `scaler`: the run's GradScaler (enabled for float16:
    runtime.setup_precision), by default a disabled one."""

    def __init__(
        self,
        entry: OptimizerEntry,
        torch_optimizer: object,
        cfg: object,
        parallel: Parallelism,
        scaler: torch.amp.GradScaler | None = None,
    ):
        self.entry, self.torch_optimizer, self.cfg, self.parallel = entry, torch_optimizer, cfg, parallel
        self.scaler = scaler or torch.amp.GradScaler(parallel.device_type, enabled=False)
        # exact MARS: the MARS that takes the look-ahead gradient (this rank's share's under ZeRO-1), else None
        self.look_ahead = parallel.local_optimizer(torch_optimizer) if entry.look_ahead(cfg) else None

    @property
    def param_groups(self) -> list:
        return self.torch_optimizer.param_groups

    @property
    def state(self) -> dict:
        """The state this rank holds (its share's under ZeRO-1)."""
        return self.torch_optimizer.state

    @property
    def optimizers(self) -> list:
        """The torch optimizers inside, each over its own parameters (a chain's, in order; else the one)."""
        inner = self.torch_optimizer
        return list(inner.optimizers) if isinstance(inner, ChainedOptimizer) else [inner]

    @property
    def label(self) -> str:
        """The run's optimizer in a few words (the memory plan's first line)."""
        return self.entry.label(self.cfg)

    @property
    def lr(self) -> float:
        """The first group's lr as the schedule set it last (the train line's)."""
        return self.param_groups[0]["lr"]

    def set_lr(self, it: int) -> None:
        """Every group's lr at iteration `it`: the schedule from its 'initial_lr'."""
        for group in self.param_groups:
            group["lr"] = scheduled_lr(it, self.cfg, group["initial_lr"])

    def zero_grad(self) -> None:
        """Clear the gradients as the parallelism keeps them: in place under DDP (its buckets), else to None."""
        self.torch_optimizer.zero_grad(set_to_none=self.parallel.gradients_to_none)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward() on: multiplied by the GradScaler's loss scale under float16, else itself."""
        return self.scaler.scale(loss)

    def unscale(self, look_ahead: bool = False) -> None:
        """Divide the gradients by the GradScaler's loss scale (float16). The step's own through scaler.unscale_,
        which records the infs it finds for scaler.step; the look-ahead's by hand, since unscale_ may run only once
        between two updates and the step's own gradient needs it."""
        scaler = self.scaler
        if not look_ahead:
            scaler.unscale_(self.torch_optimizer)
        elif scaler.is_enabled():
            inverse_scale = 1.0 / scaler.get_scale()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inverse_scale)

    def keep_look_ahead_gradient(self) -> None:
        """Exact MARS: the gradient just computed (the next step's batch at the current parameters, unscaled and
        clipped) becomes the look-ahead (mars.MARS.update_previous_grad)."""
        self.look_ahead.update_previous_grad()

    def step(self) -> None:
        """One update as training makes it: through the GradScaler (under float16 it skips a step whose gradients
        hold an inf and adjusts the loss scale; disabled, it steps), then exact MARS's update_last_grad: the
        look-ahead becomes g_{t-1} of the next step's correction."""
        self.scaler.step(self.torch_optimizer)
        self.scaler.update()
        if self.look_ahead is not None:
            self.look_ahead.update_last_grad()

    def skip(self, own_gradient_finite: bool) -> None:
        """A step not taken (a non-finite gradient norm): parameters, state and MARS's last gradient stay as they
        were. Under float16 the loss scale still falls, as scaler.step would lower it. The scaler sees the step's
        own gradient only: when the look-ahead's alone overflowed (`own_gradient_finite`), the scale is lowered
        here, or the next step's look-ahead would overflow at the same scale and the run stop at max_bad_steps."""
        scaler = self.scaler
        if not scaler.is_enabled():
            return
        if own_gradient_finite:
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
        else:
            scaler.update()

    def state_norms(self) -> dict:
        """The norms of the state the train line logs ({metrics name: 0-d tensor}, the entry's state_norms).
        Where the state is sharded every rank adds its share (a collective: every rank calls this); else rank 0's
        is the whole, and the other ranks get {}."""
        if self.parallel.state_is_sharded or self.parallel.dist.is_master:
            return self.entry.state_norms(self.torch_optimizer, self.parallel)
        return {}

    @property
    def scaler_part(self) -> ScalerState:
        """The GradScaler as a checkpoint part (its own key, 'scaler', beside the optimizer's)."""
        return ScalerState(self.scaler)

    def state_dict(self) -> dict | None:
        """The torch optimizer's state_dict (a collective under ZeRO-1: rank 0 gets it whole, the others None)."""
        return self.torch_optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's optimizer state under this run's configuration: the torch optimizer's load_state_dict
        restores the moments, the step counts and each group's saved settings (a one-file checkpoint's whole
        tensors placed as the parallelism holds them: FSDP2's rows); group_hyperparameters then writes the
        configuration's settings on top, so a resume with --learning_rate=1e-4 trains at 1e-4."""
        self.torch_optimizer.load_state_dict(self.parallel.place_state(state))
        group_hyperparameters(self.torch_optimizer, self.entry, self.cfg)

    def parameter_layout(self) -> list:
        """For the memory plan, after a step: for each torch optimizer inside, for each of its groups, for each
        parameter (parameter, its state, the bytes its step allocates beyond the state, whether its update runs
        Newton-Schulz on the whole matrix -- under FSDP2 at one owner rank: torch's Muon, MARS-Shampoo's and
        MARS-M's matrices)."""
        import torch

        import mars

        def facts(opt, group, p):
            state = opt.state[p]
            # MARS computes c_t in last_grad's buffer; a last_grad stored in another dtype than the parameter's gives
            # c_t a buffer of its own during the step (mars.MARS's corrected gradients)
            last_grad = state.get("last_grad")
            own_buffer = last_grad is not None and last_grad.dtype != p.dtype
            newton_schulz = isinstance(opt, torch.optim.Muon) or (
                isinstance(opt, mars.MARS) and mars.update_rule(p, group) in mars.NEWTON_SCHULZ_RULES
            )
            return p, state, p.numel() * p.element_size() * own_buffer, newton_schulz

        return [
            [[facts(opt, group, p) for p in group["params"]] for group in opt.param_groups] for opt in self.optimizers
        ]


def build_optimizer(
    model: object,
    cfg: object,
    parallel: Parallelism,
    registry: Registry | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> TrainingOptimizer:
    """The optimizer cfg names in `registry` (train.py's OPTIMIZERS by default) over model's trainable parameters
    (on their device), each torch optimizer in it placed by the run's parallelism, with the run's GradScaler
    (`scaler`; a disabled one by default). Every group is named and holds cfg's settings and its peak lr as
    'initial_lr' (the schedule's start)."""
    entry = (registry or OPTIMIZERS).entry(cfg)
    settings = entry.group_settings(cfg)
    parts = entry.split(model, cfg)
    _check_split(entry, model, parts)
    groups = [
        dict(params=params, name=name, **values, initial_lr=values["lr"])
        for (name, values), params in zip(settings.items(), parts, strict=True)
    ]
    return TrainingOptimizer(entry, entry.build(groups, cfg, parallel), cfg, parallel, scaler)


def _check_split(entry, model, parts):
    """Every trainable parameter of model in exactly one of the parts, and no tensor that is not model's."""
    counts = collections.Counter(id(p) for part in parts for p in part)
    named = list(model.named_parameters())  # a tied tensor once
    missing = [name for name, p in named if p.requires_grad and not counts[id(p)]]
    repeated = [name for name, p in named if counts[id(p)] > 1]
    foreign = counts.keys() - {id(p) for _, p in named}
    if missing or repeated or foreign:
        raise ValueError(
            f"{entry.name}'s parameter groups must hold every trainable parameter once: missing "
            f"{missing or 'none'}; in more than one group {repeated or 'none'}; {len(foreign)} tensors not the "
            "model's"
        )
