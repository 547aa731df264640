"""torch.optim's protocol for the optimizers this package builds that are not torch's own: step(closure) computes the
closure's loss with gradients on and returns it (closure_loss), and several torch optimizers over disjoint
parameters are stepped, cleared, saved and restored as one (ChainedOptimizer: Muon's matrices and AdamW's rest).
"""

from collections.abc import Callable


def closure_loss(closure: Callable | None) -> object:
    """torch.optim's step(closure) protocol: the loss closure() returns, computed with gradients on."""
    if closure is None:
        return None
    import torch

    with torch.enable_grad():
        return closure()


class ChainedOptimizer:
    """Several torch optimizers over disjoint parameters, driven as one (state_dict holds each)."""

    def __init__(self, *optimizers):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list:
        # Recomputed on each access: load_state_dict replaces the group dicts inside each optimizer.
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure: Callable | None = None) -> object:
        loss = closure_loss(closure)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"state_dict holds {len(saved)} optimizers, this one chains {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)
