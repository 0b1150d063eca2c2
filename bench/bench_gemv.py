"""The decode projections on CPU: kvbench's C GEMV (csrc/decode_ops.c) against oneDNN's packed linear, per row count.

A decode step of S sequences multiplies S rows by every weight of the model. For each projection shape of the
packaged SmolLM2-135M (qkv, o, gate_up, down, the LM head) and S in 1, 2, 4, 8, 12, 16, this times
`kernels.gemv` (the fused decode step's projections, and `Linear` up to its row limit) and oneDNN
(`Linear`'s packed path) on the same random weights in this process, best of --repeats, and prints GFLOP/s and the
ratio. The register tile the C kernel was built with (4 x 2 on AVX2, 8 x 3 on AVX-512) is named in the header line.
The last line is one JSON object {"vector_width": ..., "shapes": {"OxI": {"rows": {S: {...}}}}}.

    python bench/bench_gemv.py [--threads 2] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

# name -> (out, in) of SmolLM2-135M's projections (hidden 576, 9 + 2 x 3 heads of 64, intermediate 1536)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 12, 16)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvbench.runtime.backends.cpu import kernels
    from kvbench.runtime.backends.cpu.linear import Linear

    if not kernels.available():
        raise SystemExit("bench_gemv: the CPU kernels are not available on this machine (no C compiler?)")
    vn = kernels.vector_width()
    print(f"C GEMV built for {vn} floats per vector (register tile {'8 x 3' if vn == 16 else '4 x 2'}), "
          f"{torch.get_num_threads()} threads")
    torch.manual_seed(0)
    out = {"vector_width": vn, "threads": torch.get_num_threads(), "shapes": {}}
    with torch.inference_mode():
        for name, (O, I) in SHAPES.items():
            w = torch.randn(O, I)
            lin = Linear(w)
            inner = max(3, int(2e8 // (O * I * 8)))
            rows = {}
            for m in ROWS:
                x = torch.randn(m, I)
                t_c = best_time(lambda: kernels.gemv(x, w, None), args.repeats, inner)
                if lin._packed is not None:
                    t_d = best_time(lambda: lin._onednn_linear(x, lin._packed, None, "none", [None], ""),
                                    args.repeats, inner)
                else:
                    t_d = float("nan")
                flop = 2.0 * O * I * m
                rows[m] = {"c_gflops": flop / t_c / 1e9, "onednn_gflops": flop / t_d / 1e9, "c_over_onednn": t_d / t_c}
                print(f"  {name:8s} {O:6d} x {I:5d}  rows {m:2d}  C {rows[m]['c_gflops']:6.1f} GFLOP/s  "
                      f"oneDNN {rows[m]['onednn_gflops']:6.1f}  C speed x {rows[m]['c_over_onednn']:.2f}")
            out["shapes"][f"{name} {O}x{I}"] = {"rows": rows}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
