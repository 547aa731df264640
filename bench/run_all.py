"""Every benchmark in one command, one table: the numbers the README quotes come from here.

    python -m bench.run_all            # full sizes (tens of minutes on a 2-core CPU)
    python -m bench.run_all --quick    # smaller shapes and fewer repeats, a few minutes
    python -m bench.run_all --only mars train

Runs run(quick=...) of each bench/bench_*.py (optimizer step vs AdamW, model and train-step tokens/s vs
the reference loop, data preparation tokens/s, the FSDP2 step). A benchmark that fails to import or run becomes a row
saying so; the others still run.
"""

import argparse
import glob
import importlib
import os
import sys
import time

from bench.common import print_table, row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPECTED = ("mars", "model", "train", "data", "fsdp")  # the issues ask for these; run order follows this list


def available():
    """Names (without bench_) of the benchmark modules present, expected ones first."""
    found = {
        os.path.basename(p)[len("bench_") : -len(".py")] for p in glob.glob(os.path.join(REPO, "bench", "bench_*.py"))
    }
    return [n for n in EXPECTED if n in found] + sorted(found - set(EXPECTED))


def run_one(name, quick):
    """The module's rows, or one row saying why there are none."""
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"bench.bench_{name}")
        rows = list(module.run(quick=quick))
    except Exception as e:  # one broken benchmark must not hide the others' numbers
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return [row(f"bench_{name}", None, note=f"failed: {type(e).__name__}: {message}")]
    print(f"bench_{name}: {len(rows)} rows in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="Run every bench/bench_*.py and print one table.")
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these (mars, model, train, data, ...)")
    args = p.parse_args(argv)
    names = available()
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"error: no benchmark {', '.join(unknown)}; available: {', '.join(names)}", file=sys.stderr)
            return 2
        names = [n for n in names if n in args.only]
    missing = [n for n in EXPECTED if n not in available()]
    if missing:
        print(f"missing benchmarks (not written yet): {', '.join('bench_' + n for n in missing)}", file=sys.stderr)
    rows = [r for name in names for r in run_one(name, args.quick)]
    print_table(rows)
    return 1 if any(str(r["note"]).startswith("failed:") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
