"""GPU benchmark of the Triton paged-attention kernel (not a test; needs a CUDA/ROCm GPU).

    python bench/bench_triton_attention.py [--dtype bf16] [--quick]

For each shape: a correctness check against gather + dense attention in fp32, then the time of
- triton:        paged_attention_triton (block tables scattered over the pool),
- triton+scores: the same with return_key_scores=True (second pass over the table),
- sdpa dense:    torch scaled_dot_product_attention on a contiguous [B, H_kv, T, D] cache (no paging: a lower bound
                 that a paged kernel tries to approach),
and, for decode, the K/V bandwidth the kernel reached (bytes of the table read once per group / time).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvbench.runtime.backends.triton.attention import paged_attention_triton  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build(B, H_kv, group, D, ctx, Q, block_size, dtype, device, seed=0):
    """A full (uncompressed) paged cache of ctx tokens per table, blocks scattered over the pool; the Q queries
    are the last Q tokens (causal chunk; Q=1 is decode)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb = math.ceil(ctx / block_size)
    num_blocks = B * H_kv * nb
    k_pool = torch.randn(num_blocks, block_size, D, generator=g).to(dtype).to(device)
    v_pool = torch.randn(num_blocks, block_size, D, generator=g).to(dtype).to(device)
    block_tables = torch.randperm(num_blocks, generator=g).view(B, H_kv, nb).to(torch.int32).to(device)
    lengths = torch.full((B, H_kv), ctx, dtype=torch.int32, device=device)
    key_positions = torch.arange(nb * block_size, dtype=torch.int32, device=device).expand(B, H_kv, -1).contiguous()
    query_positions = torch.arange(ctx - Q, ctx, dtype=torch.int32, device=device).expand(B, -1).contiguous()
    q = torch.randn(B, H_kv * group, Q, D, generator=g).to(dtype).to(device)
    return q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions


def dense_kv(k_pool, v_pool, block_tables, ctx):
    B, H_kv, nb = block_tables.shape
    bs, D = k_pool.shape[1:]
    k = k_pool[block_tables.long()].view(B, H_kv, nb * bs, D)[:, :, :ctx].contiguous()
    v = v_pool[block_tables.long()].view(B, H_kv, nb * bs, D)[:, :, :ctx].contiguous()
    return k, v  # [B, H_kv, ctx, D]


def sdpa(q, k, v, ctx, scale):
    Q = q.shape[2]
    mask = None
    if Q > 1:  # causal chunk at the end of the context
        qpos = torch.arange(ctx - Q, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [Q, ctx]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def check(case, ctx, scale, dtype):
    q, k_pool, v_pool, block_tables, *_ = case
    out, ks = paged_attention_triton(*case, scale, return_key_scores=True)
    k, v = dense_kv(k_pool, v_pool, block_tables, ctx)
    ref = sdpa(q.float(), k.float(), v.float(), ctx, scale)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    err = (out.float() - ref).abs().max().item()
    assert err < tol * 4, f"max abs error {err:.3g} vs dense fp32 attention"
    # every valid row hands out probability 1: total per table = group * Q
    group = q.shape[1] // block_tables.shape[1]
    total = ks.sum(-1)
    assert torch.allclose(total, torch.full_like(total, group * q.shape[2]), rtol=1e-3), total
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a GPU (the CPU interpreter is far too slow to time)")
    import triton.testing

    dtype, device, bs = DTYPES[args.dtype], "cuda", args.block_size
    H_kv, group, D = 8, 4, 128  # Llama-3.1-8B attention shape
    shapes = [  # (B, ctx, Q)
        (1, 1024, 1), (1, 16384, 1), (8, 4096, 1), (32, 4096, 1), (64, 1024, 1),
        (1, 4096, 128), (1, 8192, 512), (4, 4096, 512),
    ]
    if args.quick:
        shapes = [(1, 4096, 1), (32, 4096, 1), (1, 4096, 512)]
    print(f"dtype={args.dtype} block_size={bs} H_kv={H_kv} group={group} D={D} on {torch.cuda.get_device_name()}")
    print(f"{'B':>3} {'ctx':>6} {'Q':>4} | {'err':>8} | {'triton ms':>9} {'+scores ms':>10} {'sdpa ms':>8} | "
          f"{'KV GB/s':>8}")
    for B, ctx, Q in shapes:
        scale = D ** -0.5
        case = build(B, H_kv, group, D, ctx, Q, bs, dtype, device)
        err = check(case, ctx, scale, dtype)
        q, k_pool, v_pool, block_tables, *_ = case
        k, v = dense_kv(k_pool, v_pool, block_tables, ctx)
        t = triton.testing.do_bench(lambda: paged_attention_triton(*case, scale))
        t_s = triton.testing.do_bench(lambda: paged_attention_triton(*case, scale, return_key_scores=True))
        t_d = triton.testing.do_bench(lambda: sdpa(q, k, v, ctx, scale))
        kv_bytes = 2 * B * H_kv * ctx * D * k_pool.element_size()
        gbs = kv_bytes / (t * 1e-3) / 1e9
        print(f"{B:>3} {ctx:>6} {Q:>4} | {err:8.2e} | {t:9.3f} {t_s:10.3f} {t_d:8.3f} | {gbs:8.1f}")
        del case, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
