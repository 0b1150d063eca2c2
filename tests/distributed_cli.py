"""`python -m kvbench` for a torchrun launch in tests, with one rank killed on request.

    torchrun --nproc-per-node 2 -m tests.distributed_cli [--kill-rank=R] HYDRA_ARGS

--kill-rank  rank R sends itself SIGKILL once its model and engine are loaded, before the task (as a node or an
             out-of-memory killer would), so the test sees what the other ranks and the results store do.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys

from kvbench.store import faults


def main() -> None:
    args = sys.argv[1:]
    if args and args[0].startswith("--kill-rank="):
        rank = args.pop(0).split("=", 1)[1]
        if os.environ.get("RANK") == rank:
            faults.install("before_task", lambda: os.kill(os.getpid(), signal.SIGKILL))
    sys.argv[1:] = args
    runpy.run_module("kvbench", run_name="__main__", alter_sys=True)  # as `python -m kvbench`


if __name__ == "__main__":
    main()
