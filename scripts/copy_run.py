"""Copy a run directory (out_dir) so that the copy resumes, also while a run trains in it:

    python -m scripts.copy_run out/ backup/out/

The copy holds every checkpoint file (ckpt.pt, best.pt, the kept ckpt_<iter>.pt), the shard directory each one
names (zero_stage=3), metrics.jsonl, checkpoints.jsonl and config.json; not run.lock, nor the temporary files of
a save in flight (marsgpt/run_dir.py, copy_run). `python train.py ... --out_dir=backup/out --init_from=auto` then
resumes the copy's newest checkpoint. A plain `cp -r` or rsync of a live run that writes one-file checkpoints
resumes too (a checkpoint file is only ever replaced whole, and the copy's run.lock is recognised as the
original's and taken over), but a sharded checkpoint is a file and a directory, which a plain copy may take
from two different saves: copy a live zero_stage=3 run with this command.
"""

import argparse
import sys

from marsgpt.files import os_reason
from marsgpt.run_dir import RunDirError, copy_run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the run directory to copy (a training run's out_dir)")
    parser.add_argument("destination", help="the new directory to copy it into (must not exist)")
    args = parser.parse_args(argv)
    try:
        copied = copy_run(args.source, args.destination)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot copy {args.source} to {args.destination}: {os_reason(e)}", file=sys.stderr)
        return 2
    print(f"copied {args.source} to {args.destination}: {', '.join(copied) or 'no checkpoint'} and the records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
