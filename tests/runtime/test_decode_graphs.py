"""Decode steps from captured graphs (kvbench.runtime.serving.decode_graphs) on the CPU, with the stand-in capture: it
runs the step once under a host-sync counter (a sync fails the capture, as on a GPU) and replays by running the same
function over the same static buffers. Every method of the test matrix and every codec gives the same greedy tokens
from graphs as eagerly; bucketing, static buffers and replay with new tables are checked directly."""
from __future__ import annotations

import pytest
import torch

from kvbench.methods import build_method
from kvbench.quant.registry import build_codec
from kvbench.runtime.serving import decode_graphs as dg
from kvbench.runtime.serving.engine import Engine
from tests.methods.variants import VARIANTS, knobs, variant_id
from tests.tiny_models import ByteTokenizer, tiny_model

BUDGET = 32
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, max_positions=512, tokenizer=ByteTokenizer(256))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (45, 70, 23)]


def _engine(model, name, opts, codec=None, graphs=False, budget=BUDGET):
    method = None if name == "full" else build_method(name, **knobs(name, budget), **opts)
    eng = Engine(model, method, codec=codec, block_size=8, num_blocks=1024, attention_backend="torch",
                 prefill_chunk_size=32, max_num_seqs=4)
    if graphs:
        eng.use_decode_graphs(capture=dg.cpu_standin_capture)
    return eng


CODEC_OPTIONS = {"kvquant": {"levels": "uniform", "key_ranges": "online"}}  # no calibration on the tiny model


def _codec(model, name):
    return build_codec(name, model, **CODEC_OPTIONS.get(name, {})) if name else None


def _same_tokens_both_ways(model, prompts, name, opts, codec_name=None, budget=BUDGET):
    eager = _engine(model, name, opts, _codec(model, codec_name), budget=budget).generate(
        prompts, max_new_tokens=NEW_TOKENS)
    eng = _engine(model, name, opts, _codec(model, codec_name), graphs=True, budget=budget)
    graphed = eng.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert [g.token_ids for g in graphed] == [g.token_ids for g in eager]
    assert eng.cache.pool.in_use == 0
    return eng


@pytest.mark.parametrize("variant", VARIANTS, ids=[variant_id(v) for v in VARIANTS])
def test_every_method_same_greedy_tokens_from_graphs(model, prompts, variant):
    name, opts = variant
    eng = _same_tokens_both_ways(model, prompts, name, opts)
    graphs = eng.decode_graphs
    if eng.cache.store_pre_rope or eng.cache.page_retrieval is not None:  # rotated at read time / reads counted
        assert graphs is None  # per step on the host (page retrieval): runs eagerly, said once
    elif getattr(eng.method, "reads_hidden_states", False):  # reads each layer's input (kvzap): eager steps
        assert graphs is None or graphs.replays == 0
    else:
        assert graphs.replays > 0 and graphs.graphs


@pytest.mark.parametrize("codec", ["kivi", "int8", "fp8", "kvquant", "nvfp4", "mxfp4"])
def test_every_codec_same_greedy_tokens_from_graphs(model, prompts, codec):
    eng = _same_tokens_both_ways(model, prompts, "full", {}, codec)
    if codec == "kvquant":  # pre-RoPE keys: eager
        assert eng.decode_graphs is None
    else:
        assert eng.decode_graphs.replays > 0


def test_paged_eviction_with_kivi_from_graphs(model, prompts):
    eng = _same_tokens_both_ways(model, prompts, "paged_eviction", {}, "kivi", budget=64)  # KIVI: 32-token blocks
    assert eng.decode_graphs.replays > 0


def test_buckets_static_buffers_and_replay_with_new_tables(model, prompts):
    eng = _engine(model, "full", {}, graphs=True)
    graphs = eng.decode_graphs
    assert graphs.buckets == [1, 2, 4]  # max_num_seqs=4
    assert dg.default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    slots = [eng.new_sequence() for _ in prompts]
    last = []
    for s, p in zip(slots, prompts):
        last.append(int(eng.forward_chunk(s, p, 0)[0].argmax()))
    # three sequences: bucket 4 (one padded row); then one: bucket 1
    toks = eng.decode_batch(slots, last, [len(p) for p in prompts])
    assert set(graphs.graphs) == {(4, 16)}  # 70 tokens / 8 = 9 blocks: width 16
    g = graphs.graphs[(4, 16)]
    assert int(g.plan.lengths[3].sum()) == 0 and (g.plan.tables[3] == 0).all()  # the padded row reads nothing
    assert (g.plan.write_index[3] == 0).all()  # and writes to the scratch block only
    for s, p in zip(slots, prompts):  # the pool rows each sequence wrote are its own: eager gives the same
        assert int(eng.cache.lengths[s, 0, 0]) == len(p) + 1
    one = eng.decode_batch(slots[:1], toks[:1], [len(prompts[0]) + 1])
    assert set(graphs.graphs) == {(4, 16), (1, 8)} and graphs.replays == 2  # 47 tokens: 6 blocks, width 8
    # new tables each step: a second sequence set replays the same graph with its own tables
    ref = _engine(model, "full", {})
    rs = [ref.new_sequence() for _ in prompts]
    rlast = [int(ref.forward_chunk(s, p, 0)[0].argmax()) for s, p in zip(rs, prompts)]
    assert rlast == last
    assert ref.decode_batch(rs, rlast, [len(p) for p in prompts]) == toks
    assert ref.decode_batch(rs[:1], toks[:1], [len(prompts[0]) + 1]) == one


def test_a_host_sync_in_the_captured_step_fails_the_capture(model, prompts, monkeypatch):
    eng = _engine(model, "full", {}, graphs=True)
    attend = eng.cache.attend

    def planted(layer, q, plan, scale, **kw):
        plan.lengths.max().item()  # a host sync inside the forward
        return attend(layer, q, plan, scale, **kw)

    monkeypatch.setattr(eng.cache, "attend", planted)
    with pytest.raises(dg.HostSyncInCapture, match="item"):
        eng.generate(prompts[:1], max_new_tokens=2)


def test_graphs_ignored_off_cuda_with_a_log_line(model, caplog):
    with caplog.at_level("INFO", logger="kvbench.runtime.serving.engine"):
        eng = Engine(model, None, num_blocks=64, attention_backend="torch", cuda_graphs=True)
    assert eng.decode_graphs is None and "cuda_graphs ignored" in caplog.text
