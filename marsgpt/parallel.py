"""How a training run is spread over its ranks, decided once: torchtitan's ParallelDims for train.py's three ways,
DDP (zero_stage 0), ZeRO-1 (1: the optimizer state sharded, marsgpt/zero.py) and FSDP2 / HSDP (3: parameters,
gradients and optimizer state sharded, marsgpt/fsdp.py).

Parallelism is made once from zero_stage, hsdp_replicas and the process group (runtime.Dist), and it answers every
question of how the run is parallel: it wraps the model, says when gradients are reduced and how they are cleared,
sums over the ranks and over the ranks that hold one share of the optimizer state, says how evaluation keeps the
ranks in step, places each torch optimizer (ZeRO-1's ShardedOptimizer, FSDP2's owner-computing classes) and a
one-file checkpoint's whole tensors, and says whether checkpoints are sharded. The memory plan asks the same
questions of a planned one (planned: no process group). Nothing else reads zero_stage.
"""

import contextlib
import dataclasses
import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from marsgpt import fsdp
from marsgpt.config import TrainConfig
from marsgpt.runtime import Dist, SetupError
from marsgpt.zero import ShardedOptimizer

DDP_KEYWORDS = inspect.signature(DDP.__init__).parameters  # the keywords this torch's DDP takes


@dataclasses.dataclass
class Parallelism:
    """One run's data parallelism over the ranks of `dist`."""

    dist: Dist
    zero_stage: int = 0
    replicas: int = 1  # HSDP's replica groups (zero_stage=3): each holds the whole model, sharded over its ranks
    gradient_sync: str = "step"  # zero_stage=3: when FSDP2 reduce-scatters the gradients (config.TrainConfig)
    mesh: object = None  # FSDP2's DeviceMesh, made when wrap() shards the model

    @classmethod
    def of(cls, cfg: TrainConfig, dist_info: Dist) -> "Parallelism":
        """The run cfg configures on the ranks of dist_info; SetupError (every rank alike) when HSDP's replica groups
        do not divide them."""
        if cfg.zero_stage == 3 and dist_info.world_size % cfg.hsdp_replicas:
            raise SetupError(
                f"hsdp_replicas={cfg.hsdp_replicas} does not divide the world size {dist_info.world_size}: HSDP "
                f"splits the ranks into that many groups of equal size; use a divisor of {dist_info.world_size} "
                "(1 = plain FSDP)"
            )
        return cls(dist_info, cfg.zero_stage, cfg.hsdp_replicas, cfg.gradient_sync)

    @classmethod
    def planned(cls, cfg: TrainConfig, world_size: int, torchrun: bool) -> "Parallelism":
        """cfg's run on world_size ranks, launched by torchrun or not, as the memory plan sees it: no process group,
        nothing placed on a device."""
        planned = Dist(torchrun=torchrun, world_size=world_size, device="meta")
        return cls(planned, cfg.zero_stage, cfg.hsdp_replicas, cfg.gradient_sync)

    @classmethod
    def single(cls, device_type: str = "cpu") -> "Parallelism":
        """One process on one device: nothing sharded, nothing reduced (the tools', the tests', vision's)."""
        return cls(Dist(device=device_type))

    # --- what the run is

    @property
    def device_type(self) -> str:
        return self.dist.device_type

    @property
    def shards_optimizer_state(self) -> bool:
        """ZeRO-1: zero_stage=1 and more than one rank to share the state."""
        return self.zero_stage == 1 and self.dist.world_size > 1

    @property
    def shards_parameters(self) -> bool:
        """FSDP2: zero_stage=3 under torchrun (any number of ranks). One process without torchrun has no process
        group to shard over: zero_stage=3 then trains the whole model, as zero_stage=1."""
        return self.zero_stage == 3 and self.dist.torchrun

    @property
    def state_is_sharded(self) -> bool:
        """Each rank holds a share of the optimizer state: whole tensors (ZeRO-1) or rows of each (FSDP2)."""
        return self.shards_optimizer_state or self.shards_parameters

    @property
    def shards(self) -> int:
        """The ranks that hold one copy of the model between them under FSDP2 (HSDP: one replica group's)."""
        return self.dist.world_size // self.replicas

    @property
    def note(self) -> str | None:
        """What the configuration asks for that this many ranks do not do, in words."""
        if self.zero_stage == 1 and self.dist.world_size == 1:
            return "zero_stage=1 has no effect in one process: it shards the optimizer state over DDP ranks"
        return None

    # --- the model and its gradients

    def wrap(self, model: torch.nn.Module, compile_model: bool, dtype: str) -> torch.nn.Module:
        """`model` (on its device) ready to train, and what the training forward goes through. compile_model:
        each block and the loss compiled in place (model.GPT.compile_blocks). Under FSDP2 the model is sharded in
        place, after compiling (the order the two compose in), with the mixed precision of the resolved autocast
        `dtype` (fsdp.mixed_precision); under torchrun otherwise DDP's wrapper of it; else the model itself."""
        if self.shards_parameters:
            self.mesh = fsdp.device_mesh(self.device_type, self.dist.world_size, self.replicas)
            policies = fsdp.mixed_precision(dtype, self.device_type)
            return fsdp.shard_model(model, self.mesh, policies, compile_blocks=compile_model)
        if compile_model:
            model.compile_blocks()
        return wrap_ddp(model, self.dist) if self.dist.torchrun else model

    def gradients_stay_local(self, train_model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The context of a micro-batch before a step's last: its gradients add up on this rank, unreduced. DDP's
        no_sync; FSDP2's unsharded accumulation with gradient_sync=step (with micro_batch it reduce-scatters every
        micro-batch, keeping the gradients sharded); nothing to keep in one process."""
        if self.shards_parameters:
            return fsdp.no_gradient_sync(train_model) if self.gradient_sync == "step" else contextlib.nullcontext()
        return train_model.no_sync() if self.dist.torchrun else contextlib.nullcontext()

    @property
    def gradients_to_none(self) -> bool:
        """How zero_grad clears the gradients: in place under DDP (they are views of its buckets, see wrap_ddp),
        else set to None, which frees them until the backward pass needs them again."""
        return not self.dist.torchrun or self.shards_parameters

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A DTensor's whole value on every rank (a norm of FSDP2's sharded tensors, which is Replicate: nothing to
        send), else the tensor."""
        return fsdp.full_tensor(tensor) if self.shards_parameters else tensor

    def parameter_norm(self, model: torch.nn.Module) -> torch.Tensor | None:
        """The norm of the model's parameters (a 0-d tensor on the device): under FSDP2 a collective every rank joins
        (one all-reduce of the shards' sums of squares) and every rank gets; else rank 0's alone, None on the
        others."""
        if not (self.shards_parameters or self.dist.is_master):
            return None
        return self.full_tensor(torch.nn.utils.get_total_norm(list(model.parameters())))

    def read_agreed(self, values: torch.Tensor, flags: list[float]) -> tuple[list[float], list[float]]:
        """The step's `values` (on the device) read to the host -- the step's one synchronisation -- and this rank's
        `flags` max-reduced over the ranks on the way, so every rank has the same flags after the same step: both
        as lists. Under torchrun the flags ride on one all-reduce of len(flags) numbers (0.6 ms per step on 2 gloo
        ranks, docs/training.md)."""
        if not self.dist.torchrun:
            return values.tolist(), list(flags)
        agreed = torch.tensor(flags, device=values.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        read = torch.cat([values.flatten(), agreed]).tolist()
        return read[: -len(flags)], read[-len(flags) :]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over every rank, in place (itself in one process)."""
        if self.dist.torchrun:
            dist.all_reduce(tensor)
        return tensor

    # --- evaluation

    @property
    def lockstep(self) -> bool:
        """Whether every forward pass is a collective (FSDP2's all-gathers): evaluation then keeps the ranks in
        step, a rank with fewer windows than another running passes it does not count."""
        return self.shards_parameters

    def evaluation_padding(self, windows: int, eval_iters: int) -> int:
        """The passes a rank holding `windows` of the eval_iters evaluation windows runs beyond them, on zeros."""
        return -(-eval_iters // self.dist.world_size) - windows if self.lockstep else 0

    # --- the optimizer

    def place_optimizer(self, optimizer_class: type, groups: list, **options: object) -> object:
        """optimizer_class over `groups` as this run places it: a ShardedOptimizer of it under ZeRO-1, its
        owner-computing class under FSDP2 where it has one (fsdp.OWNER_CLASSES), else itself."""
        if self.shards_optimizer_state:
            return ShardedOptimizer(groups, optimizer_class=optimizer_class, **options)
        if self.shards_parameters:
            optimizer_class = fsdp.OWNER_CLASSES.get(optimizer_class, optimizer_class)
        return optimizer_class(groups, **options)

    def local_optimizer(self, optimizer: object) -> object:
        """The torch optimizer that holds this rank's state in one place_optimizer made: ZeRO-1's share of it, else
        itself."""
        return optimizer.local if isinstance(optimizer, ShardedOptimizer) else optimizer

    def local_shards(self, tensors: list) -> list:
        """This rank's rows of each of `tensors` under FSDP2 (views of the DTensors), else the tensors."""
        return [fsdp.local(t) for t in tensors] if self.shards_parameters else list(tensors)

    def sum_over_state_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed, in place, over the ranks that hold one share each of the sharded optimizer state: every
        rank under ZeRO-1, one copy's shards under FSDP2 (HSDP's replicas hold the same shards)."""
        if self.shards_parameters:
            dist.all_reduce(tensor, group=fsdp.shard_group(self.mesh))
            return tensor
        return self.all_reduce_sum(tensor)

    def place_state(self, state: dict) -> dict:
        """A one-file checkpoint's state of whole tensors, as this run holds it: under FSDP2 each tensor shaped like
        its parameter becomes this rank's rows of it (fsdp.shard_like_parameters); else as it is."""
        return fsdp.shard_like_parameters(state, self.mesh) if self.shards_parameters else state

    # --- checkpoints

    @property
    def writes_sharded_checkpoints(self) -> bool:
        """Whether every rank writes its rows of each checkpoint (marsgpt/shards.py), rather than rank 0 one file."""
        return self.shards_parameters

    def empty_like(self, meta: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor a sharded checkpoint's tensor (`meta`: its shape and dtype) is read into: this
        rank's rows of a DTensor placed as FSDP2 places a parameter, or the whole tensor in an unsharded run."""
        if self.shards_parameters:
            return fsdp.empty(meta.shape, meta.dtype, self.mesh)
        return torch.empty(meta.shape, dtype=meta.dtype)


def wrap_ddp(model: torch.nn.Module, dist_info: Dist) -> torch.nn.Module:
    """model under DDP with gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets, not in a copy
    beside them (docs/training.md, "GPUs, nodes and the global batch", has what it saves). That holds only while
    they stay there: zero_grad clears them in place (Parallelism.gradients_to_none), and they exist before DDP is
    built, so it places them in its buckets at once. No buffer sync before each forward pass: the GPT's only
    buffers are the same constants on every rank (model.CausalSelfAttention.layer_factor_as_data); the keyword
    that says so is the one this torch's DDP takes (DDP_KEYWORDS)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    no_buffer_sync = "forward_sync_buffers" if "forward_sync_buffers" in DDP_KEYWORDS else "broadcast_buffers"
    return DDP(
        model,
        device_ids=[dist_info.local_rank] if dist_info.device_type == "cuda" else None,
        gradient_as_bucket_view=True,
        **{no_buffer_sync: False},
    )
