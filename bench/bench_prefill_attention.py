"""Chunked-prefill attention on CPU: kvbench's C prefill kernel (csrc/codec_decode.c) against the torch reference.

A later prefill chunk (Q queries over a cache that already holds earlier tokens) attends causally over every cached
key. For SmolLM2-135M's attention shape (3 kv-heads, 3 query heads each, head dim 64, blocks of 16), one sequence,
chunks of --chunk queries at each context in --contexts (keys cached before the chunk), this times
the CPU backend's attention (the C prefill kernel, reading blocks in place) against the torch backend's (gather
or dequantize the layer, then attend), over a full-precision fp32 cache and a KIVI-2 cache (packed by its rule),
best of --repeats, on the same random tensors in this process. It prints GFLOP/s (2 x 2 x Hq x D flops per visible query-key pair) and the C kernel's
ratio to the reference, the largest difference of their outputs, and ends with one JSON
line {"shapes": {"Q@context": {...}}}.

    python bench/bench_prefill_attention.py [--threads 2] [--repeats 5] [--chunk 512] [--contexts 512 1536 2560]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

H, G, D, BS = 3, 3, 64, 16  # SmolLM2-135M: kv-heads, query heads per kv-head, head dim; block size


def best_time(fn, repeats: int) -> float:
    """Seconds per call: the best of `repeats` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def filled_cache(codec, T: int, Q: int, gen: torch.Generator):
    """A one-layer cache (`codec` None: full precision) holding T tokens of one sequence, written in chunks of Q and
    packed by the codec's rule, and the plan of its last chunk (the Q newest tokens as the queries' positions)."""
    from kvbench.runtime.cache.caches import build_cache, codec_block_size
    from kvbench.runtime.cache.kv_geometry import block_bytes

    bs = codec_block_size(codec, BS) if codec is not None else BS
    mem = (3 * H * (T // bs + 2)) * block_bytes(bs, D, torch.float32)
    cache = build_cache(codec=codec, kv_memory_bytes=mem, num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs,
                        dtype=torch.float32, device="cpu", max_seqs=1)
    slot = cache.add_sequence()
    for a in range(0, T, Q):
        n = min(Q, T - a)
        plan = cache.prepare_append([slot], torch.arange(a, a + n).unsqueeze(0))
        k = torch.randn(1, H, n, D, generator=gen) * 2 + torch.linspace(-3, 3, D)
        cache.write(0, plan, k, torch.randn(1, H, n, D, generator=gen))
    if codec is not None:
        cache.pack_pending()
    return cache, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512, help="queries per chunk")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1536, 2560],
                    help="keys cached before the chunk")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvbench.quant.registry import build_codec
    from kvbench.runtime.backends.cpu import kernels
    from kvbench.runtime.backends.cpu.backend import CPU
    from kvbench.runtime.backends.torch.backend import TORCH

    if not kernels.available():
        raise SystemExit("bench_prefill_attention: the CPU kernels are not available on this machine (no C compiler?)")
    print(f"C prefill kernel built for {kernels.vector_width()} floats per vector, {torch.get_num_threads()} threads; "
          f"{H} kv-heads x {G} query heads, head dim {D}, blocks of {BS}")
    gen = torch.Generator().manual_seed(0)
    scale = D ** -0.5
    results = {}
    with torch.inference_mode():
        for ctx in args.contexts:
            Q = args.chunk
            flops = 4 * H * G * D * (Q * ctx + Q * (Q + 1) / 2)
            row = {}
            q = torch.randn(1, H * G, Q, D, generator=gen)
            for name, codec in (("fp32", None), ("kivi2", build_codec("kivi", None, bits=2))):
                cache, plan = filled_cache(codec, ctx + Q, Q, gen)
                c = lambda: cache.attend(0, q, plan, scale, backend=CPU, causal=True)[0]
                ref = lambda: cache.attend(0, q, plan, scale, backend=TORCH, causal=True)[0]
                row[f"{name}_max_abs_diff"] = float((c() - ref()).abs().max())
                t_c, t_ref = best_time(c, args.repeats), best_time(ref, args.repeats)
                row[f"{name}_c_gflops"], row[f"{name}_torch_gflops"] = flops / t_c / 1e9, flops / t_ref / 1e9
                row[f"{name}_c_over_torch"] = t_ref / t_c
            results[f"{Q}@{ctx}"] = row
            print(f"  chunk {Q:5d} after {ctx:5d} keys: fp32 C {row['fp32_c_gflops']:6.1f} GFLOP/s, torch "
                  f"{row['fp32_torch_gflops']:6.1f} ({row['fp32_c_over_torch']:.2f}x); KIVI-2 C "
                  f"{row['kivi2_c_gflops']:6.1f}, torch {row['kivi2_torch_gflops']:6.1f} "
                  f"({row['kivi2_c_over_torch']:.2f}x); max |C - torch| {row['fp32_max_abs_diff']:.1e} / "
                  f"{row['kivi2_max_abs_diff']:.1e}", flush=True)
    print(json.dumps({"vector_width": kernels.vector_width(), "threads": torch.get_num_threads(),
                      "shapes": results}))



if __name__ == "__main__":
    main()
