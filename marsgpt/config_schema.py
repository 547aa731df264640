"""Typed configuration for any dataclass whose fields are declared with key(): Python config files and --key=value
overrides applied in order, each value checked against its field's type and check, and --help listing every key.
Any mistake -- an unknown key, a wrong type, a missing file, a value outside its allowed set -- raises ConfigError
with a one-line message; entry points print it as `error: ...` and exit 2. marsgpt/config.py declares train.py's
keys with it, vision/train_cifar.py its own.

Config files are plain Python assignments (nanoGPT style), applied in order; each runs in its own namespace that
starts from the values so far, so `gradient_accumulation_steps = 480 // batch_size` works, and may import helpers
(modules, functions and classes it binds are not keys). Then the --key=value overrides, parsed with
ast.literal_eval (a str key takes the raw text when it is not a quoted literal).
"""

import ast
import contextlib
import dataclasses
import difflib
import inspect
import os
import sys
import types
import typing
from typing import Literal


class ConfigError(ValueError):
    """A configuration mistake; the message is the one line the user sees."""


# ---------------------------------------------------------------------------------------------------
# Declaring keys: key(default, help, check). A check returns None when the value is fine, else the
# end of the message "<key> <what>, got <value>".


def key(default, help, check=None, fixed=False, choices=None):
    """A config field with its one-line meaning (for --help), an optional value check, whether it is fixed
    for the life of a run (a resume that changes it is refused: the model's shape, the optimizer), and for a
    key with a set of values, `choices`: {value: its one-line meaning}, which --help lists under the key."""
    metadata = {"help": help, "check": check, "fixed": fixed, "choices": choices or {}}
    return dataclasses.field(default=default, metadata=metadata)


def positive(value):
    return None if value > 0 else "must be positive"


def non_empty(value):
    return None if value.strip() else "must not be empty"


def non_negative(value):
    return None if value >= 0 else "must be >= 0"


def fraction(value):
    """[0, 1): betas, dropout."""
    return None if 0.0 <= value < 1.0 else "must be in [0, 1)"


def betas(value):
    return None if all(0.0 <= b < 1.0 for b in value) else "must be in [0, 1)"


def device_check(*kinds):
    """The check of a device key: 'auto' or one of `kinds`, and 'cuda:N' where 'cuda' is one."""
    names = ["auto"] + [name for kind in kinds for name in ((kind, "cuda:N") if kind == "cuda" else (kind,))]

    def check(value):
        kind, _, index = value.partition(":")
        if value in ("auto", *kinds) or ("cuda" in kinds and kind == "cuda" and index.isdigit()):
            return None
        return f"is not one of: {', '.join(names)}"

    return check


# ---------------------------------------------------------------------------------------------------
# Parsing: config files and --key=value into any dataclass declared with key().


def _type_name(want):
    if typing.get_origin(want) is Literal:
        return "one of: " + ", ".join(map(str, typing.get_args(want)))
    names = {float: "float", int: "int", bool: "bool (True/False)", str: "str", bool | None: "bool or None"}
    names[tuple[float, float]] = "a pair of floats"
    return names[want]


def _checked(types_, name, value, source):
    """value converted to name's declared type, or ConfigError. bool is never taken for int or float."""
    want = types_[name]
    if typing.get_origin(want) is Literal:
        if value in typing.get_args(want) and isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(typing.get_args(want))}")
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
    raise ConfigError(f"{name} must be {_type_name(want)}, got {value!r} ({source})")


class _Schema:
    """The declared keys of one config class: their types, defaults and checks."""

    def __init__(self, cls):
        self.cls = cls
        self.fields = {f.name: f for f in dataclasses.fields(cls)}
        self.types = typing.get_type_hints(cls)
        self.aliases = getattr(cls, "KEY_ALIASES", {})  # {alias: the key it sets}

    def unknown(self, name, source):
        close = difflib.get_close_matches(name, list(self.fields), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return ConfigError(f"unknown config key '{name}' ({source}){hint}")

    def apply_file(self, values, path):
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
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except SystemExit as e:  # exit 0 with no run and no word would look like success
            raise ConfigError(
                f"{path} called sys.exit({e.code!r}) while it was read: a config file only assigns keys"
            ) from None
        except Exception as e:
            raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None
        before, given = dict(values), {}
        for name, value in namespace.items():
            if name.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
                continue  # imports and helpers the file binds
            if name in self.aliases:
                given[name] = value
                continue
            if name not in values:
                raise self.unknown(name, path)
            values[name] = _checked(self.types, name, value, path)
        self.apply_aliases(values, given, path, before)

    def apply_aliases(self, values, given, source, before):
        """The aliases one config file or override gave (`given`), each setting the key it stands for, from its
        value `before` that source. A source that sets a key and its aliases both is refused."""
        for key in dict.fromkeys(self.aliases[name] for name in given):
            mine = {name: value for name, value in given.items() if self.aliases[name] == key}
            if values[key] != before[key]:
                raise ConfigError(f"{source} sets {key} and {', '.join(mine)}, which name it too; set one of them")
            for name, value in mine.items():
                if not isinstance(value, str):
                    raise ConfigError(f"{name} must be str, got {value!r} ({source})")
            try:
                value = self.cls.resolve_aliases(key, values[key], mine)
            except ValueError as e:
                raise ConfigError(f"{e} ({source})") from None
            values[key] = _checked(self.types, key, value, source)

    def apply_override(self, values, arg):
        name, sep, text = arg[2:].partition("=")
        if not sep or not name:
            raise ConfigError(f"expected --key=value, got '{arg}'")
        if name in self.aliases:
            self.apply_aliases(values, {name: text}, f"--{name}", dict(values))
            return
        if name not in values:
            raise self.unknown(name, "command line")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = text
        if self.types[name] is str and not isinstance(value, str):
            value = text  # --wandb_run_name=2024 means the string '2024'
        values[name] = _checked(self.types, name, value, f"--{name}")

    def check(self, cfg):
        for name, f in self.fields.items():
            check = f.metadata.get("check")
            problem = check(getattr(cfg, name)) if check else None
            if problem:
                value = getattr(cfg, name)
                raise ConfigError(
                    f"{name}={value!r} {problem}" if problem.startswith("is ") else f"{name} {problem}, got {value!r}"
                )
        if hasattr(cfg, "validate"):
            cfg.validate()


def load_config(argv, cls):
    """cls from command-line arguments: config files (in order), then --key=value overrides."""
    schema = _Schema(cls)
    values = config_to_dict(cls())
    for arg in argv:
        if arg.startswith("--"):
            schema.apply_override(values, arg)
        elif arg.startswith("-"):
            raise ConfigError(f"expected a config file or --key=value, got '{arg}'")
        else:
            schema.apply_file(values, arg)
    cfg = cls(**values)
    schema.check(cfg)
    return cfg


def fixed_keys(cls):
    """The keys a resumed run must keep (declared with fixed=True)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("fixed")]


def current_keys(saved, cls):
    """A configuration saved as a dict (a checkpoint's, config.json) in cls's keys today: aliases it holds (a
    checkpoint written when the optimizer was named by optimizer_name and mars_type) turned into the key they
    stand for, when it lacks that key."""
    aliases = getattr(cls, "KEY_ALIASES", {})
    current = {name: value for name, value in saved.items() if name not in aliases}
    for key in dict.fromkeys(aliases[name] for name in saved if name in aliases):
        given = {name: value for name, value in saved.items() if aliases.get(name) == key}
        if key not in current:
            with contextlib.suppress(ValueError):  # a value no entry takes: the key stays absent
                current[key] = cls.resolve_aliases(key, getattr(cls(), key), given)
    return current


def config_to_dict(cfg):
    """Every key and value, in declaration order (for printing, wandb and checkpoints)."""
    return dataclasses.asdict(cfg)


def wants_help(argv):
    return any(arg in ("-h", "--help") for arg in argv)


def print_help(cls, usage, file=None):
    """Every key of cls with its type, default and meaning, in declaration order."""
    schema = _Schema(cls)
    lines = [f"usage: {usage}", "", inspect.cleandoc(cls.__doc__ or "").splitlines()[0], ""]
    defaults = config_to_dict(cls())
    for name, f in schema.fields.items():
        want = schema.types[name]
        kind = "str" if want is str else _type_name(want)
        lines.append(f"  --{name}={defaults[name]!r}  [{kind}]")
        lines.append(f"      {f.metadata.get('help', '')}")
        choices = f.metadata.get("choices", {})
        width = max(map(len, choices), default=0)
        lines += [f"        {value:<{width}}  {meaning}" for value, meaning in choices.items()]
    print_lines(lines, file or sys.stdout)


def print_lines(lines, out):
    """Print lines to `out`; a reader that has gone (`| head`) ends the output quietly, not in a traceback."""
    try:
        print("\n".join(lines), file=out, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
