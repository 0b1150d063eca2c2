"""Batch-1 decode at context 512 beside one busy process, kvbench alone (bench_runtime's loaded scenario without
the interleaved transformers steps, whose own swings move that figure): decode tok/s of each run, as JSON.

    python bench/loaded_decode.py [--runs 4] [--tokens 32]

Run it from two checkouts alternately (PYTHONPATH=<checkout>/src) to compare code under load."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import kvbench  # noqa: F401  (sets kvbench's OpenMP wait policy before torch loads libgomp)
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from kvbench.runtime.backends.cpu.threads import configure_threads
    from kvbench.runtime.model.loading import load_model
    from kvbench.runtime.serving.engine import Engine

    configure_threads(None)
    model = load_model(dtype="float32").model
    prompt = torch.randint(0, model.config.vocab_size, (512,), generator=torch.Generator().manual_seed(512)).tolist()
    engine = Engine(model, prefill_chunk_size=512, prefix_caching=False)  # prefix caching off: every run computes

    def decode() -> float:
        out = engine.generate([prompt], max_new_tokens=args.tokens)[0]
        return out.decode_tokens / out.decode_s

    decode()  # warm-up: the pool's pages faulted in, the kernels loaded
    idle = [decode() for _ in range(2)]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it start spinning
        loaded = [decode() for _ in range(args.runs)]
    finally:
        busy.kill()
        busy.wait()
    print(json.dumps({"kvbench": kvbench.__file__, "idle_decode_tokens_per_s": [round(x, 2) for x in idle],
                      "loaded_decode_tokens_per_s": [round(x, 2) for x in loaded]}))


if __name__ == "__main__":
    main()
