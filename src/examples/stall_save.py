r"""Run a lab with rank 0 made to wait, forever, at one point of one checkpoint save.

    python src/examples/stall_save.py --stall before-rename --save 2 --marker M \
        src/labs/lab2_ddp.py --checkpoint-every 2 ...

Rank 0 writes its process id to MARKER once it waits; the caller then kills it for real
(``distlab.chapters.fault_tolerance.kill_when_stalled``). Nothing in the labs knows
about this: the wait is patched in from outside (``stall_on``), then the lab runs as
``python lab.py`` would.
"""

import argparse
import os
import runpy
import sys
from pathlib import Path

from distlab.chapters.fault_tolerance import STALLS, stall_on


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="stall_save.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--stall", required=True, choices=sorted(STALLS), help="where rank 0 waits"
    )
    parser.add_argument(
        "--save", type=int, required=True, help="in which save (1: the first)"
    )
    parser.add_argument(
        "--marker",
        type=Path,
        required=True,
        help="rank 0 writes its pid here once waiting",
    )
    parser.add_argument("script", help="the lab to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the lab's own options")
    opts = parser.parse_args()
    if int(os.environ.get("RANK", "0")) == 0:
        stall_on(opts.save, opts.stall, opts.marker)
    sys.argv = [opts.script, *opts.args]
    # as `python lab.py` has it
    sys.path.insert(0, str(Path(opts.script).resolve().parent))
    runpy.run_path(opts.script, run_name="__main__")


if __name__ == "__main__":
    main()
