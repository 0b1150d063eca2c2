"""Page retrieval (Quest) against full attention: batch-1 decode speed and bytes read at long contexts (`make
bench-sparse`).

For each context (4,096, 16,384, 32,768 tokens) one sequence's cache is filled, then decode steps run on the packaged
model with full attention and with Quest at budgets 512, 1,024 and 2,048, the runs alternated `--repeats` times in
this one process (the median per setting is printed). The fill (`--fill`):
  random  random K/V in every layer (the default): each query head of a group picks its own pages at random, so a
          kv-head reads nearly the whole union of its group's picks, the most a step can read at a budget (the
          worst case for the GQA union; quality is tested elsewhere: tests/methods/test_quest.py, the needle test)
  text    the packaged essays prefilled by the model (minutes at 32,768 tokens on 2 cores, beyond SmolLM2's 8,192
          training positions), then copied into both caches: the pages real queries pick, whose union is smaller
Full attention runs on its own engine (no method); the Quest budgets share one engine whose method's page
retrieval is swapped between runs (same cache, same summaries).

Printed per context and setting: decode tok/s, the ratio to full, K/V bytes read per token (from the blocks the
kernels were given), the key-summary bytes scored per token, and the bound set by the bytes a step must read:
(weights + every K/V block) / (weights + the K/V read + the summaries). Then one JSON line with every figure and the
targets: Quest at budget 512 >= 1.8x full's tok/s at 16,384 and >= 2.5x at 32,768.

    python bench/bench_sparse.py [--contexts 4096 16384 32768] [--budgets 512 1024 2048] [--repeats 3]
                                 [--decode-tokens 16] [--threads N] [--fill random|text] [--gqa union|per_head]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import kvbench  # noqa: F401  (sets kvbench's OpenMP wait policy before torch loads libgomp)
import torch

TARGETS = {"quest512_over_full_ctx16384": 1.8, "quest512_over_full_ctx32768": 2.5}


def fill(engine, T: int, seed: int) -> int:
    """A new sequence holding T tokens of random K/V in every layer (positions 0..T-1); returns its slot."""
    cache, cfg = engine.cache, engine.model.config
    slot = engine.new_sequence()
    g = torch.Generator().manual_seed(seed)
    plan = cache.prepare_append([slot], torch.arange(T)[None])
    device = cache.k_pool.device
    for layer in range(cfg.num_layers):
        k = torch.randn(1, cfg.num_kv_heads, T, cfg.head_dim, generator=g, dtype=torch.float32)
        v = torch.randn(1, cfg.num_kv_heads, T, cfg.head_dim, generator=g, dtype=torch.float32)
        cache.write(layer, plan, k.to(device=device, dtype=cache.dtype), v.to(device=device, dtype=cache.dtype))
    engine.meter.track()
    return slot


def text_kv(engine, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill `tokens` on `engine` (full attention) and read back each layer's K/V as [1, H, T, D] (the sequence is
    ended after)."""
    cache = engine.cache
    ctx = engine.prefill_context(tokens)
    T, bs = len(tokens), cache.block_size
    nb = -(-T // bs)
    out = []
    for layer in range(cache.num_layers):
        ids = cache.tables[ctx.slot, layer, :, :nb].to(torch.int64)  # [H, nb]
        k = cache.k_pool[ids].reshape(ids.shape[0], nb * bs, -1)[None, :, :T]
        v = cache.v_pool[ids].reshape(ids.shape[0], nb * bs, -1)[None, :, :T]
        out.append((k.clone(), v.clone()))
    engine.end_sequence(ctx.slot)
    return out


def fill_with(engine, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """A new sequence holding the K/V `kv` (per layer [1, H, T, D], positions 0..T-1); returns its slot."""
    cache = engine.cache
    T = kv[0][0].shape[2]
    slot = engine.new_sequence()
    plan = cache.prepare_append([slot], torch.arange(T)[None])
    for layer, (k, v) in enumerate(kv):
        cache.write(layer, plan, k, v)
    engine.meter.track()
    return slot


def decode_run(engine, slot: int, n: int, vocab: int) -> dict:
    """n decode steps of one sequence (greedy, from a fixed token): tok/s and the bytes its steps read."""
    from kvbench.runtime.cache.kv_meter import DecodeReads

    cache = engine.cache
    pos = cache.tokens_seen[slot]
    tok = 1000 % vocab
    engine.decode_batch([slot], [tok], [pos])  # warm: buffers, thread choice
    cache.decode_reads = DecodeReads()
    t = time.perf_counter()
    for i in range(n):
        tok = engine.decode_batch([slot], [tok], [pos + 1 + i])[0]
    dt = time.perf_counter() - t
    return {"tokens_per_s": n / dt, **cache.decode_reads.stats()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: kvbench's default)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gqa", choices=("union", "per_head"), default=None,
                    help="quest's method.gqa (default: the method's default)")
    ap.add_argument("--fill", choices=("random", "text"), default="random",
                    help="random K/V (every query head's own pages: the widest union) or the essays prefilled")
    args = ap.parse_args()
    from kvbench.runtime.backends.cpu.threads import configure_threads
    from kvbench.runtime.model.loading import load_model
    from kvbench.runtime.serving.engine import Engine
    from kvbench.methods import build_method

    args.threads = configure_threads(args.threads)
    lm = load_model(dtype=args.dtype)
    model = lm.model
    cfg = model.config
    vocab = cfg.vocab_size
    weights = model.weight_bytes
    bs = 16
    res: dict = {"model": lm.name, "dtype": args.dtype, "threads": args.threads, "weight_bytes": weights,
                 "decode_tokens": args.decode_tokens, "repeats": args.repeats, "fill": args.fill,
                 "gqa": args.gqa or build_method("quest", 512).gqa}
    print(f"model {lm.name}  dtype {args.dtype}  threads {args.threads}  weights {weights / 1e6:.0f} MB  "
          f"block {bs}  decode tokens per run {args.decode_tokens}  repeats {args.repeats} (alternated)  "
          f"fill {args.fill}")
    corpus = None
    if args.fill == "text":
        from kvbench.data.essays import essay_corpus_text

        corpus = lm.tokenizer.encode(essay_corpus_text())
    for T in args.contexts:
        extra = (args.repeats + 1) * (args.decode_tokens + 1) + 64
        full_bytes = cfg.num_layers * cfg.num_kv_heads * -(-(T + extra) // bs) * 2 * bs * cfg.head_dim * 4
        kv_memory = int(full_bytes * 1.15) + (1 << 24)
        gqa = {} if args.gqa is None else {"gqa": args.gqa}
        methods = {b: build_method("quest", b, **gqa) for b in args.budgets}
        full = Engine(model, block_size=bs, kv_memory_bytes=kv_memory, prefix_caching=False)
        quest = Engine(model, methods[args.budgets[0]], block_size=bs, kv_memory_bytes=kv_memory,
                       prefix_caching=False)
        retrievals = {}
        for b, m in methods.items():  # each budget's page counts (the method decides them at attach)
            m.attach(quest.cache, cfg)
            retrievals[b] = m.page_retrieval
        if corpus is None:
            slots = {"full": fill(full, T, 0), "quest": fill(quest, T, 0)}
        else:
            if len(corpus) < T:
                raise SystemExit(f"--fill text: the essays hold {len(corpus)} tokens, fewer than the context {T}")
            t0 = time.perf_counter()
            kv = text_kv(full, corpus[:T])
            print(f"ctx {T:6d}  prefilled the essays in {time.perf_counter() - t0:.0f} s")
            slots = {"full": fill_with(full, kv), "quest": fill_with(quest, kv)}
            del kv
        runs: dict[str, list[dict]] = {"full": [], **{f"quest{b}": [] for b in args.budgets}}
        for _ in range(args.repeats):
            runs["full"].append(decode_run(full, slots["full"], args.decode_tokens, vocab))
            for b in args.budgets:
                quest.cache.page_retrieval = retrievals[b]
                runs[f"quest{b}"].append(decode_run(quest, slots["quest"], args.decode_tokens, vocab))
        full_tps = statistics.median(r["tokens_per_s"] for r in runs["full"])
        full_kv = statistics.median(r["kv_read_bytes_per_token"] for r in runs["full"])
        res[f"full_tokens_per_s_ctx{T}"] = full_tps
        res[f"full_kv_read_bytes_per_token_ctx{T}"] = full_kv
        print(f"ctx {T:6d}  full      {full_tps:7.2f} tok/s            K/V read {full_kv / 1e6:8.1f} MB/token")
        for b in args.budgets:
            rs = runs[f"quest{b}"]
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            kv = statistics.median(r["kv_read_bytes_per_token"] for r in rs)
            summ = statistics.median(r["summary_read_bytes_per_token"] for r in rs)
            frac = statistics.median(r["kv_read_fraction"] for r in rs)
            bound = (weights + full_kv) / (weights + kv + summ)
            key = f"quest{b}"
            res[f"{key}_tokens_per_s_ctx{T}"] = tps
            res[f"{key}_over_full_ctx{T}"] = tps / full_tps
            res[f"{key}_kv_read_bytes_per_token_ctx{T}"] = kv
            res[f"{key}_kv_read_fraction_ctx{T}"] = frac
            res[f"{key}_summary_read_bytes_per_token_ctx{T}"] = summ
            res[f"{key}_bytes_bound_ctx{T}"] = bound
            print(f"ctx {T:6d}  quest@{b:<4d} {tps:7.2f} tok/s  x{tps / full_tps:5.2f}  K/V read {kv / 1e6:8.1f} MB/token "
                  f"({frac:6.1%})  summaries {summ / 1e6:6.1f} MB/token  bytes bound x{bound:5.2f} "
                  f"(reached {tps / full_tps / bound:5.1%})")
        for e in (full, quest):
            for s in list(e.cache.live):
                e.end_sequence(s)
        del full, quest
    verdict = {k: (res[k] >= t) for k, t in TARGETS.items() if k in res}
    for k, t in TARGETS.items():
        if k in res:
            print(f"  {k} {res[k]:.2f} (target >= {t}: {'PASS' if verdict[k] else 'MISS'})")
    print(json.dumps({**res, "targets": TARGETS, "pass": verdict}))


if __name__ == "__main__":
    main()
