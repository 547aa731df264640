"""The command line of vision/'s scripts: a mistake is one line `error: ...` on stderr and exit status 2,
as train.py and vision/train_cifar.py report one (argparse's own prints the usage first)."""

import argparse
import sys


class UsageError(Exception):
    """Bad input found after parsing: main prints it as one error line and exits with status 2."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)
