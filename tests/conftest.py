"""Fixtures shared by the test modules: a tiny character corpus, and tiny checkpoints as train.py saves them."""

import dataclasses
import os
import signal
import tempfile

import pytest
import torch
import train_helpers
from train_helpers import choose_kernels, make_char_data

from marsgpt.checkpoint import save_checkpoint
from model import GPT, GPTConfig


def interpret_triton_kernels_as_gpus_round():
    """fused=True runs MARS's Triton kernel; on a CPU, in Triton's interpreter (set before the first kernel is
    built). The interpreter (Triton 3.7) casts float32 to bfloat16 by dropping bits, where a compiled kernel rounds
    to nearest even (cvt.rn.bf16.f32), as torch does: its cast here rounds as a GPU's does, through torch."""
    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    truncating = interpreter._convert_float

    def convert_float(values, input_dtype, output_dtype, rounding_mode):
        if (input_dtype, output_dtype, rounding_mode) == (tl.float32, tl.bfloat16, None):
            rounded = torch.from_numpy(values.view("float32")).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view("uint16")
        return truncating(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_float


# A shell's background job (`bash .ci/run &`, nohup ... &) starts with SIGINT ignored, and every process a test starts
# would inherit that: the Ctrl-C tests' SIGINT would reach no one. The test session takes Ctrl-C as a terminal's
# foreground job does, and what it starts gets the default disposition back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The user's signing key (marsgpt/user_key.py) in a folder of the test session's, not the real ~/.config; the runs a
# test launches inherit it.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="marsgpt-test-config-")

# First: Triton decides at its import whether its own library functions (tl.sum, ...) are interpreted, and
# choose_kernels may import it (through inductor's cache settings) before any kernel is built.
interpret_triton_kernels_as_gpus_round()
choose_kernels()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: intra-op threads would only contend (and spin) with the other worker's.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def backend_flags_settable():
    """torch's test utilities, which tests/test_mars_as_torch_optimizer.py imports, freeze torch.backends' flags as
    they are imported (for torch's own suite); collecting that module would then fail every later test of a setting
    the trainer makes (runtime.set_deterministic), so the session lets them be set, as a training run can."""
    with getattr(torch.backends, "__allow_nonbracketed_mutation")():
        yield


@pytest.fixture(autouse=True)
def no_launched_run_outlives_its_test():
    """A run a test launched and still running when the test ends (it failed while the run was held, or hanging by
    TEST_FAIL) is killed with what it started: it would otherwise wait for nobody, holding memory and its lock."""
    yield
    while train_helpers.LAUNCHED:
        proc = train_helpers.LAUNCHED.pop()
        if proc.poll() is None:
            train_helpers.kill_tree(proc)
            proc.wait()


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny models run faster single-threaded on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_path(tmp_path_factory):
    """make_char_data's word-salad corpus (dataset 'tiny'), written once per test session."""
    return make_char_data(tmp_path_factory.mktemp("data"))


@pytest.fixture
def tiny_checkpoint():
    """save(out_dir, vocab_size, data_path, dataset, block_size, seed) -> the 1-layer GPT it saved, as
    train.py saves one (the keys the tools after training read)."""

    def save(out_dir, vocab_size, data_path="", dataset="", block_size=16, seed=0):
        torch.manual_seed(seed)
        config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=16)
        model = GPT(config)
        os.makedirs(out_dir, exist_ok=True)
        state = dict(
            model=model.state_dict(),
            model_args=dataclasses.asdict(config),
            config=dict(data_path=str(data_path), dataset=dataset),
        )
        save_checkpoint(os.path.join(out_dir, "ckpt.pt"), state)
        return model

    return save
