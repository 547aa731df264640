import math

import pytest
import torch
import torch.nn as nn
from allocator import allocator_peak
from torch.nn import functional as F

import model as model_module
from marsgpt import checkpoint_parts
from model import GPT, PRESETS, GPTConfig, hidden_matrix_params, param_groups, peak_flops


def tiny_config(**overrides):
    args = dict(block_size=16, vocab_size=50, n_layer=3, n_head=4, n_embd=32)
    return GPTConfig(**{**args, **overrides})


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


# Parameter counts of OpenAI's GPT-2 checkpoints (vocab 50257, 1024 positions, biases), the tied
# embedding counted once: what Hugging Face's GPT2LMHeadModel reports for gpt2, gpt2-medium, ...
GPT2_PARAMS = {"small": 124_439_808, "medium": 354_823_168, "large": 774_030_080, "xl": 1_557_611_200}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_parameter_counts_match_gpt2(preset):
    config = GPTConfig.from_preset(preset, vocab_size=50257, block_size=1024, bias=True)
    with torch.device("meta"):  # shapes only: no memory, no init time
        gpt = GPT(config)
    assert gpt.get_num_params(non_embedding=False) == GPT2_PARAMS[preset]
    # non-embedding (nanoGPT's convention): minus the 1024 position embeddings only
    assert gpt.get_num_params() == GPT2_PARAMS[preset] - 1024 * config.n_embd
    # ... which is Kaplan et al.'s 12·L·d² (the transformer matrices) up to the biases, the LayerNorms
    # and the token embedding
    L, d = config.n_layer, config.n_embd
    assert gpt.get_num_params() == 12 * L * d * d + 13 * L * d + 2 * d + 50257 * d


def test_from_preset_overrides_and_rejects_unknown_names():
    config = GPTConfig.from_preset("medium", dropout=0.1)
    assert (config.n_layer, config.n_head, config.n_embd, config.dropout) == (24, 16, 1024, 0.1)
    with pytest.raises(ValueError, match="'huge'"):
        GPTConfig.from_preset("huge")


def test_config_rejects_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError, match="n_embd=100.*n_head=3"):
        GPTConfig(n_embd=100, n_head=3)


def test_forward_shapes_and_loss():
    gpt = tiny_gpt()
    idx = torch.randint(0, 50, (2, 16))
    logits, loss = gpt(idx)
    assert logits.shape == (2, 1, 50) and loss is None  # last position only without targets
    full_logits, loss = gpt(idx, torch.randint(0, 50, (2, 16)))
    assert full_logits.shape == (2, 16, 50)
    torch.testing.assert_close(logits[:, 0], full_logits[:, -1])
    assert loss.item() == pytest.approx(math.log(50), rel=0.05)  # at init: close to uniform


def test_loss_ignores_targets_of_minus_one():
    gpt = tiny_gpt()
    idx = torch.randint(0, 50, (2, 8))
    targets = idx.clone()
    targets[:, :4] = -1
    logits, loss = gpt(idx, targets)
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 50), idx[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_sequence_longer_than_block_size_is_rejected():
    with pytest.raises(ValueError, match="length 17 exceeds block_size 16"):
        tiny_gpt()(torch.zeros(1, 17, dtype=torch.long))


def explicit_attention(attn, x, layer_idx, scale_by_layer):
    """softmax(QKᵀ·s)V with a causal mask, written out: s = 1/sqrt(head_dim), / (layer_idx + 1) when
    scale_attn_by_inverse_layer_idx is on."""
    B, T, C = x.shape
    H = attn.n_head
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    s = 1.0 / math.sqrt(C // H)
    if scale_by_layer:
        s /= layer_idx + 1
    att = (q @ k.transpose(-2, -1)) * s
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
    return attn.c_proj(y)


@pytest.mark.parametrize("scale_by_layer", [False, True])
def test_sdpa_attention_equals_explicit_softmax(scale_by_layer):
    gpt = tiny_gpt(scale_attn_by_inverse_layer_idx=scale_by_layer)
    x = torch.randn(2, 16, 32)
    for i, block in enumerate(gpt.transformer.h):
        torch.testing.assert_close(
            block.attn(x), explicit_attention(block.attn, x, i, scale_by_layer), atol=1e-6, rtol=1e-5
        )


@pytest.mark.parametrize("scale_by_layer", [False, True])
def test_the_layer_factor_as_data_gives_every_block_one_scale_and_the_same_output(scale_by_layer):
    """What FSDP2's per-block compile needs (marsgpt/fsdp.py): the per-layer factor out of SDPA's scale, into a
    0-d buffer q is multiplied by (not saved in a checkpoint); the output the same but for q's rounding."""
    gpt = tiny_gpt(scale_attn_by_inverse_layer_idx=scale_by_layer)
    idx = torch.randint(0, 50, (2, 16))
    before, _ = gpt(idx)
    keys = gpt.state_dict().keys()
    for block in gpt.transformer.h:
        block.attn.layer_factor_as_data()
    attentions = [block.attn for block in gpt.transformer.h]
    assert len({attn.scale for attn in attentions}) == 1
    factors = [attn.q_factor.item() if scale_by_layer else attn.q_factor for attn in attentions]
    expected = [pytest.approx(1 / (i + 1), rel=1e-7) for i in range(len(attentions))] if scale_by_layer else None
    assert factors == (expected or [None] * len(attentions))
    torch.testing.assert_close(gpt(idx)[0], before, rtol=1e-5, atol=1e-6)
    assert gpt.state_dict().keys() == keys


def test_scale_attn_by_inverse_layer_idx_changes_the_output():
    idx = torch.randint(0, 50, (1, 16))
    plain, _ = tiny_gpt()(idx)
    scaled, _ = tiny_gpt(scale_attn_by_inverse_layer_idx=True)(idx)
    assert not torch.allclose(plain, scaled)


def test_gpt2_initialisation():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=4, n_head=4, n_embd=256))
    for name, p in gpt.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.05), name
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
        elif "ln_" in name and name.endswith("weight"):
            assert torch.all(p == 1), name
        else:
            assert name.endswith("bias") and torch.all(p == 0), name


def test_output_head_is_tied_to_token_embedding():
    gpt = tiny_gpt()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    names = [n for n, _ in gpt.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    # the tie survives a state-dict round trip (both names are saved, one tensor is loaded)
    other = tiny_gpt(seed=1)
    other.load_state_dict(gpt.state_dict())
    assert other.lm_head.weight is other.transformer.wte.weight
    torch.testing.assert_close(other.lm_head.weight, gpt.transformer.wte.weight)


def test_state_dict_uses_nanogpt_names():
    keys = set(tiny_gpt(n_layer=1).state_dict())
    assert keys == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "lm_head.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
        *(
            f"transformer.h.0.{m}.{p}"
            for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
            for p in ("weight", "bias")
        ),
    }


def test_loads_reference_checkpoints_with_causal_mask_buffer():

    gpt = tiny_gpt()
    state_dict = gpt.state_dict()
    for i in range(3):  # the reference code saves its T×T mask as 'attn.bias'
        state_dict[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 16, 16).tril()
    for load in (
        lambda model: model.load_state_dict(state_dict),
        lambda model: checkpoint_parts.load_model_state(model, dict(state_dict), "ref.pt"),
    ):
        other = tiny_gpt(seed=1)
        assert not torch.equal(other.lm_head.weight, gpt.lm_head.weight)
        load(other)
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), gpt.state_dict().values()))


def test_param_groups_split_like_the_reference():
    gpt = tiny_gpt()
    decay, no_decay = param_groups(gpt, weight_decay=0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    name_of = {id(p): n for n, p in gpt.named_parameters()}
    decay_names = [name_of[id(p)] for p in decay["params"]]
    no_decay_names = [name_of[id(p)] for p in no_decay["params"]]
    # weights of the four Linear layers in each block decay; the tied embedding/output matrix does not
    assert decay_names == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in range(3)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert no_decay_names == sorted(no_decay_names)
    assert set(no_decay_names) == set(name_of.values()) - set(decay_names)
    assert all(
        n.endswith("bias") or "ln_" in n or n in ("transformer.wte.weight", "transformer.wpe.weight")
        for n in no_decay_names
    )
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == gpt.get_num_params(False)


def test_hidden_matrix_params_split():
    gpt = tiny_gpt()
    hidden, other = hidden_matrix_params(gpt)
    assert len(hidden) == 4 * 3 and all(p.ndim == 2 for p in hidden)
    assert {id(p) for p in other} == {id(p) for p in gpt.parameters()} - {id(p) for p in hidden}
    assert any(p is gpt.transformer.wte.weight for p in other)


@pytest.mark.slow
def test_generate_length_and_top_k():
    gpt = tiny_gpt()
    idx = torch.randint(0, 50, (2, 10))
    out = gpt.generate(idx, max_new_tokens=12)  # runs past block_size 16: the context is cropped
    assert out.shape == (2, 22) and torch.equal(out[:, :10], idx)
    # top_k=1 is greedy: each new token is the argmax of the logits for the context before it
    out = gpt.generate(idx, max_new_tokens=3, top_k=1)
    for t in range(10, 13):
        logits, _ = gpt(out[:, :t][:, -16:])
        assert torch.equal(out[:, t], logits[:, -1].argmax(-1))
    with pytest.raises(ValueError, match="temperature"):
        gpt.generate(idx, 1, temperature=0)


@pytest.mark.slow
def test_generate_samples_only_from_the_top_k():
    gpt = tiny_gpt()
    idx = torch.randint(0, 50, (1, 5))
    logits, _ = gpt(idx)
    top3 = set(torch.topk(logits[0, -1], 3).indices.tolist())
    torch.manual_seed(0)
    samples = {gpt.generate(idx, 1, temperature=10.0, top_k=3)[0, -1].item() for _ in range(50)}
    assert samples <= top3 and len(samples) > 1


def test_estimate_mfu(monkeypatch):
    gpt = tiny_gpt()
    assert gpt.estimate_mfu(tokens_per_iter=1000, dt=1.0) is None  # CPU: no peak to compare with
    monkeypatch.setattr(model_module, "peak_flops", lambda device: 1e9)
    flops_per_token = 6 * gpt.get_num_params() + 12 * 3 * 4 * 8 * 16
    assert gpt.estimate_mfu(tokens_per_iter=1000, dt=2.0) == pytest.approx(flops_per_token * 500 / 1e9)
    llmc_flops_per_token = 6 * gpt.get_num_params(non_embedding=False) + 6 * 3 * 32 * 16
    assert gpt.estimate_mfu(1000, 2.0, "llm.c") == pytest.approx(llmc_flops_per_token * 500 / 1e9)


def test_the_two_flop_counts_of_gpt2_small():
    """PaLM's count (nanoGPT's) against llm.c's for GPT-2 small at 1024 tokens: 6 x 124M matmul FLOPs either
    way, attention counted whole or causally halved, the position embeddings out or in."""
    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304))
    n, L, C, T = 124_475_904, 12, 768, 1024  # every parameter, the tied matrix once
    assert gpt.get_num_params(non_embedding=False) == n
    assert gpt.flops_per_token("llm.c") == 6 * n + 6 * L * C * T
    assert gpt.flops_per_token("palm") == 6 * (n - T * C) + 12 * L * C * T
    assert gpt.flops_per_token("palm") / gpt.flops_per_token("llm.c") == pytest.approx(1.0646, abs=1e-4)
    with pytest.raises(ValueError, match="convention must be 'palm' or 'llm.c'"):
        gpt.flops_per_token("6N")


@pytest.mark.parametrize(
    "name, peak",
    [  # names as torch.cuda.get_device_name reports them
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989.5e12),
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.5e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A40", 149.7e12),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
        # unknown: no guess, not even for names that contain a known one
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA H20", None),
        ("NVIDIA A10G", None),
        ("NVIDIA L40", None),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_peak_flops_by_exact_gpu_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == peak
    assert peak_flops("cpu") is None


def test_crop_block_size():
    gpt = tiny_gpt()
    gpt.crop_block_size(8)
    assert gpt.transformer.wpe.weight.shape == (8, 32)
    with pytest.raises(ValueError, match="length 9 exceeds block_size 8"):
        gpt(torch.zeros(1, 9, dtype=torch.long))


def test_dropout_is_used_in_training_only():
    gpt = tiny_gpt(dropout=0.5)
    idx = torch.randint(0, 50, (1, 16))
    torch.testing.assert_close(gpt(idx)[0], gpt(idx)[0])
    gpt.train()
    assert not torch.allclose(gpt(idx)[0], gpt(idx)[0])


def test_all_layers_get_gradients():
    gpt = tiny_gpt().train()
    idx = torch.randint(0, 50, (2, 16))
    gpt(idx, idx)[1].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gpt.parameters())


def test_gelu_is_the_tanh_approximation():
    mlp = tiny_gpt().transformer.h[0].mlp
    assert isinstance(mlp.gelu, nn.GELU) and mlp.gelu.approximate == "tanh"


def saved_bytes(fn):
    """Bytes of the distinct tensors autograd saves for the backward pass while fn() runs, and fn()'s result."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sum(storages.values()), result


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_keeps_loss_and_gradients_and_saves_less(dropout):
    """Recomputing each block in the backward pass replays the forward's RNG state: the same dropout masks,
    so the same loss and gradients as the plain model; only each block's input is kept."""
    plain = tiny_gpt(dropout=dropout).train()
    recomputing = tiny_gpt(dropout=dropout).train()
    recomputing.activation_checkpointing = True
    x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for gpt in (plain, recomputing):
        torch.manual_seed(7)
        saved, (_, loss) = saved_bytes(lambda gpt=gpt: gpt(x, torch.roll(x, -1, dims=1)))
        loss.backward()
        results.append((saved, loss.detach(), [p.grad for p in gpt.parameters()]))
    (saved_plain, loss_plain, grads_plain), (saved_recomputing, loss_recomputing, grads_recomputing) = results
    torch.testing.assert_close(loss_recomputing, loss_plain)
    for g, g_plain in zip(grads_recomputing, grads_plain):
        torch.testing.assert_close(g, g_plain)
    assert saved_recomputing < saved_plain / 2
    # and without the RNG replay the masks would differ: the test can tell
    if dropout:
        torch.manual_seed(8)
        assert not torch.equal(plain(x, torch.roll(x, -1, dims=1))[1].detach(), loss_plain)


# ---------------------------------------------------------------------------------------------------
# The loss a chunk of positions at a time: what training computes instead of the whole (B, T, V) logits.


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows_per_chunk", [48, 7, 1])  # all rows at once, a last chunk cut short, row by row
def test_cross_entropy_in_chunks_is_cross_entropy_in_value_and_gradients(dtype, rows_per_chunk):
    torch.manual_seed(0)
    vocab = 50
    x = torch.randn(48, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (48,))
    targets[3:9] = -1  # not scored
    expected = F.cross_entropy(F.linear(x, weight), targets, ignore_index=-1)
    expected_grads = torch.autograd.grad(expected, (x, weight))
    loss = model_module.cross_entropy_in_chunks(x, weight, targets, chunk_scores=rows_per_chunk * vocab)
    grads = torch.autograd.grad(3.0 * loss, (x, weight))  # a scale from above reaches both gradients
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, expected, **tolerance)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, 3.0 * expected_grad, **tolerance)
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        torch.testing.assert_close(model_module.cross_entropy_in_chunks(x, weight, targets, 7 * vocab), expected)


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_training_loss_without_logits_equals_the_loss_with_them(autocast_dtype):
    """GPT(x, y, return_logits=False), train.py's call: the same loss and parameter gradients, the tied output
    layer's included, in float32 and under bfloat16 autocast (where the matmuls round as nn.Linear's do)."""
    with_logits, without = tiny_gpt(), tiny_gpt()
    idx, targets = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        logits, loss = with_logits(idx, targets)
        no_logits, chunked_loss = without(idx, targets, return_logits=False)
    assert logits.shape == (2, 16, 50) and no_logits is None
    loss.backward()
    chunked_loss.backward()
    tolerance = 1e-6 if autocast_dtype is None else 2e-3
    torch.testing.assert_close(chunked_loss, loss, rtol=tolerance, atol=tolerance)
    for (name, p), q in zip(with_logits.named_parameters(), without.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=tolerance, atol=tolerance, msg=name)


def test_the_chunked_loss_keeps_no_vocabulary_sized_activation():
    """What the backward pass keeps of the loss: the plain path saves float32 (positions x vocabulary) tensors,
    the chunked one only gradients the size of the output layer's input and weight."""
    gpt = tiny_gpt(vocab_size=2000)
    idx, targets = torch.randint(0, 2000, (4, 16)), torch.randint(0, 2000, (4, 16))

    def saved_sizes(**kwargs):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            gpt(idx, targets, **kwargs)
        return sizes

    positions_by_vocab = 4 * 16 * 2000
    assert max(saved_sizes()) >= positions_by_vocab
    assert max(saved_sizes(return_logits=False)) == gpt.lm_head.weight.numel() < positions_by_vocab


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_chunked_loss_compiles_into_one_graph(backend):
    gpt = tiny_gpt()
    idx, targets = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    compiled = torch.compile(gpt, fullgraph=True, backend=backend)  # a graph break raises
    loss = compiled(idx, targets, return_logits=False)[1]
    loss.backward()
    grads = [p.grad.clone() for p in gpt.parameters()]
    gpt.zero_grad()
    eager_loss = gpt(idx, targets, return_logits=False)[1]
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for grad, p in zip(grads, gpt.parameters()):
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_compiled_loss_holds_one_chunk_s_product_at_a_time(monkeypatch, one_thread):
    """The whole chunked loss compiled by inductor (as torch.compile of the GPT compiles it): each chunk adds its
    share of the output weight's gradient, a (vocabulary x width) product, through one opaque operation
    (model.add_product_), so the compiled loss holds one product at a time, as the eager loop does: the CPU
    allocator's peak through its forward and backward pass is at most the eager loop's. Written as `+=` (the
    second half), inductor fuses the 16 chunks' additions into one addition of 16 products, all alive together
    (2 MiB each here, in bfloat16): the peak then exceeds the eager loop's."""
    rows, vocab = 128, 8192
    torch.manual_seed(0)
    x = torch.randn(16 * rows, 128, requires_grad=True)
    weight = torch.randn(vocab, 128, requires_grad=True)
    targets = torch.randint(0, vocab, (16 * rows,))

    def peak(loss_fn):
        def forward_backward():
            x.grad = weight.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(x, weight, targets, chunk_scores=rows * vocab)
            loss.backward()

        return allocator_peak(forward_backward)

    eager = peak(model_module.cross_entropy_in_chunks)
    torch._dynamo.reset()
    compiled = peak(torch.compile(model_module.cross_entropy_in_chunks))
    assert compiled <= eager, (compiled, eager)

    def add_product_inline(total, a, b):
        total += a @ b

    monkeypatch.setattr(model_module, "add_product_", add_product_inline)
    torch._dynamo.reset()
    fused = peak(torch.compile(model_module.cross_entropy_in_chunks))
    assert fused > eager + 8 * vocab * 128 * 2, (fused, eager)  # more than 8 products beyond the eager loop's


class GraphRecorder:
    """A torch.compile backend that keeps every graph dynamo hands it and counts the calls of each: it runs the
    graph as traced (eager kernels, autograd through them)."""

    def __init__(self):
        self.graphs, self.calls = [], []

    def __call__(self, graph, example_inputs):
        index = len(self.graphs)
        self.graphs.append(graph)
        self.calls.append(0)

        def run(*args):
            self.calls[index] += 1
            return graph.forward(*args)

        return run

    def with_op(self, op):
        """The indices of the graphs that call `op`."""
        return [i for i, g in enumerate(self.graphs) if any(node.target is op for node in g.graph.nodes)]


def test_compile_blocks_compiles_one_block_graph_that_every_layer_runs():
    """GPT.compile_blocks on 12 layers with the per-layer attention scale (the paper's setting): one graph of a
    block for training and one for evaluation, each run by all 12 blocks, the loss's chunk one graph each; after
    the first step and evaluation nothing compiles again (recompiles forbidden), and the compiled model trains as
    the eager one (the per-layer factor multiplies q instead of folding into SDPA's scale: one rounding of q)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recorder = GraphRecorder()
    eager, compiled = (
        tiny_gpt(n_layer=12, scale_attn_by_inverse_layer_idx=True),
        tiny_gpt(n_layer=12, scale_attn_by_inverse_layer_idx=True),
    )
    compiled.compile_blocks(backend=recorder)
    idx, targets = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))

    def step(gpt):
        gpt.train()
        gpt.zero_grad()
        loss = gpt(idx, targets, return_logits=False)[1]
        loss.backward()
        with torch.no_grad():
            gpt.eval()
            eval_loss = gpt(idx, targets, return_logits=False)[1]
        return loss, eval_loss, [p.grad.clone() for p in gpt.parameters()]

    first = step(compiled)
    blocks = recorder.with_op(F.scaled_dot_product_attention)
    assert len(blocks) == 2 and [recorder.calls[i] for i in blocks] == [12, 12]  # training, evaluation
    assert len(recorder.graphs) == 4  # and the loss's chunk, with and without its gradient
    assert counters["stats"]["unique_graphs"] == 4 and not counters["graph_break"]
    with torch.compiler.set_stance("fail_on_recompile"):
        again = step(compiled)
    assert [recorder.calls[i] for i in blocks] == [24, 24]
    expected = step(eager)
    for got in (first, again):
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
        for grad, expected_grad in zip(got[2], expected[2]):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)
