"""FSDP2 and HSDP (zero_stage=3): how train.py shards its model over the ranks.

torch's fully_shard on each transformer block, then on the root -- the tied token embedding and output head,
the position embedding and the final LayerNorm: every parameter becomes a DTensor of which each rank holds
about 1/N of the rows (Shard(0), in torch.chunk's sizes), its gradient arrives sharded alike, and the optimizer
keeps its state sharded the same way (mars.py's sharded step for MARS; torch's classes through DTensor for
AdamW and Muon). A block's whole parameters exist only while its forward or backward pass runs (all-gathered
just before, freed after); the root's stay whole from its forward pass to the end of its backward pass, which
follows at once. HSDP: with hsdp_replicas = R the mesh is R x (N / R): each row of ranks holds one sharded
copy of the model, and the rows all-reduce their gradients (placements (Replicate(), Shard(0))).

A module of its own rather than part of runtime.py: runtime is what every tool shares (device, dtype, process
group); this is what only a sharded training run needs, and it imports torch.distributed.fsdp, which the tools
never load. What a checkpoint holds of the sharded tensors is marsgpt/checkpoint.py's; placing them on the
mesh when a run resumes is `shard_like_parameters` and `empty`, here.
"""

import contextlib

import torch


def enabled(cfg, dist_info):
    """Whether a run shards with FSDP2: zero_stage=3 under torchrun (any number of ranks). One process without
    torchrun has no process group to shard over: zero_stage=3 then trains the whole model, as zero_stage=1."""
    return cfg.zero_stage == 3 and dist_info.ddp


def device_mesh(cfg, dist_info):
    """The ranks as FSDP2 shards over them: a 1-D mesh of every rank, or HSDP's (replicas, shards) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world, replicas = dist_info.world_size, cfg.hsdp_replicas
    if replicas == 1:
        return init_device_mesh(dist_info.device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(dist_info.device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


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


def whole(tensor):
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
