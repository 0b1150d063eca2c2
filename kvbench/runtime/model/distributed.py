"""torch.distributed for kvbench: the process group a `torchrun` launch gives, split into tensor-parallel groups
and data-parallel ranks.

    torchrun --nproc-per-node 2 -m kvbench runtime.tensor_parallel=2 ...   # one model sharded over 2 ranks
    torchrun --nproc-per-node 2 -m kvbench ...                             # the task's samples split over 2 ranks

    layout = init_from_env(tensor_parallel=2)   # None outside torchrun (WORLD_SIZE unset or 1 and tp 1)
    layout.tp_rank, layout.tp_size, layout.tp_group   # the ranks one model is sharded over (consecutive ranks)
    layout.dp_rank, layout.dp_size                    # which share of the samples this rank's model evaluates
    mine = shard(items, layout)                       # this data-parallel rank's items (i, item), in order
    every = gather_in_order(results, layout)          # every rank's results, back in the items' order

The backend is NCCL when CUDA is available and gloo otherwise (tests run gloo on CPU). The world is
tensor_parallel x data_parallel ranks: ranks r*tp .. r*tp+tp-1 form data-parallel rank r's tensor-parallel group.
Results travel as Python objects (all_gather_object) among ranks; gathers are collective: every rank calls them
in the same order. A rank that dies makes the others' next collective fail (gloo: the peer's closed connection;
torchrun also stops the remaining workers), so a run is recorded failed, never half written.
"""
from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

TIMEOUT_ENV = "KVBENCH_DIST_TIMEOUT_S"  # seconds a collective may wait for a peer (default 600)


@dataclass
class Layout:
    """Where this process sits in the world: its tensor-parallel group and its data-parallel rank."""

    rank: int
    world_size: int
    tp_size: int = 1
    tp_group: Any = field(default=None, repr=False)  # a torch.distributed ProcessGroup (None when tp_size is 1)
    device: Optional[str] = None  # "cuda:<local rank>" under NCCL, else None (the config's device)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the run folder; every other rank computes and sends its results to it."""
        return self.rank == 0


def export_submitit_tasks() -> None:
    """Inside a submitit job of several tasks (Hydra's submitit_slurm or submitit_local launcher with
    hydra.launcher.tasks_per_node=N) and not under torchrun: set torchrun's variables (MASTER_ADDR, MASTER_PORT,
    RANK, WORLD_SIZE, LOCAL_RANK) from the job's, as submitit's TorchDistributedEnvironment gives them, so the
    job's tasks form one launch (one run over N data-parallel ranks). Nothing elsewhere."""
    if "WORLD_SIZE" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") not in ("slurm", "local"):
        return
    try:
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment()
    except (ImportError, KeyError, RuntimeError):  # not a submitit task after all
        return
    if env.world_size > 1:
        env.export(set_cuda_visible_devices=False)


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it, or as a submitit job of several tasks gives it (export_submitit_tasks);
    1 outside a launch."""
    export_submitit_tasks()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


_layout: Optional[Layout] = None


def current() -> Optional[Layout]:
    """The layout init_from_env made in this process, or None (a single process)."""
    return _layout


def init_from_env(tensor_parallel: int = 1) -> Optional[Layout]:
    """Join the process group torchrun describes (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and build
    the tensor-parallel groups; None for a single process with tensor_parallel 1. Called once per process (a sweep's
    later runs reuse the groups when tensor_parallel is the same; ValueError when it changes within a process)."""
    global _layout
    world = env_world_size()
    if world == 1 and tensor_parallel == 1:
        return None
    if tensor_parallel < 1 or world % tensor_parallel:
        raise ValueError(f"runtime.tensor_parallel={tensor_parallel} does not divide the world size {world}")
    if _layout is not None:
        if _layout.tp_size != tensor_parallel:
            raise ValueError(f"runtime.tensor_parallel={tensor_parallel} in a process whose groups were made for "
                             f"{_layout.tp_size}: one value per torchrun launch")
        return _layout
    import torch.distributed as dist

    device = None
    if not dist.is_initialized():
        timeout = _dt.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "600")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        dist.init_process_group(backend, timeout=timeout)
    elif torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    rank, world = dist.get_rank(), dist.get_world_size()
    group = None
    if tensor_parallel > 1:
        for start in range(0, world, tensor_parallel):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(start, start + tensor_parallel)))
            if start <= rank < start + tensor_parallel:
                group = g
    _layout = Layout(rank, world, tensor_parallel, group, device)
    return _layout


def shard(items: Sequence[Any], layout: Optional[Layout] = None) -> list[tuple[int, Any]]:
    """(index, item) of this data-parallel rank's share: items i with i % dp_size == dp_rank (round robin, so
    samples of similar length spread over ranks). Every item with no layout or one data-parallel rank."""
    layout = layout if layout is not None else _layout
    if layout is None or layout.dp_size == 1:
        return list(enumerate(items))
    return [(i, x) for i, x in enumerate(items) if i % layout.dp_size == layout.dp_rank]


def gather_in_order(results: Sequence[tuple[int, Any]], layout: Optional[Layout] = None) -> list[Any]:
    """Every data-parallel rank's (index, result) pairs, merged into one list in index order, on every rank (the
    tensor-parallel ranks of one group hold the same results; the first of each group's is taken)."""
    layout = layout if layout is not None else _layout
    if layout is None or layout.dp_size == 1:
        return [r for _, r in sorted(results, key=lambda p: p[0])]
    parts = all_gather_objects(list(results))
    merged: dict[int, Any] = {}
    for rank, part in enumerate(parts):
        if rank % layout.tp_size == 0:
            merged.update(dict(part))
    return [merged[i] for i in sorted(merged)]


def gather_over_data_parallel(obj: Any, layout: Optional[Layout] = None) -> list[Any]:
    """obj of every data-parallel rank, by data-parallel rank, on every rank (a collective; the tensor-parallel
    ranks of one group hold the same obj, the first of each group's is taken); [obj] in a single process."""
    layout = layout if layout is not None else _layout
    if layout is None:
        return [obj]
    parts = all_gather_objects(obj)
    return [parts[g * layout.tp_size] for g in range(layout.dp_size)]


def barrier() -> None:
    """Wait for every rank of the world (a collective; nothing in a single process)."""
    if _layout is None:
        return
    import torch.distributed as dist

    dist.barrier()


def all_gather_objects(obj: Any) -> list[Any]:
    """obj of every rank of the world, by rank (a collective; [obj] in a single process)."""
    if _layout is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * _layout.world_size
    dist.all_gather_object(out, obj)
    return out


def sum_over_data_parallel(values: Sequence[float], layout: Optional[Layout] = None) -> list[float]:
    """Per-rank sums (of counts or figures over a rank's samples) summed over the data-parallel groups, each
    group's value the mean over its tensor-parallel ranks (each holds a share of the kv-heads: a per-rank mean
    over its heads averages into the mean over all heads). A collective; the values themselves in one process."""
    layout = layout if layout is not None else _layout
    if layout is None:
        return list(values)
    every = all_gather_objects([float(v) for v in values])
    tp = layout.tp_size
    out = [0.0] * len(values)
    for g in range(layout.dp_size):
        group = every[g * tp:(g + 1) * tp]
        for j in range(len(values)):
            out[j] += sum(r[j] for r in group) / tp
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's obj on every rank (a collective; obj itself in a single process)."""
    if _layout is None:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def destroy() -> None:
    """Leave the process group (at the end of a launch)."""
    global _layout
    if _layout is None:
        return
    import torch.distributed as dist

    _layout = None
    if dist.is_initialized():
        dist.destroy_process_group()
