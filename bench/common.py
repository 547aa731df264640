"""Shared by every benchmark: a row format, a timer and the one table they all print.

Each bench/bench_*.py module exposes ``run(quick=False) -> list[dict]``; a row has the keys
``benchmark`` (what was measured), ``ours`` and ``reference`` (numbers in ``unit``), ``ratio``
(ours / reference, or None), ``target`` (the goal the issue sets, as text), ``note`` and, for
memory-bound steps, ``bandwidth`` (text; the table shows that column only when a row has it).
"""

import argparse
import contextlib
import time

import torch


def row(benchmark, ours, reference=None, unit="", ratio=None, target="", note="", bandwidth=None):
    if ratio is None and reference:
        ratio = ours / reference
    return dict(
        benchmark=benchmark,
        ours=ours,
        reference=reference,
        unit=unit,
        ratio=ratio,
        target=target,
        note=note,
        bandwidth=bandwidth,
    )


def time_it(fn, warmup=2, repeats=5):
    """Median wall-clock seconds of fn() over `repeats` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _fmt(x):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def print_table(rows):
    cols = ["benchmark", "ours", "reference", "unit", "ratio", "target"]
    cols += ["bandwidth"] * any(r.get("bandwidth") for r in rows) + ["note"]
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(line, widths)))


def quick_flag(doc, argv=None):
    """The command line of a benchmark with one option, --quick (and --help: doc, the module's docstring)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    return p.parse_args(argv).quick


@contextlib.contextmanager
def rendezvous():
    """The environment for the ranks of a process group this process starts: MASTER_ADDR and MASTER_PORT of a
    c10d store hosted here, on the port the OS gave it as it bound it, and TORCHELASTIC_USE_AGENT_STORE, which
    makes every rank's env:// rendezvous a client of that store, as under torchrun's agent. (A port found
    free and handed to rank 0 to bind can be taken by another process in between.)"""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    finally:
        del store
