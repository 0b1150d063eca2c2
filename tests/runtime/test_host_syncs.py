"""Host syncs in a decode step (kvbench.runtime.serving.host_sync.HostSyncCounter), counted on the CPU on the eager path
with the torch attention: at most one per step (the sampled tokens, with the block ids an eviction freed) for every
method and codec, except those the methods table (docs/methods.md, "Host syncs") lists with their reason; those are
strict xfails here, so a method that stops needing the host fails until the table says so."""
from __future__ import annotations

import pytest
import torch

from kvbench.methods import build_method
from kvbench.quant.registry import build_codec
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.host_sync import HostSyncCounter
from tests.methods.variants import VARIANTS, knobs, variant_id
from tests.tiny_models import ByteTokenizer, tiny_model

STEPS = 12  # more than a block of 8: every block method evicts at least once per sequence
# the methods table's host-bound rows: (method, options) id -> why the step reads the device on the host
HOST_BOUND = {
    "h2o": "token-level eviction every step (top-k over accumulated attention, tokens compacted per table)",
    "kvcrush": "token-level eviction every step (H2O importance + signature grouping)",
    "kvcrush-importance=snapkv-anchor=mean": "token-level eviction every step",
    "snapkv-decode=rescore-window=8": "re-scores and evicts tokens every step",
    "snapkv-decode=window-pooling=maxpool-kernel_size=7": "evicts tokens every step",
    "tova-decode=evict-heads=per_head": "evicts one token per head every step",
    "duo_attention-patterns_path": "streaming heads trimmed token by token every step",
    "knorm-decode=evict": "token-level eviction every step (the smallest key norms, tokens compacted per table)",
    "rkv-buffer=4-window=4": "token-level compression every `buffer` tokens (tables compacted to the budget)",
    "cur-decode=evict-leverage_type=kv_avg-use_random_leverage=True":
        "token-level eviction every step (the lowest CUR leverage, tokens compacted per table)",
    "merge-base=snapkv-base_options={'window': 8}-decode=cam-compression_interval=1-merge_budget=4":
        "CaM merges and evicts tokens every step",
    "kvzap-surrogate=linear-path": "token-level eviction every step (decode=evict: surrogate scores, top-k)",
    "think-key_channel_compression_ratio=0.25-base=knorm-decode=evict":
        "token-level eviction every step (its base knorm's decode=evict)",
    "dms-base=knorm-threshold=-6.0-sliding_window_size=8-decode=evict":
        "a token judged by its threshold every step (the one leaving the window; tables compacted)",
    "observed_attention-decode=evict": "token-level eviction every step (mean observed attention, top-k)",
    "block_keydiff-decode=evict": "token-level eviction every step (KeyDiff over the table, top-k)",
    "qfilter-decode=evict-path": "token-level eviction every step (Q-filter scores, top-k)",
    "merge-base=tova-decode=cam-compression_interval=1-compress_prompt=False": "CaM merges and evicts every step",
    "decoding-compression_interval=4": "token-level compression every `compression_interval` steps",
    "decoding-base=sink_recent-compression_interval=4": "token-level compression every `compression_interval` steps",
    "sink_recent-n_sink=2-decode=evict": "token-level eviction every step (the oldest non-sink token)",
    "decoding-base=snapkv-base_options={'window': 8}-head_adaptive=True-compression_interval=3":
        "head-adaptive compression every `compression_interval` steps",
}


def _bound(variant):
    vid = variant_id(variant)
    return next((why for key, why in HOST_BOUND.items() if vid.startswith(key) and
                 (vid == key or key.endswith("path"))), None)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, max_positions=512, tokenizer=ByteTokenizer(256))


def syncs_per_step(model, method, codec=None, steps=STEPS, block_size=8):
    """Decode `steps` steps of two sequences (45 and 70 prompt tokens); the host syncs of each step, and whether
    the step packed blocks (a codec's cache)."""
    eng = Engine(model, method, codec=codec, block_size=block_size, num_blocks=1024, attention_backend="torch",
                 prefill_chunk_size=32)
    # the device's path: a CPU cache builds decode appends on views of its tensors (numpy), which on a GPU cache
    # would be device reads; counted here is what a device step does
    eng.cache.host_decode_appends = False
    slots = [eng.new_sequence(), eng.new_sequence()]
    for s, n in zip(slots, (45, 70)):
        eng.forward_chunk(s, [(7 * i) % 256 for i in range(n)], 0)
    toks, pos, out = [5, 6], [45, 70], []
    for _ in range(steps):
        packed = getattr(eng.cache, "block_counts", lambda: {})().get("packed")
        with HostSyncCounter() as syncs:
            toks = eng.decode_batch(slots, toks, pos)
        pos = [p + 1 for p in pos]
        out.append((syncs.calls, getattr(eng.cache, "block_counts", lambda: {})().get("packed") != packed))
    for s in slots:
        eng.end_sequence(s)
    assert eng.cache.pool.in_use == 0
    return out


def _variant_param(v):
    why = _bound(v)
    marks = [pytest.mark.xfail(strict=True, reason=f"host-bound: {why}")] if why else []
    return pytest.param(v, id=variant_id(v), marks=marks)


@pytest.mark.parametrize("variant", [_variant_param(v) for v in VARIANTS])
def test_at_most_one_host_sync_per_decode_step(model, variant):
    name, opts = variant
    method = None if name == "full" else build_method(name, **knobs(name, 32), **opts)
    for step, (calls, _) in enumerate(syncs_per_step(model, method)):
        assert len(calls) <= 1, f"step {step}: {calls}"


KIVI_SMALL = {"group_size": 16, "residual": 16}  # 16-token blocks: packing within a few steps


@pytest.mark.parametrize("codec,options", [("kivi", KIVI_SMALL), ("int8", {}), ("fp8", {}), ("nvfp4", {}),
                                           ("mxfp4", {"rotate": "hadamard"}),
                                           ("kvquant", {"levels": "uniform", "key_ranges": "online"})])
def test_codecs_sync_only_when_packing(model, codec, options):
    """A codec cache's step reads the device once, except the step that packs blocks leaving the full-precision
    window (which ids to pack and free: once per block_size tokens per sequence)."""
    rows = syncs_per_step(model, None, build_codec(codec, model, **options), steps=18)
    assert any(packed for _, packed in rows)  # the run crossed packing steps
    for step, (calls, packed) in enumerate(rows):
        assert packed or len(calls) <= 1, f"step {step}: {calls}"


def test_block_eviction_with_a_codec(model):
    """paged_eviction over KIVI: one sync per step, except packing steps and (conservatively) the step after an
    eviction that may have dropped a full-precision block (the host cannot tell: the pack rule is then checked on
    the device, finding nothing)."""
    rows = syncs_per_step(model, build_method("paged_eviction", budget=32), build_codec("kivi", model, **KIVI_SMALL),
                          steps=18)
    extra = [(step, calls) for step, (calls, packed) in enumerate(rows) if len(calls) > 1]
    assert len(extra) <= len(rows) // 4, extra
    for step, calls in extra:  # only the pack rule's reads (which blocks, which ids)
        assert set(calls) <= {"__bool__", "nonzero", "unique", "tolist"}, f"step {step}: {calls}"


def test_a_planted_item_in_a_hook_is_counted(model, monkeypatch):
    method = build_method("paged_eviction", budget=32)
    hook = method.after_attention

    def planted(ctx):
        ctx.cache.lengths[0, 0, 0].item()
        hook(ctx)

    monkeypatch.setattr(method, "after_attention", planted)
    rows = syncs_per_step(model, method, steps=3)
    assert all(calls.count("item") == 2 and len(calls) == 3 for calls, _ in rows)  # 2 layers + the tokens
    with pytest.raises(AssertionError, match="item"):
        for calls, _ in rows:
            assert len(calls) <= 1, calls


def test_the_counter_sees_every_kind_of_host_read():
    x = torch.arange(6)
    with HostSyncCounter() as c:
        x.sum().item()
        x.tolist()
        bool(x.any())
        int(x[0])
        x.nonzero()
        x[x > 2]
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=15)  # output size given: no read
        x.to(torch.float32)  # a dtype change: no read
        torch.tensor([1, 2])  # host to device: no read
    assert c.calls == ["item", "tolist", "__bool__", "__int__", "nonzero", "__getitem__", "repeat_interleave"]
