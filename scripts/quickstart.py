"""The quickstart as one process: prepare the stdlib_char corpus, train config/quickstart.py (--init_from=auto,
then the arguments given), sample from the run. scripts/quickstart.sh execs it, so a signal sent to the script's
pid -- a scheduler's, `kill`, Ctrl-C -- reaches the training itself: it stops with a checkpoint (SIGTERM) or at
once (Ctrl-C) and the same command continues it; nothing goes on training behind a script that is gone.

    python -m scripts.quickstart [--key=value ...]     # what bash scripts/quickstart.sh runs
"""

import sys

import sample
import train
from data.prepare_common import run_prepare
from data.stdlib_char import prepare
from marsgpt.stop_signals import StopSignals

CONFIG = "config/quickstart.py"
OUT_DIR = "out-quickstart"  # CONFIG's; an --out_dir among the arguments is where the sample is read
SAMPLE = ["--start=def ", "--num_samples=1", "--max_new_tokens=400"]  # sample.py's arguments


def main(argv):
    out_dir = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--out_dir=")), OUT_DIR)
    signals = StopSignals().install()  # from now on: a stop before training starts waits for it to start
    try:
        run_prepare(lambda: prepare.main([]))
    except KeyboardInterrupt:
        print("interrupted while preparing the corpus; run the same command again", file=sys.stderr)
        return 130
    status = train.main([CONFIG, "--init_from=auto", *argv], signals)
    if status or signals.received or signals.interrupted:  # stopped: the sample waits for the finished run
        signals.ignore_from_now()
        return status
    return sample.main([f"--out_dir={out_dir}", *SAMPLE])


if __name__ == "__main__":
    train.exit_process(main(sys.argv[1:]))
