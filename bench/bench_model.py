"""Forward+backward time of our GPT (attention through SDPA) against the same model computing attention
as the paper's reference code does: softmax(QKᵀ/sqrt(d)) V with an explicit T×T matrix and mask.

    python -m bench.bench_model            # 2 layers of GPT-2 small (768 wide, 12 heads), 4 x 1024 tokens
    python -m bench.bench_model --quick    # the whole-model row at 4 x 256 tokens; 3 rounds, not 5

Rows: one attention layer alone at 4 x 1024 (where the two differ), then the whole model with its
50304-way output layer and loss (which dominate on CPU, so the ratio there is closer to 1). Both
variants share the weights and scale_attn_by_inverse_layer_idx=True (the paper's setting); only the
attention computation differs. Target: ours no slower (ratio <= 1).
"""

import torch
from torch.nn import functional as F

from bench.common import print_table, quick_flag, row, time_it
from model import GPT, CausalSelfAttention, GPTConfig


class ExplicitSoftmaxAttention(CausalSelfAttention):
    """The reference code's attention: the (B, n_head, T, T) score matrix, masked with a stored
    lower-triangular buffer, softmax, then the product with V."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def with_explicit_attention(model):
    for block in model.transformer.h:
        block.attn.__class__ = ExplicitSoftmaxAttention
        size = model.config.block_size
        block.attn.register_buffer("mask", torch.ones(size, size).tril().view(1, 1, size, size), persistent=False)
    return model


def fwd_bwd_ms(variants, quick):
    """Median milliseconds of one zero_grad + forward + backward for each (module, loss_fn) pair. The
    variants take turns, so a load change on the shared CPU hits both alike."""

    def step(module, loss_fn):
        module.zero_grad(set_to_none=True)
        loss_fn().backward()

    for module, loss_fn in variants:
        step(module, loss_fn)  # warm-up
    times = [[] for _ in variants]
    for _ in range(3 if quick else 5):
        for t, (module, loss_fn) in zip(times, variants):
            t.append(time_it(lambda m=module, f=loss_fn: step(m, f), warmup=0, repeats=1))
    return [1e3 * sorted(t)[len(t) // 2] for t in times]


def run(quick=False):
    torch.manual_seed(0)
    config = GPTConfig.from_preset("small", n_layer=2, scale_attn_by_inverse_layer_idx=True)
    ours = GPT(config).train()
    reference = with_explicit_attention(GPT(config).train())
    reference.load_state_dict(ours.state_dict())
    device = "cuda" if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    note = f"median of {3 if quick else 5}, alternating; {device}"
    rows = []

    # One attention layer alone (second block: the per-layer scale is not 1), where the kernels differ.
    B, T = 4, 1024
    x = torch.randn(B, T, config.n_embd)
    attn_ms = fwd_bwd_ms(
        [(a, lambda a=a: a(x).square().mean()) for a in (ours.transformer.h[1].attn, reference.transformer.h[1].attn)],
        quick,
    )
    rows.append(
        row(
            f"attention layer fwd+bwd, GPT-2 small shape, {B}x{T}",
            *attn_ms,
            unit="ms",
            target="<= 1 (SDPA vs explicit softmax)",
            note=note,
        )
    )

    # The whole model: embeddings, 2 blocks, the 50304-way output layer and the loss.
    T = 256 if quick else 1024
    idx = torch.randint(0, config.vocab_size, (B, T))
    model_ms = fwd_bwd_ms([(m, lambda m=m: m(idx, idx)[1]) for m in (ours, reference)], quick)
    rows.append(
        row(
            f"GPT fwd+bwd, 2 layers of GPT-2 small, {B}x{T} tokens",
            *model_ms,
            unit="ms",
            target="<= 1 (SDPA vs explicit softmax)",
            note=note,
        )
    )
    return rows


if __name__ == "__main__":
    print_table(run(quick=quick_flag(__doc__)))
