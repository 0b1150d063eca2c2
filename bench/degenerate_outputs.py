"""Degenerate generations in a results folder: runs whose outputs are one token or bigram repeated.

For every finished generation run under RESULTS_DIR, each sample's repetition share (metrics/repetition.py: the
largest share of the generated tokens covered by one token or one bigram; samples.jsonl's `repetition`, or, for
runs written before that field existed, the prediction re-tokenized with the packaged model's tokenizer) and
one JSON line per run: method, budget, block size, rouge_l (when the task has it), samples, degenerate samples
(share >= --share over >= 8 tokens), the largest share and the start of the worst prediction.
Exit status 1 when some run has a degenerate sample (with --fail).

    python bench/degenerate_outputs.py /tmp/results [--share 0.5] [--fail]
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def load_tokenizer():
    from kvbench.runtime.model.loading import load_model

    return load_model().tokenizer


def run_rows(results_dir: str, share: float) -> list[dict]:
    from kvbench.metrics.repetition import MIN_TOKENS, repetition_share
    from kvbench.store.files import read_jsonl
    from kvbench.store.folder import SAMPLES_FILE, finished_metrics, run_folders

    tokenizer = None
    rows = []
    for folder in run_folders(results_dir):
        metrics = finished_metrics(folder)
        samples_path = os.path.join(folder, SAMPLES_FILE)
        if metrics is None or not os.path.exists(samples_path):
            continue
        samples = [s for s in read_jsonl(samples_path) if "prediction" in s]
        if not samples:
            continue
        shares = []
        for s in samples:
            if s.get("repetition") is None:
                tokenizer = tokenizer or load_tokenizer()
                ids = tokenizer(s["prediction"], add_special_tokens=False)["input_ids"]
                s["repetition"] = repetition_share(ids) if len(ids) >= MIN_TOKENS else 0.0
                s["new_tokens"] = len(ids)
            shares.append(float(s["repetition"]))
        worst = max(range(len(samples)), key=lambda i: shares[i])
        degenerate = sum(1 for s, r in zip(samples, shares) if int(s.get("new_tokens") or 0) >= MIN_TOKENS and r >= share)
        rows.append({"method": metrics.get("method"), "budget": metrics.get("budget"),
                     "block_size": metrics.get("runtime_block_size"), "rouge_l": metrics.get("rouge_l"),
                     "samples": len(samples), "degenerate": degenerate, "max_repetition": round(shares[worst], 3),
                     "worst_prediction": samples[worst]["prediction"][:48], "run_id": metrics.get("run_id")})
    return sorted(rows, key=lambda r: (str(r["method"]), r["budget"] or 0, r["block_size"] or 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir")
    ap.add_argument("--share", type=float, default=0.5, help="repetition share that makes a sample degenerate")
    ap.add_argument("--fail", action="store_true", help="exit 1 when some run has a degenerate sample")
    args = ap.parse_args()
    rows = run_rows(args.results_dir, args.share)
    for row in rows:
        print(json.dumps(row))
    if not rows:
        sys.exit(f"no finished generation runs under {args.results_dir}")
    if args.fail and any(r["degenerate"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
