"""PagedEviction's own rules (methods/paged_eviction.py): which block leaves when a block fills (the lowest
||V|| / ||K|| among the oldest decode_topk after the first; the first protected unless protect_first_block=false;
the newest never), shared and per-head scores, the prompt's compression (the first and the last, possibly partial,
block kept, the best middle tokens filling the budget), its options, and on the packaged SmolLM2 the chat prompt
whose tail the authors' prefill keeps."""
from __future__ import annotations

import pytest
import torch

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.metrics.repetition import is_degenerate
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.bare_cache import assert_blocks_consistent, make_cache, positions, step
from tests.methods.test_matrix import (BLOCK_SIZES, CHUNK, NUM_BLOCKS, PROMPT_LENGTHS,  # noqa: F401  (fixtures)
                                       model, prompts)

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


# ------------------------------------------------------------------------------ on a bare one-layer cache
def ratio_kv(ratios):
    """k, v [H, T, D] with ||V|| / ||K|| = ratios[h, t]: k = 1, v = ratio (all dims)."""
    r = torch.as_tensor(ratios, dtype=torch.float32)
    if r.dim() == 1:
        r = r[None].expand(2, -1)
    H, T = r.shape
    return torch.ones(H, T, 4), r[..., None].expand(H, T, 4).clone()


@pytest.mark.parametrize("newest", [2.0, 0.01])
def test_paged_eviction_drops_the_lowest_block_and_spares_the_first(newest):
    """Block 0 scores lowest but is protected; the newest block is never evicted, even when lowest."""
    cache = make_cache(bs=4)
    m = build_method("paged_eviction", 12)
    m.attach(cache, None)
    slot = cache.add_sequence()
    # block 0 has the lowest scores of all, block 2 the lowest of the others
    k, v = ratio_kv([0.1] * 4 + [1.0] * 4 + [0.5] * 4)
    step(m, cache, slot, k, v, 0, "prefill")
    assert positions(cache, slot) == list(range(12))  # at the budget: nothing to evict
    for t in range(12, 16):
        k, v = ratio_kv([newest])
        step(m, cache, slot, k, v, t, "decode")
        if t < 15:  # the newest block is still filling
            assert positions(cache, slot) == list(range(t + 1))
    assert positions(cache, slot) == list(range(8)) + list(range(12, 16))
    assert positions(cache, slot, 1) == positions(cache, slot, 0)
    assert cache.pool.in_use == 2 * 3
    assert_blocks_consistent(cache)


def test_paged_eviction_without_protection_drops_the_first_block():
    cache = make_cache(bs=4)
    m = build_method("paged_eviction", 12, protect_first_block=False)
    m.attach(cache, None)
    slot = cache.add_sequence()
    k, v = ratio_kv([0.1] * 4 + [1.0] * 4 + [0.5] * 4 + [2.0] * 4)
    step(m, cache, slot, k[:, :12], v[:, :12], 0, "prefill")
    for t in range(12, 16):
        step(m, cache, slot, k[:, t:t + 1], v[:, t:t + 1], t, "decode")
    assert positions(cache, slot) == list(range(4, 16))


def test_paged_eviction_shared_and_per_head_scores():
    # head 0: block 1 lowest; head 1: block 2 lowest; averaged over heads: block 1 lowest
    ratios = torch.tensor([[1.0] * 4 + [0.2] * 4 + [0.9] * 4 + [5.0] * 4,
                           [1.0] * 4 + [0.7] * 4 + [0.6] * 4 + [5.0] * 4])
    k, v = ratio_kv(ratios)
    for heads, want0, want1 in [("shared", [0, 1, 2, 3, 8, 9, 10, 11], [0, 1, 2, 3, 8, 9, 10, 11]),
                                ("per_head", [0, 1, 2, 3, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6, 7])]:
        cache = make_cache(bs=4)
        m = build_method("paged_eviction", 12, heads=heads)
        m.attach(cache, None)
        slot = cache.add_sequence()
        step(m, cache, slot, k[:, :12], v[:, :12], 0, "prefill")
        for t in range(12, 16):
            step(m, cache, slot, k[:, t:t + 1], v[:, t:t + 1], t, "decode")
        assert positions(cache, slot, 0) == want0 + [12, 13, 14, 15], heads
        assert positions(cache, slot, 1) == want1 + [12, 13, 14, 15], heads


@pytest.mark.parametrize("keep_first", [True, False])
@pytest.mark.parametrize("heads", ["shared", "per_head"])
def test_paged_eviction_prefill_keeps_the_highest_ratio_tokens(heads, keep_first):
    g = torch.Generator().manual_seed(0)
    ratios = torch.rand(2, 20, generator=g) + 0.1
    ratios[:, :4] = 0.01  # the first block scores lowest (like attention sinks: small ||V||)
    k, v = ratio_kv(ratios)
    cache = make_cache(bs=4)
    m = build_method("paged_eviction", 12, heads=heads, prefill_keep_first_block=keep_first,
                     protect_last_block=False)
    m.attach(cache, None)
    slot = cache.add_sequence()
    step(m, cache, slot, k, v, 0, "prefill")
    for h in range(2):
        score = ratios.mean(0) if heads == "shared" else ratios[h]
        if keep_first:  # tokens 0..3 kept, then the 8 best of the rest
            want = [0, 1, 2, 3] + sorted((score[4:].topk(8).indices + 4).tolist())
        else:
            want = sorted(score.topk(12).indices.tolist())
            assert not set(want) & {0, 1, 2, 3}
        assert positions(cache, slot, h) == want
        kk, vv, _ = cache.gather(0, slot)
        torch.testing.assert_close(vv[h, :, 0], ratios[h, want])  # values moved with their tokens


@pytest.mark.parametrize("prompt", [18, 20])  # the last block partial (2 tokens) or full (4)
@pytest.mark.parametrize("heads", ["shared", "per_head"])
def test_paged_eviction_prefill_keeps_the_first_and_the_last_block(heads, prompt):
    """The authors' prefill: the first block and the prompt's last, possibly partial, block stay (here they score
    lowest of all), the best middle tokens fill the budget; protect_last_block=false evicts that tail by score."""
    g = torch.Generator().manual_seed(0)
    ratios = torch.rand(2, prompt, generator=g) + 0.5
    tail = prompt % 4 or 4
    ratios[:, :4] = 0.01
    ratios[:, -tail:] = 0.02  # a chat template's "<|im_start|>assistant\n": lowest by score
    k, v = ratio_kv(ratios)
    for protect_last in (True, False):
        cache = make_cache(bs=4)
        m = build_method("paged_eviction", 12, heads=heads, protect_last_block=protect_last)
        m.attach(cache, None)
        slot = cache.add_sequence()
        step(m, cache, slot, k, v, 0, "prefill")
        for h in range(2):
            score = (ratios.mean(0) if heads == "shared" else ratios[h])[4: prompt - tail]
            last = list(range(prompt - tail, prompt)) if protect_last else []
            middle = sorted((score.topk(12 - 4 - len(last)).indices + 4).tolist())
            assert positions(cache, slot, h) == [0, 1, 2, 3] + middle + last, (protect_last, h)
        assert_blocks_consistent(cache)


@pytest.mark.parametrize("topk,evicted", [(3, 2), (1, 1), (None, 5)])
def test_paged_eviction_decode_evicts_among_the_oldest_topk_blocks_after_the_first(topk, evicted):
    """When the newest block fills over the budget, the lowest-scoring block among blocks 1 .. topk leaves (the
    authors' candidate_pages = 1 .. min(1 + topk, blocks - 1) - 1); the first block (lowest of all) never does;
    decode_topk=null: any block but the first and the newest."""
    block_scores = [0.01, 1.0, 0.8, 0.9, 0.5, 0.05, 1.0]  # block 5 is the lowest after the first
    k, v = ratio_kv([r for r in block_scores for _ in range(4)])
    cache = make_cache(bs=4)
    m = build_method("paged_eviction", 28, decode_topk=topk)
    m.attach(cache, None)
    slot = cache.add_sequence()
    step(m, cache, slot, k, v, 0, "prefill")
    assert positions(cache, slot) == list(range(28))  # at the budget: nothing evicted
    for t in range(28, 32):  # block 7 fills: 32 > 28 tokens, one block leaves
        kt, vt = ratio_kv([0.001])  # the newest block scores lowest: never a candidate
        step(m, cache, slot, kt, vt, t, "decode")
    dropped = set(range(4 * evicted, 4 * evicted + 4))
    assert positions(cache, slot) == [p for p in range(32) if p not in dropped]
    assert positions(cache, slot, 1) == positions(cache, slot, 0)
    assert_blocks_consistent(cache)


def test_paged_eviction_options_validate_and_size_the_budget():
    with pytest.raises(UserError, match="decode_topk"):
        build_method("paged_eviction", 64, decode_topk=0)
    with pytest.raises(UserError, match="protect_last_block"):
        build_method("paged_eviction", 64, protect_last_block="yes")
    m = build_method("paged_eviction", 64)
    assert (m.protect_last_block, m.decode_topk) == (True, 3)  # the authors' code
    # the first and the last block at prefill need two blocks even when decoding spares no first block
    for opts, blocks in [({}, 2), ({"protect_first_block": False}, 2),
                         ({"protect_first_block": False, "protect_last_block": False}, 1)]:
        assert build_method("paged_eviction", 64, **opts)._protected_blocks() == blocks, opts


# ------------------------------------------------------------------------- on the tiny model (the method matrix's)
@pytest.mark.parametrize("heads", ["shared", "per_head"])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_paged_eviction_keeps_every_tables_first_and_last_prompt_block(model, prompts, heads, bs):
    """After the prompt's compression every (layer, kv-head) table holds the first block and the prompt's last,
    possibly partial, block (the authors' code); the middle tokens fill the budget."""
    budget, seen = 40, []
    method = build_method("paged_eviction", budget, heads=heads)
    inner = method.after_attention

    def after_attention(ctx):
        inner(ctx)
        if ctx.phase == "prefill" and ctx.last_chunk:
            slot = ctx.plan.slot_list[0]
            P = int(ctx.cache.tokens_seen[slot])
            tail = set(range(P - (P % bs or bs), P)) | set(range(bs))
            for h in range(ctx.cache.num_kv_heads):
                pos = set(ctx.cache.positions[slot, ctx.layer, h, : int(ctx.cache.lengths[slot, ctx.layer, h])].tolist())
                assert tail <= pos and len(pos) == budget, (ctx.layer, h, sorted(tail - pos))
            seen.append((P, ctx.layer))

    method.after_attention = after_attention
    engine = Engine(model, method, block_size=bs, num_blocks=NUM_BLOCKS, prefill_chunk_size=CHUNK)
    engine.generate(prompts, max_new_tokens=2)
    assert sorted(seen) == sorted((P, layer) for P in PROMPT_LENGTHS for layer in range(model.config.num_layers))


# ------------------------------------------------------------------------------ on the packaged SmolLM2
@pytest.fixture(scope="module")
def chat_paper(smollm2):
    """The first ACLSum test paper as the paged_eviction_longbench smoke prompts it (1,024 tokens + the template)."""
    from kvbench.data.aclsum import load_aclsum
    from kvbench.tasks.summarization import DEFAULT_PROMPT, summarization_requests

    docs = load_aclsum("test", limit=1)
    return summarization_requests(smollm2.tokenizer, docs, DEFAULT_PROMPT, 1024, 16, True, "aclsum")[0]


@pytest.mark.parametrize("opts,degenerate", [({}, False), ({"protect_last_block": False, "decode_topk": None}, True)])
def test_paged_eviction_keeps_a_chat_prompts_tail_and_generates_text(smollm2, chat_paper, opts, degenerate):
    """Budget 256 of 1,054 prompt tokens, block 16: the authors' rules (first and last block kept at prefill) give
    text; protect_last_block=false with decode_topk=null (prefill by score alone after the first block) evicts the
    template's tail, and the output repeats."""
    engine = Engine(smollm2.model, build_method("paged_eviction", 256, **opts), block_size=16,
                    kv_memory_bytes=64 << 20, prefix_caching=False)
    out = engine.generate([chat_paper.token_ids], max_new_tokens=16, stop_token_ids=chat_paper.stop_ids)[0]
    text = smollm2.tokenizer.decode(out.token_ids)
    assert is_degenerate(out.token_ids) == degenerate, text


def test_before_attention_timing_cuts_the_prompt_before_it_attends():
    """timing=before_attention (the authors' forward_local_eviction): the layer's K/V are cut right after the write,
    so the prompt's queries attend only to the kept tokens; after_attention (default) attends over all of them.
    Layer 0 keeps the same tokens either way (its K/V do not depend on attention); the logits differ; a budget the
    prompt fits in changes nothing."""
    from kvbench.runtime.cache.kv_layout import FullPrecisionLayout
    from tests.tiny_models import DISTINCT_SCORES, ByteTokenizer, tiny_model

    model = tiny_model(vocab=256, tokenizer=ByteTokenizer(), **DISTINCT_SCORES)
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    seen: list[int] = []
    attend = FullPrecisionLayout.attend

    def spy(self, layer, q, plan, *a, **kw):  # the keys each prefill attention reads
        seen.append(int(plan.lengths[:, layer].max()))
        return attend(self, layer, q, plan, *a, **kw)

    def run(budget, timing):
        engine = Engine(model, build_method("paged_eviction", budget, timing=timing), block_size=8, num_blocks=512,
                        prefill_chunk_size=128)
        slot = engine.new_sequence()
        logits = engine.forward_chunk(slot, ids, 0, last_chunk=True)
        lengths = engine.cache.lengths[slot]
        kept = [[engine.cache.positions[slot, li, h, : int(lengths[li, h])].tolist()
                 for h in range(lengths.shape[1])] for li in range(lengths.shape[0])]
        return logits, kept

    FullPrecisionLayout.attend = spy
    try:
        seen.clear()
        before, kept_b = run(32, "before_attention")
        assert seen and max(seen) == 32  # every layer's attention read the 32 kept tokens only
        seen.clear()
        after, kept_a = run(32, "after_attention")
        assert min(seen) == len(ids)  # every layer attended over the whole prompt
    finally:
        FullPrecisionLayout.attend = attend
    assert kept_b[0] == kept_a[0] and all(len(h) == 32 for layer in kept_b for h in layer)
    assert not torch.allclose(before, after)
    roomy_b, _ = run(128, "before_attention")
    roomy_a, _ = run(128, "after_attention")
    torch.testing.assert_close(roomy_b, roomy_a, rtol=0, atol=0)
    with pytest.raises(UserError, match="timing"):
        build_method("paged_eviction", 32, timing="during")


def test_before_attention_timing_over_a_codec_cache():
    """timing=before_attention over KIVI: with the whole prompt in the full-precision window the step equals the
    full-precision cache's; once tokens are packed the difference is quantization error (shrinks ~16x from 4 to 8
    bits), not a stale plan."""
    from kvbench.quant.registry import build_codec
    from tests.tiny_models import DISTINCT_SCORES, ByteTokenizer, tiny_model

    model = tiny_model(vocab=256, tokenizer=ByteTokenizer(), **DISTINCT_SCORES)
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(codec):
        engine = Engine(model, build_method("paged_eviction", 32, timing="before_attention"), codec=codec,
                        block_size=8, num_blocks=512, prefill_chunk_size=128)
        return engine.forward_chunk(engine.new_sequence(), ids, 0, last_chunk=True)

    fp = run(None)
    whole = run(build_codec("kivi", bits=4, group_size=8, residual=128))
    torch.testing.assert_close(whole, fp, rtol=0, atol=1e-4)
    err = {b: float((run(build_codec("kivi", bits=b, group_size=8, residual=16)) - fp).abs().max()) for b in (4, 8)}
    assert err[8] < err[4] / 4 and err[4] < 0.05, err
