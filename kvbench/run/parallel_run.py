"""One run over several processes (a `torchrun` launch): which rank does what, and the run's figures over ranks.

    torchrun --nproc-per-node 2 -m kvbench runtime.tensor_parallel=2 ...   # tensor parallel: one sharded model
    torchrun --nproc-per-node 2 -m kvbench ...                             # data parallel: the samples split

- Every rank validates the config (plan_run) and joins the process group (`join_launch`); rank 0 alone opens,
  claims and writes the run folder and tells the others whether the run goes ahead (`writer_decides`).
- Every rank loads the model (a tensor-parallel rank keeps its shard: `shard_loaded`) and runs the task. Tasks
  split their samples over data-parallel ranks and gather the per-sample results in sample order
  (kvbench.runtime.model.distributed.shard / gather_in_order, in tasks/_generation.py and tasks/perplexity.py), so every
  rank scores every sample and the metrics are those of one process over the same samples.
- `merge_rank_figures` (a collective) puts each rank's measured figures into rank 0's record: `<figure>_rank<r>`
  for every rank, and the run's figure: KV bytes summed over a tensor-parallel group (each rank's pool holds its
  kv-heads) and the largest over data-parallel groups (the memory one model replica needs); tokens per second
  summed over data-parallel groups (they run at once); ttft_s the mean over every sample.
A rank that fails or is killed fails the others' next collective (torchrun also stops them), so rank 0 records the
run as failed (a rerun redoes it) or, killed itself, leaves the claim that the next attempt takes over.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from kvbench.errors import UserError
from kvbench.runtime.model import distributed
from kvbench.runtime.model.distributed import Layout
from kvbench.runtime.model.tensor_parallel import shard_model

KV_FIGURES = ("peak_kv_bytes", "full_kv_bytes", "held_kv_bytes", "fork_shared_kv_bytes", "kv_pool_bytes",
              "kv_bytes_per_token")  # per rank: summed over a tensor-parallel group, max over data-parallel ones
RATE_FIGURES = ("prefill_tokens_per_s", "decode_tokens_per_s")  # per rank: summed over data-parallel groups


def join_launch(settings: Any) -> Optional[Layout]:
    """The process group of a torchrun launch (None for one process with runtime.tensor_parallel=1)."""
    try:
        return distributed.init_from_env(settings.runtime.tensor_parallel)
    except ValueError as exc:
        raise UserError(f"invalid runtime.tensor_parallel: {exc}") from None


def writer_decides(layout: Optional[Layout], decision: Optional[str] = None) -> Optional[str]:
    """Rank 0's decision ("run" or "skip") on every rank (a collective; the decision itself in one process)."""
    if layout is None:
        return decision
    return distributed.broadcast_object(decision if layout.is_writer else None)


def rank_device(layout: Optional[Layout], device: str) -> str:
    """The device a rank computes on: its own GPU under NCCL (cuda:<local rank>), else the config's device."""
    if layout is not None and layout.device is not None and device.startswith("cuda"):
        return layout.device
    return device


def load_device(layout: Optional[Layout], device: str) -> str:
    """Where a rank loads the checkpoint: host memory under tensor parallel (only the shard goes to the device,
    shard_loaded), else rank_device."""
    if layout is not None and layout.tp_size > 1:
        return "cpu"
    return rank_device(layout, device)


def shard_loaded(loaded: Any, layout: Optional[Layout], device: str) -> Any:
    """`loaded` (kvbench.runtime.model.loading.LoadedModel) with its model replaced by this rank's tensor-parallel shard
    on its device (a copy: the loaded full model stays cached, in host memory, for the next run); `loaded` itself
    without tensor parallelism."""
    if layout is None or layout.tp_size == 1:
        return loaded
    out = copy.copy(loaded)
    target = rank_device(layout, device)
    try:
        out.model = shard_model(loaded.model, layout.tp_rank, layout.tp_size, layout.tp_group, device=target)
        out.device = out.model.device
    except ValueError as exc:
        raise UserError(f"invalid runtime.tensor_parallel={layout.tp_size}: {exc}") from None
    return out


def merge_rank_figures(record: dict, perf: dict, num_samples: int, layout: Optional[Layout]) -> None:
    """Gather every rank's measured figures (from its own record and perf) and write the run's figures and each
    rank's into `record` (see the module docstring). A collective: every rank calls it once per run."""
    if layout is None:
        return
    mine = {k: record.get(k) for k in KV_FIGURES + ("max_sequence_tokens",)}
    mine.update({k: perf.get(k, record.get(k)) for k in RATE_FIGURES + ("ttft_s",)})
    mine["num_samples"] = perf.get("samples_computed", num_samples)  # this rank's share (tasks/_generation.py)
    every = distributed.all_gather_objects(mine)
    tp = layout.tp_size
    groups = [every[g * tp:(g + 1) * tp] for g in range(layout.dp_size)]  # data-parallel groups of tp ranks
    for key in KV_FIGURES:
        if any(r.get(key) is None for r in every):
            continue
        record[key] = max(sum(r[key] for r in group) for group in groups)
        for rank, r in enumerate(every):
            record[f"{key}_rank{rank}"] = r[key]
    longest = [r.get("max_sequence_tokens") for r in every if r.get("max_sequence_tokens") is not None]
    if longest:
        record["max_sequence_tokens"] = max(longest)
    leaders = [group[0] for group in groups]  # a tensor-parallel group computes one result: its rank 0's figures
    for key in RATE_FIGURES:
        rates = [r.get(key) for r in leaders]
        record[key] = sum(rates) if all(v is not None for v in rates) else None
        for rank, r in enumerate(every):
            record[f"{key}_rank{rank}"] = r.get(key)
    timed = [(r["ttft_s"], r["num_samples"]) for r in leaders if r.get("ttft_s") is not None and r["num_samples"]]
    if timed:
        record["ttft_s"] = sum(t * n for t, n in timed) / sum(n for _, n in timed)
    for rank, r in enumerate(every):  # the samples each rank computed (its share of the task)
        record[f"num_samples_rank{rank}"] = r["num_samples"]
    record["world_size"] = layout.world_size
    record["data_parallel"] = layout.dp_size
    record["tensor_parallel"] = layout.tp_size
