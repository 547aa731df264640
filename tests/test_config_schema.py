"""marsgpt/config_schema.py on a configuration of another tool's: any dataclass declared with key() is parsed, checked
and listed by --help. train.py's own configuration: tests/test_config.py."""

import dataclasses
import io
from typing import Literal

import pytest

from marsgpt.config_schema import ConfigError, key, load_config, positive, print_help


def test_any_dataclass_declared_with_key_parses_and_checks(tmp_path):
    @dataclasses.dataclass
    class Small:
        """A config of another tool."""

        epochs: int = key(3, "passes over the data", positive)
        mode: Literal["a", "b"] = key("a", "which mode")

    assert load_config(["--epochs=5", "--mode=b"], Small) == Small(5, "b")
    with pytest.raises(ConfigError, match="epochs must be positive, got 0"):
        load_config(["--epochs=0"], Small)
    with pytest.raises(ConfigError, match=r"mode='c' is not one of: a, b"):
        load_config(["--mode=c"], Small)
    with pytest.raises(ConfigError, match="unknown config key 'epoch'"):
        load_config(["--epoch=1"], Small)


def test_help_lists_a_key_s_choices_with_their_meaning():
    @dataclasses.dataclass
    class Small:
        """A config of another tool."""

        mode: Literal["a", "bb"] = key("a", "which mode", choices={"a": "the first", "bb": "the second"})

    out = io.StringIO()
    print_help(Small, usage="tool", file=out)
    assert "  --mode='a'  [one of: a, bb]\n      which mode\n        a   the first\n        bb  the second\n" in (
        out.getvalue()
    )
