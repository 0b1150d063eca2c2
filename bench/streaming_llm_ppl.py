"""The StreamingLLM finding on the packaged model: attention sinks keep a windowed cache working.

Perplexity of the first --tokens tokens of the packaged essays (kvbench.data.essays, sorted by name,
joined by blank lines), streamed through the cache in chunks of --chunk tokens with the budget
enforced after every chunk (prefill_mode=streaming), for:
  full                      no eviction
  streaming_llm sinks=4     4 sinks + (budget - 4) recent tokens (positions kept)
  streaming_llm sinks=4 reindex   the same, positions re-indexed inside the cache (official code)
  window (sinks=0)          the most recent `budget` tokens only
The chunk size bounds how far the cache runs over the budget while a chunk is scored (budget + chunk).
Prints a table; the last line is one JSON object keyed by row name.

    python bench/streaming_llm_ppl.py [--tokens 4096] [--budget 256] [--chunk 32] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

ROWS = [
    ("full", "full", {}),
    ("sinks4+window", "streaming_llm", {"sinks": 4}),
    ("sinks4+window reindex", "streaming_llm", {"sinks": 4, "position_mode": "reindex"}),
    ("window (sinks0)", "streaming_llm", {"sinks": 0}),
]


def essay_tokens(tokenizer, n: int) -> list[int]:
    from kvbench.data.essays import essay_corpus_text

    text = essay_corpus_text()
    ids = tokenizer(text[: 8 * n + 4096])["input_ids"]
    if len(ids) < n:
        ids = tokenizer(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the essays hold only {len(ids)} tokens")
    return list(ids[:n])


def perplexity(model, ids: list[int], method_name: str, budget: int | None, chunk: int, **opts) -> dict:
    """PPL of ids streamed through an Engine with the method (prefill_mode=streaming)."""
    from kvbench.methods import build_method
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.scoring import Scorer

    if method_name == "full":
        method = build_method("full")
    else:
        method = build_method(method_name, budget, prefill_mode="streaming", **opts)
    bs = 16
    blocks = model.config.num_layers * model.config.num_kv_heads * (len(ids) // bs + 4)
    engine = Engine(model, method, block_size=bs, num_blocks=blocks + 16, prefill_chunk_size=chunk)
    t = time.perf_counter()
    lp = Scorer(engine).score(ids, chunk_size=chunk)
    secs = time.perf_counter() - t
    stats = engine.memory_stats()
    nll = -lp.double()
    return {
        "ppl": math.exp(float(nll.mean())),
        "ppl_last_half": math.exp(float(nll[len(nll) // 2:].mean())),
        "peak_kv_bytes": stats["peak_kv_bytes"], "full_kv_bytes": stats["full_kv_bytes"],
        "seconds": round(secs, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default=None, help="comma-separated row names to run (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvbench.runtime.model.loading import load_model

    loaded = load_model()
    ids = essay_tokens(loaded.tokenizer, args.tokens)
    rows = [r for r in ROWS if args.rows is None or r[0] in args.rows.split(",")]
    print(f"StreamingLLM perplexity: {len(ids)} essay tokens, budget {args.budget}, chunk {args.chunk}, "
          f"model {loaded.name}, {torch.get_num_threads()} threads")
    out = {}
    for label, name, opts in rows:
        chunk = 512 if name == "full" else args.chunk  # full cache: chunking changes nothing but speed
        out[label] = perplexity(loaded.model, ids, name, args.budget, chunk, **opts)
        out[label].update(method=name, **opts)
    full = out.get("full", {}).get("ppl")
    print(f"{'row':<24}{'ppl':>10}{'vs full':>9}{'ppl 2nd half':>14}{'peak KV MB':>12}{'s':>7}")
    for label, r in out.items():
        ratio = f"{r['ppl'] / full:.2f}x" if full else "-"
        r["ppl_vs_full"] = r["ppl"] / full if full else None
        print(f"{label:<24}{r['ppl']:>10.2f}{ratio:>9}{r['ppl_last_half']:>14.2f}"
              f"{r['peak_kv_bytes'] / 1e6:>12.1f}{r['seconds']:>7}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
