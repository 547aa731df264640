"""GPT-2 (Small, Medium, Large, XL) as the MARS paper trains it, with Hugging Face GPT-2 interop.

Parameter names follow nanoGPT (transformer.wte, transformer.h.{i}.attn.c_attn, ..., lm_head), which is
what the paper's reference code is built on, so state dicts move between the two unchanged. This file
imports nothing from the repository: copy it into another project on its own. transformers is needed
only by the Hugging Face functions at the bottom, and is imported there.
"""

import functools
import math
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# OpenAI's GPT-2 tokenizer has 50257 tokens; the Hugging Face checkpoints have exactly that many rows.
GPT2_VOCAB_SIZE = 50257

# The four GPT-2 sizes (Radford et al., 2019, Table 2). Counts are with bias=True at vocab 50257.
PRESETS = {
    "small": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# OpenAI's checkpoints on the Hugging Face hub, by preset.
HF_CHECKPOINTS = {"gpt2": "small", "gpt2-medium": "medium", "gpt2-large": "large", "gpt2-xl": "xl"}
HF_HUB_HOST = "huggingface.co"  # where from_pretrained downloads them

# Peak dense bf16 tensor-core throughput (FLOP/s, FP32 accumulate, no 2:4 sparsity) by the exact name
# torch.cuda.get_device_name reports. Datasheets that print only the "with sparsity" figure (marked *)
# are halved. A GPU missing here -- or a MIG slice, whose name differs -- has no MFU, never a guess.
PEAK_BF16_FLOPS = {
    # A100 datasheet (nvidia.com/en-us/data-center/a100): BFLOAT16 Tensor Core 312 | 624* TFLOPS, every model
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    # H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 Tensor Core 1,979* (SXM), 1,513* (PCIe),
    # 1,671* (NVL) TFLOPS
    "NVIDIA H100 80GB HBM3": 989.5e12,
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    # H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 Tensor Core 1,979* TFLOPS (SXM)
    "NVIDIA H200": 989.5e12,
    # HGX B200 specifications (nvidia.com/en-us/data-center/hgx): FP16/BF16 Tensor Core 4.5* PFLOPS per GPU
    "NVIDIA B200": 2.25e15,
    # L40S datasheet: BF16 Tensor Core 362.05 | 733* TFLOPS
    "NVIDIA L40S": 362.05e12,
    # L4 datasheet: BF16 Tensor Core 242* TFLOPS
    "NVIDIA L4": 121e12,
    # A10 datasheet: BF16 Tensor Core 125 | 250* TFLOPS
    "NVIDIA A10": 125e12,
    # A40 datasheet: peak BF16 Tensor TFLOPS with FP32 accumulate 149.7 | 299.4*
    "NVIDIA A40": 149.7e12,
    # Ada architecture whitepaper v2.01, RTX 4090: peak BF16 Tensor TFLOPS with FP32 accumulate 165.2 | 330.4*
    "NVIDIA GeForce RTX 4090": 165.2e12,
}


@dataclass
class GPTConfig:
    block_size: int = 1024
    # GPT-2's 50257 tokens padded up to a multiple of 64: the embedding and output matmuls then tile
    # evenly on tensor cores. The 47 extra rows are never targets, so they learn to stay unlikely.
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # bias in Linear and LayerNorm layers, as in GPT-2
    # Divide layer i's attention logits by (i + 1) on top of 1/sqrt(head_dim) (Mistral's stability
    # tweak, also in Hugging Face's GPT2Config); the paper's training scripts enable it for every size.
    scale_attn_by_inverse_layer_idx: bool = False

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def model_vocab_size(data):
    """The vocabulary of a model trained on `data` (a tokens.TokenData): the data's own (meta.pkl) or GPT-2's,
    padded to 50304 as the reference does."""
    return data.vocab_size if data.meta is not None else GPTConfig.vocab_size


def model_args_from_config(cfg, vocab_size=GPTConfig.vocab_size):
    """GPTConfig's fields from a run's configuration, which declares each of them but the vocabulary (the
    data's: GPT-2's padded one unless given)."""
    shape = {f.name: getattr(cfg, f.name) for f in fields(GPTConfig) if f.name != "vocab_size"}
    return shape | {"vocab_size": vocab_size}


# The scores of the output layer cross_entropy_in_chunks computes at once: 2**25 (128 MiB in float32), about
# 670 rows with GPT-2's vocabulary, instead of a whole micro-batch's (15 x 1024 rows: 3.1 GB in float32).
LOSS_CHUNK_SCORES = 2**25
# Compiled (GPT.compile_blocks), a chunk's logits become its gradient in place and its float32 log-softmax is
# never stored: it holds a quarter of the bytes per score or less, so its chunks are 4 times larger. Fewer chunks
# are fewer additions of a (vocabulary x width) product into the output weight's gradient (GPT-2 small at
# 30 x 1024 tokens: 12 instead of 47).
COMPILED_LOSS_CHUNK_SCORES = 4 * LOSS_CHUNK_SCORES


@torch.library.custom_op("marsgpt::add_product_", mutates_args=("total",))
def add_product_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, as one operation torch.compile cannot see into. The chunked loss adds each chunk's share
    of the output weight's gradient this way: written as `+=` in a compiled loss, inductor fuses the chunks'
    in-place additions into one addition of every chunk's product, which keeps all of them (GPT-2 small at
    30 x 1024 tokens: 47 of 77 MB each) alive at once. The same kernels as `total += a @ b`, so the same bits."""
    total += a @ b


def chunk_loss(x_rows, weight, targets_rows, row_weights, vocabulary, want_grad):
    """One chunk of _ChunkedCrossEntropy: the summed cross-entropy (in row_weights' dtype, float32) of the logits
    x_rows @ weight^T against targets_rows (-1: not scored) and, with want_grad, the gradient of the mean loss
    with respect to those logits, in their dtype: (softmax - one_hot(target)) * row_weights (1 / the count of
    scored rows on scored rows, 0 elsewhere). The one-hot is a comparison with `vocabulary` (0, 1, ..., V - 1),
    not a scatter: no op here is one CUDA runs non-deterministically. GPT.compile_blocks compiles this."""
    logits = F.linear(x_rows, weight)
    log_probs = torch.log_softmax(logits.to(row_weights.dtype), dim=-1)
    loss = F.nll_loss(log_probs, targets_rows, ignore_index=-1, reduction="sum")
    if not want_grad:
        return loss, None
    grad_logits = log_probs.exp_().sub_((targets_rows[:, None] == vocabulary).to(row_weights.dtype))
    return loss, grad_logits.mul_(row_weights[:, None]).to(logits.dtype)


def matmul_dtype(weight):
    """The dtype F.linear computes with `weight` in: autocast's where it is on (for any floating dtype but
    float64, which it leaves as it is), else weight's own."""
    device = weight.device.type
    if weight.dtype != torch.float64 and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the logits x @ weight^T against targets (-1: not scored), a chunk of rows at a
    time (chunk_loss, or its compiled version: `loss_of_chunk`). The gradients with respect to x and weight are
    computed in the forward pass, chunk by chunk, and kept for the backward pass: the logits of the whole
    micro-batch, and the float32 log-softmax and gradient that F.cross_entropy keeps of them, never exist. Under
    autocast the matmuls run in its dtype and the log-softmax in float32, as they do through nn.Linear and
    F.cross_entropy: x and weight are cast once, as autocast casts them for F.linear."""

    @staticmethod
    def forward(ctx, x, weight, targets, rows_per_chunk, loss_of_chunk):
        want_grad_x, want_grad_weight = ctx.needs_input_grad[:2]
        low = matmul_dtype(weight)
        loss_dtype = torch.promote_types(weight.dtype, torch.float32)  # F.cross_entropy's under autocast
        scored = targets != -1
        count = scored.sum()
        row_weights = scored.to(loss_dtype) / count
        weight_low = weight.to(low)
        vocabulary = torch.arange(weight.size(0), device=x.device)
        loss_sum = torch.zeros((), dtype=loss_dtype, device=x.device)
        grad_x = torch.empty_like(x) if want_grad_x else None
        grad_weight = torch.zeros_like(weight, dtype=loss_dtype) if want_grad_weight else None
        for start in range(0, x.size(0), rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            x_rows = x[rows].to(low)
            loss, grad_logits = loss_of_chunk(
                x_rows, weight_low, targets[rows], row_weights[rows], vocabulary, want_grad_x or want_grad_weight
            )
            loss_sum += loss
            if want_grad_x:
                grad_x[rows] = grad_logits @ weight_low
            if want_grad_weight:
                add_product_(grad_weight, grad_logits.T, x_rows)
            del x_rows, grad_logits  # freed before the next chunk's logits exist
        ctx.save_for_backward(grad_x, grad_weight)
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight = ctx.saved_tensors
        return (
            None if grad_x is None else grad_x * grad_loss.to(grad_x.dtype),
            None if grad_weight is None else grad_weight * grad_loss,
            None,
            None,
            None,
        )


def loss_chunk_rows(vocab_size, chunk_scores=None, compiled=False):
    """The rows of logits cross_entropy_in_chunks computes at once: chunk_scores (unless given LOSS_CHUNK_SCORES,
    or COMPILED_LOSS_CHUNK_SCORES for a compiled loss) over the vocabulary, at least one. The memory plan counts
    the same chunks."""
    default = COMPILED_LOSS_CHUNK_SCORES if compiled else LOSS_CHUNK_SCORES
    return max(1, (chunk_scores or default) // vocab_size)


def cross_entropy_in_chunks(x, weight, targets, chunk_scores=None, loss_of_chunk=chunk_loss):
    """F.cross_entropy(F.linear(x, weight), targets, ignore_index=-1) for x (N, C), weight (V, C), targets (N,),
    holding at most about chunk_scores logits at a time (_ChunkedCrossEntropy): the loss without the (N, V)
    logits. loss_of_chunk: chunk_loss, or a compiled version of it."""
    rows = loss_chunk_rows(weight.size(0), chunk_scores)
    return _ChunkedCrossEntropy.apply(x, weight, targets, rows, loss_of_chunk)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # query, key and value for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # The per-layer factor folds into SDPA's softmax scale, so the fused kernels still apply.
        self.head_scale = self.scale = (config.n_embd // config.n_head) ** -0.5
        self.layer_factor = None  # 1 / (layer_idx + 1), scaling by layer
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
            self.layer_factor = 1.0 / (layer_idx + 1)
        self.register_buffer("q_factor", None, persistent=False)  # layer_factor_as_data's

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        if self.q_factor is not None:  # the per-layer factor as data (layer_factor_as_data), not in the scale
            q = q * self.q_factor
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Flash / memory-efficient kernels on GPU: the T x T attention matrix is never materialised.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, scale=self.scale
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def layer_factor_as_data(self):
        """For a block compiled on its own (FSDP2 compiles each block, marsgpt/fsdp.py): the per-layer factor
        becomes a 0-d buffer that q is multiplied by, and SDPA's scale the same in every layer, so that every
        block runs one compiled graph. Folded into the scale, the factor is a constant of each block's graph
        that differs from layer to layer: each block a compile of its own and, past torch._dynamo's
        recompile_limit (8), the remaining blocks uncompiled. The cost: one multiply and one more q-sized
        activation per block, and q rounded once more (the factors 1/2, 1/4, ... exactly). Without
        scale_attn_by_inverse_layer_idx there is nothing to do."""
        if self.layer_factor is not None:
            weight = self.c_attn.weight
            self.q_factor = torch.tensor(self.layer_factor, dtype=weight.dtype, device=weight.device)
            self.scale = self.head_scale

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The reference code keeps its causal mask as a buffer named 'attn.bias' (and Hugging Face's
        # older GPT-2 did too); SDPA needs no mask, so such checkpoints load without it.
        state_dict.pop(prefix + "bias", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU is the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block (GPT-2 moved LayerNorm to each sub-block's input)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Activation checkpointing (train.py's --activation_checkpointing): each block keeps only its input and
        # recomputes the rest in the backward pass. A switch, not a GPTConfig field: it changes memory and
        # time, never the function or the saved weights.
        self.activation_checkpointing = False
        # The training loss (forward with return_logits=False); compile_blocks compiles it.
        self.chunked_loss = cross_entropy_in_chunks
        # Weight tying (Press & Wolf, 2017), as in GPT-2: one matrix embeds tokens and scores them.
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two projections to the residual stream, so their weights
        # get std 0.02/sqrt(2 * n_layer) to keep the stream's variance from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Parameters, the tied embedding counted once. non_embedding drops the position embeddings;
        the token embedding stays because it is also the output layer's weight."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None, return_logits=True):
        """idx: (B, T) token ids. Returns (logits, loss): with targets, logits for every position and the
        mean cross-entropy over targets != -1; without, logits for the last position only, loss None.
        With targets and return_logits=False: (None, the same loss), computed a chunk of positions at a time
        (cross_entropy_in_chunks), so the (B, T, vocabulary) logits never exist -- what training uses."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}; "
                f"crop the input to its last {self.config.block_size} tokens"
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # preserve_rng_state (the default) replays the forward's RNG state, so the recomputation
                # draws the same dropout masks and the gradients are the plain model's.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            # generation needs only the next token: skip the (B, T, vocab) output matmul
            return self.lm_head(x[:, [-1], :]), None
        if not return_logits:
            return None, self.chunked_loss(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def compile_blocks(self, **options):
        """torch.compile (with `options`) each block on its own, in place, and the loss's chunk (chunk_loss): what
        train.py compiles. Every block runs the same graph (the per-layer attention factor is data:
        CausalSelfAttention.layer_factor_as_data), so a 12-layer model compiles one block graph for training and
        one for evaluation instead of a whole-model graph for each; the loss takes chunks of
        COMPILED_LOSS_CHUNK_SCORES, each one call of a small graph, so no graph sees more than one chunk. The
        embeddings, the final LayerNorm and the loop over the chunks stay eager: a few kernels each."""
        for block in self.transformer.h:
            block.attn.layer_factor_as_data()
            block.compile(**options)
        compiled_chunk_loss = torch.compile(chunk_loss, dynamic=False, **options)
        self.chunked_loss = functools.partial(
            cross_entropy_in_chunks, chunk_scores=COMPILED_LOSS_CHUNK_SCORES, loss_of_chunk=compiled_chunk_loss
        )

    def crop_block_size(self, block_size):
        """Shrink the context window, e.g. to train GPT-2's 1024-token weights at 512."""
        if not 1 <= block_size <= self.config.block_size:
            raise ValueError(f"block_size {block_size} must be between 1 and {self.config.block_size}")
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx (B, T); the context is cropped to block_size."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def flops_per_token(self, convention="palm"):
        """Training FLOPs per token, forward and backward, as one of two conventions counts them:

        palm  -- 6N for the matmuls plus 12·L·H·Q·T for attention, N without the position embeddings (PaLM,
                 Chowdhery et al. 2022, Appendix B; nanoGPT's estimate_mfu).
        llm.c -- 6N plus 6·L·C·T, N every parameter: llm.c's gpt2_estimate_mfu, which counts the causal
                 attention's half of the scores.
        For GPT-2 small (biases on, as OpenAI's) at T=1024, palm's count is 1.065x llm.c's.
        """
        cfg = self.config
        if convention == "palm":
            return 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        if convention == "llm.c":
            return 6 * self.get_num_params(non_embedding=False) + 6 * cfg.n_layer * cfg.n_embd * cfg.block_size
        raise ValueError(f"convention must be 'palm' or 'llm.c', got {convention!r}")

    def estimate_mfu(self, tokens_per_iter, dt, convention="palm"):
        """Model FLOPs utilisation: achieved FLOP/s (flops_per_token under `convention`) over the peak of the
        GPU the model is on, or None where that peak is unknown (CPU, other GPUs)."""
        peak = peak_flops(self.lm_head.weight.device)
        if peak is None:
            return None
        return self.flops_per_token(convention) * tokens_per_iter / dt / peak

    @classmethod
    def from_pretrained(cls, name, override_args=None, offline=False):
        """OpenAI's GPT-2 ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', from the Hugging Face hub)
        or a local Hugging Face GPT-2 folder such as marsgpt/export_hf.py writes. override_args may set dropout.
        offline=True reads the local Hugging Face cache only: without it, a machine that cannot reach the hub
        spends about half a minute in retries before it falls back to the cache or fails."""
        override_args = dict(override_args or {})
        unknown = set(override_args) - {"dropout"}
        if unknown:
            raise ValueError(f"from_pretrained can only override dropout, got {sorted(unknown)}")
        if name not in HF_CHECKPOINTS and not os.path.isdir(name):
            raise ValueError(
                f"unknown pretrained model {name!r}; choose one of "
                f"{', '.join(HF_CHECKPOINTS)} or a Hugging Face GPT-2 folder"
            )
        transformers = _import_transformers()
        try:
            hf_model = transformers.GPT2LMHeadModel.from_pretrained(name, local_files_only=offline)
        except OSError as e:
            if not offline:
                raise
            raise ValueError(
                f"{name} is not in the local Hugging Face cache and {HF_HUB_HOST} cannot be reached; load it once "
                f"on a machine online (the cache is ~/.cache/huggingface, or $HF_HOME), or give a local Hugging Face "
                f"GPT-2 folder: --init_from=PATH ({type(e).__name__})"
            ) from None
        return gpt_from_hf(hf_model, **override_args)


def peak_flops(device):
    """Peak dense bf16 FLOP/s of the GPU `device` is on, or None when it is not a GPU we know."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(device))


def param_groups(model, weight_decay):
    """The paper's reference split: weights of Linear layers decay; embeddings (the tied wte/lm_head
    matrix counted once, as an embedding), LayerNorm weights and all biases don't. Each group lists its
    parameters sorted by name, as the reference does, so optimizer state dicts line up with its."""
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - embeddings
    named = sorted(model.named_parameters(), key=lambda item: item[0])  # tied tensors appear once
    return [
        {"params": [p for _, p in named if id(p) in decayed], "weight_decay": weight_decay},
        {"params": [p for _, p in named if id(p) not in decayed], "weight_decay": 0.0},
    ]


def matrix_params(model):
    """The reference's Muon split (MARS/train_muon.py through opt.CombinedOptimizer): (every tensor with
    2 or more dimensions -- the token and position embeddings and the tied output head included --, every
    other tensor), each in model.parameters() order. In GPT the first are all 2-D."""
    params = list(model.parameters())
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def hidden_matrix_params(model):
    """The hidden-layer Muon split: (2-D weights inside the transformer blocks, every other parameter).
    Embeddings, the output head, LayerNorms and biases go to the second list, for AdamW."""
    hidden = [p for p in model.transformer.h.parameters() if p.ndim == 2]
    hidden_ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in hidden_ids]


# ---------------------------------------------------------------------------------------------------
# Hugging Face GPT-2 interop. Its GPT2LMHeadModel uses the same parameter names as ours, but stores the
# four projection matrices as Conv1D weights, (in, out): the transpose of nn.Linear's (out, in).

_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "Hugging Face interop needs transformers and safetensors: pip install -r requirements-extra.txt"
        ) from None
    return transformers


def _swap_conv1d_layout(state_dict):
    """Transpose the Conv1D/Linear projection weights: the same operation converts either way."""
    return {k: v.t() if k.endswith(_CONV1D_WEIGHTS) else v for k, v in state_dict.items()}


def config_from_hf(hf_config, dropout=0.0):
    """Our GPTConfig for a Hugging Face GPT2Config; raises ValueError for variants GPT cannot run."""
    if hf_config.n_inner not in (None, 4 * hf_config.n_embd):
        raise ValueError(f"n_inner={hf_config.n_inner} is not supported: the MLP is 4 * n_embd wide")
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(
            f"activation_function={hf_config.activation_function!r} is not supported: "
            "GPT uses GELU's tanh approximation"
        )
    if not hf_config.scale_attn_weights:
        raise ValueError("scale_attn_weights=False is not supported: GPT scales logits by 1/sqrt(head_dim)")
    return GPTConfig(
        block_size=hf_config.n_positions,
        vocab_size=hf_config.vocab_size,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        dropout=dropout,
        bias=True,
        scale_attn_by_inverse_layer_idx=hf_config.scale_attn_by_inverse_layer_idx,
    )


def gpt_from_hf(hf_model, dropout=0.0):
    """Our GPT with the weights of a Hugging Face GPT2LMHeadModel."""
    model = GPT(config_from_hf(hf_model.config, dropout=dropout))
    model.load_state_dict(_swap_conv1d_layout(hf_model.state_dict()))
    return model


def _fold_layer_scaling_into_queries(state_dict, n_layer, n_embd):
    """Divide layer i's query projection (weight and bias) by i + 1, in Conv1D layout: (q / (i + 1)) . k
    is the logit scale_attn_by_inverse_layer_idx computes, so the model no longer needs the flag."""
    for i in range(n_layer):
        for key in (f"transformer.h.{i}.attn.c_attn.weight", f"transformer.h.{i}.attn.c_attn.bias"):
            if key in state_dict:
                folded = state_dict[key].clone()
                folded[..., :n_embd] /= i + 1  # the first n_embd outputs of c_attn are the queries
                state_dict[key] = folded


def hf_from_gpt(model, vocab_size=GPT2_VOCAB_SIZE):
    """A Hugging Face GPT2LMHeadModel with our model's weights. Embedding rows past vocab_size (the
    padding up to 50304) are cropped away; a model trained without biases gets zero biases, which
    computes the same function in GPT-2's always-biased layout.

    scale_attn_by_inverse_layer_idx is folded into the query weights and left off in the Hugging Face
    config: GPT-2's SDPA attention, the default, ignores that flag in transformers 4.42 to 5.3 (fixed in
    5.4), and those releases would otherwise score a different function. Folded, every release and
    every attention implementation computes ours."""
    transformers = _import_transformers()
    cfg = model.config
    vocab_size = min(vocab_size, cfg.vocab_size)
    eot = GPT2_VOCAB_SIZE - 1 if vocab_size >= GPT2_VOCAB_SIZE else None
    hf_config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu_new",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=1e-5,
        scale_attn_by_inverse_layer_idx=False,  # folded into the weights below
        tie_word_embeddings=True,
        # GPT-2's end-of-text token, where the vocabulary has it
        bos_token_id=eot,
        eos_token_id=eot,
    )
    hf_model = transformers.GPT2LMHeadModel(hf_config)
    state_dict = _swap_conv1d_layout(model.state_dict())
    for key in ("transformer.wte.weight", "lm_head.weight"):
        state_dict[key] = state_dict[key][:vocab_size]
    if cfg.scale_attn_by_inverse_layer_idx:
        _fold_layer_scaling_into_queries(state_dict, cfg.n_layer, cfg.n_embd)
    if not cfg.bias:
        for name, p in hf_model.named_parameters():
            if name.endswith(".bias"):
                state_dict[name] = torch.zeros_like(p)
    hf_model.load_state_dict(state_dict)
    return hf_model
