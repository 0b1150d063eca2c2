"""kvzip on a model with sliding-window layers (Gemma 3's kind): the reconstruction pass runs on a copy-on-write
fork of the sequence, so the sliding layers' rings stay exactly as a `full` run leaves them (KVzip's own code backs
them up and restores them: RetainHybridCache), and only the full layers are scored and evicted."""
from __future__ import annotations

import math

import pytest
import torch

from kvbench.methods import build_method
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.batch import Segment
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_kvpress_b import kvpress_kvzip_kept, reconstruction_reference
from tests.tiny_models import WINDOW, ByteTokenizer, tiny_hf_model

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)

BS, CHUNK, VOCAB = 8, 32, 320  # VOCAB: tiny_config's default, test_kvpress_b's reference tokenizer's
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2  # full layers 1 and 3, sliding 0 and 2 (window WINDOW)
FULL, SLIDING = (1, 3), (0, 2)


@pytest.fixture(scope="module")
def gemma_hf():
    return tiny_hf_model("gemma3", seed=4, layers=4, layer_types=LAYER_TYPES)


@pytest.fixture(scope="module")
def gemma(gemma_hf):
    m = build_from_transformers(gemma_hf)
    m.tokenizer = ByteTokenizer(VOCAB)
    return m


@pytest.fixture(scope="module")
def ctx():
    """A context several windows long (the rings slide during its prefill and would during the pass)."""
    return torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(6)).tolist()


def prefill(model, method, ids):
    """The engine and slot after the prompt's chunked prefill (and the method's compression at its end)."""
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=1024,
                    attention_backend="torch")
    slot = engine.new_sequence()
    for a in range(0, len(ids), CHUNK):
        engine.forward_chunk(slot, ids[a: a + CHUNK], a, last_chunk=a + CHUNK >= len(ids), logits_for="none")
    return engine, slot


def test_the_sliding_layers_are_left_as_a_full_run_leaves_them(gemma, ctx):
    engine, slot = prefill(gemma, build_method("kvzip", 6), ctx)
    ref, ref_slot = prefill(gemma, None, ctx)
    assert engine.cache.method_layers == FULL
    for layer in SLIDING:
        n = int(ref.cache.lengths[ref_slot, layer].max())
        assert n < len(ctx)  # the ring slid
        assert torch.equal(engine.cache.lengths[slot, layer], ref.cache.lengths[ref_slot, layer])
        for got, want in zip(engine.cache.gather(layer, slot), ref.cache.gather(layer, ref_slot)):  # K, V, positions
            assert torch.equal(got, want), layer
        assert torch.equal(engine.cache.positions[slot, layer], ref.cache.positions[ref_slot, layer])
    assert int(engine.cache.lengths[slot, list(FULL)].sum()) < int(ref.cache.lengths[ref_slot, list(FULL)].sum())


def test_the_scores_are_the_reconstruction_attention_of_the_full_layers(gemma, gemma_hf, ctx):
    """One chunk: each context key's score in a full layer is the max of the reconstruction queries' attention (the
    transformers model's own over context + prompt + "\\n" + context, its sliding layers windowed as in the pass)."""
    method = build_method("kvzip", 10_000)
    engine, slot = prefill(gemma, method, ctx)
    ref = reconstruction_reference(gemma_hf, ctx)  # [L, H, n]
    ref[..., :4] = 2.0  # the sinks (kvpress: max + 1)
    for layer in FULL:
        torch.testing.assert_close(method.state(slot, layer)["scores"], ref[layer], atol=1e-5, rtol=1e-4)
    assert all(key[1] in FULL or key[1] < 0 for key in method._state)  # a sliding layer is never scored


@pytest.mark.parametrize("opts", [{}, {"layerwise": True}])
def test_the_full_layers_keep_the_budget_of_the_best_scores(gemma, gemma_hf, ctx, opts):
    budget = 6
    engine, slot = prefill(gemma, build_method("kvzip", budget, **opts), ctx)
    H = engine.cache.num_kv_heads
    lengths = engine.cache.lengths[slot]  # [L, H]
    scores = reconstruction_reference(gemma_hf, ctx)[list(FULL)]  # [2, H, n]
    if opts:  # layerwise: each full layer its kv_heads x budget best
        assert [int(lengths[layer].sum()) for layer in FULL] == [H * budget] * len(FULL)
        want = torch.stack([kvpress_kvzip_kept(s[None], 4, H * budget)[0] for s in scores])
    else:  # the full layers x kv_heads x budget best, jointly
        assert int(lengths[list(FULL)].sum()) == len(FULL) * H * budget
        want = kvpress_kvzip_kept(scores, 4, len(FULL) * H * budget)
    for i, layer in enumerate(FULL):
        for h in range(H):
            kept = engine.cache.positions[slot, layer, h, : int(lengths[layer, h])].tolist()
            assert sorted(kept) == want[i, h].nonzero().flatten().tolist(), (layer, h)


def test_the_ratio_counts_the_full_layers_tokens(gemma, ctx):
    engine, slot = prefill(gemma, build_method("kvzip", None, compression_ratio=0.5), ctx)
    H = engine.cache.num_kv_heads
    assert int(engine.cache.lengths[slot, list(FULL)].sum()) == len(FULL) * H * int(len(ctx) * 0.5)


def test_the_fork_leaves_no_block_nor_state_behind(gemma, ctx):
    method = build_method("kvzip", 6)
    engine, slot = prefill(gemma, method, ctx)
    cache = engine.cache
    assert cache.live == {slot} and not cache.scratch_slots  # the pass's fork was ended
    held = sum(math.ceil(int(n) / BS) for n in cache.lengths[slot].flatten())
    assert cache.pool.in_use == held  # only the sequence's own tables' blocks
    assert {key[0] for key in method._state} == {slot}
    engine.end_sequence(slot)
    assert cache.pool.in_use == 0 and not method._state
    cache.pool.check_consistency()


def test_full_kv_bytes_leave_the_pass_out(gemma, ctx):
    """The uncompressed figure is the workload's: the same as a full run's (the fork is no sequence of it, nor are
    the blocks it shares for the pass forks' sharing), while the pool's peak holds the pass's chunk."""
    stats = {}
    for name in ("full", "kvzip"):
        engine = Engine(gemma, build_method("kvzip", 10_000) if name == "kvzip" else None, block_size=BS,
                        prefill_chunk_size=CHUNK, num_blocks=1024, attention_backend="torch")
        engine.generate([ctx], max_new_tokens=2)
        stats[name] = engine.memory_stats()
    assert stats["kvzip"]["full_kv_bytes"] == stats["full"]["full_kv_bytes"]
    assert stats["kvzip"]["full_kv_bytes_full_layers"] == stats["full"]["full_kv_bytes_full_layers"]
    assert stats["kvzip"]["full_peak_kv_bytes"] == stats["full"]["full_peak_kv_bytes"]  # within a step too
    assert stats["kvzip"]["fork_shared_kv_bytes"] == 0  # the scratch fork is no fork of the workload
    assert stats["kvzip"]["peak_kv_bytes"] > stats["full"]["peak_kv_bytes"]
    for kind in ("full", "sliding"):  # each block once: the fork's shared blocks are its sequence's
        assert stats["kvzip"][f"peak_kv_bytes_{kind}_layers"] <= stats["kvzip"]["peak_kv_bytes"], kind


def greedy(engine, slot, first: int, start: int, steps: int):
    """Greedy decode from token `first` at position `start`: (tokens, logits [steps, V])."""
    tokens, logits = [first], []
    for i in range(steps):
        out = engine.step([Segment(slot, [tokens[-1]], start + i, "decode")])[0].float()
        logits.append(out)
        tokens.append(int(out.argmax()))
    return tokens[1:], torch.stack(logits)


def test_decoding_after_an_unfilled_budget_is_the_full_runs(gemma, ctx):
    """A budget above the prompt evicts nothing: every decode step is the full run's (the rings intact)."""
    runs = []
    for method in (None, build_method("kvzip", 10_000)):
        engine, slot = prefill(gemma, method, ctx)
        runs.append(greedy(engine, slot, ctx[-1], len(ctx), 6))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


def test_a_scratch_forks_held_blocks_are_its_private_ones(gemma, ctx):
    """PagedKVCache.held_lengths (the by-type held figures): a scratch fork's rows count the blocks it alone holds,
    so the rows' blocks sum to the pool's, before and after the fork appends (copy-on-write, its rings sliding)."""
    from kvbench.runtime.cache.kv_geometry import blocks_for_tokens

    engine, slot = prefill(gemma, None, ctx)
    cache = engine.cache
    child = engine.fork_sequence(slot, scratch=True)
    held = cache.held_lengths([slot, child])
    assert (held[1] == 0).all() and (held[0] == cache.host_lengths[slot]).all()
    engine.forward_chunk(child, ctx[:CHUNK], len(ctx), last_chunk=False, logits_for="none", scratch=True)
    held = cache.held_lengths([slot, child])
    assert int(blocks_for_tokens(held, BS).sum()) == cache.pool.in_use
    assert int(blocks_for_tokens(cache.host_lengths[[slot, child]], BS).sum()) > cache.pool.in_use  # shared ones
    engine.end_sequence(child)
    assert int(blocks_for_tokens(cache.host_lengths[[slot]], BS).sum()) == cache.pool.in_use
