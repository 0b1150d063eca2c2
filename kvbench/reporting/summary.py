"""The one-screen summary printed at the end of each run."""
from __future__ import annotations

import re
import textwrap
from typing import Any, Optional

from kvbench.reporting.runs import sort_value
from kvbench.reporting.stats import primary_metric

_WIDTH = 78


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1e5 or (0 < abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4g}" if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _bytes(v: Any) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    x, i = float(v), 0
    while abs(x) >= 1024 and i < len(units) - 1:
        x, i = x / 1024, i + 1
    return f"{x:.1f} {units[i]}" if i else f"{int(x)} B"


# The option that makes a task's sequences longer, for the "budget never reached" note (lm_eval: none of its own).
LONGER_INPUT = {"perplexity": "task.max_tokens", "needle": "task.lengths", "ruler": "task.lengths",
                "throughput": "task.input_tokens", "longbench": "task.max_length", "longbench_e": "task.max_length",
                "govreport": "task.max_length", "summarization": "task.max_length", "scbench": "task.length"}

# Keys shown in their own section, not among the task metrics.
_RUN_KEYS = {"run_id", "status", "error", "model", "method", "budget", "task", "prefill_tokens_per_s",
             "decode_tokens_per_s", "ttft_s", "peak_kv_bytes", "full_kv_bytes", "kv_bytes_per_token", "wall_s",
             "held_kv_bytes", "fork_shared_kv_bytes", "kv_pool_bytes",
             "num_samples", "device", "dtype", "kvbench", "torch", "transformers", "git_commit", "seed",
             "config_hash", "run_dir", "started_at", "finished_at", "model_path", "attention_backend",
             "attempt_id", "experiment", "experiment_key", "host", "pid", "loaded_from", "wandb_mode", "quant",
             "wandb_group",
             "model_gguf_file", "memory_stats_error", "max_sequence_tokens", "budget_reached", "score_tasks",
             "score_tasks_skipped", "output_tokens_per_s", "compression_ratio", "evicts", "kv_read_bytes_per_token",
             "kv_read_fraction", "summary_read_bytes_per_token", "full_peak_kv_bytes", "load_s", "logger_start_s",
             "model_cached", "estimate_s", "announced_after_s", "others_load", "sweep_estimate_s",
             "sweep_announced_after_s"}
# Speculative decoding's and the pool's health figures: their own summary lines (all of them in metrics.json).
_SPEC_KEYS = {"acceptance_rate", "mean_accepted_tokens", "draft_tokens", "accepted_tokens", "speculative_rounds",
              "speculative_plain_steps", "draft_s", "verify_s", "draft_pool_failures", "draft_peak_kv_bytes",
              "draft_kv_pool_bytes"}
_HEALTH_KEYS = {"pool_usage_pct_mean", "pool_usage_pct_p95", "prefix_cache_hit_rate", "blocks_per_request_mean",
                "preemptions_per_min", "swap_preemptions", "swap_out_bytes", "swap_in_bytes", "swap_out_blocks",
                "swap_in_blocks"}
_RUN_KEYS |= _SPEC_KEYS | _HEALTH_KEYS
# Prefixes of settings columns (flattened config) and internal storage details: in metrics.json, not the summary.
_HIDDEN_PREFIXES = ("method_", "task_", "runtime_", "quant_", "storage_")


def storage_line(record: dict) -> Optional[str]:
    """One line for a codec run's storage_* fields (all of them stay in metrics.json), or None."""
    codec = record.get("storage_codec")
    if not codec or codec in ("full", "none"):
        return None
    opts = ", ".join(f"{k[len('storage_codec_'):]}={_fmt(v)}" for k, v in record.items()
                     if k.startswith("storage_codec_") and not isinstance(v, (dict, list))
                     and k != "storage_codec_fp_block_dtype")
    bits = record.get("storage_packed_bits_per_element")
    parts = [f"{codec}" + (f" ({opts})" if opts else "")]
    if bits is not None:
        parts.append(f"{_fmt(bits)} bits/element packed")
    if record.get("storage_fp_block_dtype"):
        parts.append(f"window in {record.get('storage_fp_block_dtype')}")
    if record.get("storage_pre_rope_keys"):
        parts.append("pre-RoPE keys")
    return "\n".join(textwrap.wrap(", ".join(parts), _WIDTH, initial_indent="storage   ",
                                   subsequent_indent=" " * 10))


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def saved_fraction(record: dict) -> Optional[float]:
    """The held saving: the share of the live sequences' uncompressed KV that the method (eviction and/or codec)
    removed, measured at the moment that uncompressed figure peaked (after the method's evictions of that step):
    1 - held_kv_bytes / full_kv_bytes. Blocks forks share count once per holder on both sides, so sharing is never
    counted as saving. None for records without the figures."""
    held, full = _num(record.get("held_kv_bytes")), _num(record.get("full_kv_bytes"))
    if held is None or not full:
        return None
    return max(0.0, 1.0 - held / full)


def uncompressed_peak(record: dict) -> Optional[float]:
    """What an uncompressed cache peaks at: full_peak_kv_bytes where the model has sliding layers (their rings'
    in-step peak counted: kvbench.runtime.cache.kv_meter), else full_kv_bytes."""
    return _num(record.get("full_peak_kv_bytes")) or _num(record.get("full_kv_bytes"))


def peak_saved_fraction(record: dict) -> Optional[float]:
    """The peak saving, what a user would provision less: 1 - peak_kv_bytes (the pool's measured peak) /
    uncompressed_peak (the most an uncompressed cache would have held for the live sequences). None without the
    figures, and when forks shared blocks (the pool holds a shared block once, the uncompressed figure once per
    fork: sharing would count as saving)."""
    peak, full = _num(record.get("peak_kv_bytes")), uncompressed_peak(record)
    if peak is None or not full or _num(record.get("fork_shared_kv_bytes")):
        return None
    return 1.0 - peak / full


def _percent(fraction: Optional[float]) -> str:
    return "-" if fraction is None else f"{100.0 * fraction:.1f}%"


def _wrapped(line: str) -> list:
    return textwrap.wrap(line, _WIDTH, subsequent_indent=" " * 10)


def memory_lines(record: dict) -> list:
    """The KV memory lines: the pool's peak against an uncompressed cache (what to provision), what the method
    removed from the held KV, what forks shared, how full the pool got."""
    lines = []
    peak, pool, full = _num(record.get("peak_kv_bytes")), _num(record.get("kv_pool_bytes")), record.get("full_kv_bytes")
    shared = _num(record.get("fork_shared_kv_bytes"))
    peak_saved = peak_saved_fraction(record)
    if peak is not None and peak_saved is not None:
        lines += _wrapped(f"KV peak   {_bytes(peak)}: {_percent(peak_saved)} saved at the peak (uncompressed "
                          f"{_bytes(uncompressed_peak(record))}): the memory to provision")
    elif peak is not None and shared:
        lines += _wrapped(f"KV peak   {_bytes(peak)} (no saving at the peak is given: forks shared blocks, which "
                          "the uncompressed figure counts once per fork)")
    saved = saved_fraction(record)
    bpt = f"   {_fmt(record.get('kv_bytes_per_token'))} B/token"
    if saved is None:  # a record from before held_kv_bytes was measured: no % saved, it could count forks
        lines.append(f"KV held   - (not measured in this run; uncompressed peak {_bytes(full)}){bpt}")
    elif saved == 0.0:
        lines.append(f"KV held   {_bytes(record.get('held_kv_bytes'))}: 0.0% saved, nothing removed (as "
                     f"uncompressed){bpt}")
    else:
        removed = [w for w, on in (("eviction", record.get("method") not in (None, "full")),
                                   ("codec", record.get("storage_codec") not in (None, "full", "none"))) if on]
        by = " + ".join(removed) or "the method"
        lines += _wrapped(f"KV held   {_bytes(record.get('held_kv_bytes'))}: {100.0 * saved:.1f}% saved by {by} "
                          f"(uncompressed {_bytes(full)}, when it peaked){bpt}")
    if shared:
        lines.append(f"KV shared {_bytes(shared)} by forks (continuations share their context's blocks; "
                     "not counted as saved)")
    if peak is not None:
        of_pool = f" of the {_bytes(pool)} pool ({100.0 * peak / pool:.1f}% used)" if pool else ""
        lines.append(f"KV pool   peak {_bytes(peak)}{of_pool}")
    read, frac = _num(record.get("kv_read_bytes_per_token")), _num(record.get("kv_read_fraction"))
    if read is not None:  # the second axis: what decode steps read, beside what is resident
        summ = _num(record.get("summary_read_bytes_per_token"))
        extra = f" + {_bytes(summ)} of page summaries" if summ else ""
        lines += _wrapped(f"KV read   {_bytes(read)} per decoded token{extra}: {_percent(frac)} of what full "
                          "attention reads (the blocks the decode kernels were given)")
    if record.get("storage_codec") not in (None, "full", "none"):
        lines.extend(textwrap.wrap("(B/token: one stored token, packed; held and pool peak also hold the "
                                   "full-precision window and part-filled blocks)", _WIDTH,
                                   initial_indent=" " * 10, subsequent_indent=" " * 11))
    return lines


def _pct(v: Any) -> str:
    return "-" if _num(v) is None else f"{100.0 * float(v):.1f}%"


def serving_lines(record: dict) -> list:
    """Speculative decoding (acceptance, the draft cache's peak beside the target's) and the pool's health."""
    lines = []
    if record.get("draft_tokens") is not None:
        draft = (f"{record.get('runtime_speculative_method')}@{_fmt(record.get('runtime_speculative_budget'))}"
                 if record.get("runtime_speculative_draft") in (None, "self") else record.get("runtime_speculative_draft"))
        text = (f"speculate k={_fmt(record.get('runtime_speculative_num_tokens'))}, draft {draft}: acceptance "
                f"{_pct(record.get('acceptance_rate'))}, {_fmt(record.get('mean_accepted_tokens'))} accepted per "
                f"round, {_fmt(record.get('draft_tokens'))} drafted; draft KV peak "
                f"{_bytes(record.get('draft_peak_kv_bytes'))} beside the target's {_bytes(record.get('peak_kv_bytes'))}")
        lines.extend(textwrap.wrap(text, _WIDTH, subsequent_indent=" " * 10))
    if record.get("pool_usage_pct_mean") is not None:
        swaps = record.get("swap_preemptions") or 0
        swapped = (f" ({swaps} by swap: {_bytes(record.get('swap_out_bytes'))} out, "
                   f"{_bytes(record.get('swap_in_bytes'))} in)" if swaps else "")
        text = (f"pool      usage mean {_fmt(record.get('pool_usage_pct_mean'))}% p95 "
                f"{_fmt(record.get('pool_usage_pct_p95'))}%, {_fmt(record.get('blocks_per_request_mean'))} blocks "
                f"per request, {_fmt(record.get('preemptions_per_min'))} preemptions/min{swapped}, prefix-cache "
                f"hits {_pct(record.get('prefix_cache_hit_rate'))}")
        lines.extend(textwrap.wrap(text, _WIDTH, subsequent_indent=" " * 10))
    return lines


EXAMPLE_METHOD, EXAMPLE_BUDGET = "paged_eviction", 1024  # what the next-step line suggests after an uncompressed run


def next_step_lines(record: dict) -> list:
    """After a finished run that kept every token in full precision: the overrides that run it again with a
    compressed cache (a budget below the longest sequence, so that something is evicted)."""
    if (record.get("status") != "ok" or record.get("method") not in (None, "full")
            or record.get("storage_codec") not in (None, "full", "none")):
        return []
    budget, longest = EXAMPLE_BUDGET, _num(record.get("max_sequence_tokens"))
    if longest is not None and longest <= budget:  # a short task: half its longest sequence, whole blocks
        budget = max(16, int(longest) // 32 * 16)
    return _wrapped(f"next      add method={EXAMPLE_METHOD} budget={budget} to this command: the same run with a "
                    f"compressed cache ({budget} tokens kept per sequence), to set beside this one")


_TURN_KEY = re.compile(r"^(score|ttft_s)_turn_(\d+)$")


def turn_lines(record: dict) -> list:
    """Multi-turn tasks (task=scbench): the score of each turn side by side, and turn 1's TTFT against the later
    turns'."""
    turns = sorted((int(m.group(2)), v) for k, v in record.items()
                   if (m := _TURN_KEY.match(k)) and m.group(1) == "score")
    if not turns:
        return []
    text = "turns     score by turn: " + " | ".join(f"{k} {_fmt(v)}" for k, v in turns)
    if record.get("ttft_s_turn_1") is not None and record.get("ttft_s_later_turns") is not None:
        text += (f"; ttft turn 1 {_fmt(record.get('ttft_s_turn_1'))} s, later turns "
                 f"{_fmt(record.get('ttft_s_later_turns'))} s")
    return textwrap.wrap(text, _WIDTH, subsequent_indent=" " * 10)


def format_summary(record: dict, run_dir: Optional[str] = None, next_step: bool = False) -> str:
    """A short table of one run's record (the metrics.json content): its metrics first, then speed and memory, then
    its provenance (run id, model, method, task, storage, time, folder); next_step adds, after an uncompressed run,
    the overrides that compress it."""
    lines = []
    status = record.get("status", "?")
    title = f" kvbench run {status.upper()} "
    lines.append(title.center(_WIDTH, "="))
    if status != "ok":
        lines.append(f"error     {record.get('error')}")
    # 1. what the run measured: the task's metrics first
    metrics = [(k, v) for k, v in record.items() if k not in _RUN_KEYS and not k.startswith(_HIDDEN_PREFIXES)
               and not isinstance(v, (dict, list)) and not _TURN_KEY.match(k) and k != "ttft_s_later_turns"]
    if metrics:
        cells = [f"{k} {_fmt(v)}" for k, v in metrics]
        row = ""
        for c in cells:
            if row and len(row) + len(c) + 3 > _WIDTH:
                lines.append(row)
                row = ""
            row = f"{row}   {c}" if row else c
        if row:
            lines.append(row)
    if record.get("score_tasks"):  # what a multi-task `score` averages (RULER without its QA data: 11 tasks)
        tasks = str(record["score_tasks"]).split(",")
        skipped = [t for t in str(record.get("score_tasks_skipped") or "").split(",") if t]
        lines.extend(textwrap.wrap(
            f"score     the mean over {len(tasks)} task{'s' if len(tasks) != 1 else ''}: {', '.join(tasks)}"
            + (f" ({', '.join(skipped)} skipped: no data)" if skipped else ""), _WIDTH, subsequent_indent=" " * 10))
    lines.extend(turn_lines(record))
    # 2. speed and memory
    lines.append("-" * _WIDTH)
    lines.append(f"speed     prefill {_fmt(record.get('prefill_tokens_per_s'))} tok/s   "
                 f"decode {_fmt(record.get('decode_tokens_per_s'))} tok/s   ttft {_fmt(record.get('ttft_s'))} s")
    if _num(record.get("output_tokens_per_s")) is not None:  # serving: the end-to-end rate, prefill included
        lines.append(f"          end-to-end output {_fmt(record.get('output_tokens_per_s'))} tok/s (all output "
                     "tokens over the wall time, prefill included)")
    lines.extend(memory_lines(record))
    lines.extend(serving_lines(record))
    if record.get("budget_reached") is False:
        longer = LONGER_INPUT.get(str(record.get("task")))
        lines.extend(textwrap.wrap(
            f"note      budget {record.get('budget')} was never reached: the longest sequence held "
            f"{record.get('max_sequence_tokens')} tokens, so nothing was evicted ("
            + (f"raise {longer} or lower budget)" if longer else "lower budget: this task's prompts are its own)"),
            _WIDTH, subsequent_indent=" " * 10))
    # 3. provenance: what ran, where it is
    lines.append("-" * _WIDTH)
    lines.append(f"run       {record.get('run_id')}")
    lines.append(f"model     {record.get('model')}  ({record.get('dtype')}, {record.get('device')})")
    settings = {k[len('method_'):]: v for k, v in record.items() if k.startswith("method_")
                and k not in ("method_budget", "method_name") and not k.endswith("_sha256")}  # digests: identity
    extra = ", ".join(f"{k}={_fmt(v)}" for k, v in settings.items())
    quant = record.get("quant")
    method = record.get("method") if quant in (None, "none", "full") else f"{record.get('method')} + {quant}"
    lines.append(f"method    {method}   budget {_fmt(record.get('budget'))}"
                 + (f"   [{extra}]" if extra else ""))
    lines.append(f"task      {record.get('task')}   samples {_fmt(record.get('num_samples'))}")
    if record.get("experiment"):
        lines.append(f"experiment {record.get('experiment')}")
    storage = storage_line(record)
    if storage:
        lines.append(storage)
    lines.append(f"time      {_fmt(record.get('wall_s'))} s")
    if run_dir:
        lines.append(f"results   {run_dir}")
    if next_step:
        lines.extend(next_step_lines(record))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


# Columns of the sweep table besides the task's own metrics (decode speed for generation, % saved for all).
_SWEEP_EXTRA = ("decode_tokens_per_s", "output_tokens_per_s", "kv_read_fraction")
_SWEEP_MAX_METRICS = 6  # task metrics shown per run (the rest are in each run's metrics.json)


def _is_metric(key: str, value: Any) -> bool:
    return (key not in _RUN_KEYS and not key.startswith(_HIDDEN_PREFIXES) and isinstance(value, (int, float))
            and not isinstance(value, bool) and "_pos_" not in key and not key.endswith("_stderr"))


def _headline(records: list) -> Optional[str]:
    """The task's headline metric (its averaged `score`, `ppl`, `accuracy`, ...) of the first run that has one."""
    for r in records:
        name = primary_metric(r.get("task"), r)
        if name is not None and _num(r.get(name)) is not None:
            return name
    return None


def format_sweep_table(records: list) -> str:
    """One table for a sweep's runs, after their boxes: a row per run (method, budget, compression ratio and any
    other setting that differs between the runs, such as a threshold), a column per metric (the task's headline
    metric first, then the first few others the task reports, decode tok/s when measured, the peak and held
    savings as the summary defines them) and the status. Rows by method, then the swept numbers as numbers."""
    records = [r for r in records if isinstance(r, dict)]
    if not records:
        return ""
    settings = sorted({k for r in records for k in r if k.startswith(("method_", "task_", "quant_", "runtime_"))
                       and not isinstance(r.get(k), (dict, list)) and not k.endswith("_sha256")})
    by_method: dict = {}
    for r in records:
        by_method.setdefault((r.get("method"), r.get("quant")), []).append(r)
    # settings swept besides method and budget: those that differ between runs of one method
    varying = [k for k in settings if k not in ("method_name", "method_budget", "method_compression_ratio")
               and any(len({str(r.get(k)) for r in group}) > 1 for group in by_method.values())]
    knobs = ["budget"] + (["compression_ratio"] if any(r.get("compression_ratio") is not None for r in records)
                          else []) + varying
    metrics: list = []
    head = _headline(records)
    for r in records:
        for k, v in r.items():
            if _is_metric(k, v) and k not in metrics and k != head:
                metrics.append(k)
    if head is not None:
        metrics.insert(0, head)
    shown = metrics[:_SWEEP_MAX_METRICS]
    shown += [k for k in _SWEEP_EXTRA if any(_num(r.get(k)) is not None for r in records) and k not in shown]
    names = {"budget": "budget", "compression_ratio": "ratio"}
    header = (["method"] + [names.get(k) or k.split("_", 1)[1] for k in knobs] + shown
              + ["peak saved", "held saved", "status"])
    keyed = []
    for r in records:
        quant = r.get("quant")
        method = r.get("method") if quant in (None, "none", "full") else f"{r.get('method')} + {quant}"
        row = ([str(method)] + [_fmt(r.get(k)) for k in knobs] + [_fmt(r.get(k)) for k in shown]
               + [_percent(peak_saved_fraction(r)), _percent(saved_fraction(r)), str(r.get("status"))])
        keyed.append(((str(method), *(sort_value(r.get(k)) for k in knobs)), row))
    rows = [row for _, row in sorted(keyed, key=lambda kr: kr[0])]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def line(cells: list) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    title = f" kvbench sweep: {len(records)} runs "
    width = max(_WIDTH, len(line(header)))
    out = [title.center(width, "="), line(header), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    if len(metrics) > _SWEEP_MAX_METRICS:
        out.append(f"({len(metrics) - _SWEEP_MAX_METRICS} more metrics per run in metrics.json / runs.jsonl)")
    out.append("=" * width)
    return "\n".join(out)
