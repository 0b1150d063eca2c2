"""Parity with NVIDIA kvpress: the same model and text through kvbench's methods and kvpress's presses.

For every method both have and every compression ratio, the prompt (the first `--tokens` tokens of the packaged
essays) is compressed by each side; the table prints
  jaccard   mean over (layer, kv-head) of |kept_kvbench & kept_kvpress| / |kept_kvbench | kept_kvpress| (min beside it);
  greedy    whether the `--new-tokens` greedy continuations are identical (and the first token where they differ);
  nll       the mean negative log-likelihood of the text's next `--continuation` tokens, each side scoring them
            against its own compressed prompt (kvbench's Scorer.score_continuation, and the same in kvpress: the
            prompt but its last token compressed, then one uncompressed chunk).
kvpress pins its own transformers, so its side runs in its own environment (`--kvpress-python`, default
$KVPRESS_PYTHON or a kvpress_env/bin/python in the checkout or a folder above it, set up with
`python3 -m venv kvpress_env && kvpress_env/bin/pip install kvpress torch==<kvbench's torch>`; kvpress 0.5.5 cannot go
into kvbench's own environment: it requires transformers < 5.3 and pandas < 3. Offline, a venv that reads kvbench's
site-packages through a .pth file (for torch) and holds `kvpress==0.5.5 "transformers<5.3" "tokenizers<=0.23.0"
"huggingface-hub<2" "pandas<3" "cachetools<6" "fire<0.7" termcolor peft` installed with --no-deps works, with
kvbench's newer `kernels` package hidden from transformers 5.2 (a `kernels/__init__.py` raising ImportError)):
this script (in kvbench's environment) writes a job file, runs itself there with `--side kvpress`, and compares.
The compression ratio r becomes kvbench's budget int(T * (1 - r)) per table (kvpress's n_kept), so a run needs no
ratio support in kvbench. Both sides run the model in float32 on the CPU, kvbench with the torch attention backend.

    .venv/bin/python bench/parity_kvpress.py [--tokens 1024] [--ratios 0.25 0.5 0.75] [--methods knorm tova ...]
        [--text-file held_out.txt]   # another text than the packaged essays

Where the definitions differ on purpose, the row says so (NOTES); everything else is expected at Jaccard 1.000.
Two rows need more than a ratio (2026-12-02):
  kvzip: KVzipPress takes the chat template's prefix length (the tokens before a user message's content; 24 for
    SmolLM2-Instruct) off every context unscored, assuming the context starts with it, as its pipeline's does. Its
    prompt here is that prefix + the text (--tokens in all; PROMPTS; chat_prompt checks it against the pipeline's
    preprocess), so both skip the same prefix (kvbench's kvzip skips one that is present); both keep the
    first n_sink = 4 tokens. KVzipPress scores when its context manager exits and masks: its kept sets are read
    from module.masked_key_indices after the `with`, kvbench's after its after_prefill_chunk eviction. kvpress prunes
    int(L x H x T x r) over the sequence, kvbench keeps L x H x int(T x (1 - r)): the same at --tokens 1024 (a
    multiple of 4), up to L x H - 1 tokens apart otherwise (the NLL's prompt, T - 1 = 1023: kvpress keeps 23 / 45 /
    68 tokens more at 0.25 / 0.5 / 0.75, of 92k; at --tokens 1025 the NLLs agree to 4 decimals and the kept sets,
    rounded apart, are at Jaccard 0.998-0.999).
  duo_attention: the ratio is the share of streaming kv-heads on both sides (kvpress's leaderboard sets
    DuoAttentionPress.head_compression_ratio to it; kvbench's head_compression_ratio, RATIO_OPTION), and the
    streaming heads keep kvpress's on-the-fly 128 sinks + 256 recent tokens (kvbench budget 384, FIXED_BUDGET;
    prefill_mode paper, decode none). Head scores: kvpress's duo_attention_on_the_fly calls
    load_dataset("kmfoda/booksum") itself, so its module's load_dataset is replaced (feed_booksum) by kvbench's own
    calibration samples (the first 50 packaged essays by file name, 49 exist, as text that re-tokenizes to the same
    ids); kvpress divides the sum by num_samples = 50, kvbench by the 49 it has (one factor for every head).
    kvpress tokenizes each text whole; kvbench cuts it at on_the_fly_max_tokens (default 4,096), here 8,192, the
    most it allows (the model's positions), so only the 2 essays longer than that (9,863 and 18,145 tokens) are
    cut, on both sides. Printed below the table: the streaming heads of both sides and the largest head-score
    difference. `--duo-samples N` uses the first N essays on both sides (quicker; the first 8: 24k tokens, none cut).
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
    # scores when kvpress's context manager exits (kept sets from module.masked_key_indices after the `with`); the
    # prompt is the chat template's prefix + text (PROMPTS), as kvpress's pipeline feeds a context
    "kvzip": ("kvzip", {}, "KVzipPress", {}),
    "kvzip_plus": ("kvzip", {"kvzip_plus_normalization": True}, "KVzipPress", {"kvzip_plus_normalization": True}),
    # the ratio is the share of streaming kv-heads on both sides (RATIO_OPTION), which keep 128 sinks + 256 recent
    # tokens (FIXED_BUDGET); head scores from the on-the-fly estimate over the packaged essays on both sides
    "duo_attention": ("duo_attention", {"on_the_fly": True, "sinks": 128, "prefill_mode": "paper", "decode": "none",
                                        "on_the_fly_samples": 50, "on_the_fly_max_tokens": 8192},
                      "DuoAttentionPress", {"on_the_fly_scoring": True}),
    # issue 57's presses. Compactor's Gaussian sketch is kvbench's (seeded per layer) on both sides (SKETCH)
    "compactor": ("compactor", {}, "CompactorPress", {}),
    "adakv_compactor": ("adakv_compactor", {}, "AdaKVPress", {"press": ["CompactorPress", {}]}),
    "cur": ("cur", {}, "CURPress", {}),
    "chunkkv": ("chunkkv", {"chunk_length": 20, "base": "snapkv"}, "ChunkKVPress",
                {"press": ["SnapKVPress", {"window_size": 64, "kernel_size": 5}], "chunk_length": 20}),
    # the question = the prompt's last 64 tokens on both sides (kvpress: window_size set, no delimiter in the text)
    "finch": ("finch", {"window": 64}, "FinchPress", {}),
    "merge_knorm": ("merge", {"base": "knorm"}, "MergingPress", {"press": ["KnormPress", {}]}),
    "merge_snapkv": ("merge", {"base": "snapkv"}, "MergingPress",
                     {"press": ["SnapKVPress", {"window_size": 64, "kernel_size": 5}]}),
    # KVzap: the packaged model's surrogates (trained into the cache by kvbench-train-kvzap; kvpress loads the same
    # folder with KVzapModel.from_pretrained instead of nvidia/KVzap-<type>-<model>). kvzap_mlp_head: KVzapPress alone
    # at a ratio (the registry's kvzap_mlp_head); kvzap_linear / kvzap_mlp: DMSPress(KVzapPress) by threshold (the
    # board's rows: --thresholds, not --ratios)
    "kvzap_mlp_head": ("kvzap", {"surrogate": "mlp"}, "KVzapPress", {"model_type": "mlp"}),
    "kvzap_linear": ("dms", {"base": "kvzap", "base_options": {"surrogate": "linear"}}, "DMSPress",
                     {"press": ["KVzapPress", {"model_type": "linear"}]}),
    "kvzap_mlp": ("dms", {"base": "kvzap", "base_options": {"surrogate": "mlp"}}, "DMSPress",
                  {"press": ["KVzapPress", {"model_type": "mlp"}]}),
    # ComposedPress([SnapKVPress(r), ThinKPress(0.5)]) (kvpress's `snap_think`): the ratio goes to the token press;
    # the channels each (layer, kv-head) pruned are compared too (CHANNELS)
    "think": ("think", {"base": "snapkv", "base_options": {"window": 64, "kernel_size": 5},
                        "key_channel_compression_ratio": 0.5, "window_size": 32}, "ComposedPress",
              {"presses": [["SnapKVPress", {"window_size": 64, "kernel_size": 5}],
                           ["ThinKPress", {"key_channel_compression_ratio": 0.5, "window_size": 32}]]}),
}
# rows that prune key channels: the channels whose keys are all zero once the prompt is compressed, per layer and
# kv-head, compared by Jaccard
CHANNELS = {"think"}
# rows whose kvbench side takes the ratio itself (compression_ratio) rather than the budget int(T * (1 - r)): the
# ratio enters their definition (Compactor's blending, ChunkKV's chunk count, Finch's n_kept)
RATIO_KNOB = {"compactor", "adakv_compactor", "chunkkv", "finch"}
# rows whose kvpress side needs a setting no constructor takes: Finch's window (FINCH_WINDOW tokens) with a delimiter
# id that never occurs; Compactor's sketch drawn as kvbench draws it
FINCH_WINDOW = 64
SKETCH = {"compactor", "adakv_compactor"}
# rows swept by threshold (kvpress DMSPress: evict every token scored below it outside the newest 128), not ratio
THRESHOLD_ROWS = {"kvzap_linear", "kvzap_mlp"}
KVZAP_ROWS = {"kvzap_mlp_head", "kvzap_linear", "kvzap_mlp"}
# rows whose prompt is not the raw text: "chat" = the chat template's tokens before a user message's content, then
# the text (kvpress's pipeline: apply_chat_template on the context, cut where the content ends; KVzipPress skips
# exactly that prefix's length unscored, kvbench's kvzip skips it when the prompt starts with it)
PROMPTS = {"kvzip": "chat", "kvzip_plus": "chat"}
# rows where the ratio is not the share of each table removed: (kvbench option, kvpress option) it sets instead
RATIO_OPTION = {"duo_attention": ("head_compression_ratio", "head_compression_ratio")}
# rows with a budget per table that does not follow the ratio (kvpress's duo_attention_on_the_fly: 128 + 256)
FIXED_BUDGET = {"duo_attention": 128 + 256}
NOTES = {
    "pyramidkv": "layer budgets: kvbench's sum to layers x budget exactly (kvpress rounds each layer) and start from "
                 "the integer budget (kvpress: T * (1 - r), fractional), which can flip the SnapKV fallback",
    "pyramidkv_w16": "as pyramidkv",
    "keydiff": "kvbench key_diff keeps the first block at prefill by default (here off) and evicts blocks "
               "while decoding (here off)",
    "streaming_llm": "kvbench's default evicts after every chunk and while decoding (here paper / none)",
    "kvzip": "prompt = chat-template prefix (unscored but 4 sinks) + text on both sides; kvpress rounds the pruned "
             "count over the sequence (NLL's T - 1 keeps up to L x H - 1 more)",
    "kvzip_plus": "as kvzip; the sinks always kept on both sides (kvpress: max + 1, kvbench: +inf)",
    "duo_attention": "ratio = share of streaming kv-heads (128 sinks + 256 recent), not of the KV removed; "
                     "calibration: kvbench's essays fed to kvpress's estimate",
    "compactor": "the leverage sketch is kvbench's seeded one on both sides (kvpress draws torch.randn)",
    "adakv_compactor": "as compactor",
    "chunkkv": "kvbench never keeps more than int(T * (1 - r)) tokens: a chosen chunk that would overflow is passed "
               "over (T not a multiple of chunk_length)",
    "finch": "window = the prompt's last 64 tokens on both sides (no delimiter); kept keys re-rotated on both, the "
             "tokens after the prompt at the compressed length (kvpress's pipeline rule)",
    "think": "ratio = SnapKV's token ratio; then half of each kv-head's key channels pruned on both sides (the "
             "channels' Jaccard below the table)",
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
    out = {"kvpress_version": version("kvpress"), "transformers_version": version("transformers"), "results": {}}
    if job.get("duo_samples") is not None:
        feed_booksum(job["model_dir"], job["duo_samples"])
    for name, ratio in job["runs"]:
        _, _, cls, opts = METHODS[name]
        text = job["texts"][PROMPTS.get(name, "raw")]
        prompt, cont = text["prompt"], text["continuation"]
        press = build_press(kvpress, cls, opts, ratio, "threshold" if name in THRESHOLD_ROWS
                            else RATIO_OPTION.get(name, (None, None))[1])
        if cls == "FinchPress":  # the question's extent given, no delimiter to find (an id no text holds)
            press.delimiter_token_id, press.window_size = -1, FINCH_WINDOW
        if name in SKETCH:
            kvbench_sketch(kvpress)
        if name in KVZAP_ROWS:
            local_kvzap(press, job["kvzap_dir"])
        composed = getattr(press, "presses", None)
        kept = record_kept(composed[0] if composed else press)  # the token press of a composition
        channels = record_zero_channels(composed[-1]) if name in CHANNELS else {}
        extra = {}
        with torch.no_grad():
            cache = DynamicCache()
            with press(model):  # compress the prompt, then greedy decoding with the compressed cache
                logits = model(torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
            if not kept:  # presses that score when their context manager exits (KVzipPress) and mask
                kept.update(kept_from_masks(model, len(prompt)))
            if cls == "DuoAttentionPress":  # its head choice, and the on-the-fly scores it came from (cached)
                from kvpress.presses.duo_attention_press import duo_attention_on_the_fly

                extra = {"streaming": press.streaming_mask.cpu().tolist(),
                         "head_scores": duo_attention_on_the_fly(model).tolist()}
            tokens = [int(logits.argmax())]
            start = continuation_start(kvpress, press, cache, len(prompt))
            for i in range(job["new_tokens"] - 1):
                pos = torch.tensor([[start + i]])
                logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=pos).logits[0, -1]
                tokens.append(int(logits.argmax()))
            layers = {str(k): v for k, v in kept.items()}
            kept.clear()
            if name in CHANNELS:
                extra["channels"] = {str(k): v for k, v in channels.items()}
            cache = DynamicCache()  # NLL: the prompt but its last token compressed, then one plain chunk
            with press(model):
                model(torch.tensor([prompt[:-1]]), past_key_values=cache)
            # one token per step: a multi-token step gets a causal mask sized from layer 0's cache, which fails when
            # layers hold different numbers of tokens (pyramidkv)
            nll = 0.0
            start = continuation_start(kvpress, press, cache, len(prompt) - 1)
            for j, tok in enumerate(prompt[-1:] + cont[:-1]):
                pos = torch.tensor([[start + j]])
                logits = model(torch.tensor([[tok]]), past_key_values=cache, position_ids=pos).logits[0, -1]
                nll -= float(torch.log_softmax(logits.float(), -1)[cont[j]]) / len(cont)
        out["results"][f"{name}@{ratio}"] = {"kept": layers, "greedy": tokens, "nll": nll, **extra}
    return out


def continuation_start(kvpress, press, cache, prompt_len: int) -> int:
    """The position of the first token after the compressed prompt, as kvpress's pipeline._forward sets it: the
    cache's (first layer's) compressed length after a press that re-rotates the kept keys (FinchPress with
    rerotate_keys, KeyRerotationPress), else the prompt's length."""
    if isinstance(press, kvpress.KeyRerotationPress) or (isinstance(press, kvpress.FinchPress)
                                                        and press.rerotate_keys):
        return cache.get_seq_length()
    return prompt_len


def local_kvzap(press, kvzap_dir: str) -> None:
    """The KVzapPress of `press` (itself or a DMSPress's) loads its surrogate from kvzap_dir/<model_type> (the hub's
    format, written by kvbench-train-kvzap) instead of nvidia/KVzap-<type>-<model>."""
    from kvpress.presses.kvzap_press import KVzapModel

    inner = getattr(press, "press", press)
    inner.kvzap_model = KVzapModel.from_pretrained(os.path.join(kvzap_dir, inner.model_type))
    inner.post_init_from_model = lambda model: None


def feed_booksum(model_dir: str, samples: list[dict]) -> None:
    """kvpress's duo_attention_on_the_fly reads `load_dataset("kmfoda/booksum", split="train").to_pandas()
    .sample(num_samples, random_state=42)["chapter"].tolist()` and tokenizes each text with `tokenizer(text)`:
    its module's load_dataset is replaced by one whose rows are kvbench's calibration samples (the essays, cut to
    kvbench's token limit, as text), in kvbench's order; `sample(n)` takes the first n (all of them when n is
    larger: kvpress still divides by its num_samples, 50, a factor common to every head). Checks that kvpress's
    tokenization of each text gives kvbench's token ids."""
    from transformers import AutoTokenizer
    import kvpress.presses.duo_attention_press as duo

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for i, sample in enumerate(samples):
        assert tokenizer(sample["text"])["input_ids"] == sample["ids"], f"calibration text {i} re-tokenizes otherwise"

    class Rows:
        def __init__(self, texts: list[str]):
            self.texts = texts

        def to_pandas(self) -> "Rows":
            return self

        def sample(self, n: int, random_state=None) -> "Rows":
            return Rows(self.texts[:n])

        def __getitem__(self, column: str) -> "Rows":
            assert column == "chapter", column
            return self

        def tolist(self) -> list[str]:
            return list(self.texts)

    def load_dataset(path: str, split: str | None = None, **kwargs):
        assert path == "kmfoda/booksum" and split == "train", (path, split)
        return Rows([s["text"] for s in samples])

    duo.load_dataset = load_dataset


def kept_from_masks(model, n: int) -> dict:
    """Kept positions from each attention module's masked_key_indices (batch, head, position), for presses that
    set them outside compress (KVzipPress, when its context manager exits) -> {layer: [[pos] per head]}."""
    import torch

    heads = model.config.num_key_value_heads
    kept = {}
    for layer in model.model.layers:
        module = layer.self_attn
        drop = torch.zeros(heads, n, dtype=torch.bool)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            b, h, t = (x.cpu() for x in masked)
            drop[h[b == 0], t[b == 0]] = True
        kept[int(module.layer_idx)] = [(~drop[i]).nonzero().flatten().tolist() for i in range(heads)]
    return kept


def build_press(kvpress, cls: str, opts: dict, ratio: float, ratio_option: str | None = None):
    """The press of METHODS[...]: a wrapper gets its inner press ("press": [class, options]) and the ratio through
    its compression_ratio property; ratio_option names the option the ratio sets instead of compression_ratio; a
    composition ("presses": [[class, options], ...]) gives the ratio to its first press."""
    opts = dict(opts)
    if "presses" in opts:
        (first, first_opts), *rest = opts.pop("presses")
        presses = [getattr(kvpress, first)(compression_ratio=ratio, **first_opts)]
        presses += [getattr(kvpress, c)(**o) for c, o in rest]
        return getattr(kvpress, cls)(presses, **opts)
    inner = opts.pop("press", None)
    if inner is None:
        return getattr(kvpress, cls)(**{ratio_option or "compression_ratio": ratio}, **opts)
    if ratio_option == "threshold":  # DMSPress: its compression ratio is read-only (realized)
        return getattr(kvpress, cls)(press=getattr(kvpress, inner[0])(**inner[1]), threshold=ratio, **opts)
    press = getattr(kvpress, cls)(press=getattr(kvpress, inner[0])(**inner[1]), **opts)
    press.compression_ratio = ratio
    return press


def kvbench_sketch(kvpress) -> None:
    """LeverageScorePress draws its Gaussian sketch from torch's global generator: make it draw kvbench's
    (methods/compactor.py: Compactor.sketch, seed 0, per layer; kvpress scales it by 1 / sqrt(k) itself), so both
    sides score with the same sketch."""
    import torch

    lev = kvpress.LeverageScorePress
    if getattr(lev, "_kvbench_sketch", False):
        return
    compute, score = lev.compute_leverage_scores, lev.score

    def scored(self, module, hidden_states, keys, values, attentions, kwargs):
        layer = int(module.layer_idx)

        def with_sketch(key_states, k):
            real = torch.randn
            gen = torch.Generator().manual_seed(layer)
            torch.randn = lambda *shape, **kw: real(*shape[1:], generator=gen).view(*shape).to(
                dtype=kw.get("dtype") or torch.float32, device=kw.get("device"))
            try:
                return compute(key_states, k)
            finally:
                torch.randn = real

        self.compute_leverage_scores = with_sketch
        try:
            return score(self, module, hidden_states, keys, values, attentions, kwargs)
        finally:
            del self.compute_leverage_scores

    lev.score, lev._kvbench_sketch = scored, True


def record_kept(press) -> dict:
    """Wrap press.compress: which input positions each layer's output keys came from -> {layer: [[pos] per head]}.
    Keys are matched by their exact bits (compress gathers rows, so every kept row is a bit-exact copy)."""
    import torch

    kept: dict[int, list[list[int]]] = {}
    inner = press.compress
    rerotated: dict[int, list[list[int]]] = {}  # presses that re-rotate the kept keys (Finch): the indices
    if type(press).__name__ == "FinchPress":
        import kvpress.presses.finch_press as finch

        rerotate = finch.KeyRerotationPress.rerotate_keys

        class Rerotation(finch.KeyRerotationPress):
            @staticmethod
            def rerotate_keys(module, indices, keys):
                rerotated[module.layer_idx] = [sorted(r.tolist()) for r in indices[0]]
                return rerotate(module, indices, keys)

        finch.KeyRerotationPress = Rerotation

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k_out, v_out = inner(module, hidden_states, keys, values, attentions, kwargs)
        masked = getattr(module, "masked_key_indices", None)  # head-wise presses (AdaKV) mask instead of removing
        if module.layer_idx in rerotated:
            kept[module.layer_idx] = rerotated.pop(module.layer_idx)
        elif masked is not None and k_out.shape[2] == keys.shape[2]:
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


def record_zero_channels(press) -> dict:
    """Wrap press.compress (ThinKPress): the channels whose output keys are all zero -> {layer: [[channel] per
    head]} (ThinK zeroes the pruned ones)."""
    channels: dict[int, list[list[int]]] = {}
    inner = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k_out, v_out = inner(module, hidden_states, keys, values, attentions, kwargs)
        zero = (k_out[0] == 0).all(dim=1)  # [H, D]
        channels[module.layer_idx] = [row.nonzero().flatten().tolist() for row in zero]
        return k_out, v_out

    press.compress = compress
    return channels


# ------------------------------------------------------------------------------------------------ kvbench side
def kvbench_side(job: dict, loaded) -> dict:
    import torch
    from kvbench.methods import build_method
    from kvbench.runtime.hooks import NoCompression
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.scoring import Scorer

    torch.set_num_threads(job["threads"])
    cfg = loaded.model.config  # a pool for one uncompressed sequence (plus a partly filled block per table)
    out = {}
    for name, ratio in job["runs"]:
        method_name, opts, _, _ = METHODS[name]
        text = job["texts"][PROMPTS.get(name, "raw")]
        prompt, cont = text["prompt"], text["continuation"]
        tokens = len(prompt) + len(cont) + job["new_tokens"] + 16 * 2
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * tokens * 2
        opts = dict(opts)
        if name in RATIO_OPTION:
            opts[RATIO_OPTION[name][0]] = ratio
        if name in KVZAP_ROWS:  # the same surrogate folder as kvpress's side
            if "base_options" in opts:
                opts["base_options"] = dict(opts["base_options"], path=os.path.join(
                    job["kvzap_dir"], opts["base_options"]["surrogate"]))
            else:
                opts["path"] = os.path.join(job["kvzap_dir"], opts["surrogate"])
        if name in THRESHOLD_ROWS:
            opts["threshold"] = ratio
        kept: dict[str, list[list[int]]] = {}
        channels: dict[str, list[list[int]]] = {}  # CHANNELS rows: the all-zero key channels after the prompt
        built = []

        def record(cache, slot: int) -> None:
            for layer in range(cache.num_layers):
                lengths = cache.lengths[slot, layer]
                kept[str(layer)] = [sorted(cache.positions[slot, layer, h, : int(lengths[h])].tolist())
                                    for h in range(lengths.shape[0])]

        def engine_for(n_prompt: int, record_kept: bool):
            budget = None if name in THRESHOLD_ROWS else FIXED_BUDGET.get(name, max(1, int(n_prompt * (1 - ratio))))
            if name in RATIO_KNOB:
                method = build_method(method_name, None, compression_ratio=ratio, **opts)
            else:
                method = build_method(method_name, budget, **opts)
            built.append(method)
            if record_kept and hasattr(method, "rerotate"):  # finch: the kept positions before re-rotation
                rerotate = method.rerotate

                def rerotate_recorded(obs):
                    lengths = obs.lengths
                    kept[str(obs.layer)] = [sorted(obs.positions[h, : int(lengths[h])].tolist())
                                            for h in range(lengths.shape[0])]
                    rerotate(obs)

                method.rerotate = rerotate_recorded
            elif record_kept:
                inner = method.after_attention

                def after_attention(ctx):
                    inner(ctx)
                    if ctx.phase == "prefill" and ctx.last_chunk:
                        record(ctx.cache, ctx.plan.slot_list[0])
                        if name in CHANNELS:
                            keys, _, pos = ctx.cache.gather(ctx.layer, ctx.plan.slot_list[0])  # [H, T, D]
                            zero = ((keys == 0) | (pos < 0)[..., None]).all(dim=1)  # [H, D]
                            channels[str(ctx.layer)] = [row.nonzero().flatten().tolist() for row in zero]

                method.after_attention = after_attention
                after_chunk = method.after_prefill_chunk
                if type(method).after_prefill_chunk is not NoCompression.after_prefill_chunk:  # kvzip: reconstructs
                    # and evicts after the prompt's last chunk

                    def after_prefill_chunk(slot, token_ids, start_pos, last_chunk):
                        after_chunk(slot, token_ids, start_pos, last_chunk)
                        if last_chunk:
                            record(method.engine.cache, slot)

                    method.after_prefill_chunk = after_prefill_chunk
            return Engine(loaded.model, method, prefill_chunk_size=len(prompt) + len(cont),
                          attention_backend="torch", kv_memory_bytes=kv_bytes)

        with torch.no_grad():
            gen = engine_for(len(prompt), True).generate([prompt], max_new_tokens=job["new_tokens"])[0]
            lps, _ = Scorer(engine_for(len(prompt) - 1, False)).score_continuation(prompt, cont)
        out[f"{name}@{ratio}"] = {"kept": kept, "greedy": list(gen.token_ids), "nll": -sum(lps) / len(lps)}
        if name in CHANNELS:
            out[f"{name}@{ratio}"]["channels"] = channels
        mask = getattr(built[0], "mask", None)
        if name == "duo_attention" and mask is not None:
            out[f"{name}@{ratio}"].update(streaming=mask.tolist(), head_scores=built[0].head_scores.tolist())
    return out


def duo_samples(loaded, opts: dict) -> list[dict]:
    """kvbench's on-the-fly calibration samples for these duo_attention options (its own _calibration_samples), as
    token ids and as the text kvpress re-tokenizes."""
    from kvbench.methods import build_method

    method = build_method("duo_attention", opts["sinks"] + 1, **opts)
    return [{"ids": ids, "text": loaded.tokenizer.decode(ids)} for ids in method._calibration_samples(loaded.model)]


def chat_prompt(tokenizer, ids: list[int], n: int, n_cont: int) -> dict:
    """kvpress's pipeline context for the text, n tokens: the chat template's tokens before a user message's content
    (kvbench's kvzip.template_parts, KVzipPress's prefix_length), then the text's first tokens; and the text's next
    n_cont tokens. Checks it against the pipeline's preprocess (apply_chat_template on context + separator, cut at
    the separator, tokenized whole): the same prefix tokens and the same text (its tokens may differ at the cut,
    e.g. a trailing " " + "\n" that the whole-string tokenization merges)."""
    from kvbench.methods.kvzip import template_parts

    prefix = template_parts(tokenizer)[0]
    body = ids[: n - len(prefix)]
    text = tokenizer.decode(body)
    separator = "#" * (len(text) + 10)
    context = tokenizer.apply_chat_template([{"role": "user", "content": text + separator}],
                                            add_generation_prompt=True, tokenize=False).split(separator)[0]
    piped = tokenizer.encode(context, add_special_tokens=False)
    assert piped[: len(prefix)] == prefix and tokenizer.decode(piped) == tokenizer.decode(prefix + body), \
        "kvpress's pipeline context differs"
    return {"prompt": prefix + body, "continuation": ids[len(body): len(body) + n_cont], "prefix": len(prefix)}


# ------------------------------------------------------------------------------------------------ comparison
def jaccard(a: dict, b: dict) -> tuple[float, float]:
    """Mean and min Jaccard of kept sets over every (layer, head)."""
    vals = []
    for layer, heads in a.items():
        for ha, hb in zip(heads, b[layer]):
            sa, sb = set(ha), set(hb)
            vals.append(len(sa & sb) / max(1, len(sa | sb)))
    return sum(vals) / len(vals), min(vals)


def duo_heads(a: dict, b: dict, n_samples: int) -> dict:
    """duo_attention's head choice on both sides: streaming kv-heads, and the on-the-fly head scores (kvpress
    divides its sum over the texts by num_samples = 50 whatever their number; kvbench by their number n)."""
    import torch

    sa, sb = torch.tensor(a["streaming"]), torch.tensor(b["streaming"])
    ha, hb = torch.tensor(a["head_scores"]), torch.tensor(b["head_scores"]) * 50 / n_samples
    return {"kv_heads": sa.numel(), "streaming_heads_kvbench": int(sa.sum()), "streaming_heads_kvpress": int(sb.sum()),
            "streaming_same": bool(torch.equal(sa, sb)), "head_scores_max_abs_diff": float((ha - hb).abs().max()),
            "head_scores_min": float(ha.min()), "head_scores_max": float(ha.max()),
            "head_order_same": bool(torch.equal(ha.flatten().argsort(stable=True), hb.flatten().argsort(stable=True)))}


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
    ap.add_argument("--text-file", help="held-out text to use instead of the packaged essays (UTF-8)")
    ap.add_argument("--continuation", type=int, default=64, help="text tokens scored for the NLL")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--thresholds", type=float, nargs="+", default=[-3.0, -4.0, -5.0],
                    help="the threshold rows' (kvzap_linear, kvzap_mlp) thresholds, in place of --ratios")
    ap.add_argument("--kvzap-dir", help="folder with the packaged model's KVzap surrogates {linear,mlp} (default: "
                    "kvbench's cache, trained there first if missing)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--duo-samples", type=int, help="duo_attention's on-the-fly samples on both sides (default 50, "
                    "kvpress's num_samples; the packaged essays are 49): fewer for a quick run")
    ap.add_argument("--json", help="also write every figure here")
    args = ap.parse_args()
    if args.side == "kvpress":
        Path(args.out).write_text(json.dumps(kvpress_side(json.loads(Path(args.job).read_text()))))
        return

    from kvbench.data.essays import essay_corpus_text
    from kvbench.runtime.model.loading import load_model

    if not args.kvpress_python or not Path(args.kvpress_python).exists():
        sys.exit(f"kvpress environment not found{': ' + args.kvpress_python if args.kvpress_python else ''}: "
                 "pass --kvpress-python (or set KVPRESS_PYTHON)")
    loaded = load_model(keep_hf=True)  # the packaged SmolLM2-135M-Instruct, float32, CPU
    loaded.model.tokenizer = loaded.tokenizer  # kvzip writes its reconstruction prompt, duo_attention calibrates
    text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else essay_corpus_text()
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < args.tokens + args.continuation:
        sys.exit(f"the text has {len(ids)} tokens: --tokens {args.tokens} + --continuation {args.continuation} need more")
    texts = {"raw": {"prompt": ids[: args.tokens], "continuation": ids[args.tokens: args.tokens + args.continuation]}}
    if any(PROMPTS.get(m) == "chat" for m in args.methods):
        texts["chat"] = chat_prompt(loaded.tokenizer, ids, args.tokens, args.continuation)
    if "duo_attention" in args.methods and args.duo_samples is not None:
        METHODS["duo_attention"][1]["on_the_fly_samples"] = args.duo_samples
    kvzap_dir = args.kvzap_dir
    if kvzap_dir is None and KVZAP_ROWS & set(args.methods):
        from kvbench.methods.kvzap_surrogate import packaged_folder
        from kvbench.methods.kvzap_train import ensure_packaged

        ensure_packaged(loaded.model, loaded.tokenizer, "mlp")
        kvzap_dir = str(packaged_folder("mlp").parent)
    runs = [(m, r) for m in args.methods for r in (args.thresholds if m in THRESHOLD_ROWS else args.ratios)]
    job = {"model_dir": str(loaded.hf_dir), "texts": texts, "new_tokens": args.new_tokens, "kvzap_dir": kvzap_dir,
           "threads": args.threads, "runs": runs,
           "duo_samples": duo_samples(loaded, METHODS["duo_attention"][1]) if "duo_attention" in args.methods
           else None}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "kvpress.json"
        job_path.write_text(json.dumps(job))
        subprocess.run([args.kvpress_python, __file__, "--side", "kvpress", "--job", str(job_path),
                        "--out", str(out_path)], check=True)
        theirs = json.loads(out_path.read_text())
    ours = kvbench_side(job, loaded)
    rows, extras = [], []
    print(f"kvpress {theirs['kvpress_version']} (transformers {theirs['transformers_version']}) vs kvbench; "
          f"model {loaded.name}; prompt {args.tokens} tokens, NLL over {args.continuation}, greedy {args.new_tokens}")
    print(f"{'method':<20} {'ratio':>5} {'jaccard':>8} {'min':>6} {'greedy':>8} {'nll kvbench':>12} "
          f"{'nll kvpress':>12}   (threshold rows: the threshold in the ratio column, then the kept fraction)")
    for m in args.methods:
        for r in (args.thresholds if m in THRESHOLD_ROWS else args.ratios):
            a, b = ours[f"{m}@{r}"], theirs["results"][f"{m}@{r}"]
            mean_j, min_j = jaccard(a["kept"], b["kept"])
            diff = first_difference(a["greedy"], b["greedy"])
            row = {"method": m, "ratio": r, "jaccard": mean_j, "jaccard_min": min_j, "greedy_equal": diff is None,
                   "greedy_first_difference": diff, "nll_kvbench": a["nll"], "nll_kvpress": b["nll"],
                   "note": NOTES.get(m, "")}
            rows.append(row)
            greedy = "same" if diff is None else f"@{diff}"
            if m in THRESHOLD_ROWS:  # what each side kept of the prompt, over every (layer, kv-head)
                row["kept_fraction_kvbench"], row["kept_fraction_kvpress"] = (
                    round(sum(len(h) for hs in side["kept"].values() for h in hs)
                          / (len(job["texts"]["raw"]["prompt"]) * sum(len(hs) for hs in side["kept"].values())), 4)
                    for side in (a, b))
                row["note"] = (f"kept {row['kept_fraction_kvbench']:.4f} (kvpress {row['kept_fraction_kvpress']:.4f})")
            print(f"{m:<20} {r:>5.2f} {mean_j:>8.3f} {min_j:>6.3f} {greedy:>8} {a['nll']:>12.4f} {b['nll']:>12.4f}"
                  + (f"  ({row['note']})" if row["note"] else ""))
            assert math.isfinite(a["nll"]) and math.isfinite(b["nll"])
            if "channels" in a and "channels" in b:
                row["channels_jaccard"], row["channels_jaccard_min"] = jaccard(a["channels"], b["channels"])
                n_pruned = sum(len(h) for heads in a["channels"].values() for h in heads)
                extras.append(f"  {m} @ {r:.2f}: pruned key channels, Jaccard over (layer, kv-head) "
                              f"{row['channels_jaccard']:.3f} (min {row['channels_jaccard_min']:.3f}); "
                              f"{n_pruned} pruned by kvbench in all")
            if "streaming" in a and "streaming" in b:
                row.update(duo_heads(a, b, len(job["duo_samples"])))
                extras.append(f"  {m} @ {r:.2f}: {row['streaming_heads_kvbench']} streaming kv-heads of "
                              f"{row['kv_heads']} (kvpress {row['streaming_heads_kvpress']}), same heads: "
                              f"{row['streaming_same']}; head scores max |kvbench - kvpress x 50/n| "
                              f"{row['head_scores_max_abs_diff']:.2e} (scores {row['head_scores_min']:.4f}.."
                              f"{row['head_scores_max']:.4f}), same order: {row['head_order_same']}")
    for line in extras:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
