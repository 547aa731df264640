"""The training configuration: every key declared once, with its type and default, and checked.

    python train.py [config/a.py ...] [--key=value ...]

Config files are plain Python assignments (nanoGPT style), applied in order; each runs in its own
namespace that starts from the values so far, so `gradient_accumulation_steps = 480 // batch_size`
works. Then the --key=value overrides, parsed with ast.literal_eval (a str key takes the raw text when
it is not a quoted literal). Key names and defaults are those of the paper's reference training script
(AGI-Arena/MARS, MARS/train_mars.py), except where a comment says otherwise.

Any mistake -- an unknown key, a wrong type, a missing file, a value outside its allowed set -- raises
ConfigError with a one-line message; entry points print it as `error: ...` and exit 2.
`python configurator.py [args]` prints the effective configuration (itself a valid config file).
"""

import ast
import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration mistake; the message is the one line the user sees."""


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 2000
    log_interval: int = 1
    eval_iters: int = 200
    eval_only: bool = False  # stop right after the first evaluation
    # Accepted for the reference's configs; ckpt.pt is written at every evaluation regardless, because an
    # exact resume needs the latest state (best.pt keeps the best one).
    always_save_checkpoint: bool = False
    init_from: str = "scratch"  # 'scratch', 'resume' or a GPT-2 name ('gpt2', 'gpt2-medium', ...)
    save_best: bool = True  # also keep the best-validation checkpoint
    keep_every_n_evals: int = 0  # keep a periodic checkpoint every N evaluations; 0 = off
    # wandb
    wandb_log: bool = False
    wandb_project: str = "owt"
    wandb_run_name: str = "gpt2"
    wandb_run_id: str = ""  # set to continue an existing wandb run; resume takes it from the checkpoint
    # data: the token files live in data_path/dataset (data/<name>/prepare.py writes them)
    data_path: str = "data"
    dataset: str = "openwebtext"  # or 'fineweb_edu', 'shakespeare_char', ...
    # Micro-batches per optimizer step across ALL ranks (nanoGPT's meaning): the global batch
    # batch_size * gradient_accumulation_steps sequences does not change with the number of GPUs.
    # 40 = the reference's 5 per GPU on its 8 GPUs.
    gradient_accumulation_steps: int = 40
    batch_size: int = 12  # micro-batch size, sequences per forward pass
    block_size: int = 1024
    seed: int = 5000  # the reference seeds with 5000 (+ rank; our batches do not depend on rank)
    # model
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    scale_attn_by_inverse_layer_idx: bool = True
    # optimizer
    optimizer_name: str = "mars"  # 'mars', 'adamw' or 'muon'
    learning_rate: float = 6e-4  # peak lr (MARS's 2-D tensors, AdamW's everything)
    max_iters: int = 600000
    weight_decay: float = 1e-1
    beta1: float = 0.95
    beta2: float = 0.99
    grad_clip: float = 1.0  # global gradient-norm clip; 0 disables
    # The gradient of a step is grad_multiplier x the mean over its micro-batches. The paper's code
    # summed each GPU's micro-batch gradients instead of averaging them, i.e. used (micro-batches per GPU)
    # x the mean: 4 for small/medium (15 x 4 x 8 GPUs), 12 for large/xl (5 x 12 x 8). The paper configs
    # set it so, which reproduces that scale (it matters to grad_clip and MARS's clip) on any GPU count.
    grad_multiplier: float = 1.0
    max_bad_steps: int = 10  # stop after this many consecutive non-finite steps
    # MARS (mars.py): see its docstring for what each one does
    gamma: float = 0.025
    lr_1d: float = 3e-3  # AdamW lr for 1-D tensors when optimize_1d is False; follows the schedule
    is_approx: bool = True  # False: exact MARS, an extra forward/backward per step
    mars_type: str = "mars-adamw"
    optimize_1d: bool = False
    weight_decay_1d: float = 0.1
    betas_1d: tuple[float, float] = (0.9, 0.95)
    last_grad_dtype: str = "float32"  # MARS's stored previous gradient; 'bfloat16' halves its memory
    # Muon baseline: torch.optim.Muon on the hidden 2-D matrices, AdamW on the rest.
    # Defaults are the reference train_muon.py's (muon_learning_rate, learning_rate).
    muon_lr: float = 2e-2
    muon_adamw_lr: float = 6e-4
    # learning-rate schedule (optim.lr_factor)
    decay_lr: bool = True  # False: constant learning_rate, no warmup
    warmup_iters: int = 2000
    lr_decay_iters: int = 600000  # cosine reaches min_lr here, ~= max_iters per Chinchilla
    min_lr: float = 6e-5  # absolute, for learning_rate; every other group gets the same fraction
    schedule: str = "cosine"  # 'cosine', 'wsd' or 'constant'
    wsd_decay_frac: float = 0.2  # wsd: linear decay over this last fraction of max_iters
    # evaluation
    hellaswag_interval: int = 0  # HellaSwag every N steps; 0 = off
    hellaswag_path: str = ""  # hellaswag_val.jsonl; empty = download when online
    # system. 'auto' (and compile=None) choose per device: CUDA if present; NCCL on CUDA, gloo on CPU;
    # bfloat16 autocast where CUDA supports it, else float16 with a GradScaler, float32 on CPU;
    # torch.compile on CUDA only. The reference hard-codes cuda / nccl / bfloat16 / compile=True.
    backend: str = "auto"
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'
    dtype: str = "auto"
    compile: bool | None = None
    ddp_timeout_s: int = 600  # collective timeout: a dead rank ends the job instead of hanging it


ALLOWED = {
    "optimizer_name": ("mars", "adamw", "muon"),
    "mars_type": ("mars-adamw", "mars-lion", "mars-shampoo"),
    "last_grad_dtype": ("float32", "bfloat16"),
    "schedule": ("cosine", "wsd", "constant"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "backend": ("auto", "nccl", "gloo"),
    "init_from": ("scratch", "resume", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"),
}
POSITIVE = (
    "batch_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "gradient_accumulation_steps",
    "eval_interval",
    "log_interval",
    "eval_iters",
    "max_bad_steps",
    "ddp_timeout_s",
    "grad_multiplier",
)
NON_NEGATIVE = (
    "max_iters",
    "warmup_iters",
    "lr_decay_iters",
    "hellaswag_interval",
    "keep_every_n_evals",
    "learning_rate",
    "min_lr",
    "lr_1d",
    "muon_lr",
    "muon_adamw_lr",
    "weight_decay",
    "weight_decay_1d",
    "gamma",
    "grad_clip",
)

_TYPES = typing.get_type_hints(TrainConfig)
_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def _type_name(key):
    return {
        float: "float",
        int: "int",
        bool: "bool (True/False)",
        str: "str",
        bool | None: "bool or None",
        tuple[float, float]: "a pair of floats",
    }[_TYPES[key]]


def _unknown_key(key, source):
    close = difflib.get_close_matches(key, _KEYS, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}' ({source}){hint}")


def _checked(key, value, source):
    """value converted to key's declared type, or ConfigError. bool is never taken for int or float."""
    want = _TYPES[key]
    if want is float and type(value) in (int, float):
        return float(value)
    if (
        want == tuple[float, float]
        and isinstance(value, (tuple, list))
        and len(value) == 2
        and all(type(v) in (int, float) for v in value)
    ):
        return tuple(float(v) for v in value)
    if want == bool | None and (value is None or type(value) is bool):
        return value
    if want in (int, bool, str) and type(value) is want:
        return value
    raise ConfigError(f"{key} must be {_type_name(key)}, got {value!r} ({source})")


def _apply_file(values, path):
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    namespace = dict(values)
    try:
        exec(compile(text, path, "exec"), namespace)
    except SyntaxError as e:
        raise ConfigError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:
        raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None
    for key, value in namespace.items():
        if key.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if key not in values:
            raise _unknown_key(key, path)
        values[key] = _checked(key, value, path)


def _apply_override(values, arg):
    key, sep, text = arg[2:].partition("=")
    if not sep or not key:
        raise ConfigError(f"expected --key=value, got '{arg}'")
    if key not in values:
        raise _unknown_key(key, "command line")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = text
    if _TYPES[key] is str and not isinstance(value, str):
        value = text  # --wandb_run_name=2024 means the string '2024'
    values[key] = _checked(key, value, f"--{key}")


def _validate(cfg):
    for key, allowed in ALLOWED.items():
        value = getattr(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(allowed)}")
    for key in POSITIVE:
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(cfg, key)}")
    for key in NON_NEGATIVE:
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(cfg, key)}")
    if not (cfg.device in ("auto", "cpu", "mps") or cfg.device.split(":")[0] == "cuda"):
        raise ConfigError(f"device={cfg.device!r} is not one of: auto, cpu, cuda, cuda:N, mps")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {cfg.dropout}")
    for key, betas in (("beta1/beta2", (cfg.beta1, cfg.beta2)), ("betas_1d", cfg.betas_1d)):
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"{key} must be in [0, 1), got {betas}")
    if not 0.0 < cfg.wsd_decay_frac <= 1.0:
        raise ConfigError(f"wsd_decay_frac must be in (0, 1], got {cfg.wsd_decay_frac}")
    if cfg.decay_lr and cfg.schedule == "cosine" and cfg.lr_decay_iters <= cfg.warmup_iters:
        raise ConfigError(
            f"lr_decay_iters={cfg.lr_decay_iters} must exceed warmup_iters={cfg.warmup_iters} for the cosine schedule"
        )


def load_config(argv):
    """TrainConfig from command-line arguments: config files (in order), then --key=value overrides."""
    values = config_to_dict(TrainConfig())
    for arg in argv:
        if arg.startswith("--"):
            _apply_override(values, arg)
        elif arg.startswith("-"):
            raise ConfigError(f"expected a config file or --key=value, got '{arg}'")
        else:
            _apply_file(values, arg)
    cfg = TrainConfig(**values)
    _validate(cfg)
    return cfg


def config_to_dict(cfg):
    """Every key and value, in declaration order (for printing, wandb and checkpoints)."""
    return dataclasses.asdict(cfg)


def main(argv=None):
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key, value in config_to_dict(cfg).items():
        print(f"{key} = {value!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
