"""CPU threads on a busy machine: ms per step of the quickstart's model (config/quickstart.py) with torch's
default threads, with one thread, and with train.py's own choice (no OMP_NUM_THREADS: marsgpt/runtime.py's
choose_cpu_threads), while other work keeps every CPU busy.

    python -m bench.bench_threads            # 3 rounds of 100 steps (tens of minutes: torch's default crawls)
    python -m bench.bench_threads --quick    # 1 round of 60 steps

The other work is made here, so that the measurement does not depend on what else the machine runs: one
process spinning per CPU this process may use, started before the rounds and ended after them. Each
configuration is a `python train.py config/quickstart.py ...` process; the rounds take the three in turn and
each configuration reports its median round's ms/step over the steps after the first train line (started,
warm). Target: train.py's choice no slower than one thread, and faster than torch's default.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from bench.common import print_table, row
from marsgpt.runtime import usable_cpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_ms(threads, steps, out_dir):
    """ms/step of the last train line of a quickstart run of `steps` steps; threads None: OMP_NUM_THREADS unset."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    args = [f"--max_iters={steps}", f"--log_interval={steps // 2}", "--eval_iters=1", f"--out_dir={out_dir}"]
    args += ["--init_from=scratch", "--overwrite=True", "--device=cpu"]
    done = subprocess.run(
        [sys.executable, "train.py", "config/quickstart.py", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1])
    last = [line for line in done.stdout.splitlines() if line.startswith(f"iter {steps}:")][0]
    return float(re.search(r"([\d.]+) ms/step", last).group(1))


def run(quick=False):
    rounds, steps = (1, 60) if quick else (3, 100)
    subprocess.run([sys.executable, "-m", "data.stdlib_char.prepare"], cwd=REPO, check=True, capture_output=True)
    default = int(
        subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    configurations = {f"torch's default ({default} threads)": default, "1 thread": 1, "train.py's choice": None}
    times = {name: [] for name in configurations}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cpus()[1])]
    try:
        with tempfile.TemporaryDirectory() as directory:
            for _ in range(rounds):
                for name, threads in configurations.items():
                    times[name].append(step_ms(threads, steps, os.path.join(directory, "out")))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    median = {name: statistics.median(values) for name, values in times.items()}
    note = f"{len(spinners)} spinning processes keep every CPU busy; median of {rounds} round(s) of {steps} steps"
    reference = median[f"torch's default ({default} threads)"]
    return [
        row(
            f"quickstart step on a busy machine, {name}",
            ms,
            reference,
            "ms/step",
            target="< torch's default",
            note=note,
        )
        for name, ms in median.items()
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round of 60 steps")
    args = p.parse_args(argv)
    print_table(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
