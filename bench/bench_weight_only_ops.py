"""torch's weight-only CPU ops against the fp32 linear kvbench runs today (issue 66 item 2's first measurement).

For each projection shape (Gemma 3 270M's fused gate/up and down, a 7B Llama's q, gate/up and down) and row count
(1 and 16: decode at batch 1 and 16; 128: a prefill chunk), this times, on the same random weights in this process,
best of --repeats:
  fp32  torch.nn.functional.linear on fp32 weights (today's path: every GGUF de-quantized)
  int8  torch.ops.aten._weight_int8pack_mm: int8 weights, one fp32 scale per output row (no GGUF type maps onto it
        exactly: Q8_0 has a scale per 32 weights)
  int4  torch.ops.aten._weight_int4pack_mm_for_cpu, groups of 32 with an fp32 scale and zero each: Q4_0 (zero 0) and
        Q4_K (scale d*sc, zero 8*d*sc - dmin*m) map onto it exactly
and prints tok/s-like calls/s, GB/s of weight bytes read and the ratio to fp32, each op checked against its own
de-quantized fp32 weights first. The last line is one JSON object.

    python bench/bench_weight_only_ops.py [--threads 2] [--repeats 5] [--rows 1,16,128] [--shapes 7b_q,...] [--quick]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

# name -> (out, in)
SHAPES = {"gemma270m_gate_up": (4096, 640), "gemma270m_down": (640, 2048), "7b_q": (4096, 4096),
          "7b_gate_up": (22016, 4096), "7b_down": (4096, 11008)}
ROWS = (1, 16, 128)
GROUP = 32


def best_time(fn, repeats: int, inner: int) -> float:
    """Seconds per call: the best of `repeats` means over `inner` calls, after two warm-up calls."""
    fn(), fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scales [N], their fp32 de-quantization) of w [N, K], one scale per row."""
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale, q.float() * scale[:, None]


def int4_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int4, scales_and_zeros [K/32, N, 2], fp32 de-quantization) of w [N, K], asymmetric groups of 32 as
    Q4_K's sub-blocks: w = (q - 8) * scale + zero."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)  # [N, K/32]
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale
    deq = ((q.float() - 8) * scale[..., None] + zero[..., None]).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1)
    return packed, torch.stack([scale.T, zero.T], dim=-1).contiguous(), deq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--quick", action="store_true", help="the Gemma shapes and 1 row only (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    rows_list = tuple(int(r) for r in args.rows.split(","))
    if args.quick:
        shapes, rows_list = {k: v for k, v in shapes.items() if k.startswith("gemma")}, (1,)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
          f"best of {args.repeats}")
    out: dict = {"threads": args.threads, "torch": torch.__version__, "shapes": {}}
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=g) * 0.02
        q8, s8, deq8 = int8_weights(w)
        q4, sz4, deq4 = int4_weights(w)
        ops = {
            "fp32": (lambda x: torch.nn.functional.linear(x, w), w, 4 * n * k),
            "int8": (lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8), deq8, n * k + 4 * n),
            "int4": (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, GROUP, sz4), deq4,
                     n * k // 2 + 8 * n * k // GROUP),
        }
        per_rows: dict = {}
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g)
            res: dict = {}
            for op, (fn, deq, nbytes) in ops.items():
                err = (fn(x) - x @ deq.T).abs().max().item()
                assert err < 1e-3, f"{op} {name} rows {rows}: off its own de-quantized weights by {err}"
                inner = max(1, int(2e8 // (n * k * max(rows, 4))))
                t = best_time(lambda: fn(x), args.repeats, inner)
                res[op] = {"ms": round(t * 1e3, 4), "weight_GBps": round(nbytes / t / 1e9, 2)}
            for op in ("int8", "int4"):
                res[op]["speedup_vs_fp32"] = round(res["fp32"]["ms"] / res[op]["ms"], 3)
            per_rows[rows] = res
            print(f"{name:18s} {n}x{k} rows {rows:4d}: " + "  ".join(
                f"{op} {r['ms']:.3f} ms ({r['weight_GBps']} GB/s)" + (f" x{r['speedup_vs_fp32']}" if op != "fp32"
                                                                      else "") for op, r in res.items()))
        out["shapes"][name] = {"out": n, "in": k, "rows": per_rows}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
