"""`kvbench-torchrun`: torchrun for kvbench, with bad input refused before any worker starts.

    kvbench-torchrun --nproc-per-node 2 runtime.tensor_parallel=2 method=snapkv budget=1024
    = torchrun --nproc-per-node 2 -m kvbench runtime.tensor_parallel=2 method=snapkv budget=1024

torchrun turns any worker's non-zero exit into its own ChildFailedError traceback and exit code 1, so under a plain
`torchrun -m kvbench` a typo ends in a screen of traceback. Here the config (every job of a sweep) is first checked
in one process, exactly as `python -m kvbench` checks it before its model loads, with WORLD_SIZE set to the launch's
size (so tensor-parallel sizes are checked against it): bad input is one line and exit 2 and no worker starts.
Arguments before the first kvbench override (`key=value`, `-m`) are torchrun's; the rest are kvbench's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import NoReturn, Optional

CHECK_ONLY_ENV = "KVBENCH_CHECK_ONLY"  # set: `python -m kvbench` checks each config and runs nothing
MULTIRUN_FLAGS = ("-m", "--multirun")


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, kvbench's): kvbench's start at the first override (`key=value` not starting with
    `-`) or multirun flag; a `--` ends torchrun's explicitly."""
    for i, arg in enumerate(args):
        if arg == "--":
            return args[:i], args[i + 1:]
        if arg in MULTIRUN_FLAGS or ("=" in arg and not arg.startswith("-")):
            return args[:i], args[i:]
    return list(args), []


def _option(torchrun_args: list[str], *names: str) -> Optional[str]:
    """The value of a torchrun option given as `--name value` or `--name=value` (either spelling of `-`/`_`)."""
    spellings = {n for name in names for n in (name, name.replace("-", "_"))}
    for i, arg in enumerate(torchrun_args):
        key, eq, value = arg.partition("=")
        if key in spellings:
            if eq:
                return value
            return torchrun_args[i + 1] if i + 1 < len(torchrun_args) else None
    return None


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's --nproc-per-node words (torch.distributed.run)


def check_torchrun_args(torchrun_args: list[str]) -> Optional[str]:
    """Why torchrun would refuse its arguments with a traceback (--nproc-per-node not a count >= 1 or one of its
    words, --nnodes not N or MIN:MAX with 1 <= MIN <= MAX), as one line; None when they are fine."""
    for names in (("--nproc-per-node", "--nproc_per_node"), ("--nnodes",)):
        given = any(a.partition("=")[0] in {n for name in names for n in (name, name.replace("-", "_"))}
                    for a in torchrun_args)
        if given and _option(torchrun_args, *names) in (None, ""):
            return f"{names[0]} needs a value"
    nproc = _option(torchrun_args, "--nproc-per-node", "--nproc_per_node")
    if nproc is not None and not (nproc in NPROC_WORDS or (nproc.isdigit() and int(nproc) >= 1)):
        return (f"invalid --nproc-per-node {nproc!r}: expected an integer >= 1 or one of {', '.join(NPROC_WORDS)}")
    nnodes = _option(torchrun_args, "--nnodes")
    if nnodes is not None:
        parts = nnodes.split(":")
        ok = len(parts) in (1, 2) and all(p.isdigit() and int(p) >= 1 for p in parts) and \
            int(parts[0]) <= int(parts[-1])
        if not ok:
            return f"invalid --nnodes {nnodes!r}: expected N or MIN:MAX (integers, 1 <= MIN <= MAX)"
    return None


def launch_world_size(torchrun_args: list[str]) -> int:
    """The processes the launch starts: nproc-per-node (a number, or gpu / cpu / auto as torchrun reads them) times
    the nodes (the least of a `min:max` range)."""
    nproc = _option(torchrun_args, "--nproc-per-node", "--nproc_per_node") or "1"
    if nproc.isdigit():
        per_node = int(nproc)
    else:
        import torch

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        per_node = {"gpu": cuda, "cpu": os.cpu_count() or 1}.get(nproc, cuda or os.cpu_count() or 1)
    nodes = (_option(torchrun_args, "--nnodes") or "1").split(":")[0]
    return max(1, per_node) * (int(nodes) if nodes.isdigit() else 1)


def check_launch(kvbench_args: list[str], world_size: int) -> int:
    """Run `python -m kvbench ARGS` in check-only mode (every job's config checked, nothing run, nothing written
    outside a scratch folder); its exit code (2 and its one line on stderr for bad input)."""
    scratch = tempfile.mkdtemp(prefix="kvbench-check-")
    env = {**os.environ, CHECK_ONLY_ENV: "1", "WORLD_SIZE": str(world_size)}
    for var in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    try:
        return subprocess.call([sys.executable, "-m", "kvbench", *kvbench_args, f"hydra.run.dir={scratch}/run",
                                f"hydra.sweep.dir={scratch}/sweep", "hydra.output_subdir=null"], env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def torchrun_argv(torchrun_args: list[str], kvbench_args: list[str]) -> list[str]:
    """The torchrun command line that runs kvbench on every worker."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "kvbench", *kvbench_args]


def main(argv: Optional[list[str]] = None) -> NoReturn:
    """Entry point of `kvbench-torchrun`."""
    torchrun_args, kvbench_args = split_args(list(sys.argv[1:] if argv is None else argv))
    bad = check_torchrun_args(torchrun_args)
    if bad is not None:  # torchrun would end in its own traceback: one line, exit 2, nothing started
        print(f"kvbench-torchrun: error: {bad}", file=sys.stderr)
        raise SystemExit(2)
    code = check_launch(kvbench_args, launch_world_size(torchrun_args))
    if code != 0:
        raise SystemExit(code)
    command = torchrun_argv(torchrun_args, kvbench_args)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
