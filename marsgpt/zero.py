"""ZeRO-1 (zero_stage=1): each DDP rank keeps the optimizer state of its share of the parameters.

ShardedOptimizer is what marsgpt/parallel.py makes of each torch optimizer of a run whose optimizer state is
sharded; its checkpoints are in the unsharded optimizer's own format, so a run resumes on any number of ranks,
sharded or not.
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from marsgpt import checkpoint


class ShardedOptimizer:
    """ZeRO-1 (Rajbhandari et al., 2020, stage P_os) on torch's ZeroRedundancyOptimizer, which gives each rank
    whole parameters -- the largest first, each to the rank holding the fewest elements so far -- runs
    optimizer_class on that rank's share, and after step() broadcasts each rank's updated parameters to the
    others. A rule that looks at a whole tensor (MARS's clip of c_t to Frobenius norm 1, Muon's Newton-Schulz)
    therefore sees exactly what it sees unsharded. Hyperparameters written into param_groups (the schedule,
    a resume's configuration) reach the rank's optimizer at the next step().

    What this wrapper adds:
    - state_dict() is collective (every rank calls it, like a checkpoint's other parts) and returns on rank 0
      the state in the unsharded optimizer's own format (None on the other ranks): a checkpoint resumes on
      any number of ranks, sharded or not, and readers that know nothing of sharding read it;
    - load_state_dict() takes that format and loads this rank's share through optimizer_class's own
      load_state_dict, which places each state tensor as that class wants it (fused AdamW's step counts on
      the device, for instance).
    Exact MARS's look-ahead calls go to `local`, the rank's own MARS.
    """

    def __init__(self, params: list, optimizer_class: type, **defaults: object):
        # imported here: torch.distributed.optim adds seconds to every start, and only sharded runs need it
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.zero = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **defaults)

    @property
    def param_groups(self) -> list:
        return self.zero.param_groups

    @property
    def local(self) -> torch.optim.Optimizer:
        """This rank's optimizer_class over its share of the parameters."""
        return self.zero.optim

    @property
    def state(self) -> dict:
        """The state this rank holds: its share's."""
        return self.local.state

    def step(self, closure: Callable | None = None) -> object:
        return self.zero.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict | None:
        """Collective: on rank 0 every rank's share in the unsharded format, on the other ranks None.

        Each state tensor reaches rank 0's host once, one tensor at a time: over gloo straight into its host
        tensor; over NCCL from its owner's device into a buffer of its size on rank 0's device, then to the
        host. A save therefore adds at most the largest state tensor to rank 0's GPU (memory_plan's "checkpoint
        save") and one copy of the state to its host. (torch's consolidate_state_dict moves each rank's whole
        share through the GPU as serialized bytes and keeps two host copies of it, one pinned.)

        The unsharded format numbers the parameters in param_groups' order: each rank sends, with its share's
        layout, that number for each of its own parameters, and rank 0 files every rank's state under them in
        the groups torch.optim.Optimizer.state_dict writes (what ZeroRedundancyOptimizer.state_dict does with
        the states consolidate_state_dict gathers).
        """
        zero, group = self.zero, self.zero.process_group
        local = self.local.state_dict()
        number = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        mine = [number[id(p)] for g in self.local.param_groups for p in g["params"]]  # by the share's numbering
        root = dist.get_global_rank(group, 0)
        layouts = [None] * zero.world_size if zero.rank == 0 else None  # each rank's state on meta, its numbers
        layout = (checkpoint.map_tensors(local, lambda t: t.to("meta")), mine)
        dist.gather_object(layout, layouts, dst=root, group=group)
        # gloo moves host tensors, NCCL only device tensors
        device = torch.device("cpu") if "gloo" in dist.get_backend(group) else self.param_groups[0]["params"][0].device
        if zero.rank != 0:
            for tensor in checkpoint.tensors_of(local):
                transfer(dist.isend, tensor.detach().to(device).contiguous(), root, group)
            return None
        shares = [checkpoint.map_tensors(local, lambda t: t.detach().to("cpu", copy=True))]
        for rank in range(1, zero.world_size):
            source = dist.get_global_rank(group, rank)
            shares.append(
                checkpoint.map_tensors(layouts[rank][0], partial(received, source=source, group=group, device=device))
            )
        state = torch.optim.Optimizer.state_dict(zero)
        for share, (_, numbers) in zip(shares, layouts):
            state["state"].update({numbers[i]: value for i, value in share["state"].items()})
        state["state"] = dict(sorted(state["state"].items()))
        for group in state["param_groups"]:  # as the optimizer's own state_dict() writes a dtype (MARS: by name)
            group.update({k: str(v).removeprefix("torch.") for k, v in group.items() if isinstance(v, torch.dtype)})
        return checkpoint.hand_over(state)  # private host copies: the checkpoint writer need not copy them again

    def load_state_dict(self, state_dict: dict) -> None:
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


def transfer(op: Callable, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup) -> None:
    """One isend or irecv of `tensor` with global rank `peer`, finished. Through batch_isend_irecv, which on
    NCCL uses the group's communicator; a plain send or recv would open a new one for each pair of ranks."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]):
        work.wait()


def received(like: torch.Tensor, source: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """A host tensor shaped like the meta tensor `like`, received from global rank `source` into a buffer on
    `device` (the buffer itself when that is the CPU)."""
    buffer = torch.empty(like.shape, dtype=like.dtype, device=device)
    transfer(dist.irecv, buffer, source, group)
    return buffer.to("cpu")
