"""Quest (methods/quest.py) and the runtime's page retrieval (kvbench.runtime.cache.page_retrieval, block_summaries).

  * the page bound is never below the true page maximum of q.k (random tensors, every dtype the pool holds);
  * the selected pages equal a transcription of the official evaluation code's selection (quest_attention.py:
    repeat_kv, the sign trick, chunk max, local_heavy_hitter_mask's top-k), united per kv-head;
  * the decode kernels given a compacted block list equal attention over those blocks gathered by torch;
  * a budget covering every page gives exactly full attention's greedy tokens and NLL (op by op and fused);
  * kv_read_bytes_per_token equals selected blocks x block bytes on a hand-counted case (G = 1: each query head's
    pages are its kv-head's);
  * summaries follow eviction (keep_tokens) and swap round trips; bad settings are one-line UserErrors;
  * only the retrieving layers' blocks keep (and count) summaries: not a dense or sliding layer's, through every
    allocation path, op by op and fused, with the same tokens (issue 68 item 7).
"""
from __future__ import annotations

import math

import pytest
import torch

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.runtime.backends.cpu import kernels
from kvbench.runtime.backends.torch.attention import paged_decode_torch
from kvbench.runtime.cache.block_summaries import BlockSummaries, round_down_half, round_up_half
from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.cache.page_retrieval import page_bounds, select_pages
from kvbench.runtime.serving.engine import Engine
from kvbench.methods.quest import quest_pages
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import tiny_model

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


def _paged(keys: torch.Tensor, bs: int, dtype: torch.dtype, seed: int = 0):
    """keys [H, T, D] -> (k_pool [N, bs, D] in dtype, tables [1, H, MB] int32 with shuffled block ids, lengths
    [1, H], summaries built by BlockSummaries.update as the keys are written in chunks)."""
    H, T, D = keys.shape
    MB = -(-T // bs)
    N = 1 + H * MB
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(N - 1, generator=g) + 1)[: H * MB].view(1, H, MB).to(torch.int32)
    pool = torch.zeros(N, bs, D, dtype=dtype)
    summ = BlockSummaries(N, bs, D, torch.device("cpu"))
    t = torch.arange(T)
    rows = ids[0][:, t // bs].to(torch.int64) * bs + t % bs  # [H, T]
    for start in range(0, T, 7):  # written in uneven chunks, as prefill chunks and decode steps would
        r = rows[:, start:start + 7].reshape(-1)
        pool.view(-1, D)[r] = keys[:, start:start + 7].reshape(-1, D).to(dtype)
        summ.update(r, pool.view(-1, D)[r])
    return pool, ids, torch.full((1, H), T, dtype=torch.int64), summ


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_page_bound_is_never_below_the_true_page_max(dtype):
    g = torch.Generator().manual_seed(3)
    H, G, T, D, bs = 2, 3, 101, 64, 16
    keys = torch.randn(H, T, D, generator=g) * 2
    pool, tables, lengths, summ = _paged(keys, bs, dtype)
    for trial in range(5):
        q = torch.randn(1, H * G, D, generator=g) * (trial + 1)
        bound = page_bounds(q, summ.summary, tables)[0]  # [Hq, MB]
        k = pool.float()[tables[0].long()].view(H, -1, D)[:, :T]  # the keys as stored, [H, T, D]
        dots = torch.einsum("hgd,htd->hgt", q[0].view(H, G, D).double(), k.double())  # exact
        pad = -(-T // bs) * bs - T
        dots = torch.nn.functional.pad(dots, (0, pad), value=-math.inf)
        true_max = dots.view(H, G, -1, bs).amax(-1).reshape(H * G, -1)
        # the bound is summed in fp32: allow that rounding, relative to sum |q||k|
        slack = 1e-5 * (q[0].abs().double() @ k.abs().amax(1).double().T.repeat_interleave(1, 0)).amax()
        assert bool((bound.double() >= true_max - slack).all())
        assert bool((bound.double() <= true_max.abs().max() * 64 + 1e4).all())  # finite, not a blanket +inf


def _official_selection(q: torch.Tensor, keys: torch.Tensor, budget: int, chunk: int) -> torch.Tensor:
    """Transcription of mit-han-lab/Quest evaluation/quest_attention.py (decode, one query): per query head, the
    boolean mask of its selected chunks [Hq, n_chunks]. q [Hq, D], keys [H, T, D] (after RoPE)."""
    Hq, D = q.shape
    H, T, _ = keys.shape
    key_states = keys.repeat_interleave(Hq // H, dim=0)[None]  # repeat_kv: [1, Hq, T, D]
    query_states = q[None, :, None, :]  # [1, Hq, 1, D]
    sign = (query_states > 0) + (~(query_states > 0)) * -1
    max_key = key_states * sign
    postive_query = query_states * sign
    padding_length = chunk - ((T - 1) % chunk + 1)
    max_key = torch.cat([max_key, torch.ones((1, Hq, padding_length, D)) * torch.tensor(torch.finfo(max_key.dtype).min)],
                        dim=-2)
    chunk_max_key = max_key.reshape(1, Hq, max_key.shape[2] // chunk, chunk, D).amax(dim=-2)
    chunk_max_key = chunk_max_key.unsqueeze(-2).repeat(1, 1, 1, chunk, 1).reshape(1, Hq, -1, D)[:, :, :T, :]
    quantized_weight = torch.matmul(postive_query.float(), chunk_max_key.transpose(2, 3))  # [1, Hq, 1, T]
    token_budget = min(T, budget)
    # local_heavy_hitter_mask
    attn_weights = quantized_weight
    attn_weights = torch.cat([attn_weights, torch.ones((1, Hq, 1, padding_length))
                              * torch.tensor(torch.finfo(attn_weights.dtype).min)], dim=-1)
    chunk_attn_weights = attn_weights.reshape(1, Hq, 1, attn_weights.shape[3] // chunk, chunk).amax(dim=-1)
    k = min(max(3, token_budget // chunk), chunk_attn_weights.size(-1))
    _, topk = chunk_attn_weights.topk(k=k, dim=-1)
    mask = torch.zeros(Hq, chunk_attn_weights.shape[-1], dtype=torch.bool)
    mask.scatter_(-1, topk[0, :, 0], True)
    return mask


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("T,budget", [(300, 64), (257, 128), (1000, 512), (40, 512)])
def test_selection_equals_the_official_code(G, T, budget):
    bs, H, D = 16, 2, 64
    g = torch.Generator().manual_seed(T + G)
    keys = torch.randn(H, T, D, generator=g)
    q = torch.randn(H * G, D, generator=g)
    pool, tables, lengths, summ = _paged(keys, bs, torch.float32, seed=T)
    sel_tables, sel_lengths = select_pages(q[None], summ.summary, tables, lengths, bs, quest_pages(budget, bs))
    want = _official_selection(q, keys, budget, bs)  # [Hq, MB]
    nb = -(-T // bs)
    if budget < T:  # the official code clamps the budget to the context first (quest.py: the one difference)
        union = want.view(H, G, -1).any(1)  # [H, MB]
    else:
        union = torch.ones(H, nb, dtype=torch.bool)
    for h in range(H):
        cols = union[h].nonzero().flatten()
        n = len(cols)
        assert sel_tables[0, h, :n].tolist() == tables[0, h, cols].tolist()
        last_full = bool(cols[-1] < nb - 1) or T % bs == 0
        assert int(sel_lengths[0, h]) == n * bs - (0 if last_full else bs - T % bs)


@pytest.mark.parametrize("T,budget", [(300, 64), (257, 128), (1000, 512)])
def test_per_head_selection_is_the_official_mask(T, budget):
    """gqa=per_head: each query head's table lists exactly the chunks the official code's mask keeps for it."""
    from kvbench.runtime.cache.page_retrieval import select_pages_per_head

    bs, H, G, D = 16, 2, 3, 64
    g = torch.Generator().manual_seed(T)
    keys = torch.randn(H, T, D, generator=g)
    q = torch.randn(H * G, D, generator=g)
    pool, tables, lengths, summ = _paged(keys, bs, torch.float32, seed=T)
    sel_t, sel_l = select_pages_per_head(q[None], summ.summary, tables, lengths, bs, quest_pages(budget, bs))
    want = _official_selection(q, keys, budget, bs)  # [Hq, MB]
    nb = -(-T // bs)
    for hq in range(H * G):
        cols = want[hq].nonzero().flatten()
        n = len(cols)
        assert sel_t[0, hq, :n].tolist() == tables[0, hq // G, cols].tolist()
        assert bool((sel_t[0, hq, n:] == 0).all())  # padding: the scratch block
        last_full = bool(cols[-1] < nb - 1) or T % bs == 0
        assert int(sel_l[0, hq]) == n * bs - (0 if last_full else bs - T % bs)


def _gathered_attention(q, k_pool, v_pool, tables, lengths, scale):
    """Reference: the listed blocks' K/V gathered by torch, softmax over the first `lengths` slots."""
    S, Hq, _, D = q.shape
    H = tables.shape[1]
    G = Hq // H
    bs = k_pool.shape[1]
    out = torch.zeros(S, Hq, 1, D, dtype=torch.float64)
    for s in range(S):
        for h in range(H):
            n = int(lengths[s, h])
            ids = tables[s, h, : -(-n // bs)].long()
            k = k_pool[ids].reshape(-1, D)[:n].double()
            v = v_pool[ids].reshape(-1, D)[:n].double()
            for j in range(G):
                w = torch.softmax(k @ q[s, h * G + j, 0].double() * scale, 0)
                out[s, h * G + j, 0] = w @ v
    return out


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_kernel_given_a_block_list_equals_gathered_attention(backend):
    g = torch.Generator().manual_seed(7)
    S, H, G, D, bs, T = 2, 2, 3, 64, 16, 333
    k_all = torch.randn(H, T, D, generator=g)
    pool_k, tables, lengths, summ = _paged(k_all, bs, torch.float32, seed=1)
    pool_v = torch.randn_like(pool_k)
    pool_v[0] = 0  # the scratch block
    tables, lengths = tables.expand(S, -1, -1).contiguous(), lengths.expand(S, -1).contiguous()
    q = torch.randn(S, H * G, 1, D, generator=g)
    sel_t, sel_l = select_pages(q[:, :, 0], summ.summary, tables, lengths, bs, 4)
    assert bool((sel_l < lengths).all())  # a real selection
    scale = D ** -0.5
    ref = _gathered_attention(q, pool_k, pool_v, sel_t, sel_l, scale)
    read = torch.zeros(pool_k.shape[0], dtype=torch.bool)
    read[0] = True  # the scratch block (zeros): padding columns name it
    for s in range(S):
        for h in range(H):
            read[sel_t[s, h, : -(-int(sel_l[s, h]) // bs)].long()] = True
    pool_k[~read] = float("nan")  # every block not selected: the kernel must not read it
    pool_v[~read] = float("nan")
    if backend == "cpu":
        if not kernels.available():
            pytest.skip("no C kernels")
        out, _ = kernels.paged_decode_attention_cpu(q, pool_k, pool_v, sel_t, sel_l, scale)
    else:
        # the torch reference reads every block of the table's width (masked): give it only the selected columns
        width = -(-int(sel_l.max()) // bs)
        out, _ = paged_decode_torch(q, pool_k, pool_v, sel_t[:, :, :width].contiguous(), sel_l, scale)
        out = torch.nan_to_num(out, nan=float("inf"))  # a NaN read shows as a mismatch
    assert bool(torch.isfinite(out).all()), "read a block that was not selected"
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- on a tiny model
@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=4, vocab=256, hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=256,
                      max_positions=2048)


def _decode_nll(engine, prompt: list[int], steps: int) -> tuple[list[int], float]:
    """Greedy tokens of `steps` decode steps after `prompt`, and their NLL under the engine (sum of -log p of the
    token chosen at each step); the sequence is ended."""
    tokens, nll, slot = _greedy(engine, prompt, steps)
    engine.end_sequence(slot)
    return tokens, nll


def _greedy(engine, prompt: list[int], steps: int, on_step=None) -> tuple[list[int], float, int]:
    """_decode_nll without ending the sequence: (tokens, NLL, slot); on_step(slot) after the prompt and each step."""
    slot = engine.new_sequence()
    logits = engine.forward_chunk(slot, prompt, 0)
    tokens, nll, pos = [], 0.0, len(prompt)
    for _ in range(steps):
        if on_step is not None:
            on_step(slot)
        lp = torch.log_softmax(logits[0].double(), -1)
        t = int(lp.argmax())
        tokens.append(t)
        nll -= float(lp[t])
        logits = engine.runner.forward([slot], torch.tensor([[t]]), torch.tensor([[pos]]), phase="decode",
                                       last_chunk=True, logits_for="last", max_position=pos)
        pos += 1
    if on_step is not None:
        on_step(slot)
    return tokens, nll, slot


@pytest.mark.parametrize("fused", [False, True])
def test_full_budget_equals_full(model, fused):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (203,), generator=g).tolist()
    model.fuse_decode_layers = fused
    try:
        runs = {}
        for name, budget in (("full", None), ("quest", 4096)):
            engine = Engine(model, build_method(name, budget), block_size=16, num_blocks=1024,
                            attention_backend="cpu" if kernels.available() else "torch")
            runs[name] = _decode_nll(engine, prompt, 12)
            stats = engine.memory_stats()
            assert stats["kv_read_fraction"] == pytest.approx(1.0)
        assert runs["quest"][0] == runs["full"][0]
        assert runs["quest"][1] == pytest.approx(runs["full"][1], rel=1e-6, abs=1e-6)
        # a small budget reads fewer blocks, and says so
        engine = Engine(model, build_method("quest", 48), block_size=16, num_blocks=1024)
        _decode_nll(engine, prompt, 4)
        assert engine.memory_stats()["kv_read_fraction"] < 0.8
    finally:
        model.fuse_decode_layers = True


def test_read_bytes_per_token_hand_count():
    """G = 1 (6 heads over 6 kv-heads): a retrieving layer reads exactly `pages` blocks per kv-head."""
    m = tiny_model(layers=4, vocab=256, hidden=384, heads=6, kv_heads=6, head_dim=64, intermediate=256,
                   max_positions=2048)
    bs, prompt_len, steps, budget = 16, 160, 3, 64  # 10 full blocks, then blocks 11 (tokens 161..163)
    engine = Engine(m, build_method("quest", budget), block_size=bs, num_blocks=1024)
    prompt = list(range(5, 5 + prompt_len))
    _decode_nll(engine, prompt, steps)
    L, H, D = 4, 6, 64
    pages = quest_pages(budget, bs)  # 4
    assert pages == 4
    # decode step i appends token prompt_len + i: tables of prompt_len + i + 1 tokens = 11 blocks each step
    dense_blocks = sum(2 * H * math.ceil((prompt_len + i + 1) / bs) for i in range(steps))  # layers 0, 1
    quest_blocks = steps * 2 * H * pages  # layers 2, 3
    block_kv_bytes = 2 * bs * D * 4  # K and V, fp32
    stats = engine.memory_stats()
    assert stats["kv_read_bytes_per_token"] == (dense_blocks + quest_blocks) * block_kv_bytes / steps
    full = sum(L * H * math.ceil((prompt_len + i + 1) / bs) for i in range(steps))
    assert stats["kv_read_fraction"] == pytest.approx((dense_blocks + quest_blocks) / full)
    # the summaries are memory, kept by the retrieving layers' blocks only (layers 2 and 3: 11 blocks per table at
    # the end, the peak), counted with them in peak_kv_bytes; the dense layers' blocks cost their K/V only
    assert stats["peak_blocks_in_use"] == L * H * 11
    assert stats["peak_kv_bytes"] == L * H * 11 * block_kv_bytes + 2 * H * 11 * 2 * D * 2  # fp16 min, max


def test_summaries_follow_eviction():
    """keep_tokens moves keys between slots: the touched tables' summaries are recomputed from the pool."""
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
    from kvbench.runtime.cache.page_retrieval import PageRetrieval
    cache.enable_page_retrieval(PageRetrieval((1,)))
    slot = cache.add_sequence()
    plan = cache.prepare_append([slot], torch.arange(13)[None])
    k = torch.randn(1, 2, 13, 8)
    cache.write(0, plan, k, torch.randn(1, 2, 13, 8))
    keep = torch.tensor([[0, 2, 5, 6, 9, 12], [1, 3, 4, 7, 8, 11]])
    cache.keep_tokens(0, slot, keep)
    for h in range(2):
        kept = k[0, h, keep[h]]
        for b in range(2):
            ids = int(cache.tables[slot, 0, h, b])
            blk = kept[4 * b: 4 * b + 4]
            torch.testing.assert_close(cache.summaries.summary[ids, 0], round_down_half(blk.amin(0)))
            torch.testing.assert_close(cache.summaries.summary[ids, 1], round_up_half(blk.amax(0)))


def test_bad_settings_are_user_errors():
    with pytest.raises(UserError, match="needs a budget"):
        build_method("quest")
    with pytest.raises(UserError, match="compression_ratio"):
        build_method("quest", compression_ratio=0.5)
    with pytest.raises(UserError, match="evict_budget"):
        build_method("quest", 512, evict="snapkv")
    with pytest.raises(UserError, match="choose an eviction method"):
        build_method("quest", 512, evict="full", evict_budget=64)
    with pytest.raises(UserError, match="without quest.evict"):
        build_method("quest", 512, evict_budget=64)


def _top_k_lowest_first(bound: torch.Tensor, k: int) -> torch.Tensor:
    """Brute force: the k largest of bound [n] (ties at the k-th value taken lowest index first) as a bool mask."""
    order = sorted(range(len(bound)), key=lambda j: (-float(bound[j]), j))[:k]
    mask = torch.zeros(len(bound), dtype=torch.bool)
    mask[order] = True
    return mask


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("G", [1, 3, 4, 7, 9])
@pytest.mark.parametrize("case", ["random", "ties", "all_equal", "negative_zero"])
def test_c_selection_equals_a_brute_force_top_k(G, case, per_head):
    """The fused step's C selection (bisection over order keys, ties lowest block first) against a brute-force
    per-query-head top-k, united per kv-head (or, per_head, each query head's own table), including heavy ties,
    all-equal bounds and -0 / +0 bounds; G = 9 takes the C code's generic (not unrolled) path."""
    bs, H, D, pages = 16, 2, 64, 5
    g = torch.Generator().manual_seed(G)
    S, T = 2, 16 * 23 + 5
    nb = -(-T // bs)
    summary = torch.randn(1 + S * H * nb, 2, D, generator=g)
    summary[:, 0], summary[:, 1] = summary.min(1).values, summary.max(1).values
    summary = summary.half()  # as the pool keeps them
    q = torch.randn(S, H * G, D, generator=g)
    if case == "ties":  # blocks share a few distinct summaries: many bounds equal at the k-th value
        summary[1:] = summary[1 + torch.randint(0, 3, (S * H * nb,), generator=g)]
    elif case == "all_equal":
        q.zero_()
    elif case == "negative_zero":  # bounds of -0.0 and +0.0 (equal) beside positive ones
        summary[1:] = 0.0
        summary[1::4, 1] = 1.0
        q = q.abs() * torch.where(torch.rand(S, H * G, D, generator=g) < 0.5, -0.0, 1.0)
    tables = (1 + torch.randperm(S * H * nb, generator=g)).view(S, H, nb).to(torch.int32)
    lengths = torch.tensor([[T, T - 40], [T - 17, 3 * bs]])  # ragged, one table of exactly `pages` - 2 blocks
    got_tables, got_lengths = kernels.select_pages_c(q, summary, tables, lengths, bs, pages, per_head)
    bound = page_bounds(q, summary, tables).view(S, H, G, nb)
    for s in range(S):
        for h in range(H):
            held = -(-int(lengths[s, h]) // bs)
            union = torch.zeros(held, dtype=torch.bool)
            picks = [_top_k_lowest_first(bound[s, h, gi, :held], min(pages, held)) for gi in range(G)]
            for pick in picks:
                union |= pick
            # per_head: table h * G + g lists query head g's own blocks; else table h the group's union
            for row, mask in ([(h * G + gi, p) for gi, p in enumerate(picks)] if per_head else [(h, union)]):
                cols = mask.nonzero().flatten()
                n = len(cols)
                assert got_tables[s, row, :n].tolist() == tables[s, h, cols].tolist(), (s, h, row)
                assert (got_tables[s, row, n:] == 0).all()
                in_block = (int(lengths[s, h]) - cols * bs).clamp(max=bs)
                assert int(got_lengths[s, row]) == int(in_block.sum())


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable")
def test_c_summary_update_equals_the_torch_summaries():
    """The fused step's summary update (csrc/page_select.c: page_summary_update, F16C's directed rounding) gives the
    same fp16 min / max as BlockSummaries.update (torch, next-after on the bits): keys written one row at a time
    into shuffled blocks, with values around fp16's rounding points, subnormals, -0 and beyond its range."""
    import ctypes

    lib = kernels.load_kernel()
    lib.page_summary_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.page_summary_update.restype = None
    g = torch.Generator().manual_seed(11)
    N, bs, D = 9, 4, 64
    n = (N - 1) * bs
    keys = torch.randn(n, D, generator=g) * torch.logspace(-9, 5, D)
    keys[0, :4] = torch.tensor([-0.0, 70000.0, -70000.0, 1e-8])
    keys[1] = keys[0].half().float() * (1 + 2.0 ** -12)  # just past an fp16 value
    # each block's slots written in order (slot 0 starts a block afresh), the blocks interleaved in a shuffled order;
    # block 0 is the scratch block
    order = 1 + torch.randperm(N - 1, generator=g)
    rows = (order[None, :] * bs + torch.arange(bs)[:, None]).flatten().to(torch.int64)
    ref = BlockSummaries(N, bs, D, torch.device("cpu"))
    got = torch.zeros(N, 2, D, dtype=torch.float16)
    for r, k in zip(rows.tolist(), keys):
        ref.update(torch.tensor([r]), k[None])
        kc = k.contiguous()
        lib.page_summary_update(got.data_ptr(), kc.data_ptr(), r, bs, D)
    assert torch.equal(got[1:].view(torch.int16), ref.summary[1:].view(torch.int16))
    blocks = rows // bs
    for b in range(1, N):
        kb = keys[blocks == b]
        assert (got[b, 0].float() <= kb.amin(0)).all() and (got[b, 1].float() >= kb.amax(0)).all()


@pytest.mark.parametrize("gqa", ["union", "per_head"])
def test_fused_step_selects_as_the_op_by_op_path(model, monkeypatch, gqa):
    """The C selection inside the fused decode step (csrc/page_select.c) reads the same blocks as select_pages (or,
    per_head, select_pages_per_head): the same tokens, log-probabilities and blocks read, at a budget well below
    the context."""
    if not kernels.available():
        pytest.skip("no C kernels")
    built = []
    of = kernels.PageSelect.of
    monkeypatch.setattr(kernels.PageSelect, "of", classmethod(lambda cls, *a: built.append(1) or of(*a)))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (301,), generator=g).tolist()
    runs = {}
    for fused in (False, True):
        model.fuse_decode_layers = fused
        try:
            engine = Engine(model, build_method("quest", 64, gqa=gqa), block_size=16, num_blocks=1024,
                            attention_backend="cpu")
            runs[fused] = (*_decode_nll(engine, prompt, 10), engine.memory_stats())
        finally:
            model.fuse_decode_layers = True
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-5)
    for key in ("kv_read_bytes_per_token", "kv_read_fraction", "summary_read_bytes_per_token", "peak_kv_bytes"):
        assert runs[True][2][key] == runs[False][2][key], key
    # per_head counts each kv-head's distinct blocks, as the union does
    assert runs[True][2]["kv_read_fraction"] < 0.8
    assert built, "the fused step never ran with page retrieval"


def test_quest_over_snapkv_evicts_then_retrieves(model):
    """method=quest method.evict=snapkv: the prompt is evicted to evict_budget (resident memory falls), then decode
    steps read `budget` worth of pages of what stayed (bytes read fall further); the summaries follow the eviction
    (every retrieving step's selection equals select_pages over a fresh recomputation of the summaries)."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 256, (400,), generator=g).tolist()
    stats = {}
    for name, method in (("full", build_method("full")),
                         ("snapkv", build_method("snapkv", 160, window=8)),
                         ("quest+snapkv", build_method("quest", 48, evict="snapkv", evict_budget=160,
                                                       evict_options={"window": 8}))):
        engine = Engine(model, method, block_size=16, num_blocks=1024)
        if name == "quest+snapkv":
            cache = engine.cache
            slot = engine.new_sequence()
            engine.forward_chunk(slot, prompt, 0)
            assert int(cache.lengths[slot].max()) == 160  # evicted to evict_budget
            fresh = BlockSummaries(cache.pool.num_blocks, 16, cache.head_dim, torch.device("cpu"))
            assert [cache.summarizes(li) for li in range(cache.num_layers)] == [False, False, True, True]
            for layer in (2, 3):  # the retrieving layers (0 and 1 read every page: their blocks keep no summary)
                table = cache.tables[slot, layer]
                fresh.recompute(cache.k_pool[table.long()], table, cache.lengths[slot, layer])
                ids = cache.tables[slot, layer, :, :10].flatten().long()
                torch.testing.assert_close(cache.summaries.summary[ids], fresh.summary[ids])
            engine.end_sequence(slot)
        _decode_nll(engine, prompt, 6)
        stats[name] = engine.memory_stats()
    # snapkv's peak is the whole prompt (it evicts after attending over it): what stays after is smaller
    assert stats["quest+snapkv"]["held_kv_bytes"] < stats["full"]["held_kv_bytes"]
    # snapkv alone reads all it keeps; quest over it reads less of the same cache
    assert stats["quest+snapkv"]["kv_read_bytes_per_token"] < stats["snapkv"]["kv_read_bytes_per_token"]
    assert stats["snapkv"]["kv_read_bytes_per_token"] < stats["full"]["kv_read_bytes_per_token"]
    assert stats["quest+snapkv"]["kv_read_fraction"] < 1.0


def test_reads_counted_alike_from_decode_graphs(model):
    """Decode steps replayed from (stand-in) graphs count the blocks they read as eager steps do (the capture pass
    is not a step); page retrieval runs eagerly."""
    from kvbench.runtime.serving import decode_graphs as dg

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (45, 70)]
    stats = []
    for graphs in (False, True):
        engine = Engine(model, None, block_size=8, num_blocks=1024, attention_backend="torch", max_num_seqs=4)
        if graphs:
            assert engine.use_decode_graphs(capture=dg.cpu_standin_capture) is not None
        engine.generate(prompts, max_new_tokens=6)
        if graphs:
            assert engine.decode_graphs.replays > 0
        stats.append(engine.memory_stats())
    for key in ("kv_read_bytes_per_token", "kv_read_fraction"):
        assert stats[0][key] == stats[1][key] and stats[0][key] is not None, key
    engine = Engine(model, build_method("quest", 32), block_size=8, num_blocks=1024, attention_backend="torch")
    assert engine.use_decode_graphs(capture=dg.cpu_standin_capture) is None


def test_codec_reads_counted_at_their_packed_size(model):
    """A codec cache's decode steps read its packed blocks at their packed size: KIVI-2 reads less per token than
    full precision; quest refuses a codec that stores keys before RoPE (one line, before any model loads)."""
    from kvbench.quant.registry import build_codec
    from kvbench.run.spec import check_retrieval_storage

    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 256, (300,), generator=g).tolist()
    stats = {}
    for name, codec in (("full", None), ("kivi", build_codec("kivi", model, bits=2))):
        engine = Engine(model, None, codec=codec, block_size=32, num_blocks=1024, attention_backend="torch")
        _decode_nll(engine, prompt, 4)
        stats[name] = engine.memory_stats()
    assert stats["full"]["kv_read_fraction"] == pytest.approx(1.0)
    assert stats["kivi"]["kv_read_bytes_per_token"] < 0.5 * stats["full"]["kv_read_bytes_per_token"]
    with pytest.raises(UserError, match="before RoPE"):
        check_retrieval_storage("quest", "kvquant")
    check_retrieval_storage("quest", "kivi")
    check_retrieval_storage("snapkv", "kvquant")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_quest_over_kivi2(model, backend):
    """quest over KIVI-2 pages: a budget covering every page equals KIVI-2 alone (tokens and NLL); a small budget
    reads fewer bytes than KIVI-2 alone; the packed blocks' summaries are the min / max of their decoded keys; the
    summaries are counted in the codec pool's bytes."""
    from kvbench.quant.registry import build_codec

    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 256, (300,), generator=g).tolist()
    runs = {}
    for name, method in (("kivi", None), ("quest-all", build_method("quest", 4096)), ("quest", build_method("quest", 64))):
        engine = Engine(model, method, codec=build_codec("kivi", model, bits=2), block_size=32, num_blocks=1024,
                        attention_backend=backend)
        runs[name] = (*_decode_nll(engine, prompt, 6), engine.memory_stats())
        if name == "quest":
            cache = engine.cache
            slot = engine.new_sequence()
            engine.forward_chunk(slot, prompt, 0)
            cache.pack_pending()
            table = cache.tables[slot, 3]  # [H, MB]
            packed = table[table >= cache.num_fp_blocks][:4].long()
            assert packed.numel() > 0
            for b in packed.tolist():
                h = int((table == b).nonzero()[0, 0])
                keys = cache._decode("key", cache.kq_pool[b - cache.num_fp_blocks][None], 3,
                                     torch.tensor([h]))[0].float()
                torch.testing.assert_close(cache.summaries.summary[b, 0], round_down_half(keys.amin(0)))
                torch.testing.assert_close(cache.summaries.summary[b, 1], round_up_half(keys.amax(0)))
            engine.end_sequence(slot)
    assert runs["quest-all"][0] == runs["kivi"][0]
    assert runs["quest-all"][1] == pytest.approx(runs["kivi"][1], rel=1e-6, abs=1e-6)
    assert runs["quest"][2]["kv_read_bytes_per_token"] < 0.8 * runs["kivi"][2]["kv_read_bytes_per_token"]
    assert runs["quest"][2]["peak_kv_bytes"] > runs["kivi"][2]["peak_kv_bytes"]  # the summaries are memory


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_per_head_over_kivi2(model, backend):
    """gqa=per_head over KIVI-2 pages (one table per query head into the codec's attention): a budget covering every
    page equals KIVI-2 alone; at a small budget the kernels are given `pages` blocks per query head (counted at the
    codec's block sizes: fewer bytes than KIVI-2 alone reads) and the result differs from KIVI-2 alone."""
    from kvbench.quant.registry import build_codec

    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(0, 256, (400,), generator=g).tolist()
    runs = {}
    for name, method in (("kivi", None), ("all", build_method("quest", 4096, gqa="per_head")),
                         ("per_head", build_method("quest", 48, gqa="per_head")), ("union", build_method("quest", 48))):
        engine = Engine(model, method, codec=build_codec("kivi", model, bits=2), block_size=16, num_blocks=1024,
                        attention_backend=backend)
        runs[name] = (*_decode_nll(engine, prompt, 6), engine.memory_stats())
        assert engine.cache.pool.in_use == 0
    assert runs["all"][0] == runs["kivi"][0]
    assert runs["all"][1] == pytest.approx(runs["kivi"][1], rel=1e-6, abs=1e-6)
    assert runs["per_head"][2]["kv_read_bytes_per_token"] < 0.9 * runs["kivi"][2]["kv_read_bytes_per_token"]
    assert runs["per_head"][1] != pytest.approx(runs["kivi"][1], rel=1e-9, abs=0)  # fewer pages: another result
    assert math.isfinite(runs["per_head"][1])


def test_ragged_steps_with_full_budget_equal_full(model):
    """Ragged steps (prefill chunks and decode tokens of several sequences in one forward, the mixed schedule):
    a budget covering every page gives full attention's greedy tokens; a small one still decodes every sequence."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 61, 233)]
    outs = {}
    for name, budget in (("full", None), ("quest", 4096), ("quest-small", 48)):
        method = build_method("quest" if budget else "full", budget)
        engine = Engine(model, method, block_size=16, num_blocks=2048, max_num_batched_tokens=96,
                        prefill_chunk_size=64)
        outs[name] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=8)]
        assert engine.cache.pool.in_use == 0
    assert outs["quest"] == outs["full"]
    assert all(len(t) == 8 for t in outs["quest-small"])


def test_selection_reads_nothing_on_the_host(model):
    """On the device's path (torch attention, appends built with torch) a decode step with retrieving layers reads
    the device once (the sampled tokens), as full attention does: the selection and its counting stay on the
    device; over KIVI too, except the steps that pack blocks."""
    from tests.runtime.test_host_syncs import KIVI_SMALL, syncs_per_step
    from kvbench.quant.registry import build_codec

    for step, (calls, _) in enumerate(syncs_per_step(model, build_method("quest", 32))):
        assert len(calls) <= 1, f"step {step}: {calls}"
    rows = syncs_per_step(model, build_method("quest", 32), build_codec("kivi", model, **KIVI_SMALL), steps=18)
    for step, (calls, packed) in enumerate(rows):
        assert packed or len(calls) <= 1, f"step {step}: {calls}"


def test_per_head_attention(model):
    """gqa=per_head: a budget covering every page equals full attention; at a small budget the kernels are given
    one table of `pages` blocks per query head (hand-counted bytes), and the result differs from full attention."""
    g = torch.Generator().manual_seed(10)
    prompt = torch.randint(0, 256, (250,), generator=g).tolist()
    runs = {}
    for name, method in (("full", build_method("full")), ("per_head-all", build_method("quest", 4096, gqa="per_head")),
                         ("per_head", build_method("quest", 48, gqa="per_head")),
                         ("union", build_method("quest", 48))):
        engine = Engine(model, method, block_size=16, num_blocks=1024)
        runs[name] = (*_decode_nll(engine, prompt, 6), engine.memory_stats())
    assert runs["per_head-all"][0] == runs["full"][0]
    assert runs["per_head-all"][1] == pytest.approx(runs["full"][1], rel=1e-6, abs=1e-6)
    # what was read, per step: layers 0-1 every block of their 2 kv-heads' tables; layers 2-3 one table of 3 pages
    # per query head (6 query heads, 3 per kv-head), each block counted once per kv-head: from 3 blocks per kv-head
    # (the group's picks all alike) to 9 (all different); blocks of 16 fp32 keys and values of 64
    block = 2 * 16 * 64 * 4
    steps = [250 + i + 1 for i in range(6)]  # table lengths of the 6 decode steps
    dense = sum(2 * 2 * math.ceil(n / 16) for n in steps)
    read = runs["per_head"][2]["kv_read_bytes_per_token"] * 6 / block - dense  # blocks layers 2-3 read
    assert 6 * 2 * 2 * 3 <= read <= 6 * 2 * 2 * 9 and read == int(read)
    assert runs["per_head"][0] != runs["full"][0] or runs["per_head"][1] != pytest.approx(runs["full"][1])
    with pytest.raises(UserError, match="gqa"):
        build_method("quest", 64, gqa="mean")


def test_eviction_codec_and_retrieval_in_one_run(model):
    """quest over snapkv over KIVI-2: the prompt is evicted to evict_budget and packed, the summaries of the tables
    snapkv re-stored are the min / max of the keys as attention decodes them, and decode reads less than KIVI-2 with
    snapkv alone."""
    from kvbench.quant.registry import build_codec

    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (400,), generator=g).tolist()
    stats = {}
    for name, method in (("snapkv", build_method("snapkv", 192, window=8)),
                         ("quest", build_method("quest", 48, evict="snapkv", evict_budget=192,
                                                evict_options={"window": 8}))):
        engine = Engine(model, method, codec=build_codec("kivi", model, bits=2), block_size=32, num_blocks=1024,
                        attention_backend="cpu" if kernels.available() else "torch")
        if name == "quest":
            cache = engine.cache
            slot = engine.new_sequence()
            engine.forward_chunk(slot, prompt, 0)
            cache.pack_pending()
            assert int(cache.lengths[slot].max()) == 192
            assert [cache.summarizes(li) for li in range(cache.num_layers)] == [False, False, True, True]
            for layer in (2, 3):  # the retrieving layers (0 and 1 read every page: their blocks keep no summary)
                table = cache.tables[slot, layer]
                H, MB = table.shape
                keys = cache._dense_table_blocks(layer, table[None])[0].view(H, MB, 32, cache.head_dim).float()
                for h in range(H):
                    for c in range(192 // 32):
                        b = int(table[h, c])
                        torch.testing.assert_close(cache.summaries.summary[b, 0], round_down_half(keys[h, c].amin(0)))
                        torch.testing.assert_close(cache.summaries.summary[b, 1], round_up_half(keys[h, c].amax(0)))
            engine.end_sequence(slot)
        _decode_nll(engine, prompt, 6)
        stats[name] = engine.memory_stats()
    assert stats["quest"]["kv_read_bytes_per_token"] < stats["snapkv"]["kv_read_bytes_per_token"]


def test_quest_reads_pages_only_on_plain_full_layers():
    """Sliding layers (never compressed) attend densely over their ring; a full layer with sinks or soft-capping
    (GPT-OSS, Gemma 2), which the page kernels do not apply, is refused in one line."""
    from kvbench.runtime.model.families import build_from_transformers
    from tests.tiny_models import tiny_hf_model

    gemma = build_from_transformers(tiny_hf_model("gemma3"))
    eng = Engine(gemma, build_method("quest", 64, dense_layers=0), block_size=8, num_blocks=256)
    full_layers = set(eng.cache.method_layers)
    assert full_layers and all((eng.method.page_retrieval.pages_for(li) > 0) == (li in full_layers)
                               for li in range(gemma.config.num_layers))
    with pytest.raises(UserError, match="method=quest reads pages through the plain attention kernels; layer 1"):
        Engine(build_from_transformers(tiny_hf_model("gpt_oss")), build_method("quest", 64), block_size=8,
               num_blocks=256)


# --------------------------------------------------------------------------- issue 68: Quest's edges
@pytest.mark.parametrize("path", ["torch", "cpu", "fused", "kivi"])
def test_per_head_reads_count_each_kv_heads_distinct_blocks(model, path):
    """gqa=per_head: a budget covering every page reads what full attention reads (kv_read_fraction 1, not G x: it
    was 2.87 with G = 3); at a small budget, with only the last layer retrieving (the same queries either way), it
    reads exactly the blocks gqa=union reads (the union of the query heads' pages is both rules' set per kv-head)."""
    from kvbench.quant.registry import build_codec

    if path in ("cpu", "fused") and not kernels.available():
        pytest.skip("no C kernels")
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (301,), generator=g).tolist()
    model.fuse_decode_layers = path == "fused"
    try:
        def stats(budget, **kw):
            codec = build_codec("kivi", model, bits=4) if path == "kivi" else None
            engine = Engine(model, build_method("quest", budget, **kw), block_size=16, num_blocks=1024, codec=codec,
                            attention_backend="torch" if path in ("torch", "kivi") else "cpu")
            _decode_nll(engine, prompt, 1 if "dense_layers" in kw else 4)
            return engine.memory_stats()

        if path != "kivi":  # a codec's blocks read at their packed sizes: compared with KIVI alone instead
            assert stats(4096, gqa="per_head")["kv_read_fraction"] == pytest.approx(1.0)
        else:
            full = Engine(model, None, block_size=16, num_blocks=1024, codec=build_codec("kivi", model, bits=4),
                          attention_backend="torch")
            _decode_nll(full, prompt, 4)
            assert stats(4096, gqa="per_head")["kv_read_bytes_per_token"] == \
                full.memory_stats()["kv_read_bytes_per_token"]
        per_head = stats(48, gqa="per_head", dense_layers=3)
        union = stats(48, dense_layers=3)
        assert per_head["kv_read_bytes_per_token"] == union["kv_read_bytes_per_token"]
        assert per_head["kv_read_fraction"] < 0.9
    finally:
        model.fuse_decode_layers = True


def test_kv_head_selection_counts_distinct_blocks():
    """kv_head_selection against a set count per kv-head (padding, short tables and shared picks)."""
    from kvbench.runtime.cache.page_retrieval import kv_head_selection

    g = torch.Generator().manual_seed(2)
    S, H, G, k, bs = 3, 2, 3, 4, 16
    tables = torch.randint(1, 9, (S, H * G, k), generator=g, dtype=torch.int32)
    lengths = torch.randint(0, k * bs + 1, (S, H * G), generator=g)
    got_tables, got_lengths = kv_head_selection(tables, lengths, H, bs)
    for s in range(S):
        for h in range(H):
            want = set()
            for q in range(h * G, (h + 1) * G):
                want |= set(tables[s, q, : -(-int(lengths[s, q]) // bs)].tolist())
            assert int(got_lengths[s, h]) == len(want) * bs
            n = len(want)
            assert sorted(got_tables[s, h, :n].tolist()) == sorted(want) and (got_tables[s, h, n:] == 0).all()


def test_summary_update_equals_a_brute_force_fold():
    """BlockSummaries.update over rows written in batches (several slots of one block in a batch, in shuffled order;
    a second round restarting every block at slot 0, whose earlier keys must no longer count) equals the min / max
    of each block's current keys."""
    g = torch.Generator().manual_seed(4)
    N, bs, D = 12, 4, 8
    summ = BlockSummaries(N, bs, D, torch.device("cpu"))
    pool = torch.zeros(N * bs, D)
    for rnd in range(2):
        # blocks in a random order, each block's slots in order (slot 0 first, as a table fills)
        rows_in_order = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in torch.randperm(N, generator=g)])
        done = torch.zeros(N * bs, dtype=torch.bool)
        for start in range(0, N * bs, 5):
            rows = rows_in_order[start:start + 5]
            k = torch.randn(rows.numel(), D, generator=g) * (rnd + 1)
            pool[rows], done[rows] = k, True
            shuffle = torch.randperm(rows.numel(), generator=g)
            summ.update(rows[shuffle], k[shuffle])
            for b in set((rows // bs).tolist()) - {0}:  # block 0 is the scratch block
                held = torch.arange(b * bs, (b + 1) * bs)
                held = held[done[held]]
                assert torch.equal(summ.summary[b, 0], round_down_half(pool[held].amin(0))), (rnd, b)
                assert torch.equal(summ.summary[b, 1], round_up_half(pool[held].amax(0))), (rnd, b)


def test_summary_update_touches_only_the_written_blocks():
    """A one-row update into a pool of 2^21 blocks takes no time in proportion to the pool (it was a copy of every
    summary per call: quest over a codec ran for minutes); 40 updates in well under the old cost of one."""
    import time

    summ = BlockSummaries(1 << 21, 16, 16, torch.device("cpu"))
    rows, k = torch.tensor([16 * 1000]), torch.randn(1, 16)  # slot 0: the block holds this key alone
    summ.update(rows, k)
    t = time.perf_counter()
    for _ in range(40):
        summ.update(rows, k)
    assert time.perf_counter() - t < 2.0
    assert torch.equal(summ.summary[1000, 0], round_down_half(k[0])) and torch.equal(summ.summary[1000, 1],
                                                                                       round_up_half(k[0]))


def test_quest_over_dms_runs_and_keeps_what_dms_keeps(model):
    """method.evict=dms (listed among the choices) runs: a threshold rule takes no evict_budget (its threshold in
    evict_options); the prompt keeps what dms alone keeps, and decode reads fewer bytes than dms alone. An
    evict_budget with dms is one line."""
    from kvbench.methods.base import METHODS

    assert "dms" in [n for n in METHODS.names() if METHODS[n].evicts]
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 256, (400,), generator=g).tolist()
    opts = {"base": "knorm", "threshold": -3.0, "sliding_window_size": 32}  # about 60% of the prompt evicted
    stats = {}
    for name, method in (("full", build_method("full")), ("dms", build_method("dms", None, **opts)),
                         ("quest+dms", build_method("quest", 48, dense_layers=0, evict="dms", evict_options=opts))):
        engine = Engine(model, method, block_size=16, num_blocks=1024)
        _decode_nll(engine, prompt, 4)
        stats[name] = engine.memory_stats()
    # K/V of a block (fp32) and its fp16 min / max, counted with it (every layer retrieves: dense_layers=0)
    block, summary = 2 * 16 * 64 * 4, 2 * 64 * 2
    assert stats["quest+dms"]["held_kv_bytes"] / (block + summary) == stats["dms"]["held_kv_bytes"] / block
    assert stats["dms"]["held_kv_bytes"] < stats["full"]["held_kv_bytes"]
    assert stats["quest+dms"]["kv_read_bytes_per_token"] < stats["dms"]["kv_read_bytes_per_token"]
    with pytest.raises(UserError, match="invalid quest.evict_budget=64: quest.evict=dms keeps what scores above"):
        build_method("quest", 48, evict="dms", evict_budget=64, evict_options=opts)


# --------------------------------------------------------------------------- issue 68 item 7: summaries where read
SUMMARY_BYTES_D64 = 2 * 64 * 2  # one block's fp16 min and max at head_dim 64


def _bytes_from_tables(cache, retrieving: list[bool]) -> tuple[int, int]:
    """(bytes, K/V bytes) the live tables hold, counted from the tables alone: each layer's distinct blocks at the
    K/V block size, plus a summary for each block of a layer that retrieves pages."""
    total = kv_only = 0
    for layer in range(cache.num_layers):
        ids = set()
        for s in cache.live:
            for h in range(cache.num_kv_heads):
                n = -(-int(cache.host_lengths[s, layer, h]) // cache.block_size)
                ids.update(cache.tables[s, layer, h, :n].tolist())
        kv_only += len(ids) * cache.kv_block_bytes
        total += len(ids) * (cache.kv_block_bytes + (2 * cache.head_dim * 2 if retrieving[layer] else 0))
    return total, kv_only


def test_summaries_counted_on_retrieving_layers_only_with_sliding_layers():
    """Gemma 3 (layers 0-2 sliding, 3 full): only layer 3 retrieves pages, so only its blocks carry a key summary.
    peak_kv_bytes is the peak of the true total, K/V of every block + a summary per block of layer 3, counted from
    the tables right after each allocation (where the pool peaks: everything else frees); it is below the old figure
    (a summary for every block in use). The full run's pool peaks at the K/V part alone; kv_bytes_per_token, the
    sliding layers' peak and each sequence's bytes count no summary for a sliding layer."""
    from kvbench.runtime.model.families import build_from_transformers
    from tests.tiny_models import tiny_hf_model

    gemma = build_from_transformers(tiny_hf_model("gemma3"))
    prompt = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for name in ("full", "quest"):
        method = build_method("quest", 16) if name == "quest" else build_method("full")
        engine = Engine(gemma, method, block_size=8, num_blocks=512, prefill_chunk_size=32)
        cache = engine.cache
        retrieving = [engine.method.page_retrieval is not None and engine.method.page_retrieval.pages_for(li) > 0
                      for li in range(cache.num_layers)]
        seen = []  # table-counted (bytes, K/V bytes) right after each allocation
        noted = cache._noted
        cache._noted = lambda plan: (seen.append(_bytes_from_tables(cache, retrieving)), noted(plan))[1]

        def held_now(slot):
            assert cache.kv_bytes_in_use() == _bytes_from_tables(cache, retrieving)[0]
            assert engine.meter.sequence(slot)["kv_bytes"] == _bytes_from_tables(cache, retrieving)[0]

        *_, slot = _greedy(engine, prompt, 6, held_now)
        engine.end_sequence(slot)
        runs[name] = (engine.memory_stats(), seen, retrieving, cache)
    stats, seen, retrieving, cache = runs["quest"]
    assert retrieving == [False, False, False, True]
    kv, summary = cache.kv_block_bytes, 2 * 16 * 2  # head_dim 16: fp16 min and max
    assert stats["peak_kv_bytes"] == max(total for total, _ in seen)
    assert stats["peak_kv_bytes"] < stats["peak_blocks_in_use"] * (kv + summary)  # the figure before
    full = runs["full"][0]
    assert full["peak_kv_bytes"] == max(kv_only for _, kv_only in runs["full"][1]) == \
        max(kv_only for _, kv_only in seen)
    assert stats["kv_bytes_per_token"] == (kv + summary) * 1 * cache.num_kv_heads / cache.block_size
    assert stats["peak_kv_bytes_sliding_layers"] == full["peak_kv_bytes_sliding_layers"]
    assert stats["peak_kv_bytes_full_layers"] > full["peak_kv_bytes_full_layers"]


def test_summaries_on_every_layer_keep_the_figures():
    """No sliding layer and dense_layers=0: every block carries a summary, and every figure is what it was (each
    block at K/V + summary)."""
    m = tiny_model(layers=3, vocab=256, hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=256,
                   max_positions=2048)
    engine = Engine(m, build_method("quest", 48, dense_layers=0), block_size=16, num_blocks=1024)
    prompt = list(range(5, 5 + 150))
    *_, slot = _greedy(engine, prompt, 4)
    per_block = 2 * 16 * 64 * 4 + SUMMARY_BYTES_D64
    assert engine.cache.kv_bytes_in_use() == engine.cache.pool.in_use * per_block
    assert engine.meter.sequence(slot)["kv_bytes"] == 3 * 2 * 10 * per_block  # 154 tokens: 10 blocks
    engine.end_sequence(slot)
    stats = engine.memory_stats()
    assert stats["peak_kv_bytes"] == stats["peak_blocks_in_use"] * per_block
    assert stats["held_kv_bytes"] == 3 * 2 * 10 * per_block
    assert stats["kv_bytes_per_token"] == per_block * 3 * 2 / 16
    assert stats["kv_pool_bytes"] == engine.cache.pool.capacity * per_block


@pytest.mark.parametrize("path", ["torch", "cpu", "fused"])
def test_dense_layers_keep_no_summaries_and_decode_the_same(model, path, monkeypatch):
    """dense_layers=2: layers 0 and 1 read every page, so their blocks neither keep nor update a summary (their rows
    of the pool-sized tensor are never written: op by op, and in the fused C step, csrc/decode_layer.c); the
    retrieving layers' blocks hold their keys' min / max; the greedy tokens and NLL equal those of a cache that
    keeps summaries on every layer (as before), and, fused, the op-by-op path's."""
    if path != "torch" and not kernels.available():
        pytest.skip("no C kernels")
    prompt = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(9)).tolist()
    backend = "torch" if path == "torch" else "cpu"

    def run(fused: bool, every_layer: bool):
        model.fuse_decode_layers = fused
        try:
            with monkeypatch.context() as m:
                if every_layer:  # the summaries kept on every layer, as before (op by op: the write asks this)
                    m.setattr(PagedKVCache, "summarizes", lambda self, layer: self.summaries is not None,
                              raising=False)
                engine = Engine(model, build_method("quest", 48), block_size=16, num_blocks=1024,
                                attention_backend=backend)
                tokens, nll, slot = _greedy(engine, prompt, 8)
            return tokens, nll, engine.cache, slot
        finally:
            model.fuse_decode_layers = True

    tokens, nll, cache, slot = run(path == "fused", False)
    ref_tokens, ref_nll, *_ = run(False, True)
    assert tokens == ref_tokens
    if path == "fused":
        assert nll == pytest.approx(ref_nll, rel=1e-5)
    else:
        assert nll == ref_nll
    bs = cache.block_size
    for layer in range(cache.num_layers):
        for h in range(cache.num_kv_heads):
            n = int(cache.host_lengths[slot, layer, h])
            ids = cache.tables[slot, layer, h, : -(-n // bs)].to(torch.int64)
            rows = cache.summaries.summary[ids]  # [nb, 2, D]
            if layer < 2:
                assert not rows.any(), (layer, h)  # never written (no block was reused in this run)
                continue
            for c, b in enumerate(ids.tolist()):
                k = cache.k_pool[b, : min(bs, n - c * bs)]
                assert torch.equal(rows[c, 0], round_down_half(k.amin(0))), (layer, h, c)
                assert torch.equal(rows[c, 1], round_up_half(k.amax(0))), (layer, h, c)


@pytest.mark.parametrize("codec", [None, "kivi"])
def test_summary_tags_follow_every_allocation_path(codec):
    """Two layers, only layer 1 retrieving: through prefill and decode appends, a fork and its copy-on-write, a
    token-level eviction of a shared table, a swap out and in, a rollback and (over KIVI) packing, every block of
    layer 1 and none of layer 0 is tagged, and the bytes in use, shared by the fork and moved by swap are those the
    tables hold (each block at K/V, + its summary in layer 1); layer 1's summaries bound its keys."""
    from kvbench.quant.codecs import KiviCodec
    from kvbench.runtime.cache.page_retrieval import PageRetrieval
    from kvbench.runtime.cache.quantized_cache import QuantizedPagedKVCache
    from kvbench.runtime.cache.swap import SwapSpace

    L, H, D, bs = 2, 2, 8, 4
    if codec is None:
        cache = PagedKVCache(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=256)
    else:
        cache = QuantizedPagedKVCache(codec=KiviCodec(4, group_size=4, residual=4), num_layers=L, num_kv_heads=H,
                                      head_dim=D, block_size=bs, max_bytes=1 << 20)
    cache.enable_page_retrieval(PageRetrieval((0, 3)))
    summary = 2 * D * 2
    g = torch.Generator().manual_seed(1)

    def append(slot, n):
        start = cache.tokens_seen[slot]
        plan = cache.prepare_append([slot], torch.arange(start, start + n)[None])
        for layer in range(L):
            cache.write(layer, plan, torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g))

    def check():
        cache.pool.check_consistency()
        refs: dict[int, int] = {}  # block -> table references
        for s in cache.live:
            for layer in range(L):
                for h in range(H):
                    n = int(cache.host_lengths[s, layer, h])
                    ids = cache.tables[s, layer, h, : -(-n // bs)].tolist()
                    assert cache.pool.tags_of(ids) == [layer] * len(ids), (s, layer, h)
                    for b in ids:
                        refs[b] = refs.get(b, 0) + 1
                    if layer == 1 and n:  # the summaries bound the keys attention reads
                        keys, _, _ = cache.gather(1, s)
                        for c, b in enumerate(ids):
                            k = keys[h, c * bs: min(n, (c + 1) * bs)].float()
                            assert (cache.summaries.summary[b, 0].float() <= k.amin(0)).all()
                            assert (cache.summaries.summary[b, 1].float() >= k.amax(0)).all()
        def size(b):
            kv = cache.kv_block_bytes if codec is None else (
                cache.kv_fp_block_bytes if b < cache.num_fp_blocks else cache.kv_packed_block_bytes)
            return kv + summary * cache.pool.tags_of((b,))[0]
        assert cache.kv_bytes_in_use() == sum(size(b) for b in refs)
        assert cache.fork_shared_bytes() == sum((r - 1) * size(b) for b, r in refs.items())
        return sum(size(b) for b in refs)

    a = cache.add_sequence()
    append(a, 13)
    check()
    for _ in range(4):
        append(a, 1)
        check()
    b = cache.fork(a)
    append(a, 1)
    append(b, 1)  # copy-on-write of the shared last blocks
    check()
    keep = torch.tensor([[0, 2, 5, 6, 9, 12, 16, 17], [1, 3, 4, 7, 8, 11, 15, 17]])  # of 18 tokens
    cache.keep_tokens(1, b, keep)  # layer 1 of a table whose blocks are shared
    cache.keep_tokens(0, b, keep)
    check()
    swap = SwapSpace(cache, 1 << 30)
    held_b = cache.kv_bytes_in_use()
    expected = swap.bytes_of(b)  # its distinct blocks' K/V, and the summaries of its layer-1 blocks only
    assert swap.swap_out(b) == expected
    check()
    swap.swap_in(b)
    assert cache.kv_bytes_in_use() == held_b
    check()
    cache.truncate(a, 15)
    check()
    if codec is not None:
        assert cache.pool.packed.in_use > 0  # packing ran (KIVI's residual of 4 tokens)
    assert cache.peak_kv_bytes() >= max(check(), held_b)
