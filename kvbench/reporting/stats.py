"""Which metrics are scores, which way is better, and their bootstrap intervals over per-sample scores.

Per-sample fields written by the tasks (samples.jsonl):
- perplexity: `nll` (mean per token of the document) and `num_tokens` -> ppl = exp(token-weighted mean nll); and
  `window_nll_sum` / `window_tokens`, the NLL sums and token counts of the document's consecutive windows
  (tasks/perplexity.py WINDOW_TOKENS): the units resampled, so one document's ppl has an interval too
- needle: `score` (0/1) -> accuracy = mean
- longbench: `score` per sample (0-1) and `dataset` -> score_<ds> = 100 x mean; score = mean over datasets
- summarization / govreport: `rouge_l`, `rouge1`, ... per sample (0-1) -> metric = 100 x mean

`statistic(name, samples)` recomputes a metric from samples in the metric's own unit (a scale factor found from
the recorded value absorbs the x100); `bootstrap_interval` resamples the samples (with replacement, fixed seed);
`paired_interval` bootstraps the difference of two runs scored on the same items (resampled together);
`sample_count` / `sample_unit` say how many units are resampled and what they are (samples, or perplexity windows).

Speeds (`is_speed`): rates (tokens or requests per second) and latencies (ttft_s, tpot_s, e2e_s and their
percentiles); `speed_loss` is the fraction of speed lost, one scale for both (0.5 = half the rate, twice the time).
"""
from __future__ import annotations

import math
import re
from typing import Callable, Optional, Sequence

import numpy as np

LOWER_IS_BETTER = re.compile(r"^(ppl|nll)(_.*)?$|^ttft_s$")
SCORE = re.compile(r"^(ppl|nll|accuracy|score|score_[A-Za-z0-9_.-]+|rouge\w*|acc|acc_norm|exact_match|f1|em)$"
                   r"|^[\w.-]+/(acc|acc_norm|exact_match|f1|em|bleu|rouge\w*)(,[\w-]+)?$")
SPEED = ("decode_tokens_per_s", "prefill_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s",
         "requests_per_s")
LATENCY = re.compile(r"^(ttft_s|tpot_s|e2e_s)(_p\d+)?$")
MEMORY = ("peak_kv_bytes",)
# Counts of failures that must not grow.
FAILURE_COUNTS = ("failed_requests",)
# The headline metric of each task, when an experiment's paper block names none the run has.
PRIMARY = {"perplexity": "ppl", "needle": "accuracy", "longbench": "score", "longbench_e": "score",
           "longbench_v2": "accuracy", "ruler": "score", "scbench": "score", "gsm8k": "accuracy",
           "math500": "accuracy", "aime": "accuracy", "summarization": "rouge_l", "govreport": "rouge_l",
           "throughput": "output_tokens_per_s"}
# Headline metrics in order of preference for a task PRIMARY does not name: an average before its parts.
HEADLINES = ("score", "accuracy", "ppl", "rouge_l")


def score_tasks(metrics: dict) -> Optional[tuple]:
    """The tasks a multi-task headline `score` averages (RULER): `score_tasks` as recorded, else (a record from
    before it) the tasks with a `num_samples_<task>` count; None for a record with neither."""
    named = metrics.get("score_tasks")
    if isinstance(named, str) and named:
        return tuple(sorted(named.split(",")))
    counted = sorted(k[len("num_samples_"):] for k, v in metrics.items()
                     if k.startswith("num_samples_") and isinstance(v, int) and v > 0)
    return tuple(counted) if counted else None


def averages_tasks(name: str) -> bool:
    """A metric that averages over a run's tasks (`score`, and `score_<length>` per context length)."""
    return name == "score" or bool(re.match(r"^score_\d+$", name))


def lower_is_better(name: str) -> bool:
    return bool(LOWER_IS_BETTER.match(name))


def is_score(name: str) -> bool:
    """A quality metric compared by kvbench-compare (needle cells acc_<len>_<depth> are summarized by accuracy)."""
    return bool(SCORE.match(name)) and not name.startswith("score_") or _is_dataset_score(name)


def _is_dataset_score(name: str) -> bool:
    return name.startswith("score_") and not re.search(r"_(0-4k|4-8k|8k\+)$", name)


def is_speed(name: str) -> bool:
    """A rate (higher is faster) or a latency (lower is faster)."""
    return name in SPEED or bool(LATENCY.match(name))


def speed_loss(name: str, base: float, new: float) -> Optional[float]:
    """The fraction of speed lost from base to new (negative: faster): 1 - new/base for a rate, 1 - base/new for a
    latency (a rate that fell to 0 lost all of it); None when there is no speed to compare (a value <= 0)."""
    if name in SPEED:
        return 1.0 - max(new, 0.0) / base if base > 0 else None
    return 1.0 - base / new if base > 0 and new > 0 else None


def primary_metric(task: Optional[str], metrics: dict) -> Optional[str]:
    """The task's headline metric (PRIMARY), else the first of HEADLINES with a number (a multi-part task's
    averaged `score`, never its first part's `score_<part>`), else the first score-like key with a number."""
    name = PRIMARY.get(str(task))
    if name and isinstance(metrics.get(name), (int, float)):
        return name
    for key in HEADLINES:
        if isinstance(metrics.get(key), (int, float)) and not isinstance(metrics.get(key), bool):
            return key
    for key, value in metrics.items():
        if is_score(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
            return key
    return name


def _raw_statistic(name: str, samples: Sequence[dict]) -> Optional[Callable[[np.ndarray], float]]:
    """A function of sample indices that recomputes `name` from `samples` (up to a constant factor), or None."""
    if name in ("ppl", "nll"):
        units = _nll_units(samples)
        if units is None:
            return None
        sums, ntok = units

        def weighted(idx: np.ndarray) -> float:
            mean = float(sums[idx].sum() / max(ntok[idx].sum(), 1e-12))
            return math.exp(min(mean, 700.0)) if name == "ppl" else mean
        return weighted
    if name == "accuracy" or name == "score" or name.startswith("score_"):
        key = "score"
    else:
        key = name
    values = [(s.get(key), s.get("dataset")) for s in samples]
    if name.startswith("score_"):
        values = [(v, d) for v, d in values if d == name[len("score_"):]]
    if not values or any(not isinstance(v, (int, float)) or isinstance(v, bool) for v, _ in values):
        return None
    arr = np.array([v for v, _ in values], dtype=float)
    if name == "score":  # mean over datasets of the per-dataset means
        groups = np.array([str(d) for _, d in values])
        labels = sorted(set(groups))

        def by_dataset(idx: np.ndarray) -> float:
            g = groups[idx]
            means = [arr[idx][g == lab].mean() for lab in labels if (g == lab).any()]
            return float(np.mean(means))
        return by_dataset
    return lambda idx: float(arr[idx].mean())


def _windows(sample: dict) -> Optional[tuple[list, list]]:
    sums, counts = sample.get("window_nll_sum"), sample.get("window_tokens")
    if not isinstance(sums, list) or not isinstance(counts, list) or len(sums) != len(counts) or not sums:
        return None
    if not all(_finite(v) for v in sums) or not all(_finite(n) and n > 0 for n in counts):
        return None
    return sums, counts


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _nll_units(samples: Sequence[dict]) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(NLL sums, token counts) of the units a perplexity is resampled over: every document's windows when all
    samples have them, else whole documents (nll x num_tokens); None when a sample has neither."""
    if not samples:
        return None
    windows = [_windows(s) for s in samples]
    if all(w is not None for w in windows):
        sums = [v for w in windows for v in w[0]]  # type: ignore[index]
        counts = [n for w in windows for n in w[1]]  # type: ignore[index]
        return np.array(sums, dtype=float), np.array(counts, dtype=float)
    rows = [(s.get("nll"), s.get("num_tokens")) for s in samples]
    if any(not _finite(v) or not _finite(n) for v, n in rows):
        return None
    ntok = np.array([n for _, n in rows], dtype=float)
    return np.array([v for v, _ in rows], dtype=float) * ntok, ntok


def statistic(name: str, samples: Sequence[dict], recorded: Optional[float] = None) -> Optional[Callable]:
    """Like _raw_statistic, scaled so that all samples give the recorded value (e.g. x100 for LongBench)."""
    fn = _raw_statistic(name, samples)
    if fn is None:
        return None
    full = np.arange(sample_count(name, samples))
    base = fn(full)
    scale = 1.0
    if recorded is not None and base not in (0.0,) and math.isfinite(base) and name not in ("ppl", "nll"):
        scale = unit_scale(recorded, base)
    return lambda idx: fn(idx) * scale


def unit_scale(recorded: float, base: float) -> float:
    """The factor from a metric recomputed from samples (base) to its recorded unit (x100 for LongBench and RULER):
    a power of ten when the recorded value is that multiple rounded to 2 decimals (as the tasks round it), so that
    the rounding of one run's figure never shifts its draws against another run's; else recorded / base."""
    for k in range(-3, 4):
        if abs(recorded - base * 10.0 ** k) <= 0.005 + 1e-9 * abs(recorded):
            return 10.0 ** k
    return recorded / base


def aligned(name: str, base: Sequence[dict], new: Sequence[dict]) -> bool:
    """Whether two runs' samples score the same items in the same order (same ids; for ppl/nll the same windows),
    so that `paired_interval` can resample them together."""
    if len(base) != len(new) or [s.get("id") for s in base] != [s.get("id") for s in new]:
        return False
    if name in ("ppl", "nll"):
        return sample_unit(name, base) == sample_unit(name, new) and all(
            b.get("window_tokens") == n.get("window_tokens") and b.get("num_tokens") == n.get("num_tokens")
            for b, n in zip(base, new))
    return True


def paired_interval(name: str, base: Sequence[dict], new: Sequence[dict], base_value: Optional[float] = None,
                    new_value: Optional[float] = None) -> Optional[tuple[float, float, int]]:
    """The bootstrap 95% interval of statistic(new) - statistic(base), both computed on the same resampled items
    (a paired bootstrap: the items' own difficulty cancels), and the number of items; None when the samples are
    not aligned or the metric cannot be recomputed from them."""
    if not aligned(name, base, new):
        return None
    fb, fn = statistic(name, base, base_value), statistic(name, new, new_value)
    n = sample_count(name, base)
    if fb is None or fn is None or n < 2:
        return None
    lo, hi = bootstrap_interval(lambda idx: fn(idx) - fb(idx), n)
    return lo, hi, n


def _count(name: str, samples: Sequence[dict]) -> int:
    ds = name[len("score_"):]
    return sum(1 for s in samples if s.get("dataset") == ds)


def bootstrap_interval(fn: Callable[[np.ndarray], float], n: int, *, iters: int = 1000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """The bootstrap percentile interval of fn over n samples (resampled with replacement)."""
    if n < 2:
        v = fn(np.arange(n))
        return v, v
    rng = np.random.default_rng(seed)
    stats = np.array([fn(rng.integers(0, n, size=n)) for _ in range(iters)])
    lo, hi = np.quantile(stats, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def sample_count(name: str, samples: Sequence[dict]) -> int:
    """How many units `statistic(name, samples)` resamples (perplexity windows, or samples)."""
    if name in ("ppl", "nll"):
        units = _nll_units(samples)
        return 0 if units is None else len(units[0])
    return _count(name, samples) if name.startswith("score_") else len(samples)


def sample_unit(name: str, samples: Sequence[dict]) -> str:
    """What the resampled units are: "windows" (perplexity windows of the documents) or "samples"."""
    if name in ("ppl", "nll") and samples and all(_windows(s) is not None for s in samples):
        return "windows"
    return "samples"


def _usable(name: str, samples: Optional[Sequence[dict]], recorded: float) -> Optional[Callable]:
    """statistic(name, samples) when it recomputes the recorded value from at least two units, else None (no
    samples, one unit, or samples that do not give the recorded value: their noise would not be this run's)."""
    if not samples:
        return None
    fn = statistic(name, samples, recorded)
    n = sample_count(name, samples)
    if fn is None or n < 2:
        return None
    value = fn(np.arange(n))
    if not math.isfinite(value) or abs(value - recorded) > 0.005 + 1e-6 * abs(recorded):  # as rounded to 2 decimals
        return None
    return fn


def row_draws(name: str, rows: Sequence[Sequence[tuple[float, Optional[Sequence[dict]]]]], *, iters: int = 1000,
              seed: int = 0) -> tuple[np.ndarray, dict]:
    """Bootstrap draws of each row's value, for judging a relation between rows on an interval.

    rows: per row, its runs as (recorded value, samples or None); a row's value is the mean of its runs'. Paired
    when every row has one run and all of them scored the same items (`aligned`): one resampling of the items
    serves every row, so the items' own difficulty cancels in a ratio or a difference. Else each run is resampled
    on its own. A run whose samples cannot recompute its value (none, one unit, or a mismatch) stays at its
    recorded value in every draw: no noise is known for it.
    Returns draws [rows, iters] and what was resampled: {"paired", "unit", "items" (units per run, row by row),
    "exact" (indices of rows with a run held at its value)}."""
    fns = [[(_usable(name, s, v), v, s) for v, s in runs] for runs in rows]
    unit = next((sample_unit(name, s) for runs in fns for fn, _, s in runs if fn is not None), "samples")
    items = [[sample_count(name, s) if s else 0 for _, _, s in runs] for runs in fns]
    exact = [i for i, runs in enumerate(fns) if any(fn is None for fn, _, _ in runs)]
    rng = np.random.default_rng(seed)
    draws = np.empty((len(rows), iters))
    singles = [runs[0] for runs in fns if len(runs) == 1]
    paired = (len(singles) == len(rows) >= 2 and all(fn is not None for fn, _, _ in singles)
              and all(aligned(name, singles[0][2], s) for _, _, s in singles[1:]))
    if paired:
        n = sample_count(name, singles[0][2])
        for i in range(iters):
            idx = rng.integers(0, n, size=n)
            for r, (fn, _, _) in enumerate(singles):
                draws[r, i] = fn(idx)
    else:
        for r, runs in enumerate(fns):
            per_run = np.empty((len(runs), iters))
            for j, (fn, value, samples) in enumerate(runs):
                if fn is None:
                    per_run[j] = value
                    continue
                n = sample_count(name, samples)
                per_run[j] = [fn(rng.integers(0, n, size=n)) for _ in range(iters)]
            draws[r] = per_run.mean(axis=0)
    return draws, {"paired": paired, "unit": unit, "items": items, "exact": exact}


def percentile_interval(draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of bootstrap draws (inf allowed: no interpolation across it)."""
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    finite = np.isfinite(draws).all()
    lo, hi = np.quantile(draws, q) if finite else np.quantile(draws, q, method="inverted_cdf")
    return float(lo), float(hi)
