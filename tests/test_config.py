"""marsgpt/config.py: config files, overrides and their order, every error, --help."""

import dataclasses
import os
import subprocess
import sys

import pytest

from marsgpt.config import TrainConfig, current_keys, load_config, main
from marsgpt.config_schema import ConfigError, config_to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_are_the_reference_training_script_s():
    cfg = load_config([])
    assert cfg == TrainConfig()
    assert (cfg.optimizer, cfg.schedule) == ("mars-adamw", "cosine")
    assert (cfg.learning_rate, cfg.min_lr, cfg.max_iters, cfg.warmup_iters) == (6e-4, 6e-5, 600000, 2000)
    assert (cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.gamma) == (0.95, 0.99, 0.1, 0.025)
    assert (cfg.lr_1d, cfg.weight_decay_1d, cfg.betas_1d) == (3e-3, 0.1, (0.9, 0.95))
    assert cfg.is_approx and not cfg.optimize_1d and not cfg.bias and cfg.scale_attn_by_inverse_layer_idx
    assert cfg.batch_size * cfg.gradient_accumulation_steps == 12 * 5 * 8  # the reference's 8 GPUs


def test_files_apply_in_order_then_overrides(tmp_path):
    a = write(tmp_path, "a.py", "batch_size = 4\nlearning_rate = 1e-3\nout_dir = 'from_a'\n")
    b = write(
        tmp_path,
        "b.py",
        "import math\nlearning_rate = 2e-3\ngradient_accumulation_steps = 32 // batch_size  # sees a.py's value\n",
    )
    cfg = load_config([a, b, "--out_dir=out-cli", "--batch_size=2"])
    assert cfg.learning_rate == 2e-3  # b after a
    assert cfg.gradient_accumulation_steps == 8
    assert (cfg.out_dir, cfg.batch_size) == ("out-cli", 2)  # overrides after files
    assert load_config(["--learning_rate=1e-2", a]).learning_rate == 1e-3  # order is the argv order


def test_config_files_run_in_their_own_namespace(tmp_path):
    a = write(tmp_path, "a.py", "batch_size = 3\n")
    load_config([a])
    assert "batch_size" not in vars(sys.modules["marsgpt.config"])


@pytest.mark.parametrize(
    "arg, key, value",
    [
        ("--eval_only=True", "eval_only", True),
        ("--learning_rate=1", "learning_rate", 1.0),  # int accepted for float
        ("--betas_1d=[0.8, 0.9]", "betas_1d", (0.8, 0.9)),
        ("--betas_1d=(0, 0.5)", "betas_1d", (0.0, 0.5)),
        ("--wandb_run_name=2024", "wandb_run_name", "2024"),  # str key keeps the text
        ("--out_dir='quoted'", "out_dir", "quoted"),
        ("--out_dir=out/run-1", "out_dir", "out/run-1"),
        ("--compile=None", "compile", None),
        ("--compile=False", "compile", False),
        ("--init_from=gpt2-xl", "init_from", "gpt2-xl"),
    ],
)
def test_override_values(arg, key, value):
    got = getattr(load_config([arg]), key)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learnig_rate=1e-3"], "unknown config key 'learnig_rate' (command line); did you mean 'learning_rate'?"),
        (["--batch_size=1.5"], "batch_size must be int, got 1.5 (--batch_size)"),
        (["--batch_size=True"], "batch_size must be int, got True"),
        (["--eval_only=1"], "eval_only must be bool (True/False), got 1"),
        (["--learning_rate=fast"], "learning_rate must be float, got 'fast'"),
        (["--betas_1d=0.9"], "betas_1d must be a pair of floats, got 0.9"),
        (["--compile=yes"], "compile must be bool or None, got 'yes'"),
        (["--batch_size"], "expected --key=value, got '--batch_size'"),
        (["-v"], "expected a config file or --key=value, got '-v'"),
        (["no/such/config.py"], "config file not found: no/such/config.py"),
        (["--optimizer_name=sgd"], "optimizer_name='sgd' is not one of: mars, adamw, muon"),
        (["--mars_type=mars-sgd"], "mars_type='mars-sgd' is not one of: mars-adamw, mars-lion, mars-shampoo"),
        (["--schedule=linear"], "schedule='linear' is not one of: cosine, wsd, constant"),
        (["--dtype=fp8"], "dtype='fp8' is not one of: auto, float32, bfloat16, float16"),
        (["--backend=mpi"], "backend='mpi' is not one of: auto, nccl, gloo"),
        (["--init_from=gpt3"], "init_from='gpt3' is not one of: scratch, resume, auto, gpt2, gpt2-medium"),
        (["--device=tpu"], "device='tpu' is not one of: auto, cpu, cuda, cuda:N, mps"),
        (["--batch_size=0"], "batch_size must be positive, got 0"),
        (["--n_head=0"], "n_head must be positive, got 0"),
        (["--gradient_accumulation_steps=-1"], "gradient_accumulation_steps must be positive, got -1"),
        (["--learning_rate=-1e-3"], "learning_rate must be >= 0, got -0.001"),
        (["--n_embd=100"], "n_embd=100 must be divisible by n_head=12"),
        (["--dropout=1.0"], "dropout must be in [0, 1), got 1.0"),
        (["--beta2=1.0"], "beta2 must be in [0, 1), got 1.0"),
        (["--out_dir="], "out_dir must not be empty, got ''"),
        (["--wsd_decay_frac=0"], "wsd_decay_frac must be in (0, 1], got 0.0"),
        (["--lr_decay_iters=100"], "lr_decay_iters=100 must exceed warmup_iters=2000 for the cosine schedule"),
    ],
)
def test_errors_name_the_key_and_value(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, optimizer",
    [
        (["--optimizer_name=mars"], "mars-adamw"),
        (["--optimizer_name=mars", "--mars_type=mars-m"], "mars-m"),
        (["--mars_type=mars-lion"], "mars-lion"),  # optimizer_name's default is the reference's: mars
        (["--optimizer=mars-lion", "--optimizer_name=mars"], "mars-lion"),  # the rule so far stays
        (["--optimizer=adamw", "--optimizer_name=mars"], "mars-adamw"),  # the reference's default rule
        (["--optimizer=adamw", "--mars_type=mars-m"], "adamw"),  # the reference reads mars_type for MARS only
        (["--optimizer_name=moonlight"], "moonlight"),
    ],
)
def test_the_reference_keys_name_the_optimizer(tmp_path, argv, optimizer):
    """The paper's reference names the optimizer with optimizer_name and, for MARS, mars_type: a config file or an
    override in its keys selects the optimizer it names there, from what the sources before it chose."""
    assert load_config(argv).optimizer == optimizer
    key_value = [arg[2:].split("=") for arg in argv]
    files = [write(tmp_path, f"{i}.py", f"{key} = {value!r}\n") for i, (key, value) in enumerate(key_value)]
    assert load_config(files).optimizer == optimizer


def test_a_file_naming_the_optimizer_twice_is_refused_and_saved_configs_are_read_in_today_s_keys(tmp_path):
    both = write(tmp_path, "both.py", "optimizer = 'adamw'\noptimizer_name = 'muon'\n")
    with pytest.raises(ConfigError, match="sets optimizer and optimizer_name, which name it too; set one of them"):
        load_config([both])
    # a checkpoint written when the optimizer was named by the reference's keys
    saved = dict(config_to_dict(TrainConfig()), optimizer_name="mars", mars_type="mars-shampoo")
    del saved["optimizer"]
    assert current_keys(saved) == config_to_dict(TrainConfig(optimizer="mars-shampoo"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("learnig_rate = 1e-3\n", "unknown config key 'learnig_rate' ({path}); did you mean 'learning_rate'?"),
        ("batch_size = '15'\n", "batch_size must be int, got '15' ({path})"),
        ("schedule = 'cos'\n", "schedule='cos' is not one of: cosine, wsd, constant"),
        ("batch_size = = 3\n", "{path}:1: syntax error"),
        ("batch_size = undefined_name\n", "{path}: NameError: name 'undefined_name' is not defined"),
    ],
)
def test_file_errors_name_the_file(tmp_path, text, message):
    path = write(tmp_path, "bad.py", text)
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert message.format(path=path) in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizer_name=sgd"], "error: optimizer_name='sgd' is not one of: mars, adamw, muon"),
        (["--n_layr=2"], "error: unknown config key 'n_layr' (command line); did you mean 'n_layer'?"),
        (["missing.py"], "error: config file not found: missing.py"),
        (["--dtype=int8"], "error: dtype='int8' is not one of"),
    ],
)
def test_command_line_error_is_one_line_and_exit_2(argv, message):
    run = subprocess.run([sys.executable, "-m", "marsgpt.config", *argv], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.startswith(message) and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "sys.exit()", "raise SystemExit(3)"])
def test_a_config_file_that_exits_is_an_error_not_a_silent_success(tmp_path, exit_call):
    """train.py with a config file that exits while it is read ended with status 0, no output and no run."""
    path = write(tmp_path, "exits.py", f"import sys\nn_layer = 2\n{exit_call}\n")
    run = subprocess.run([sys.executable, "train.py", path], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.startswith(f"error: {path} called sys.exit(") and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.rstrip().endswith("while it was read: a config file only assigns keys")


def test_printed_config_is_a_config_file_that_loads_back(tmp_path, capsys):
    argv = [os.path.join(ROOT, "config/train_gpt2_small_muon.py"), "--betas_1d=(0.8, 0.9)", "--compile=False"]
    assert main(argv) == 0
    path = write(tmp_path, "effective.py", capsys.readouterr().out)
    assert load_config([path]) == load_config(argv)
    cfg = load_config(argv)
    assert TrainConfig(**config_to_dict(cfg)) == cfg


@pytest.mark.slow
def test_help_lists_every_key_with_type_default_and_meaning():
    run = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == ""
    for field in dataclasses.fields(TrainConfig):
        line = next(line for line in run.stdout.splitlines() if line.startswith(f"  --{field.name}="))
        assert repr(getattr(TrainConfig(), field.name)) in line
        assert field.metadata["help"]
    assert "[one of: mars-adamw, mars-lion, mars-shampoo, mars-m, adamw, muon, moonlight]" in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [["train.py", "--help"], ["-m", "marsgpt.config", "--help"], ["-m", "marsgpt.config", "config/quickstart.py"]],
)
def test_output_into_a_closed_pipe_ends_quietly(argv):
    """`python train.py --help | head`: a reader gone before the output is written is no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the process starts: its first write meets a closed pipe
    run = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE)
    os.close(write_end)
    err = run.stderr.read().decode()
    assert run.wait() == 0 and err == "", err


def test_config_files_may_import_helpers(tmp_path):
    path = write(
        tmp_path,
        "c.py",
        "import math\nfrom os.path import join\ndef half(x):\n    return x // 2\nbatch_size = half(8)\n",
    )
    assert load_config([path]).batch_size == 4
