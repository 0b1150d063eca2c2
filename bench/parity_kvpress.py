"""Parity with NVIDIA kvpress: the same model and text through kvbench's methods and kvpress's presses.

For every method both have and every compression ratio, the prompt (the first `--tokens` tokens of the packaged
essays) is compressed by each side; the table prints
  jaccard   mean over (layer, kv-head) of |kept_kvbench & kept_kvpress| / |kept_kvbench | kept_kvpress| (min beside it);
  greedy    whether the `--new-tokens` greedy continuations are identical (and the first token where they differ);
  nll       the mean negative log-likelihood of the text's next `--continuation` tokens, each side scoring them
            against its own compressed prompt (kvbench's Engine.score_continuation, and the same in kvpress: the
            prompt but its last token compressed, then one uncompressed chunk).
kvpress pins its own transformers, so its side runs in its own environment (`--kvpress-python`, default
$KVPRESS_PYTHON or a kvpress_env/bin/python in the checkout or a folder above it, set up with
`python3 -m venv kvpress_env && kvpress_env/bin/pip install kvpress torch==<kvbench's torch>`):
this script (in kvbench's environment) writes a job file, runs itself there with `--side kvpress`, and compares.
The compression ratio r becomes kvbench's budget int(T * (1 - r)) per table (kvpress's n_kept), so a run needs no
ratio support in kvbench. Both sides run the model in float32 on the CPU, kvbench with the torch attention backend.

    .venv/bin/python bench/parity_kvpress.py [--tokens 1024] [--ratios 0.25 0.5 0.75] [--methods knorm tova ...]

Where the definitions differ on purpose, the row says so (NOTES); everything else is expected at Jaccard 1.000.
Shared methods not compared here yet (2026-12-01):
  kvzip: KVzipPress scores after the prompt's forward, when its context manager exits (a reconstruction pass over
    the cache, then masks: module.masked_key_indices per layer, readable after the `with`), but it takes the chat
    template's prefix length (SmolLM2-Instruct has a template) off every context unscored, assuming the prompt
    starts with that prefix; this prompt is raw text, and kvbench's kvzip only skips a prefix that is present.
    Comparing needs the templated prompt on both sides (not done yet). Defaults agree: layerwise false, chunk 2048,
    n_sink 4, 8-token postfix.
  duo_attention: kvpress's duo_attention_on_the_fly(model, num_samples, q_len) calls load_dataset("kmfoda/booksum")
    itself (no text argument; feeding local text means patching that module's load_dataset), kvbench's reads the
    packaged essays; and the board's ratio is its share of streaming heads (see
    conf/experiment/rows/kvpress_leaderboard/duo_attention.yaml).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> (kvbench method, kvbench options, kvpress press class, kvpress options); the options make each side
# run the other's definition where kvbench's defaults differ (decode=none: kvpress presses compress the prompt only)
METHODS = {
    "random": ("random", {"seed": 0}, "RandomPress", {"seed": 0}),
    "knorm": ("knorm", {}, "KnormPress", {}),
    "snapkv": ("snapkv", {"window": 64, "kernel_size": 5}, "SnapKVPress", {"window_size": 64, "kernel_size": 5}),
    "streaming_llm": ("streaming_llm", {"sinks": 4, "prefill_mode": "paper", "decode": "none"},
                      "StreamingLLMPress", {"n_sink": 4}),
    "tova": ("tova", {}, "TOVAPress", {}),
    "expected_attention": ("expected_attention", {}, "ExpectedAttentionPress", {}),
    "lagkv": ("lagkv", {}, "LagKVPress", {}),
    "pyramidkv": ("pyramidkv", {}, "PyramidKVPress", {}),
    "pyramidkv_w16": ("pyramidkv", {"window": 16}, "PyramidKVPress", {"window_size": 16}),
    "keydiff": ("key_diff", {"prefill_keep_first_block": False, "decode": "none"}, "KeyDiffPress", {}),
    # wrappers: kvpress's options name the inner press ("press": [class, options]); AdaKV masks (fake keys), so its
    # kept sets are read from module.masked_key_indices
    "adakv": ("adakv", {"base": "expected_attention"}, "AdaKVPress", {"press": ["ExpectedAttentionPress", {}]}),
    "criticalkv": ("criticalkv", {"base": "snapkv"}, "CriticalKVPress",
                   {"press": ["SnapKVPress", {"window_size": 64, "kernel_size": 5}]}),
}
NOTES = {
    "pyramidkv": "layer budgets: kvbench's sum to layers x budget exactly (kvpress rounds each layer) and start from "
                 "the integer budget (kvpress: T * (1 - r), fractional), which can flip the SnapKV fallback",
    "pyramidkv_w16": "as pyramidkv",
    "keydiff": "kvbench key_diff keeps the first block at prefill by default (here off) and evicts blocks "
               "while decoding (here off)",
    "streaming_llm": "kvbench's default evicts after every chunk and while decoding (here paper / none)",
}


def default_kvpress_python() -> str:
    """$KVPRESS_PYTHON, else the first kvpress_env/bin/python found in the checkout or a folder above it (a venv
    beside the worktrees); "" if none."""
    env = os.environ.get("KVPRESS_PYTHON")
    if env:
        return env
    for folder in Path(__file__).resolve().parents[1:]:
        candidate = folder / "kvpress_env" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return ""


# ------------------------------------------------------------------------------------------------ kvpress side
def kvpress_side(job: dict) -> dict:
    """Run every (method, ratio) of the job through kvpress; kept positions per layer/head, greedy tokens, NLL."""
    from importlib.metadata import version

    import torch
    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    prompt, cont = job["prompt"], job["continuation"]
    out = {"kvpress_version": version("kvpress"), "transformers_version": version("transformers"), "results": {}}
    for name, ratio in job["runs"]:
        _, _, cls, opts = METHODS[name]
        press = build_press(kvpress, cls, opts, ratio)
        kept = record_kept(press)
        with torch.no_grad():
            cache = DynamicCache()
            with press(model):  # compress the prompt, then greedy decoding with the compressed cache
                logits = model(torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
            tokens = [int(logits.argmax())]
            for i in range(job["new_tokens"] - 1):
                pos = torch.tensor([[len(prompt) + i]])
                logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=pos).logits[0, -1]
                tokens.append(int(logits.argmax()))
            layers = {str(k): v for k, v in kept.items()}
            kept.clear()
            cache = DynamicCache()  # NLL: the prompt but its last token compressed, then one plain chunk
            with press(model):
                model(torch.tensor([prompt[:-1]]), past_key_values=cache)
            # one token per step: a multi-token step gets a causal mask sized from layer 0's cache, which fails when
            # layers hold different numbers of tokens (pyramidkv)
            nll = 0.0
            for j, tok in enumerate(prompt[-1:] + cont[:-1]):
                pos = torch.tensor([[len(prompt) - 1 + j]])
                logits = model(torch.tensor([[tok]]), past_key_values=cache, position_ids=pos).logits[0, -1]
                nll -= float(torch.log_softmax(logits.float(), -1)[cont[j]]) / len(cont)
        out["results"][f"{name}@{ratio}"] = {"kept": layers, "greedy": tokens, "nll": nll}
    return out


def build_press(kvpress, cls: str, opts: dict, ratio: float):
    """The press of METHODS[...]: a wrapper gets its inner press ("press": [class, options]) and the ratio through
    its compression_ratio property."""
    opts = dict(opts)
    inner = opts.pop("press", None)
    if inner is None:
        return getattr(kvpress, cls)(compression_ratio=ratio, **opts)
    press = getattr(kvpress, cls)(press=getattr(kvpress, inner[0])(**inner[1]), **opts)
    press.compression_ratio = ratio
    return press


def record_kept(press) -> dict:
    """Wrap press.compress: which input positions each layer's output keys came from -> {layer: [[pos] per head]}.
    Keys are matched by their exact bits (compress gathers rows, so every kept row is a bit-exact copy)."""
    import torch

    kept: dict[int, list[list[int]]] = {}
    inner = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k_out, v_out = inner(module, hidden_states, keys, values, attentions, kwargs)
        masked = getattr(module, "masked_key_indices", None)  # head-wise presses (AdaKV) mask instead of removing
        if masked is not None and k_out.shape[2] == keys.shape[2]:
            b, h, t = (x.cpu() for x in masked)
            drop = torch.zeros(keys.shape[1], keys.shape[2], dtype=torch.bool)
            drop[h[b == 0], t[b == 0]] = True
            kept[module.layer_idx] = [(~drop[i]).nonzero().flatten().tolist() for i in range(keys.shape[1])]
        elif k_out.shape[2] != keys.shape[2] or not torch.equal(k_out, keys):
            w = torch.randint(1, 2**31 - 1, (keys.shape[-1],), generator=torch.Generator().manual_seed(0))
            h_in = (keys[0].contiguous().view(torch.int32).long() * w).sum(-1)  # [H, T] exact integer hashes
            h_out = (k_out[0].contiguous().view(torch.int32).long() * w).sum(-1)  # [H, n]
            heads = []
            for h in range(keys.shape[1]):
                order = h_in[h].argsort()
                idx = order[torch.searchsorted(h_in[h][order], h_out[h]).clamp(max=order.numel() - 1)]
                assert torch.equal(keys[0, h, idx], k_out[0, h]), "a kept key matches no input key"
                heads.append(sorted(idx.tolist()))
            kept[module.layer_idx] = heads
        else:
            kept[module.layer_idx] = [list(range(keys.shape[2]))] * keys.shape[1]
        return k_out, v_out

    press.compress = compress
    return kept


# ------------------------------------------------------------------------------------------------ kvbench side
def kvbench_side(job: dict, loaded) -> dict:
    import torch
    from kvbench.methods import build_method
    from kvbench.runtime.engine import Engine

    torch.set_num_threads(job["threads"])
    prompt, cont = job["prompt"], job["continuation"]
    cfg = loaded.model.config  # a pool for one uncompressed sequence (plus a partly filled block per table)
    tokens = len(prompt) + len(cont) + job["new_tokens"] + 16 * 2
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * tokens * 2
    out = {}
    for name, ratio in job["runs"]:
        method_name, opts, _, _ = METHODS[name]
        kept: dict[str, list[list[int]]] = {}

        def engine_for(n_prompt: int, record: bool):
            method = build_method(method_name, max(1, int(n_prompt * (1 - ratio))), **opts)
            if record:
                inner = method.after_attention

                def after_attention(ctx):
                    inner(ctx)
                    if ctx.phase == "prefill" and ctx.last_chunk:
                        lengths = ctx.cache.lengths[ctx.plan.slot_list[0], ctx.layer]
                        kept[str(ctx.layer)] = [sorted(ctx.cache.positions[ctx.plan.slot_list[0], ctx.layer, h,
                                                                           : int(lengths[h])].tolist())
                                                for h in range(lengths.shape[0])]

                method.after_attention = after_attention
            return Engine(loaded.model, method, prefill_chunk_size=len(prompt) + len(cont),
                          attention_backend="torch", kv_memory_bytes=kv_bytes)

        with torch.no_grad():
            gen = engine_for(len(prompt), True).generate([prompt], max_new_tokens=job["new_tokens"])[0]
            lps, _ = engine_for(len(prompt) - 1, False).score_continuation(prompt, cont)
        out[f"{name}@{ratio}"] = {"kept": kept, "greedy": list(gen.token_ids), "nll": -sum(lps) / len(lps)}
    return out


# ------------------------------------------------------------------------------------------------ comparison
def jaccard(a: dict, b: dict) -> tuple[float, float]:
    """Mean and min Jaccard of kept sets over every (layer, head)."""
    vals = []
    for layer, heads in a.items():
        for ha, hb in zip(heads, b[layer]):
            sa, sb = set(ha), set(hb)
            vals.append(len(sa & sb) / max(1, len(sa | sb)))
    return sum(vals) / len(vals), min(vals)


def first_difference(x: list[int], y: list[int]) -> int | None:
    for i, (p, q) in enumerate(zip(x, y)):
        if p != q:
            return i
    return None if len(x) == len(y) else min(len(x), len(y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=["driver", "kvpress"], default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--kvpress-python", default=default_kvpress_python(),
                    help="kvpress's environment's python (default: $KVPRESS_PYTHON, else kvpress_env/bin/python in "
                         "the checkout or a folder above it)")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens (the packaged essays)")
    ap.add_argument("--continuation", type=int, default=64, help="text tokens scored for the NLL")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write every figure here")
    args = ap.parse_args()
    if args.side == "kvpress":
        Path(args.out).write_text(json.dumps(kvpress_side(json.loads(Path(args.job).read_text()))))
        return

    from kvbench.data.essays import essay_corpus_text
    from kvbench.runtime.loading import load_model

    if not args.kvpress_python or not Path(args.kvpress_python).exists():
        sys.exit(f"kvpress environment not found{': ' + args.kvpress_python if args.kvpress_python else ''}: "
                 "pass --kvpress-python (or set KVPRESS_PYTHON)")
    loaded = load_model(keep_hf=True)  # the packaged SmolLM2-135M-Instruct, float32, CPU
    ids = loaded.tokenizer(essay_corpus_text(), add_special_tokens=False)["input_ids"]
    job = {"model_dir": str(loaded.hf_dir), "prompt": ids[: args.tokens],
           "continuation": ids[args.tokens: args.tokens + args.continuation], "new_tokens": args.new_tokens,
           "threads": args.threads, "runs": [(m, r) for m in args.methods for r in args.ratios]}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "kvpress.json"
        job_path.write_text(json.dumps(job))
        subprocess.run([args.kvpress_python, __file__, "--side", "kvpress", "--job", str(job_path),
                        "--out", str(out_path)], check=True)
        theirs = json.loads(out_path.read_text())
    ours = kvbench_side(job, loaded)
    rows = []
    print(f"kvpress {theirs['kvpress_version']} (transformers {theirs['transformers_version']}) vs kvbench; "
          f"model {loaded.name}; prompt {args.tokens} tokens, NLL over {args.continuation}, greedy {args.new_tokens}")
    print(f"{'method':<20} {'ratio':>5} {'jaccard':>8} {'min':>6} {'greedy':>8} {'nll kvbench':>12} "
          f"{'nll kvpress':>12}")
    for m in args.methods:
        for r in args.ratios:
            a, b = ours[f"{m}@{r}"], theirs["results"][f"{m}@{r}"]
            mean_j, min_j = jaccard(a["kept"], b["kept"])
            diff = first_difference(a["greedy"], b["greedy"])
            row = {"method": m, "ratio": r, "jaccard": mean_j, "jaccard_min": min_j, "greedy_equal": diff is None,
                   "greedy_first_difference": diff, "nll_kvbench": a["nll"], "nll_kvpress": b["nll"],
                   "note": NOTES.get(m, "")}
            rows.append(row)
            greedy = "same" if diff is None else f"@{diff}"
            print(f"{m:<20} {r:>5.2f} {mean_j:>8.3f} {min_j:>6.3f} {greedy:>8} {a['nll']:>12.4f} {b['nll']:>12.4f}"
                  + (f"  ({row['note']})" if row["note"] else ""))
            assert math.isfinite(a["nll"]) and math.isfinite(b["nll"])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
