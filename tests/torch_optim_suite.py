"""Run torch's own generic optimizer tests (TestOptimRenewed in a torch checkout's test/test_optim.py) on every
MARS variant, and count the results per variant.

    python -m tests.torch_optim_suite /path/to/pytorch/test/test_optim.py [-k PATTERN]

torch ships the machinery (torch.testing._internal.common_optimizers: OptimizerInfo, @optims) but not the test
file, so this takes the path of one (use the file of the torch version installed). The file's optimizer
database is replaced by tests/mars_optim_infos.py's MARS_OPTIM_DB before it is loaded, so every test runs on the
MARS variants only; the test classes it imports from its own folder (learning-rate schedulers, SWA, the
differentiable optimizers: none of them about a generic optimizer) are stood in by empty ones. Expected
failures are the torch conventions that do not fit MARS, each named with its reason in MARS_OPTIM_DB.
tests/test_mars_protocol.py holds MARS to the same protocol in this repository's CI, with checks written here.
"""

import argparse
import collections
import importlib.util
import os
import sys
import types
import unittest

VARIANTS = ("MARS_AdamW", "MARS_Lion", "MARS_Shampoo", "MARS_M", "MARS_exact")


def install_stand_ins():
    """Empty test classes under the names test_optim.py imports from its folder (optim/test_*.py)."""
    package = types.ModuleType("optim")
    package.__path__ = []
    sys.modules["optim"] = package
    for module, name in (
        ("test_lrscheduler", "TestLRScheduler"),
        ("test_optim", "TestDifferentiableOptimizer"),
        ("test_swa_utils", "TestSWAUtils"),
    ):
        stand_in = types.ModuleType(f"optim.{module}")
        setattr(stand_in, name, type(name, (unittest.TestCase,), {}))
        sys.modules[f"optim.{module}"] = stand_in


def load_torch_tests(path):
    """test_optim.py loaded with MARS_OPTIM_DB as its optim_db; returns its module."""
    from torch.testing._internal import common_optimizers

    from tests.mars_optim_infos import MARS_OPTIM_DB

    common_optimizers.optim_db = MARS_OPTIM_DB
    install_stand_ins()
    spec = importlib.util.spec_from_file_location("torch_test_optim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CountingResult(unittest.TextTestResult):
    """A text result that also tallies each outcome per MARS variant (from the test's name)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tally = collections.defaultdict(collections.Counter)

    def _count(self, test, outcome):
        name = test.id().rsplit(".", 1)[-1]
        variant = next((v for v in VARIANTS if f"_{v}_" in name), "other")
        self.tally[variant][outcome] += 1

    def addSuccess(self, test):
        super().addSuccess(test)
        self._count(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._count(test, "failed")

    def addError(self, test, err):
        super().addError(test, err)
        self._count(test, "errors")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._count(test, "skipped")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._count(test, "expected failures")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._count(test, "unexpected successes")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_optim", help="path of test/test_optim.py in a torch checkout")
    parser.add_argument("-k", dest="pattern", default=None, help="run only tests whose name contains this")
    parser.add_argument("-v", dest="verbosity", action="store_const", const=2, default=1, help="one line a test")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.test_optim):
        parser.error(f"{args.test_optim}: no such file (pass the path of test/test_optim.py in a torch checkout)")
    sys.argv = sys.argv[:1]  # torch's test utilities parse the command line when imported
    module = load_torch_tests(args.test_optim)
    loader = unittest.TestLoader()
    if args.pattern:
        loader.testNamePatterns = [f"*{args.pattern}*"]
    suite = loader.loadTestsFromTestCase(module.TestOptimRenewedCPU)
    result = unittest.TextTestRunner(verbosity=args.verbosity, resultclass=CountingResult).run(suite)
    outcomes = ("passed", "failed", "errors", "skipped", "expected failures", "unexpected successes")
    print(f"\n{'variant':<14}" + "".join(f"{o:>22}" for o in outcomes) + f"{'total':>8}")
    for variant, tally in sorted(result.tally.items()):
        print(f"{variant:<14}" + "".join(f"{tally[o]:>22}" for o in outcomes) + f"{sum(tally.values()):>8}")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
