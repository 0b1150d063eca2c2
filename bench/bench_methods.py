"""`make bench-methods`: decode speed and KV memory of every eviction method against `full`, one process.

For each method at --budget (1024): a batch of --batch (4) prompts of --prompt-tokens (4096) tokens
cut from the packaged essays, prefilled in chunks of --chunk (512), then --new-tokens (256) greedy
tokens each, decoded together. Printed per method, each with its ratio to `full` from the same run:
  decode tok/s   decode tokens / decode seconds (the engine's per-step wall times; the batch shares
                 every step, so the seconds are those of the decode loop)
  KV end         pool bytes held after the last decode step (all sequences still live)
  KV mean        pool bytes held after each decode step, averaged
  KV peak        the pool's peak over the whole run (prefill included: paper-mode methods attend
                 over the whole prompt before evicting)
  agree          mean length of the generated prefix identical to full's, over --new-tokens
The last line is one JSON object keyed by method name; each entry holds at least
decode_speedup_vs_full and kv_bytes_ratio_vs_full (KV end over full's). For a model with sliding-window layers
(Gemma 2/3, GPT-OSS, Mistral's window) each entry also splits the KV bytes by layer type (full_kv_bytes_full_layers,
full_kv_bytes_sliding_layers, peak_kv_bytes_full_layers, peak_kv_bytes_sliding_layers): the methods compress the
full layers only, the sliding layers keep a ring of their window.

    python bench/bench_methods.py [--model smollm2-135m] [--prompt-tokens 4096] [--new-tokens 256]
                                  [--methods full,paged_eviction] [--budget 1024] [--batch 4] [--threads N]

--model: a conf/model preset (smollm2-135m, gemma-3-1b, ...), a model folder or hub id, or tiny-gemma3 (a random
Gemma-3-shaped model: 5 sliding layers of a 512-token window per global one, 6 layers, 1 kv-head of 64, built from
transformers' config with the packaged SmolLM2 tokenizer: the layer-type split without a download; its speeds and
agreement say nothing about a real model).
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from computed import require_computed  # bench/computed.py: a speed is work done, not a cache hit

PREFERRED_ORDER = ["streaming_llm", "h2o", "paged_eviction", "kvcrush", "snapkv", "key_diff"]
# The default set: the seed eviction methods (a few minutes on a 2-core machine); --methods all runs every one.
SEED_METHODS = ["streaming_llm", "h2o", "paged_eviction", "snapkv"]


def default_methods() -> list[str]:
    """The seed methods that are registered, in PREFERRED_ORDER."""
    registered = set(eviction_methods())
    return [n for n in SEED_METHODS if n in registered]


def eviction_methods() -> list[str]:
    """Every registered eviction method (methods.eviction.EvictionMethod), the papers' ones first."""
    from kvbench.methods import METHODS, available_methods
    from kvbench.methods.eviction import EvictionMethod

    names = [n for n in available_methods() if issubclass(METHODS[n], EvictionMethod)]
    return sorted(names, key=lambda n: (PREFERRED_ORDER.index(n) if n in PREFERRED_ORDER else len(PREFERRED_ORDER), n))


def essay_prompts(tokenizer, batch: int, n: int) -> list[list[int]]:
    """`batch` consecutive windows of n tokens from the packaged essays."""
    from kvbench.data.essays import essay_corpus_text

    text = essay_corpus_text()
    need = batch * n
    ids = tokenizer(text[: 6 * need + 10000])["input_ids"]
    if len(ids) < need:
        ids = tokenizer(text)["input_ids"]
    if len(ids) < need:
        raise SystemExit(f"the essays hold {len(ids)} tokens, fewer than {batch} x {n}")
    return [list(ids[i * n:(i + 1) * n]) for i in range(batch)]


def run_method(model, name: str, budget: int, prompts: list[list[int]], new_tokens: int, block_size: int,
               chunk: int, options: dict) -> dict:
    from kvbench.methods import build_method
    from kvbench.runtime.serving.engine import Engine

    method = build_method(name, None if name == "full" else budget, **options)
    cfg = model.config
    per_table = -(-(max(len(p) for p in prompts) + new_tokens) // block_size) + 2
    num_blocks = len(prompts) * cfg.num_layers * cfg.num_kv_heads * per_table + 16
    # prefix caching off: the prefill speed is prompt tokens computed (checked below), never a cache hit
    engine = Engine(model, method, block_size=block_size, num_blocks=num_blocks, prefill_chunk_size=chunk,
                    prefix_caching=False)
    cache = engine.cache
    held: list[int] = []  # pool bytes after each decode step
    end: list[int] = []
    last_layer = cache.method_layers[-1] if cache.method_layers else -1  # hooks see the full layers only
    inner_after, inner_end = method.after_attention, method.on_sequence_end

    def after_attention(ctx):
        inner_after(ctx)
        if ctx.phase == "decode" and ctx.layer == last_layer:
            held.append(cache.kv_bytes_in_use())

    def on_sequence_end(slot):
        if not end:
            end.append(cache.kv_bytes_in_use())  # every sequence still holds its blocks here
        inner_end(slot)

    method.after_attention, method.on_sequence_end = after_attention, on_sequence_end
    method.acts_after_attention = True  # sample the pool after every decode step, `full` included
    engine.runner.layer_hook = method  # the runner read acts_after_attention when the engine was built
    t0 = time.perf_counter()
    gens = engine.generate(prompts, max_new_tokens=new_tokens)
    wall = time.perf_counter() - t0
    stats = engine.memory_stats()
    decode_tokens = sum(g.decode_tokens for g in gens)
    prefilled = require_computed(sum(g.prefill_tokens for g in gens), sum(len(p) for p in prompts), f"{name} prefill")
    decode_s = max(g.decode_s for g in gens)
    row = {
        "method": name, "budget": None if name == "full" else budget,
        "decode_tokens": decode_tokens, "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "prefill_tokens_per_s": prefilled / sum(g.prefill_s for g in gens), "prefill_tokens_computed": prefilled,
        "kv_bytes_end": end[0] if end else 0,
        "kv_bytes_mean": sum(held) / len(held) if held else 0,
        "peak_kv_bytes": stats["peak_kv_bytes"], "full_kv_bytes": stats["full_kv_bytes"],
        **{k: v for k, v in stats.items() if k.endswith("_layers")},  # the split by layer type, where there is one
        "wall_s": wall, "settings": method.describe(),
        "_tokens": [g.token_ids for g in gens],
    }
    del engine
    gc.collect()
    return row


TINY_GEMMA3 = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=64, sliding_window=512, query_pre_attn_scalar=64,
                   max_position_embeddings=32768)


def load_bench_model(spec: str, dtype: str):
    """(kvbench model, tokenizer, name) for --model: a preset, a path / hub id, or tiny-gemma3."""
    from kvbench.runtime.model.loading import load_model

    if spec == "tiny-gemma3":
        import transformers as tf

        from kvbench.runtime.model.families import build_from_transformers
        from kvbench.runtime.model.loading import resolve_dtype

        tok = load_model(dtype=dtype).tokenizer  # the packaged SmolLM2's
        torch.manual_seed(0)
        cfg = tf.Gemma3TextConfig(vocab_size=len(tok), **TINY_GEMMA3)
        hf = tf.AutoModelForCausalLM.from_config(cfg).eval()
        return build_from_transformers(hf, dtype=resolve_dtype(dtype)), tok, spec
    if spec == "smollm2-135m":
        loaded = load_model(dtype=dtype)
    else:
        from kvbench.commands.info import resolve

        path, _, gguf = resolve(spec)
        loaded = load_model(path, gguf_file=gguf, dtype=dtype)
    return loaded.model, loaded.tokenizer, loaded.name


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--methods", default=None,
                    help="comma-separated, or `all` (every eviction method); default: the seed methods "
                         f"({','.join(SEED_METHODS)}); `full` always runs first (the reference)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="smollm2-135m",
                    help="a conf/model preset, a model folder or hub id, or tiny-gemma3 (see the module docstring)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods is None:
        names = default_methods()
        print(f"bench-methods: the seed methods ({', '.join(names)}); every registered eviction method: "
              f"--methods all (make bench-methods ARGS='--methods all'; {len(eviction_methods())} methods, "
              "much longer)", flush=True)
    elif args.methods == "all":
        names = eviction_methods()
    else:
        names = [m for m in args.methods.split(",") if m]
    names = list(dict.fromkeys(n for n in names if n != "full"))
    from kvbench.methods import build_method

    for n in names:  # fail on a bad name before the minutes of `full`
        build_method(n, args.budget)
    model, tokenizer, model_name = load_bench_model(args.model, args.dtype)
    prompts = essay_prompts(tokenizer, args.batch, args.prompt_tokens)
    windows = sorted({w for w in model.config.layer_windows if w is not None})
    layer_note = f" ({sum(w is not None for w in model.config.layer_windows)} of {model.config.num_layers} layers " \
                 f"sliding, window {', '.join(map(str, windows))}: methods compress the full layers only)" if windows else ""
    print(f"bench-methods: {model_name}{layer_note}, {args.dtype}, {torch.get_num_threads()} threads; batch {args.batch} x "
          f"{args.prompt_tokens} prompt tokens + {args.new_tokens} new, budget {args.budget}, "
          f"block {args.block_size}, prefill chunk {args.chunk}", flush=True)
    rows = {}
    for name in ["full"] + names:
        rows[name] = run_method(model, name, args.budget, prompts, args.new_tokens, args.block_size,
                                args.chunk, {})
        r = rows[name]
        print(f"  {name}: {r['decode_tokens_per_s']:.2f} decode tok/s, {r['wall_s']:.0f} s", flush=True)
    full = rows["full"]
    mb = 1024 ** 2
    print(f"{'method':<16}{'decode tok/s':>13}{'x full':>8}{'KV end MiB':>12}{'x full':>8}{'KV mean MiB':>13}"
          f"{'KV peak MiB':>13}{'x full':>8}{'agree':>7}")
    out = {}
    for name, r in rows.items():
        speed = r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        end_ratio = r["kv_bytes_end"] / full["kv_bytes_end"]
        peak_ratio = r["peak_kv_bytes"] / full["peak_kv_bytes"]
        agree = sum(_prefix(a, b) for a, b in zip(r["_tokens"], full["_tokens"])) / (len(prompts) * args.new_tokens)
        print(f"{name:<16}{r['decode_tokens_per_s']:>13.2f}{speed:>8.2f}{r['kv_bytes_end'] / mb:>12.1f}"
              f"{end_ratio:>8.3f}{r['kv_bytes_mean'] / mb:>13.1f}{r['peak_kv_bytes'] / mb:>13.1f}{peak_ratio:>8.3f}"
              f"{agree:>7.2f}")
        out[name] = {k: v for k, v in r.items() if not k.startswith("_")}
        out[name].update(decode_speedup_vs_full=speed, kv_bytes_ratio_vs_full=end_ratio,
                         peak_kv_bytes_ratio_vs_full=peak_ratio, prefix_agreement_with_full=agree)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
