import dataclasses
import json
import os
import sys

import pytest
import torch
from train_helpers import tiny_args

import train
from marsgpt.export_hf import export_hf, main
from marsgpt.trained_model import load_model
from model import GPT, GPTConfig, config_from_hf, gpt_from_hf, hf_from_gpt

transformers = pytest.importorskip("transformers")


def random_hf_gpt2(scale_attn_by_inverse_layer_idx, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=300,
        n_positions=32,
        n_embd=48,
        n_layer=3,
        n_head=4,
        scale_attn_by_inverse_layer_idx=scale_attn_by_inverse_layer_idx,
        attn_implementation="eager",  # the path that honours the layer scaling in every transformers release
        bos_token_id=None,
        eos_token_id=None,
    )
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF zero-initialises biases and LayerNorms: make every parameter matter
        for p in hf_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf_model


def all_logits(gpt, idx):
    """Our logits at every position (forward returns them all when given targets)."""
    return gpt(idx, torch.zeros_like(idx))[0]


@pytest.mark.slow
@pytest.mark.parametrize("scale_by_layer", [False, True])
def test_hf_to_ours_and_back_gives_the_same_logits(scale_by_layer):
    hf_model = random_hf_gpt2(scale_by_layer)
    idx = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        expected = hf_model(idx).logits
        gpt = gpt_from_hf(hf_model).eval()
        assert gpt.config.scale_attn_by_inverse_layer_idx == scale_by_layer
        assert (expected - all_logits(gpt, idx)).abs().max() <= 1e-5
        back = hf_from_gpt(gpt).eval()
        assert not back.config.scale_attn_by_inverse_layer_idx  # folded into the query weights
        assert (expected - back(idx).logits).abs().max() <= 1e-5


def tiny_gpt(**overrides):
    torch.manual_seed(0)
    args = dict(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=32, scale_attn_by_inverse_layer_idx=True)
    return GPT(GPTConfig(**{**args, **overrides})).eval()


@pytest.mark.slow
def test_export_folder_loads_in_transformers_and_matches_our_logits(tmp_path):
    gpt = tiny_gpt()
    export_hf(gpt, tmp_path)
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= set(os.listdir(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == 50257 and config["scale_attn_by_inverse_layer_idx"] is False  # folded
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        ours = all_logits(gpt, idx)[..., :50257]  # the padded rows are cropped away
        assert (ours - loaded(idx).logits).abs().max() <= 1e-5
        # and back: GPT.from_pretrained reads the folder too
        again = GPT.from_pretrained(str(tmp_path)).eval()
        assert again.config.vocab_size == 50257
        assert (ours - all_logits(again, idx)).abs().max() <= 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("Hello world") == [15496, 995] and tokenizer.eos_token_id == 50256


def sdpa_without_scale(monkeypatch):
    """Make every SDPA call ignore its `scale`, as GPT-2's SDPA path in transformers 4.42-5.3 does."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def ignoring_scale(*args, scale=None, **kwargs):
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", ignoring_scale)


@pytest.mark.slow
@pytest.mark.parametrize("sdpa_drops_scale", [False, True])
@pytest.mark.parametrize("scale_by_layer", [False, True])
def test_lm_eval_harness_loading_scores_our_function(tmp_path, monkeypatch, scale_by_layer, sdpa_drops_scale):
    """Loaded as lm-evaluation-harness loads it (AutoModelForCausalLM.from_pretrained, default arguments),
    the export gives our logits with the layer scaling on or off, also where SDPA ignores the scaling."""
    gpt = tiny_gpt(scale_attn_by_inverse_layer_idx=scale_by_layer, n_layer=3)
    with torch.no_grad():  # sharp attention, so that the layer scaling moves the logits far beyond 1e-5
        for block in gpt.transformer.h:
            block.attn.c_attn.weight.mul_(30)
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        ours = all_logits(gpt, idx)[..., :50257]
        flipped = GPT(dataclasses.replace(gpt.config, scale_attn_by_inverse_layer_idx=not scale_by_layer)).eval()
        flipped.load_state_dict(gpt.state_dict())
        assert (ours - all_logits(flipped, idx)[..., :50257]).abs().max() > 1e-2  # the flag matters here
    export_hf(gpt, tmp_path)
    if sdpa_drops_scale:
        sdpa_without_scale(monkeypatch)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (ours - loaded(idx).logits).abs().max() <= 1e-5


def test_export_of_a_model_without_biases(tmp_path):
    gpt = tiny_gpt(bias=False, vocab_size=100)  # a small vocabulary is kept whole, without tokenizer
    export_hf(gpt, tmp_path)
    assert "vocab.json" not in os.listdir(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 100, (1, 32))
    with torch.no_grad():
        assert (all_logits(gpt, idx) - loaded(idx).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_every_file_of_an_export_gets_the_mode_the_umask_gives(tmp_path, umask, mode):
    """safetensors writes model.safetensors 0600; the export's other files, and now it too, follow the umask."""
    previous = os.umask(umask)
    try:
        export_hf(tiny_gpt(), tmp_path / "hf")  # GPT-2's vocabulary: the tokenizer files too
    finally:
        os.umask(previous)
    modes = {name: oct(os.stat(tmp_path / "hf" / name).st_mode & 0o777) for name in os.listdir(tmp_path / "hf")}
    assert {"model.safetensors", "config.json", "vocab.json", "merges.txt"} <= set(modes)
    assert set(modes.values()) == {oct(mode)}, modes


@pytest.fixture(scope="module")
def trained_run(data_path, tmp_path_factory):
    """An out_dir that train.py itself wrote: 2 steps of the tiny character model (about a second)."""
    out = str(tmp_path_factory.mktemp("run") / "out")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(tiny_args(data_path, out, max_iters=2, eval_interval=2, eval_iters=1)) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_command_exports_a_checkpoint_train_py_wrote(trained_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main([trained_run, str(hf)]) == 0
    printed = capsys.readouterr().out
    assert "from iteration 2 of" in printed
    # A character-level model: no GPT-2 tokenizer files, and the output says so.
    assert "note: no tokenizer written" in printed and "vocab.json" not in os.listdir(hf)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing left beside it
    gpt, _ = load_model(trained_run)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(hf).eval()
    idx = torch.randint(0, gpt.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert (all_logits(gpt, idx) - loaded(idx).logits).abs().max() <= 1e-5


def failing_save(monkeypatch):
    """save_pretrained writes the whole folder, then fails (a full disk while the tokenizer is copied)."""
    real = transformers.GPT2LMHeadModel.save_pretrained

    def save_then_fail(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "save_pretrained", save_then_fail)


def test_a_failed_export_leaves_no_folder_that_looks_complete(trained_run, tmp_path, monkeypatch, capsys):
    failing_save(monkeypatch)
    assert main([trained_run, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err  # after transformers' progress bar
    assert err.splitlines()[-1] == "error: [Errno 28] No space left on device" and "Traceback" not in err
    assert os.listdir(tmp_path) == []  # neither hf/ nor its temporary folder


def test_a_failed_reexport_keeps_the_previous_export_and_a_good_one_replaces_it(trained_run, tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    assert main([trained_run, str(hf)]) == 0
    before = {name: (hf / name).read_bytes() for name in os.listdir(hf)}
    with monkeypatch.context() as m:
        failing_save(m)
        assert main([trained_run, str(hf) + "/"]) == 2
    assert {name: (hf / name).read_bytes() for name in os.listdir(hf)} == before
    assert os.listdir(tmp_path) == ["hf"]
    (hf / "model.safetensors").write_bytes(b"stale")
    assert main([trained_run, str(hf)]) == 0  # a previous export is replaced whole
    assert {name: (hf / name).read_bytes() for name in os.listdir(hf)} == before
    assert os.listdir(tmp_path) == ["hf"]


@pytest.mark.parametrize(
    "make_target, message",
    [
        (lambda t: t.write_text("mine"), "exists and is not a folder"),
        (lambda t: (t.mkdir(), (t / "notes.txt").write_text("mine")), "not a previous export (notes.txt)"),
    ],
)
def test_an_output_path_that_is_not_an_export_is_refused_untouched(trained_run, tmp_path, capsys, make_target, message):
    target = tmp_path / "target"
    make_target(target)
    assert main([trained_run, str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert (target / "notes.txt" if target.is_dir() else target).read_text() == "mine"
    assert os.listdir(tmp_path) == ["target"]


def test_command_reports_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nowhere" in err and "Traceback" not in err
    assert "train a model first" in err and "--init_from" not in err  # advice for this tool, not train.py's
    assert os.listdir(tmp_path) == []


def test_without_transformers_the_message_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"pip install -r requirements-extra\.txt"):
        hf_from_gpt(tiny_gpt())
    with pytest.raises(ImportError, match=r"pip install -r requirements-extra\.txt"):
        GPT.from_pretrained("gpt2")


def test_offline_from_pretrained_reads_only_the_cache_and_says_what_to_do(monkeypatch):
    asked = []

    def not_cached(name, local_files_only=False):
        asked.append(local_files_only)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", not_cached)
    with pytest.raises(ValueError, match="gpt2 is not in the local Hugging Face cache and huggingface.co cannot"):
        GPT.from_pretrained("gpt2", offline=True)
    with pytest.raises(OSError):  # online, the library's own error stands
        GPT.from_pretrained("gpt2")
    assert asked == [True, False]


def test_from_pretrained_rejects_unknown_names_and_overrides():
    with pytest.raises(ValueError, match="'gpt3'"):
        GPT.from_pretrained("gpt3")
    with pytest.raises(ValueError, match="n_layer"):
        GPT.from_pretrained("gpt2", dict(n_layer=2))


def test_unsupported_hf_variants_are_rejected():
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, activation_function="relu")
    with pytest.raises(ValueError, match="relu"):
        config_from_hf(config)
