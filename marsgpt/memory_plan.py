"""The memory plan: what one GPU holds at the peak of a training step, estimated before the run starts.

    python train.py config/train_gpt2_xl_mars.py --dry_run=True --gpu_memory_gb=40 --plan_world_size=8

plan(cfg, world_size, gpu_memory_gb) returns the numbers (a MemoryPlan); train.py prints them (format_plan)
at the start of every run, and --dry_run=True prints them and exits, reading no data and needing no GPU.
Parameters, gradients and optimizer state are exact: optimizer_layout builds the model on the meta device
and lets the run's own optimizer take one step there, so each parameter's state is what the optimizer
allocated; under ZeRO-1, zero_partition replays torch's assignment of parameters to ranks. Activations
(with --deterministic=True, the math attention kernel's probabilities), the chunked loss's buffers,
autocast's weight copies and the backward pass's gradient buffers follow a formula (Activations: bytes per
token and per model, eager mode); the peak is the largest of a few moments of the forward and backward
pass, of the optimizer step and of a ZeRO-1 checkpoint save. docs/memory.md gives the formula
term by term, the moments, and how close the plan comes to measured peaks. A plan fits when its total is
at most 1 - HEADROOM of the GPU's memory.
"""

import dataclasses
import json
import math
import os
import typing

import torch

from marsgpt.parallel import Parallelism
from marsgpt.runtime import resolve_compile, resolve_dtype
from marsgpt.tokens import DataError, TokenData
from marsgpt.training_optimizer import build_optimizer
from model import (
    GPT,
    GPT2_VOCAB_SIZE,
    HF_CHECKPOINTS,
    PRESETS,
    GPTConfig,
    loss_chunk_rows,
    model_args_from_config,
    model_vocab_size,
)

GIB = 2**30
HEADROOM = 0.10  # of the GPU's memory, for what the plan does not count (docs/memory.md)
AUTO_DTYPE = "bfloat16"  # dtype=auto on any GPU from the A100 on


class PlannedParameter(typing.NamedTuple):
    """One parameter as the plan needs it."""

    elements: int
    state_bytes: int  # its optimizer state
    step_buffer: int  # what the optimizer step allocates for it beyond the state
    largest: int  # its largest state tensor's bytes
    rows: int  # its first dimension, the one FSDP2 shards (1 for a 0-d tensor)
    newton_schulz: tuple | None = None  # its shape when its update runs Newton-Schulz on the whole matrix


@dataclasses.dataclass(frozen=True)
class OptimizerLayout:
    """The run's optimizer as the plan needs it: its name in a few words, and for each torch optimizer inside
    (Muon's pair has two) its parameter groups, each a list of PlannedParameter per parameter, in order."""

    label: str
    optimizers: tuple

    @property
    def planned_parameters(self):
        """Every PlannedParameter, in order."""
        return [entry for groups in self.optimizers for group in groups for entry in group]


def optimizer_layout(cfg, model_args):
    """Build the model on the meta device, take one optimizer step there as training takes it (exact MARS's
    look-ahead too), and record each parameter's state (training_optimizer.TrainingOptimizer.parameter_layout)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    optimizer = build_optimizer(model, cfg, Parallelism.single("meta"))
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    if optimizer.look_ahead is not None:
        optimizer.keep_look_ahead_gradient()
    optimizer.step()

    def entry(p, state, step_buffer, newton_schulz):
        sizes = [v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v)]
        rows = p.shape[0] if p.ndim else 1
        shape = tuple(p.shape) if newton_schulz else None
        return PlannedParameter(p.numel(), sum(sizes), step_buffer, max(sizes, default=0), rows, shape)

    layout = optimizer.parameter_layout()
    return OptimizerLayout(
        optimizer.label, tuple(tuple(tuple(entry(*facts) for facts in group) for group in opt) for opt in layout)
    )


def zero_partition(groups, world_size):
    """Each rank's parameters as torch's ZeroRedundancyOptimizer assigns them (its _partition_parameters):
    group by group, the largest tensor first, each to the rank with the fewest elements so far (the lowest
    rank on a tie). `groups` hold layout entries; returns one list of entries per rank."""
    sizes, ranks = [0] * world_size, [[] for _ in range(world_size)]
    for group in groups:
        for entry in sorted(group, key=lambda e: e[0], reverse=True):
            rank = sizes.index(min(sizes))
            ranks[rank].append(entry)
            sizes[rank] += entry[0]
    return ranks


@dataclasses.dataclass(frozen=True)
class Activations:
    """The formula's per-token and fixed terms for one model and dtype (docs/memory.md, "How the plan is
    computed"), for the CUDA kernels a run takes, or (device_type="cpu", what the tests measure) the CPU's with
    torch's own bfloat16 matmul: oneDNN's keeps buffers that depend on the processor (tests/test_memory_plan.py)."""

    cfg: GPTConfig
    element_bytes: int  # a
    linear_weights: int  # W: elements of every Linear weight
    linear_params: int  # with their biases (autocast's cache while the forward pass runs)
    block_linear_params: int  # one block's Linear weights and biases
    loss_rows: int  # rows of the output layer's scores the loss computes at once (model.loss_chunk_rows)
    math_attention: bool = False  # the math attention kernel (--deterministic=True on CUDA)
    device_type: str = "cuda"
    compiled: bool = False  # the blocks and the loss's chunks compiled (model.GPT.compile_blocks)

    @property
    def cast(self):
        return self.element_bytes < 4

    @property
    def dropout(self):
        return self.cfg.dropout > 0

    def mask(self, element_bytes):
        """Bytes per element a dropout keeps for its backward pass: CUDA's fused kernel a 1-byte mask, the CPU
        its scaled noise, in the dtype of the tensor it drops from (element_bytes)."""
        return 1 if self.device_type == "cuda" else element_bytes

    def per_block(self):
        """A block's activations per token, its attention probabilities aside (attention_probabilities)."""
        c, a, h = self.cfg.n_embd, self.element_bytes, self.cfg.n_head
        dropout = 2 * c * self.mask(a) * self.dropout  # after the attention and the MLP
        if self.math_attention:  # float32 copies of q, k and v instead of q, k, v and the log-sum-exp
            return 8 * c + 11 * a * c + 12 * c + 16 + dropout
        if self.compiled:  # the attention projection's output (a bytes), not the float32 sum the MLP's input is,
            # and q times the per-layer factor, a tensor of its own (model.CausalSelfAttention.layer_factor_as_data)
            scaled_q = a * c * self.cfg.scale_attn_by_inverse_layer_idx
            return 4 * c + 15 * a * c + scaled_q + 4 * h + 16 + dropout
        return 8 * c + 14 * a * c + 4 * h + 16 + dropout

    def attention_probabilities(self):
        """Per token and block, what the math kernel keeps of its n_head x block_size scores per token: the
        float32 softmax and, with dropout, the dropped probabilities and the mask (0 with the fused kernels)."""
        if not self.math_attention:
            return 0
        return self.cfg.n_head * self.cfg.block_size * (4 + (4 + self.mask(4)) * self.dropout)

    def kept_through_attention_backward(self):
        """Per token, what the math kernel's block still holds when its attention's backward pass runs: the
        first LayerNorm's input and statistics, its output as c_attn reads it, the float32 q and k."""
        c, a = self.cfg.n_embd, self.element_bytes
        return 4 * c + 8 + a * c + 8 * c

    def attention_backward(self, tokens):
        """The math kernel's backward pass at its fullest, beyond what the block kept through it: either its
        first matmul's (the gradient of the probabilities, beside the dropped ones and the mask it still keeps,
        and the float32 v, the incoming gradient and its contiguous copy) or the softmax's and the dropout's
        (a float32 gradient in and one out, and v's gradient)."""
        c, scores = self.cfg.n_embd, tokens * self.cfg.n_head * self.cfg.block_size
        dropped = (4 + self.mask(4)) * self.dropout  # per score, what the dropout keeps besides the probabilities
        first_matmul = scores * 4 + tokens * 16 * c
        softmax = scores * (8 - 4 * self.dropout - dropped) + tokens * 8 * c  # the dropout's own are freed by then
        return max(first_matmul, softmax)

    def block_backward(self, tokens):
        """A block's backward pass at its fullest, its first matmul (the MLP's output projection): the
        gradient of the residual stream (float32), its copy in the autocast dtype or the dropout's gradient,
        and the matmul's two gradients, the MLP hidden layer's and the weight's (in the autocast dtype; cast to
        float32 after the matmul has freed more than that)."""
        c, a = self.cfg.n_embd, self.element_bytes
        return tokens * (4 * c + 4 * a * c + a * c * max(self.cast, self.dropout)) + 4 * c * c * a

    def mlp_dropout(self, tokens):
        """The MLP dropout's mask, freed by its backward step, the first of the block's."""
        return tokens * self.cfg.n_embd * self.mask(self.element_bytes) * self.dropout

    def after_blocks(self):
        """Per token: the final LayerNorm's input and statistics."""
        return 4 * self.cfg.n_embd + 8

    def embedding_dropout(self, tokens):
        """The embedding dropout's mask (on the float32 sum of the two embeddings), kept until the last
        backward step."""
        return tokens * self.cfg.n_embd * self.mask(4) * self.dropout

    def rng_states(self, checkpointing):
        """The CPU RNG state each checkpointed block keeps for its recomputation: on the CPU's allocator, or in
        a GPU run's host memory (not counted)."""
        return checkpointing * self.cfg.n_layer * torch.get_rng_state().numel() * (self.device_type == "cpu")

    def loss_chunks(self, tokens):
        """The rows of each size of chunk the loss takes a micro-batch in."""
        full, rest = divmod(tokens, self.loss_rows)
        return [rows for rows, count in ((self.loss_rows, full), (rest, rest)) if count]

    def loss_chunk(self, rows):
        """The most one chunk of model._ChunkedCrossEntropy's forward holds at once: its input rows cast to the
        autocast dtype, then in model.chunk_loss its logits (a bytes per score), their float32 log-softmax, which
        becomes the gradient in place, the one-hot comparison (1 byte) and its float32 copy, the gradient's copy in
        the autocast dtype; then that gradient's two matmuls, each with its output."""
        c, v, a, cast = self.cfg.n_embd, self.cfg.vocab_size, self.element_bytes, self.cast
        low = a * cast  # the gradient's copy in the autocast dtype, a tensor of its own when cast
        x_rows = a * cast * rows * c
        if self.compiled:  # one buffer, the logits and then their gradient; the two matmuls after it
            return x_rows + a * rows * v + max(a * rows * c, a * v * c + self.promote())
        gradient = (low if cast else 4) * rows * v
        return x_rows + max(
            a * rows * v,  # the logits' matmul
            (a + 4 * cast + 4) * rows * v,  # the log-softmax of a float32 copy
            (a + 9) * rows * v,  # minus the one-hot
            (a + 4 + low) * rows * v,  # the gradient's copy
            gradient + a * rows * c,  # the input's gradient
            gradient + a * v * c + self.promote(),  # the output weight's gradient
        )

    def promote(self):
        """What the CPU's += of a product in the autocast dtype into the float32 output weight's gradient adds: a
        float32 copy of the product."""
        return 4 * self.cfg.vocab_size * self.cfg.n_embd * self.cast * (self.device_type == "cpu")

    def loss_forward(self, tokens):
        """The most the loss holds in the forward pass: its input (the final LayerNorm's float32 output), the
        gradients it computes there for the backward pass (the input's, the output weight's in float32), each
        row's float32 weight in the mean, the scored positions' mask, the vocabulary's indices, and its largest
        chunk."""
        c, v = self.cfg.n_embd, self.cfg.vocab_size
        held = tokens * (8 * c + 5) + 4 * v * c + 8 * v
        return held + max(self.loss_chunk(rows) for rows in self.loss_chunks(tokens))

    def loss_backward(self, tokens):
        """The loss's backward pass: the two gradients it kept, and their copies scaled by the incoming one."""
        c, v = self.cfg.n_embd, self.cfg.vocab_size
        return 2 * (tokens * 4 * c + 4 * v * c)

    def forward_weight_copies(self, checkpointing):
        """The Linear parameters whose copies in the autocast dtype exist when the forward pass ends: autocast's
        cache holds every weight's and bias's; compiled, the loss holds its weight's and each block keeps its
        weights' for its backward pass (its biases' are temporaries of its graph), unless it is checkpointed."""
        if not self.compiled:
            return self.linear_params
        head = self.cfg.vocab_size * self.cfg.n_embd
        return head if checkpointing else self.linear_weights

    def peak(self, tokens, checkpointing):
        """(moment, {part: bytes}) of the largest moment of the forward and backward pass."""
        c, v, n_layer, a, cast = self.cfg.n_embd, self.cfg.vocab_size, self.cfg.n_layer, self.element_bytes, self.cast
        attention = tokens * self.attention_probabilities()
        # the tied embedding's gradient from the loss waits in float32 for the embedding's own (autograd adds
        # the two up first): through every block's backward pass
        tied = 4 * v * c
        kept = self.embedding_dropout(tokens) + self.rng_states(checkpointing)  # until the last backward step
        # the loss's and the embedding's gradients of the tied matrix, and the embedding's input's
        end = {"end of the backward pass": dict(gradients=2 * tied + tokens * 4 * c)}
        if not checkpointing:
            blocks = kept + tokens * n_layer * self.per_block()
            last_block = dict(
                activations=blocks - self.mlp_dropout(tokens),
                attention=n_layer * attention,
                weight_copies=cast * a * (self.linear_weights - v * c),
                gradients=self.block_backward(tokens) + tied,
            )
            moments = {
                "loss in the forward pass": dict(
                    activations=blocks + tokens * self.after_blocks(),
                    attention=n_layer * attention,
                    loss=self.loss_forward(tokens),
                    weight_copies=cast * a * self.forward_weight_copies(checkpointing),
                ),
                "start of the backward pass": dict(
                    activations=blocks + tokens * self.after_blocks(),
                    attention=n_layer * attention,
                    loss=self.loss_backward(tokens),
                    weight_copies=cast * a * (self.linear_weights - v * c),
                ),
                "backward pass of the last block": last_block,
                # by then the block's MLP and output projection have their gradients: their copies are gone
                "attention's backward pass in the last block": dict(
                    last_block,
                    activations=blocks - tokens * (self.per_block() - self.kept_through_attention_backward()),
                    weight_copies=cast * a * (self.linear_weights - v * c - 9 * c * c),
                    gradients=self.attention_backward(tokens) + tied,
                ),
                **end,
            }
        else:
            block_inputs = kept + tokens * n_layer * 4 * c
            # the recomputed block's input is the one it kept: counted once
            recomputed = dict(
                activations=block_inputs + tokens * (self.per_block() - 4 * c) - self.mlp_dropout(tokens),
                attention=attention,
                weight_copies=cast * a * self.block_linear_params,
                gradients=self.block_backward(tokens) + tied,
            )
            moments = {
                "loss in the forward pass": dict(
                    activations=block_inputs + tokens * self.after_blocks(),
                    loss=self.loss_forward(tokens),
                    weight_copies=cast * a * self.forward_weight_copies(checkpointing),
                ),
                "start of the backward pass": dict(
                    activations=block_inputs + tokens * self.after_blocks(),
                    loss=self.loss_backward(tokens),
                ),
                "recomputation of a block": recomputed,
                "attention's backward pass in a recomputed block": dict(
                    recomputed,
                    activations=block_inputs + tokens * (self.kept_through_attention_backward() - 4 * c),
                    weight_copies=cast * a * 3 * c * c,  # c_attn's, the one Linear before it
                    gradients=self.attention_backward(tokens) + tied,
                ),
                **end,
            }
        if not self.math_attention:  # the fused kernels' backward passes hold no more than the block's first
            moments = {name: parts for name, parts in moments.items() if not name.startswith("attention's")}
        return max(moments.items(), key=lambda item: sum(item[1].values()))


def activations_for(model_args, dtype, math_attention=False, device_type="cuda", compiled=False):
    """The formula's terms for the model model_args describes (built on the meta device) in autocast dtype, with
    the math attention kernel or the fused ones, on CUDA (or the CPU, whose kernels the tests measure), compiled
    (model.GPT.compile_blocks) or not."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def params(modules, biases=True):
        return sum(m.weight.numel() + (m.bias.numel() if biases and m.bias is not None else 0) for m in modules)

    block = [m for m in model.transformer.h[0].modules() if isinstance(m, torch.nn.Linear)]
    return Activations(
        cfg=model.config,
        element_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
        linear_weights=params(linears, biases=False),
        linear_params=params(linears),
        block_linear_params=params(block),
        loss_rows=loss_chunk_rows(model.config.vocab_size, compiled=compiled),
        math_attention=math_attention,
        device_type=device_type,
        compiled=compiled,
    )


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one GPU holds at the peak of a training step (the fullest rank under ZeRO-1)."""

    description: str  # the run the plan is for, in words
    n_params: int
    world_size: int
    sharded: bool  # ZeRO-1 in effect (zero_stage=1 and more than one rank)
    micro_batch: int
    block_size: int
    dtype: str
    activation_checkpointing: bool
    compiled: bool  # the blocks and the loss's chunks compiled (model.GPT.compile_blocks)
    parameter_bytes: int
    gradient_bytes: int
    rank_state_bytes: tuple  # each rank's optimizer state (one entry unsharded)
    peak_moment: str  # when the parts below are all alive at once
    peak_parts: dict  # {name: bytes} at that moment, beyond parameters, gradients and state
    gpu_memory_bytes: int | None
    gpu_name: str | None
    max_micro_batch: int | None  # the largest batch_size that fits (0: not even 1), None without a GPU size
    save_bytes: int = 0  # what a checkpoint save adds to rank 0's GPU between steps: its "checkpoint save" moment
    fused_attention_bytes: int | None = None  # deterministic=True: the total with the fused attention kernels
    notes: tuple = ()
    fsdp_shards: int = 0  # zero_stage=3 under torchrun: the ranks one copy of the model is sharded over
    hsdp_replicas: int = 1

    @property
    def state_bytes(self):
        """The fullest rank's optimizer state."""
        return max(self.rank_state_bytes)

    @property
    def total_state_bytes(self):
        return sum(self.rank_state_bytes) if self.sharded or self.fsdp_shards else self.state_bytes

    @property
    def total_bytes(self):
        return self.parameter_bytes + self.gradient_bytes + self.state_bytes + sum(self.peak_parts.values())

    @property
    def usable_bytes(self):
        return None if self.gpu_memory_bytes is None else usable(self.gpu_memory_bytes)

    @property
    def fits(self):
        return None if self.gpu_memory_bytes is None else self.total_bytes <= self.usable_bytes


def usable(gpu_memory_bytes):
    """What a plan may fill of a GPU's memory: all but HEADROOM."""
    return int(gpu_memory_bytes * (1 - HEADROOM))


def plan(
    cfg,
    world_size=1,
    gpu_memory_gb=None,
    model_args=None,
    dtype=None,
    layout=None,
    gpu_name=None,
    device_type="cuda",
    torchrun=None,
):
    """The MemoryPlan of cfg's run on world_size GPUs of gpu_memory_gb GiB each (None: no verdict; gpu_name
    only labels it). torchrun: whether the run is launched by torchrun (None: when world_size > 1), which decides
    whether zero_stage=3 shards on one GPU: under torchrun it does (FSDP2 over a mesh of one, as train.py runs it),
    one process without torchrun trains the whole model (parallel.Parallelism.shards_parameters).

    model_args: GPTConfig fields (default: cfg's model with GPT-2's padded vocabulary; train.py passes the
    data's); dtype: the autocast dtype the run resolves to (default: cfg.dtype, 'auto' taken as bfloat16);
    layout: optimizer_layout(cfg, model_args), to reuse it across plans that differ only in world size,
    batch, checkpointing or zero_stage; device_type: where the run trains (FSDP2 gathers bfloat16 parameters on
    CUDA only, marsgpt/fsdp.py's mixed_precision; compile=None compiles on CUDA only, runtime.resolve_compile).
    """
    model_args = model_args or model_args_from_config(cfg)
    dtype = dtype or (AUTO_DTYPE if cfg.dtype == "auto" else cfg.dtype)
    layout = layout or optimizer_layout(cfg, model_args)
    # --deterministic=True leaves CUDA only the math attention kernel (runtime.set_deterministic)
    compiled = resolve_compile(cfg.compile, device_type)
    activations = activations_for(model_args, dtype, math_attention=cfg.deterministic, compiled=compiled)
    torchrun = world_size > 1 if torchrun is None else torchrun
    parallel = Parallelism.planned(cfg, world_size, torchrun)
    sharded = parallel.shards_optimizer_state
    parameters = layout.planned_parameters
    parameter_bytes = sum(e.elements for e in parameters) * 4  # float32 weights, and gradients alike
    fsdp = FSDP2.of(cfg, world_size, model_args, dtype, device_type) if parallel.shards_parameters else None
    if fsdp is not None:
        shares = [[fsdp.share(e, rank) for e in parameters] for rank in range(fsdp.shards)]
        parameter_bytes = sum(e.elements for e in shares[0]) * 4  # rank 0 holds the most rows of every tensor
    elif sharded:
        shares = [[] for _ in range(world_size)]
        for groups in layout.optimizers:  # Muon's pair: one ZeroRedundancyOptimizer each
            for rank, entries in enumerate(zero_partition(groups, world_size)):
                shares[rank] += entries
    else:
        shares = [parameters]
    rank_state_bytes = tuple(sum(e.state_bytes for e in share) for share in shares)
    state_bytes = max(rank_state_bytes)
    fullest = shares[rank_state_bytes.index(state_bytes)]
    # A save gathers the state on rank 0 tensor by tensor (zero.ShardedOptimizer.state_dict); over NCCL each
    # tensor of another rank's share passes through a buffer of its size on rank 0's GPU, over gloo none does.
    staged = [e.largest for share in shares[1:] for e in share] if cfg.backend != "gloo" and sharded else []
    save_bytes = max(staged, default=0)  # FSDP2: each rank copies its rows to host memory, nothing else on the GPU

    def peak(micro_batch, activations=activations):
        """(moment, {part: bytes}): the largest moment of a step beyond parameters, gradients and state."""
        pass_moment, pass_parts = activations.peak(micro_batch * cfg.block_size, cfg.activation_checkpointing)
        step = dict(step_buffer=sum(e.step_buffer for e in fullest))
        if fsdp is not None:
            pass_parts = dict(pass_parts, **fsdp.pass_parts(cfg))
            if fsdp.gathered_bytes < 4 and "weight_copies" in pass_parts:  # the blocks' are bfloat16 already:
                c, v = activations.cfg.n_embd, activations.cfg.vocab_size  # autocast copies the output head only
                pass_parts["weight_copies"] = min(pass_parts["weight_copies"], activations.element_bytes * v * c)
            step = dict(step, newton_schulz=fsdp.newton_schulz_bytes(parameters))
        moments = {pass_moment: pass_parts, "optimizer step": step, "checkpoint save": dict(state_transfer=save_bytes)}
        return max(moments.items(), key=lambda item: sum(item[1].values()))  # the first on a tie

    static = 2 * parameter_bytes + state_bytes
    gpu_memory_bytes = None if gpu_memory_gb is None else int(gpu_memory_gb * GIB)
    max_micro_batch = None
    if gpu_memory_bytes is not None:
        max_micro_batch = largest(lambda b: static + sum(peak(b)[1].values()) <= usable(gpu_memory_bytes))
    notes = [parallel.note] if parallel.note else []
    moment, parts = peak(cfg.batch_size)
    fused_attention_bytes = None
    if cfg.deterministic:
        fused = activations_for(model_args, dtype, compiled=compiled)
        fused_attention_bytes = static + sum(peak(cfg.batch_size, fused)[1].values())
        notes.append(
            f"deterministic=True: CUDA runs only the math attention kernel, which keeps each layer's float32 "
            f"attention probabilities; with the fused kernels (deterministic=False) the total is "
            f"{gib(fused_attention_bytes)}, {gib(static + sum(parts.values()) - fused_attention_bytes)} less"
        )
    return MemoryPlan(
        description=layout.label,
        n_params=sum(e.elements for e in parameters),
        world_size=world_size,
        sharded=sharded,
        micro_batch=cfg.batch_size,
        block_size=cfg.block_size,
        dtype=dtype,
        activation_checkpointing=cfg.activation_checkpointing,
        compiled=compiled,
        parameter_bytes=parameter_bytes,
        gradient_bytes=parameter_bytes,
        rank_state_bytes=rank_state_bytes,
        peak_moment=moment,
        peak_parts=parts,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_name=gpu_name,
        max_micro_batch=max_micro_batch,
        save_bytes=save_bytes,
        fused_attention_bytes=fused_attention_bytes,
        notes=tuple(notes),
        fsdp_shards=fsdp.shards if fsdp is not None else 0,
        hsdp_replicas=fsdp.replicas if fsdp is not None else 1,
    )


@dataclasses.dataclass(frozen=True)
class FSDP2:
    """What zero_stage=3 (marsgpt/fsdp.py) holds on a GPU beyond its rows (docs/memory.md, "FSDP2 and HSDP").

    Every parameter, its gradient and its optimizer state are split by rows over `shards` ranks in torch.chunk's
    sizes (rank 0 holds the most). While a block's forward or backward pass runs its parameters are whole (in
    bfloat16 on CUDA with dtype=bfloat16, else float32), and FSDP2 gathers the next block's meanwhile: two blocks
    whole; the root's parameters (embeddings, final LayerNorm) stay whole, in float32, from the forward pass to
    the end of the backward pass; a block's whole float32 gradient waits for its reduce-scatter. With
    gradient_sync=step and more than one micro-batch per rank, the micro-batches before the last add up whole
    float32 gradients of the model. Newton-Schulz runs at owner ranks, in buckets (mars_sharded.py's exchange):
    owner_exchange_bytes."""

    shards: int
    replicas: int
    block_elements: int
    root_elements: int
    gathered_bytes: int  # bytes per element of a gathered block's parameters
    newton_schulz_bytes_per_element: int  # the dtype the iteration runs in (mars.newton_schulz_dtype on a GPU)
    micro_batches: int  # per rank and step

    @classmethod
    def of(cls, cfg, world_size, model_args, dtype, device_type):
        """The FSDP2 layout of cfg's run on world_size ranks under torchrun, or None when it does not shard its
        parameters (parallel.Parallelism.shards_parameters)."""
        parallel = Parallelism.planned(cfg, world_size, torchrun=True)
        if not parallel.shards_parameters:
            return None
        with torch.device("meta"):
            model = GPT(GPTConfig(**model_args))
        total = sum(p.numel() for p in model.parameters())
        block = sum(p.numel() for p in model.transformer.h[0].parameters())
        low_precision = dtype == "bfloat16" and device_type == "cuda"
        return cls(
            shards=parallel.shards,
            replicas=parallel.replicas,
            block_elements=block,
            root_elements=total - block * len(model.transformer.h),
            gathered_bytes=2 if low_precision else 4,
            newton_schulz_bytes_per_element=2 if device_type == "cuda" else 4,
            micro_batches=max(1, cfg.gradient_accumulation_steps // world_size),
        )

    def rows(self, entry, rank):
        """The rows of entry's parameter rank holds (torch.chunk's split, as FSDP2's Shard(0))."""
        chunk = math.ceil(entry.rows / self.shards)
        return max(0, min(chunk, entry.rows - rank * chunk))

    def share(self, entry, rank):
        """entry scaled to rank's rows: its elements, state and step buffer."""
        fraction = self.rows(entry, rank) / entry.rows
        return entry._replace(
            elements=round(entry.elements * fraction),
            state_bytes=round(entry.state_bytes * fraction),
            step_buffer=round(entry.step_buffer * fraction),
            largest=round(entry.largest * fraction),
        )

    def pass_parts(self, cfg):
        """{part: bytes} FSDP2 adds to every moment of the forward and backward pass."""
        accumulating = cfg.gradient_sync == "step" and self.micro_batches > 1
        return dict(
            gathered=2 * self.block_elements * self.gathered_bytes + 4 * self.root_elements,
            unsharded_gradients=4 * self.block_elements
            + 4 * (self.root_elements + self.block_elements * cfg.n_layer) * accumulating,
        )

    def newton_schulz_bytes(self, parameters, bucket_mib=None):
        """The fullest rank's buffers of the Newton-Schulz exchange in the optimizer step (owner_exchange_bytes)."""
        shapes = [e.newton_schulz for e in parameters if e.newton_schulz is not None]
        iteration = self.newton_schulz_bytes_per_element
        return max(owner_exchange_bytes(shapes, self.shards, 4, iteration, bucket_mib), default=0)


def owner_exchange_bytes(shapes, world, element_bytes, iteration_bytes, bucket_mib=None):
    """Each rank's most bytes held at once by mars_sharded.py's Newton-Schulz exchange of matrices of `shapes` (in
    the step's order, m in element_bytes per element) split by rows over `world` ranks, the iteration in
    iteration_bytes per element, in buckets of bucket_mib (default mars_sharded.BUCKET_MIB): its schedule replayed
    buffer by buffer (docs/memory.md, "FSDP2 and HSDP"). While an owner computes bucket k, bucket k+1's all-to-all
    (the rank's rows sent, the owner's pieces received) and bucket k-1's back (the results sent, the rank's rows
    received) are in flight."""
    import mars_sharded

    if not shapes:
        return [0] * world
    e, q = element_bytes, iteration_bytes
    y = min(e, q)  # the results travel back in the narrower dtype
    bucket_bytes = (bucket_mib or mars_sharded.BUCKET_MIB) * 2**20
    owners = mars_sharded.balanced_owners([mars_sharded.newton_schulz_cost(shape) for shape in shapes], world)
    buckets = mars_sharded.owner_buckets([math.prod(s) * e for s in shapes], owners, world, bucket_bytes)

    def rows(shape, rank):  # this rank's elements of a matrix split by rows in torch.chunk's sizes
        chunk = -(-shape[0] // world)
        return max(0, min(chunk, shape[0] - rank * chunk)) * math.prod(shape[1:])

    def peak(rank):
        sent = [sum(rows(shapes[i], rank) for i in bucket) for bucket in buckets]  # elements of the rank's rows
        owned = [[i for i in bucket if owners[i] == rank] for bucket in buckets]
        whole = [sum(math.prod(shapes[i]) for i in mine) for mine in owned]
        view = [len(mine) == 1 for mine in owned]  # received viewed as the one matrix, sent back as it is
        held = [e * (sent[0] + whole[0])]
        for k in range(len(buckets)):
            coming = e * (sent[k + 1] + whole[k + 1]) if k + 1 < len(buckets) else 0
            returning = y * (whole[k - 1] + sent[k - 1]) if k else 0  # results sent, rows received
            base = coming + returning + e * sent[k]  # this bucket's rows sent: released after its Newton-Schulz
            copies = 0 if view[k] else e * whole[k]
            held.append(base + e * whole[k] + copies)  # the pieces received, copied into their stacks
            stacks = {}
            for i in owned[k]:
                stacks.setdefault(shapes[i], []).append(i)
            done, pending = 0, e * whole[k]
            for shape, members in stacks.items():
                n, big = sorted(shape)
                size = len(members) * n * big
                column = len(members) * n * q
                block = mars_sharded.block_columns(column, n, big, bucket_bytes / 4)
                products = q * len(members) * n * n + 2 * column * block  # XX^T and two products on columns
                if q < e:  # cast down: the stack and its cast, then the cast alone
                    held.append(base + done + pending + q * size)
                    pending -= e * size
                    held.append(base + done + pending + q * size + products)
                    done += q * size
                else:
                    held.append(base + pending + products)
                    done += e * size
            base -= e * sent[k]
            copied = 0 if view[k] and q <= e else y * whole[k]  # one matrix's result goes as it is
            held.append(base + done + copied)
            sent_back = y * (whole[k] + sent[k])
            held.append(base + sent_back)
            if k:  # bucket k-1's rows received and applied (cast to m's dtype where they came narrower)
                held.append(base + sent_back + e * (y < e) * sent[k - 1])
        held.append(y * whole[-1] + (y + e * (y < e)) * sent[-1])
        return max(held)

    return [peak(rank) for rank in range(world)]


def largest(fits, limit=1 << 20):
    """The largest n >= 1 with fits(n) (fits is monotone: true up to some n), 0 when fits(1) is false."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def gib(n):
    return f"{n / GIB:.2f} GiB"


PART_NAMES = dict(
    activations="activations",
    attention="attention probs",
    loss="loss buffers",
    weight_copies="weight copies",
    gradients="gradient buffers",
    step_buffer="step buffer",
    state_transfer="state transfer",
    gathered="gathered params",
    unsharded_gradients="whole gradients",
    newton_schulz="Newton-Schulz",
)


def sharding(p):
    """How the plan's run splits its state over the GPUs, in words."""
    if p.fsdp_shards:
        hsdp = f" in each of {p.hsdp_replicas} HSDP replicas" if p.hsdp_replicas > 1 else ""
        return f"FSDP2 over {p.fsdp_shards} GPU{'s' * (p.fsdp_shards != 1)}{hsdp}"
    return f"ZeRO-1 over {p.world_size} GPUs" if p.sharded else f"{p.world_size} GPU(s), unsharded"


def format_plan(p):
    """The lines train.py prints."""
    lines = [
        f"memory plan per GPU (an estimate): {p.n_params / 1e6:,.1f}M parameters, {p.description}, {sharding(p)}, "
        f"micro-batch {p.micro_batch} x {p.block_size} tokens, {p.dtype}, {'' if p.compiled else 'not '}compiled, "
        f"activation checkpointing {'on' if p.activation_checkpointing else 'off'}"
        + (", deterministic (the math attention kernel)" if p.fused_attention_bytes is not None else ""),
        f"  parameters       {gib(p.parameter_bytes):>11}",
        f"  gradients        {gib(p.gradient_bytes):>11}",
        f"  optimizer state  {gib(p.state_bytes):>11}"
        + (f"  (the fullest rank's share of {gib(p.total_state_bytes)})" if p.sharded or p.fsdp_shards else ""),
    ]
    if p.fsdp_shards:
        lines[1] += "  (rank 0's rows, the most)"
    peak = [(name, value) for name, value in p.peak_parts.items() if value]
    for i, (name, value) in enumerate(peak):
        lines.append(
            f"  {PART_NAMES[name]:<16} {gib(value):>11}" + (f"  (peak: the {p.peak_moment})" if i == 0 else "")
        )
    if p.sharded and p.peak_moment != "checkpoint save":  # else it is the peak, listed above
        lines.append(
            f"  {'checkpoint save':<16} {gib(p.save_bytes):>11}  (on rank 0 between steps, within the total: "
            "the largest state tensor it gathers from another rank through its GPU)"
        )
    total = f"  total            {gib(p.total_bytes):>11}"
    if p.gpu_memory_bytes is None:
        total += "  (no GPU to compare with: give --gpu_memory_gb=N)"
    else:
        name = f" ({p.gpu_name})" if p.gpu_name else ""
        verdict = "fits" if p.fits else "does NOT fit"
        total += (
            f"  of {p.gpu_memory_bytes / GIB:.1f} GiB{name}, {p.usable_bytes / GIB:.1f} usable: {verdict}; "
            f"the largest micro-batch that fits: {p.max_micro_batch}"
        )
    lines.append(total)
    lines += [f"note: {note}" for note in p.notes]
    return lines


def advice(p):
    """What to try when a plan does not fit, in the order of least cost to the run."""
    options = []
    if not p.sharded and not p.fsdp_shards and p.world_size > 1:
        options.append("--zero_stage=1")
    if not p.fsdp_shards and p.world_size > 1:
        options.append("--zero_stage=3")
    if not p.activation_checkpointing:
        options.append("--activation_checkpointing=True")
    if p.fused_attention_bytes is not None:
        fits = " (which fits)" if p.usable_bytes is not None and p.fused_attention_bytes <= p.usable_bytes else ""
        options.append(f"--deterministic=False (the fused attention kernels: {gib(p.fused_attention_bytes)}{fits})")
    if p.max_micro_batch:
        options.append(f"--batch_size={p.max_micro_batch} (with gradient_accumulation_steps raised to match)")
    return " or ".join(options) if options else "more or larger GPUs"


# ---------------------------------------------------------------------------------------------------
# The plan of a run: train.py's at its start, and --dry_run=True's.


def gpu_memory(cfg, device):
    """(GiB, name) of the GPU the plan is checked against: --gpu_memory_gb, else the GPU `device` is on,
    else (None, None)."""
    if cfg.gpu_memory_gb:
        return cfg.gpu_memory_gb, None
    if torch.device(device).type != "cuda":
        return None, None
    return torch.cuda.get_device_properties(device).total_memory / GIB, torch.cuda.get_device_name(device)


def plan_memory(cfg, dist_info, model_args):
    """This run's memory plan (py) on its GPUs, for describe() to print."""
    gb, name = gpu_memory(cfg, dist_info.device)
    dtype = resolve_dtype(cfg.dtype, dist_info.device_type)
    return plan(
        cfg,
        dist_info.world_size,
        gb,
        model_args=model_args,
        dtype=dtype,
        gpu_name=name,
        device_type=dist_info.device_type,
        torchrun=dist_info.torchrun,
    )


def planned_model_args(cfg):
    """The model a run of cfg builds, without reading tokens: the data's vocabulary when its files are there,
    else GPT-2's (padded); OpenAI's shape for init_from=gpt2*, a local Hugging Face folder's for one."""
    if cfg.init_from in HF_CHECKPOINTS:
        preset = PRESETS[HF_CHECKPOINTS[cfg.init_from]]
        return {
            **model_args_from_config(cfg, GPT2_VOCAB_SIZE),
            **preset,
            "bias": True,
            "block_size": min(cfg.block_size, 1024),
        }
    if os.path.isdir(cfg.init_from):  # config.init_source: a Hugging Face GPT-2 folder, its config.json
        with open(os.path.join(cfg.init_from, "config.json")) as f:
            hf = json.load(f)
        return {
            **model_args_from_config(cfg, hf["vocab_size"]),
            **{key: hf[key] for key in ("n_layer", "n_head", "n_embd")},
            "bias": True,
            "block_size": min(cfg.block_size, hf["n_positions"]),
        }
    try:
        vocab_size = model_vocab_size(TokenData(os.path.join(cfg.data_path, cfg.dataset), "train"))
    except DataError:
        vocab_size = GPTConfig().vocab_size
    return model_args_from_config(cfg, vocab_size)


def dry_run_plan(cfg, layout=None):
    """The memory plan --dry_run=True prints: no process group, data or GPU needed.

    The world size is plan_world_size, else the launch's; the GPU is gpu_memory_gb, else the one present;
    dtype=auto is planned as it resolves on that GPU (bfloat16 without one, as on any GPU from the A100 on).
    layout: optimizer_layout's, to reuse across plans of one model and optimizer.
    """
    world_size = cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = cfg.device not in ("cpu", "mps")  # auto: the run is planned for GPUs, present or not
    gpu_here = on_gpu and torch.cuda.is_available()
    dtype = resolve_dtype(cfg.dtype, "cuda") if gpu_here else cfg.dtype
    if dtype == "auto":
        dtype = AUTO_DTYPE if on_gpu else "float32"
    gb, name = gpu_memory(cfg, "cuda" if gpu_here else "cpu")
    model_args = planned_model_args(cfg)
    device_type = "cuda" if on_gpu else "cpu"
    torchrun = world_size > 1 or "WORLD_SIZE" in os.environ
    return plan(
        cfg,
        world_size,
        gb,
        model_args=model_args,
        dtype=dtype,
        layout=layout,
        gpu_name=name,
        device_type=device_type,
        torchrun=torchrun,
    )


def measured_peak(plan, steps):
    """A CUDA run's line after its first `steps` steps: the peak memory rank 0 measured beside the plan's."""
    return (
        f"memory: rank 0 peaked at {torch.cuda.max_memory_allocated() / GIB:.2f} GiB allocated "
        f"({torch.cuda.max_memory_reserved() / GIB:.2f} GiB reserved) in the first {steps} steps; "
        f"the plan: {plan.total_bytes / GIB:.2f} GiB"
    )


def dry_run(cfg):
    """--dry_run=True: print the memory plan per GPU (rank 0 only, under torchrun) and return 0."""
    plan = dry_run_plan(cfg)
    if os.environ.get("RANK", "0") == "0":
        print("\n".join(format_plan(plan)))
        if plan.fits is False:
            print(f"to fit, try {advice(plan)}")
        if cfg.gradient_accumulation_steps % plan.world_size:
            print(
                f"note: a run on {plan.world_size} processes is refused: gradient_accumulation_steps="
                f"{cfg.gradient_accumulation_steps} is not a multiple of {plan.world_size}"
            )
    return 0
