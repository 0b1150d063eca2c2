"""Tensor parallel over torch.distributed: time and KV bytes per rank at TP 1 and TP N (figures, no speed target).

    python bench/bench_distributed.py [--nproc 2] [--prompt 512] [--new 32] [--repeats 3]

Spawns --nproc processes (gloo on CPU, one thread each unless --threads; NCCL on one GPU per rank where CUDA has
as many GPUs). One random Llama-family model (fp32 on CPU, bf16 on GPU; --layers/--hidden/--heads/--kv-heads, a
kv-head count that --nproc divides) is built identically on every rank. TP=1: rank 0 alone runs the whole model
while the others wait; TP=N: every rank runs its shard (kvbench/runtime/model/tensor_parallel.py). Each measures a
prefill of --prompt tokens (engine.score, fresh engine each repeat) and a greedy decode of --new tokens, and reads
its own pool's peak bytes. One JSON line per TP value with per-rank figures, then one with the ratios TP=N / TP=1
(same process group, same run; this bench measures, it sets no target). On CPU the TP=1 decode takes kvbench's
fused C decode step (whole layers per call) and a shard runs layer by layer with two gloo all-reduces per layer,
so the decode ratio there measures that difference as well as the halved matmuls.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch


def _model(args, device: str, dtype: torch.dtype):
    import transformers as tf

    from kvbench.runtime.model.families import build_from_transformers

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=4096,
                         max_position_embeddings=8192)
    hf = tf.AutoModelForCausalLM.from_config(cfg).eval()
    full = build_from_transformers(hf, dtype=dtype, device="cpu")  # sharded from host memory
    return full, (full if device == "cpu" else build_from_transformers(hf, dtype=dtype, device=device))


def _measure(model, args, device) -> dict:
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.scoring import Scorer

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4096, (args.prompt,), generator=gen).tolist()
    prefill, decode, peak = [], [], None
    for _ in range(args.repeats):
        eng = Engine(model, None, block_size=16, prefill_chunk_size=512, prefix_caching=False, cuda_graphs=False)
        _sync(device)
        t0 = time.perf_counter()
        Scorer(eng).score(ids)
        _sync(device)
        prefill.append(args.prompt / (time.perf_counter() - t0))
        eng = Engine(model, None, block_size=16, prefill_chunk_size=512, prefix_caching=False, cuda_graphs=False)
        out = eng.generate([ids], max_new_tokens=args.new, stop_token_ids=[], temperature=0.0)[0]
        decode.append(out.decode_tokens / out.decode_s if out.decode_s > 0 else None)
        peak = eng.memory_stats()["peak_kv_bytes"]
        kv_heads = eng.cache.num_kv_heads
    return {"prefill_tokens_per_s": statistics.median(prefill),
            "decode_tokens_per_s": statistics.median([d for d in decode if d is not None]),
            "peak_kv_bytes": peak, "kv_heads": kv_heads, "prompt_tokens": args.prompt, "new_tokens": args.new}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    from kvbench.runtime.model import distributed
    from kvbench.runtime.model.tensor_parallel import shard_model

    layout = distributed.init_from_env(tensor_parallel=world)
    device = layout.device or "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    full, whole = _model(args, device, dtype)  # whole: the unsharded model on this rank's device
    rows = {}
    with torch.inference_mode():
        one = _measure(whole, args, device) if rank == 0 else None
        distributed.all_gather_objects(None)  # the other ranks wait for TP=1 to finish
        shard = shard_model(full, layout.tp_rank, layout.tp_size, layout.tp_group, device=device)
        mine = _measure(shard, args, device)
    every = distributed.all_gather_objects(mine)
    if rank == 0:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        common = {"backend": backend, "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
                  "threads_per_rank": args.threads, "layers": args.layers, "hidden": args.hidden,
                  "heads": args.heads, "kv_heads": args.kv_heads, "dtype": str(dtype).replace("torch.", "")}
        rows[1] = {"tensor_parallel": 1, **common, "ranks": [one], "peak_kv_bytes": one["peak_kv_bytes"]}
        rows[world] = {"tensor_parallel": world, **common, "ranks": every,
                       "peak_kv_bytes": sum(r["peak_kv_bytes"] for r in every)}
        for row in rows.values():
            print(json.dumps(row), flush=True)
        lead = every[0]
        print(json.dumps({"bench": "tensor_parallel", "tensor_parallel": world,
                          "prefill_ratio": round(lead["prefill_tokens_per_s"] / one["prefill_tokens_per_s"], 3),
                          "decode_ratio": round(lead["decode_tokens_per_s"] / one["decode_tokens_per_s"], 3),
                          "kv_bytes_per_rank_ratio": round(lead["peak_kv_bytes"] / one["peak_kv_bytes"], 3),
                          "kv_bytes_total_ratio": round(rows[world]["peak_kv_bytes"] / one["peak_kv_bytes"], 3)}),
              flush=True)
    distributed.destroy()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    args = p.parse_args(argv)
    if args.kv_heads % args.nproc or args.heads % args.nproc:
        p.error(f"--nproc {args.nproc} must divide --heads {args.heads} and --kv-heads {args.kv_heads}")
    if torch.cuda.is_available() and torch.cuda.device_count() < args.nproc:
        p.error(f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPU(s) here (one per rank)")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    main()
