"""FSDP2 and HSDP (zero_stage=3): how train.py shards its model over the ranks.

torch's fully_shard on each transformer block, then on the root -- the tied token embedding and output head,
the position embedding and the final LayerNorm: every parameter becomes a DTensor of which each rank holds
about 1/N of the rows (Shard(0), in torch.chunk's sizes), its gradient arrives sharded alike, and the optimizer
keeps its state sharded the same way (mars_sharded.py's step for MARS; torch's AdamW through DTensor, torch's
Muon rule through ShardedMuon). A block's whole parameters exist only while its forward or backward pass runs
(all-gathered just before, freed after); the root's stay whole from its forward pass to the end of its backward
pass, which follows at once. HSDP: with hsdp_replicas = R the mesh is R x (N / R): each row of ranks holds one
sharded copy of the model, and the rows all-reduce their gradients (placements (Replicate(), Shard(0))).

A module of its own rather than part of runtime.py: runtime is what every tool shares (device, dtype, process
group); this is what only a sharded training run needs, and it imports torch.distributed.fsdp, which the tools
never load. What a checkpoint holds of the sharded tensors is marsgpt/checkpoint.py's; placing them on the
mesh when a run resumes is `shard_like_parameters` and `empty`, here.
"""

import contextlib
import math

import torch

from mars_sharded import map_whole_tensors
from marsgpt.optim_protocol import closure_loss


def device_mesh(device_type, world_size, replicas):
    """The ranks as FSDP2 shards over them: a 1-D mesh of every rank, or HSDP's (replicas, shards) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def mixed_precision(dtype, device_type):
    """(the blocks' MixedPrecisionPolicy, the root's) for a run's resolved autocast dtype.

    bfloat16 on CUDA: the blocks' parameters are all-gathered and used in bfloat16 (half the all-gather's bytes
    and half the whole block's memory) and their gradients reduce-scattered in float32. Their inputs are not
    cast (cast_forward_inputs=False), and the root -- the embeddings, whose output is the residual stream, and
    the output head -- keeps float32: the residual stream stays float32 as under DDP with autocast, which still
    runs each matmul in bfloat16. What differs from DDP is the rounding of the blocks' LayerNorm weights and
    Linear biases to bfloat16 (autocast computes LayerNorm in float32 from them). float16 (GPUs without
    bfloat16), float32 and the CPU: no policy, float32 parameters and gradients, autocast as under DDP; a
    float16 run's GradScaler unscales the DTensor gradients with one all-reduce of its inf check, so every rank
    agrees on a skipped step."""
    if not (dtype == "bfloat16" and device_type == "cuda"):
        return None, None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return blocks, MixedPrecisionPolicy(reduce_dtype=torch.float32)


def shard_model(model, mesh, policies=(None, None), compile_blocks=False):
    """fully_shard each of model's blocks, then the root, in place (model stays the GPT, its parameters
    DTensors). compile_blocks: compile each block and the loss first (in place, model.GPT.compile_blocks), the
    order FSDP2 and torch.compile compose in: the all-gathers and reduce-scatters stay outside the compiled
    graphs, which hold no graph break. Every block runs the same graphs (one for training, one for evaluation):
    the attention's per-layer factor is data, not a constant of each block's graph
    (model.CausalSelfAttention.layer_factor_as_data; without it, GPT-2 small's 12 blocks passed torch._dynamo's
    recompile_limit of 8 and 4 of them ran uncompiled). tests/test_fsdp.py compiles 10 blocks on 2 CPU ranks
    with dynamo's aot_eager backend."""
    from torch.distributed.fsdp import fully_shard

    blocks_policy, root_policy = policies
    if compile_blocks:
        model.compile_blocks()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, **_policy(blocks_policy))
    fully_shard(model, mesh=mesh, **_policy(root_policy))
    return model


def _policy(policy):
    return {} if policy is None else {"mp_policy": policy}


@contextlib.contextmanager
def no_gradient_sync(model):
    """A micro-batch whose gradients stay on this rank: FSDP2 adds them up whole (unsharded) in each parameter's
    gradient buffer, and the next micro-batch with the sync on reduce-scatters the sum (HSDP: and all-reduces
    it across the replicas) -- DDP's no_sync."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(tensor):
    """A DTensor's whole value on every rank (a norm's Replicate result: nothing to send), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local(tensor):
    """This rank's shard of a DTensor (a view), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shard_group(mesh):
    """The process group whose ranks hold the shards of one copy of the model (HSDP: one of the replicas')."""
    return mesh.get_group("shard")


def placements(mesh):
    """Where FSDP2 puts a parameter: rows over the shard dimension, whole over HSDP's replica dimension."""
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))


def empty(shape, dtype, mesh):
    """An uninitialised DTensor placed as FSDP2 places a parameter of that shape: what a resume loads a
    checkpoint's sharded tensor into (only this rank's rows are read from the files)."""
    import torch.distributed.tensor as dtensor

    return dtensor.empty(tuple(shape), dtype=dtype, device_mesh=mesh, placements=placements(mesh))


def shard_like_parameters(state, mesh):
    """An optimizer state of whole tensors (a one-file checkpoint's, written by a zero_stage 0 or 1 run) with each
    tensor of one or more dimensions -- the state shaped like its parameter -- replaced by this rank's rows of it
    as a DTensor placed like the parameter; 0-d tensors (step counts) and DTensors stay. Every rank holds the
    whole tensors, so nothing is sent."""
    from torch.distributed.tensor import distribute_tensor

    from marsgpt.checkpoint import map_tensors

    def shard(tensor):
        if hasattr(tensor, "to_local") or tensor.ndim == 0:
            return tensor
        return distribute_tensor(tensor, mesh, placements(mesh), src_data_rank=None)

    return map_tensors(state, shard)


# ---------------------------------------------------------------------------------------------------
# Optimizers on the sharded parameters.


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon's rule on FSDP2's sharded (DTensor) parameters, each matrix's Newton-Schulz run whole at one
    owner rank (mars_sharded.map_whole_tensors, MARS's owner exchange) and the rest on each rank's rows: what one
    process computes, with torch's own Newton-Schulz on the same whole matrices, where torch's Muon through
    DTensor's dispatch gathers every matrix on every rank and rounds in another order. State and checkpoints are
    torch.optim.Muon's. docs/mars.md ("Sharded parameters") has the measurements and why the one private import."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim._muon import _zeropower_via_newtonschulz

        loss = closure_loss(closure)
        for group in self.param_groups:
            params, grads, momenta = [], [], []
            self._init_group(group, params, grads, momenta)
            if not params:
                continue
            lr, momentum = group["lr"], group["momentum"]
            updates = []
            for grad, buf in zip(map(local, grads), map(local, momenta)):
                buf.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)

            def orthogonalize(update, group=group):
                return _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])

            directions = map_whole_tensors(params, updates, orthogonalize, result_dtype=torch.bfloat16)
            for p, direction in zip(params, directions):
                rows = local(p)
                rows.mul_(1 - lr * group["weight_decay"])
                rows.add_(direction, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def adjusted_lr(lr, adjust_lr_fn, shape):
    """The lr torch.optim.Muon steps a (rows, cols) matrix with, as its documentation gives adjust_lr_fn: "original"
    (or None) lr sqrt(max(1, rows / cols)), "match_rms_adamw" lr 0.2 sqrt(max(rows, cols))."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


# torch optimizers whose rule looks at whole matrices, and the classes that step FSDP2's sharded parameters with
# those matrices whole at owner ranks instead of through DTensor's dispatch (ShardedMuon says why).
OWNER_CLASSES = {torch.optim.Muon: ShardedMuon}
