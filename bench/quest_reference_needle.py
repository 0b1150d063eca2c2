"""Quest as its official evaluation code runs it, over transformers' own attention: the reference for kvbench's
quest on the needle task (tests/methods/test_quest_needle.py).

The attention below transcribes mit-han-lab/Quest evaluation/quest_attention.py's decode path (the keys repeated over
the GQA group, the sign trick, each 16-token chunk's max, local_heavy_hitter_mask's top max(3, budget // 16) chunks
per query head, layers 0 and 1 and prefill dense) into a transformers attention function, registered as
"quest_official" and run by the packaged SmolLM2 through `generate` (greedy). `--gqa union` gives every query head of
a kv-head the union of its group's chunks, as kvbench's default; `--budget 0` runs transformers' eager attention
alone (the control). The prompts are a kvbench needle run's own
(`samples.jsonl`, tokenized the same way): the predictions and scores printed beside the run's show whether a
difference lies in kvbench or in the method on this model.

    python -m kvbench method=quest budget=512 task=needle 'task.lengths=[4096]' 'task.depths=[0,50,100]' \\
        results_dir=/tmp/needle
    python bench/quest_reference_needle.py /tmp/needle/<run>/samples.jsonl --budget 512 [--gqa per_head|union]
"""
from __future__ import annotations

import argparse
import json
import math

import kvbench  # noqa: F401  (kvbench's OpenMP settings before torch loads)
import torch


def official_mask(q: torch.Tensor, k: torch.Tensor, budget: int, chunk: int) -> torch.Tensor:
    """local_heavy_hitter_mask over the official code's quantized weights: q [B, Hq, 1, D], k [B, Hq, T, D] (already
    repeated) -> bool [B, Hq, 1, T] (the chunks each query head keeps)."""
    T = k.shape[-2]
    sign = (q > 0) + (~(q > 0)) * -1
    max_key = k * sign
    pad = chunk - ((T - 1) % chunk + 1)
    max_key = torch.cat([max_key, torch.full((*max_key.shape[:2], pad, max_key.shape[3]),
                                             torch.finfo(max_key.dtype).min)], dim=-2)
    chunk_max = max_key.reshape(*max_key.shape[:2], max_key.shape[2] // chunk, chunk, max_key.shape[3]).amax(-2)
    chunk_max = chunk_max.unsqueeze(-2).repeat(1, 1, 1, chunk, 1).reshape(*chunk_max.shape[:2], -1,
                                                                          chunk_max.shape[-1])[:, :, :T]
    weight = torch.matmul((q * sign).float(), chunk_max.transpose(2, 3).float())  # [B, Hq, 1, T]
    token_budget = min(T, budget)
    w = torch.cat([weight, torch.full((*weight.shape[:3], pad), torch.finfo(weight.dtype).min)], dim=-1)
    chunk_w = w.reshape(*w.shape[:3], w.shape[3] // chunk, chunk).amax(-1)
    k_top = min(max(3, token_budget // chunk), chunk_w.shape[-1])
    top = chunk_w.topk(k_top, dim=-1).indices
    top = (top.unsqueeze(-1) * chunk + torch.arange(chunk)).reshape(*top.shape[:3], -1)
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask.scatter_(-1, top, True)
    return mask[..., :T]


def make_attention(budget: int, gqa: str, chunk: int = 16, dense_layers: int = 2):
    """A transformers attention function: eager attention, with Quest's chunk mask on one-token decode steps."""

    def quest_official(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        G = module.num_key_value_groups
        k = key.repeat_interleave(G, dim=1)  # repeat_kv
        v = value.repeat_interleave(G, dim=1)
        scaling = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask[:, :, :, : k.shape[-2]]
        if query.shape[-2] == 1 and module.layer_idx >= dense_layers:
            mask = official_mask(query, k, budget, chunk)
            if gqa == "union":  # every query head of a kv-head reads its group's chunks
                B, Hq = mask.shape[:2]
                mask = mask.view(B, Hq // G, G, 1, -1).any(2, keepdim=True).expand(-1, -1, G, -1, -1).reshape(
                    mask.shape)
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
        p = torch.softmax(w.float(), dim=-1).to(query.dtype)
        out = torch.matmul(p, v).transpose(1, 2).contiguous()
        return out, p

    return quest_official


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("samples", help="a kvbench needle run's samples.jsonl (its prompts and predictions)")
    ap.add_argument("--budget", type=int, default=512, help="0: no retrieval, transformers' eager attention (the control)")
    ap.add_argument("--gqa", choices=("per_head", "union"), default="per_head")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--key-phrases", nargs="+", default=None, help="default: the default needle's (sandwich, ...)")
    args = ap.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM

    from kvbench.data.needle import needle_score
    from kvbench.runtime.model.loading import load_model

    AttentionInterface.register("quest_official", make_attention(args.budget, args.gqa))
    attention = "quest_official" if args.budget > 0 else "eager"
    folder = load_model(dtype="float32").name  # the packaged model's converted folder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attention).eval()
    rows = [json.loads(line) for line in open(args.samples)]
    found = 0
    for row in rows:
        ids = tok(row["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        pred = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        score = needle_score(pred, *([args.key_phrases] if args.key_phrases else []))
        found += score
        print(json.dumps({"id": row["id"], "prompt_tokens": ids.shape[1], "kvbench_prompt_tokens": row["prompt_tokens"],
                          "official_score": score, "kvbench_score": row["score"], "official_prediction": pred,
                          "kvbench_prediction": row["prediction"]}))
    print(json.dumps({"budget": args.budget, "gqa": args.gqa, "official_found": found, "of": len(rows),
                      "kvbench_found": sum(r["score"] for r in rows)}))


if __name__ == "__main__":
    main()
