"""compactor, adakv_compactor, cur and chunkkv keep exactly the tokens of their definitions: kvpress's presses
(CompactorPress = LeverageScorePress + NonCausalAttnPress, AdaKVPress, CURPress, ChunkKVPress over SnapKVPress)
written out here in plain torch, batched as kvpress writes them, on random K/V and on a transformers model's own
keys, values and pre-RoPE states; and each frees its evicted bytes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.methods.chunkkv import chunk_keep
from kvbench.methods.compactor import compactor_scores
from kvbench.methods.cur import cur_scores
from kvbench.runtime.contract import rotate_half
from tests.fixtures.press_fixtures import PROMPT_TOKENS, hf, hf_out, ids  # noqa: F401  (fixtures)
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_kvpress_a import kept_after_prefill, layer_kv, top_sets
from tests.tiny_models import tiny_model

T, BUDGET = PROMPT_TOKENS, 120  # T: the prompt of the shared ids fixture

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


# ------------------------------------------------------------------------ kvpress's presses, batched [B, H, S, D]
def ref_leverage(keys, phi):  # LeverageScorePress.compute_leverage_scores, Phi given (kvpress draws it)
    X = keys - keys.mean(dim=-2, keepdim=True)
    X = torch.matmul(X, phi).to(torch.float32)
    XT = X.transpose(-2, -1)
    G = XT @ X
    G = 0.5 * (G + G.transpose(-2, -1))
    eye, cur = torch.eye(G.shape[-1]), 1e-2
    for _ in range(5):
        L, info = torch.linalg.cholesky_ex(G + cur * eye, upper=False)
        if bool((info == 0).all()):
            break
        cur = max(1e-8, (1e-2 if cur == 0.0 else 10.0 * cur))
    inv_Xt = torch.cholesky_solve(XT, L, upper=False)
    s = (X * inv_Xt.transpose(-2, -1)).sum(dim=-1).clamp_min(0)
    return (s - s.mean()) / s.std().clamp_min(1e-6)


def ref_non_causal(q, k, chunk_size):  # NonCausalAttnPress.non_causal_chunked_attn
    B, H, S, d = k.shape
    S_pad = math.ceil(S / chunk_size) * chunk_size
    pad_len = S_pad - S
    if pad_len > 0:
        q = torch.cat([q, torch.zeros(B, H, pad_len, d)], dim=2)
        k = torch.cat([k, torch.zeros(B, H, pad_len, d)], dim=2)
        last_chunk_start = (S // chunk_size) * chunk_size
    else:
        last_chunk_start = ((S - 1) // chunk_size) * chunk_size
    in_valid = torch.arange(last_chunk_start, S_pad) >= S
    mask = in_valid.view(1, 1, chunk_size).expand(B, H, chunk_size)
    n = S_pad // chunk_size
    dots = torch.matmul(q.view(B, H, n, chunk_size, d), k.view(B, H, n, chunk_size, d).transpose(-2, -1))
    dots[:, :, -1].masked_fill_(mask.unsqueeze(-1), 0)
    dots[:, :, -1].masked_fill_(mask.unsqueeze(-2), -1e-9)
    attn = torch.softmax(dots.to(torch.float32), dim=-1)
    return attn.sum(dim=-2).view(B, H, S_pad)[..., :S]


def ref_compactor(q, keys, pre_keys, values, phi, ratio, chunk_size=256, sink_start=8, sink_end=4):
    """CompactorPress.score: q [B, Hq, S, D] post-RoPE, keys post-RoPE, pre_keys pre-RoPE [B, H, S, D]."""
    n = keys.shape[-2]
    left = min(sink_start, n)
    right = min(sink_end, max(0, n - left))
    sl = slice(left, n - right)
    lev = ref_leverage(pre_keys[:, :, sl], phi)
    G = q.shape[1] // keys.shape[1]
    A = ref_non_causal(q[:, :, sl], keys[:, :, sl].repeat_interleave(G, dim=1), chunk_size)
    A = A.view(A.shape[0], keys.shape[1], -1, A.shape[-1]).mean(dim=-2)
    s = A * values[:, :, sl].norm(dim=-1)
    s = F.avg_pool1d(s, kernel_size=3, padding=1, stride=1)
    att = (s - s.mean()) / s.std().clamp_min(1e-6)
    scores = ratio * lev + att
    return F.pad(scores, (left, right), value=float(scores.max()))


def ref_cur(keys, values, num_sinks=4, leverage_type="kv_product", local=True, w=16, G=None):  # CURPress.score
    if G is not None:
        keys, values = keys @ G, values @ G
    k2, v2 = (keys ** 2).sum(-1), (values ** 2).sum(-1)
    if local:
        b, h, n = k2.shape
        k2 = F.pad(k2, (0, (w - n % w) % w)).reshape(b, h, -1, w)
        k2 = (k2 / k2.sum(dim=-1, keepdim=True)).reshape(b, h, -1)[:, :, :n]
        v2 = F.pad(v2, (0, (w - n % w) % w)).reshape(b, h, -1, w)
        v2 = (v2 / v2.sum(dim=-1, keepdim=True)).reshape(b, h, -1)[:, :, :n]
    s = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[leverage_type]
    s = s / s.sum(dim=-1, keepdim=True)
    s[:, :, :num_sinks] = 1.0
    return s


def ref_chunkkv(global_scores, ratio, chunk_length):  # ChunkKVPress.compress's indices (B = 1)
    kv_len = global_scores.shape[-1]
    complete, rest = kv_len // chunk_length, kv_len % chunk_length
    main = global_scores[..., : complete * chunk_length].sum(dim=1).view(-1, complete, chunk_length).mean(-1)
    if rest > 0:
        main = torch.cat([main, global_scores[..., -rest:].sum(dim=1).mean(dim=-1, keepdim=True)], dim=-1)
    n_kept = max(1, int((complete + (rest > 0)) * (1 - ratio)))
    idx = []
    for c in main.topk(n_kept, dim=-1).indices[0]:
        idx.append(torch.arange(c * chunk_length, min((c + 1) * chunk_length, kv_len)))
    return set(torch.cat(idx).tolist())


def ref_snapkv(q_window, keys, window=64, kernel=5):  # SnapKVPress.score from the window's post-RoPE queries
    B, H, k_len, D = keys.shape
    G = q_window.shape[1] // H
    kq = keys.repeat_interleave(G, dim=1)
    w = torch.matmul(q_window, kq.transpose(2, 3)) / math.sqrt(D)
    mask = torch.triu(torch.full_like(w, float("-inf")), diagonal=k_len - window + 1)
    w = torch.softmax(w + mask, dim=-1, dtype=torch.float32)[..., :-window]
    s = F.avg_pool1d(w.mean(dim=-2), kernel_size=kernel, padding=kernel // 2, stride=1)
    s = s.view(B, H, G, k_len - window).mean(2)
    return F.pad(s, (0, window), value=s.max().item() + 1)


# ------------------------------------------------------------------------ the tiny model's states, as kvpress reads them
def model_states(hf, out, layer):
    """(post-RoPE queries [1, Hq, T, D], post-RoPE keys, pre-RoPE keys, values [1, H, T, D]) of one layer."""
    attn = hf.model.layers[layer].self_attn
    cfg = hf.config
    Hq, H, D = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    with torch.no_grad():
        h = hf.model.layers[layer].input_layernorm(out.hidden_states[layer])  # [1, T, E]
        n = h.shape[1]
        cos, sin = hf.model.rotary_emb(h, torch.arange(n)[None])
        q = attn.q_proj(h).view(1, n, Hq, D).transpose(1, 2)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        kp = attn.k_proj(h).view(1, n, H, D).transpose(1, 2)
    k, v = layer_kv(out, layer)
    return q.float(), k[None], kp.float(), v[None]


def test_compactor_scores_are_kvpress_on_random_tensors():
    g = torch.Generator().manual_seed(0)
    H, G, S, D = 2, 3, 150, 16
    q, k = torch.randn(1, H * G, S, D, generator=g), torch.randn(1, H, S, D, generator=g)
    kp, v = torch.randn(1, H, S, D, generator=g), torch.randn(1, H, S, D, generator=g)
    phi = torch.randn(1, H, D, 8, generator=g) / math.sqrt(8)
    for chunk in (256, 32, 46):  # one padded chunk, several with a padded last one, a multiple of the length
        want = ref_compactor(q, k, kp, v, phi, 0.5, chunk_size=chunk)[0]
        got = compactor_scores([q[0, h * G:(h + 1) * G] for h in range(H)], list(k[0]), list(kp[0]), list(v[0]),
                               phi[0], 0.5, chunk, 8, 4)
        torch.testing.assert_close(torch.stack(got), want, rtol=1e-4, atol=1e-4)


def test_cur_scores_are_kvpress_on_random_tensors():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 101, 16, generator=g), torch.randn(1, 2, 101, 16, generator=g)
    P = torch.randn(16, 20, generator=g) / math.sqrt(20)
    for lt in ("kv_product", "key", "value", "kv_avg"):
        for local in (True, False):
            want = ref_cur(k, v, leverage_type=lt, local=local)[0]
            got = cur_scores(k[0], v[0], torch.tensor([101, 101]), num_sinks=4, leverage_type=lt,
                             local_window=16 if local else None)
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(cur_scores(k[0], v[0], torch.tensor([101, 101]), num_sinks=4,
                                          leverage_type="kv_product", local_window=16, projection=P),
                               ref_cur(k, v, G=P)[0])


@pytest.mark.parametrize("T_,ratio", [(100, 0.5), (110, 0.25), (117, 0.75), (15, 0.5)])
def test_chunkkv_chunks_are_kvpress_on_random_scores(T_, ratio):
    s = torch.rand(1, 2, T_, generator=torch.Generator().manual_seed(T_))
    got = chunk_keep(s[0], 20, ratio, budget=T_)  # a budget that never binds: kvpress's chunks
    if T_ < 20:
        assert got is None  # shorter than a chunk: the base's own selection (kvpress delegates)
        return
    assert set(got.tolist()) == ref_chunkkv(s, ratio, 20)
    tight = chunk_keep(s[0], 20, ratio, budget=int(T_ * (1 - ratio)))  # kvbench: never over the budget
    assert tight is not None and tight.numel() <= int(T_ * (1 - ratio))


@pytest.mark.parametrize("chunk_size", [256, 64])
@pytest.mark.parametrize("chunk", [T, 64])
def test_compactor_keeps_kvpress_tokens_on_the_tiny_model(hf, ids, hf_out, chunk, chunk_size):
    method = build_method("compactor", None, compression_ratio=0.5, chunk_size=chunk_size)
    kept, engine = kept_after_prefill(hf, ids, method, chunk)
    n_kept = int(T * 0.5)
    for layer in range(2):
        q, k, kp, v = model_states(hf, hf_out, layer)
        phi = method.sketch(layer, k.shape[1], k.shape[-1], "cpu")[None]
        want = ref_compactor(q, k, kp, v, phi, 0.5, chunk_size=chunk_size)[0]
        assert kept[layer] == top_sets(want, n_kept), f"layer {layer}"
        assert set(range(8)) | set(range(T - 4, T)) <= kept[layer][0]  # the sinks


@pytest.mark.parametrize("chunk", [T, 64])
def test_adakv_compactor_keeps_kvpress_tokens_on_the_tiny_model(hf, ids, hf_out, chunk):
    method = build_method("adakv_compactor", None, compression_ratio=0.5)
    kept, _ = kept_after_prefill(hf, ids, method, chunk)
    n_kept = int(T * 0.5)
    for layer in range(2):
        q, k, kp, v = model_states(hf, hf_out, layer)
        phi = method.inner.sketch(layer, k.shape[1], k.shape[-1], "cpu")[None]
        s = ref_compactor(q, k, kp, v, phi, 0.5)[0]  # [H, T]
        H = s.shape[0]
        # AdaKVPress: each head's int(n_kept * 0.2) best kept, then the layer's H * n_kept best pairs
        s = s.clone()
        s.scatter_(-1, s.topk(int(n_kept * 0.2), dim=-1).indices, torch.finfo(s.dtype).max)
        flat = s.reshape(-1).topk(H * n_kept).indices
        want = [set((flat[flat // T == h] % T).tolist()) for h in range(H)]
        assert kept[layer] == want, f"layer {layer}"
        assert sum(len(x) for x in kept[layer]) == H * n_kept


@pytest.mark.parametrize("opts", [{}, {"leverage_type": "kv_avg", "local_window_size": 8, "num_sinks": 2}])
@pytest.mark.parametrize("chunk", [T, 64])
def test_cur_keeps_kvpress_tokens_on_the_tiny_model(hf, ids, hf_out, opts, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("cur", BUDGET, **opts), chunk)
    for layer in range(2):
        k, v = layer_kv(hf_out, layer)
        want = ref_cur(k[None], v[None], num_sinks=opts.get("num_sinks", 4),
                       leverage_type=opts.get("leverage_type", "kv_product"), w=opts.get("local_window_size", 16))[0]
        assert kept[layer] == top_sets(want, BUDGET), f"layer {layer}"


@pytest.mark.parametrize("chunk", [T, 64])
def test_chunkkv_keeps_kvpress_chunks_on_the_tiny_model(hf, ids, hf_out, chunk):
    # T = 230 = 11 x 20 + 10: kvpress keeps int(12 x 0.5) = 6 chunks
    method = build_method("chunkkv", None, compression_ratio=0.5)
    kept, _ = kept_after_prefill(hf, ids, method, chunk)
    for layer in range(2):
        q, k, _, _ = model_states(hf, hf_out, layer)
        want = ref_chunkkv(ref_snapkv(q[:, :, -64:], k), 0.5, 20)
        if len(want) > int(T * 0.5):  # kvbench keeps within the budget: the same chunks but one (see chunkkv.py)
            assert all(h <= want for h in kept[layer])
        else:
            assert all(h == want for h in kept[layer]), f"layer {layer}"
        assert kept[layer][0] == kept[layer][1]  # the same chunks in every kv-head


@pytest.mark.parametrize("name,opts", [("compactor", {"chunk_size": 16}), ("adakv_compactor", {}), ("cur", {}),
                                       ("chunkkv", {"chunk_length": 8}), ("finch", {"window": 8}),
                                       ("merge", {}), ("merge", {"decode": "cam", "compression_interval": 4})])
def test_new_methods_free_their_evicted_bytes(name, opts):
    """At compression ratio 0.5 the pool's peak KV bytes are below full's, and what the tables hold once the prompts
    are compressed is about half (bytes measured from the pool, not computed)."""
    from kvbench.runtime.serving.engine import Engine
    from tests.tiny_models import ByteTokenizer
    m = tiny_model(vocab=256, tokenizer=ByteTokenizer(256))
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (200, 150)]
    stats = {}
    for label, method in (("full", None), (name, build_method(name, None, compression_ratio=0.5, **opts))):
        engine = Engine(m, method, block_size=8, prefill_chunk_size=32, num_blocks=2048)
        engine.generate(prompts, max_new_tokens=8)
        stats[label] = engine.memory_stats()
    assert stats[name]["peak_kv_bytes"] < stats["full"]["peak_kv_bytes"], stats
    assert stats[name]["held_kv_bytes"] <= 0.6 * stats["full"]["held_kv_bytes"], stats


def test_bad_options_are_refused_in_one_line():
    for name, opts, word in [("compactor", {"chunk_size": 0}, "chunk_size"), ("cur", {"leverage_type": "x"},
                             "leverage_type"), ("chunkkv", {"chunk_length": -1}, "chunk_length"),
                             ("adakv_compactor", {"base": "snapkv"}, "base"), ("compactor", {"decode": "evict"},
                             "decode")]:
        with pytest.raises(UserError, match=word) as e:
            build_method(name, 32, **opts)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------ finch
def ref_finch(q_window, keys, normalize=True):  # FinchPress.score (window = the last W prompt tokens)
    B, H, k_len, D = keys.shape
    W = q_window.shape[2]
    G = q_window.shape[1] // H
    w = torch.matmul(q_window, keys.repeat_interleave(G, dim=1).transpose(2, 3)) / math.sqrt(D)
    w = w + torch.triu(torch.full_like(w, float("-inf")), diagonal=k_len - W + 1)
    w = torch.softmax(w, dim=-1, dtype=torch.float32)[..., :-W]
    if normalize:
        w = w * torch.arange(k_len - W, k_len)[None, None, :, None]
    s = w.mean(dim=-2).view(B, H, G, k_len - W).mean(dim=2)
    return F.pad(s, (0, W), value=s.max().item() + 1)


def ref_rerotate(keys, indices, inv_freq):  # KeyRerotationPress.rerotate_keys, indices [B, H, n] sorted
    B, H, n = indices.shape
    delta = (torch.arange(n)[None, None, :].float() - indices.float()).unsqueeze(2)  # [B, H, 1, n]
    freqs = (delta * inv_freq[None, None, :, None].float()).transpose(2, 3)  # [B, H, n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    k = keys.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    return k * emb.cos() + rotate_half(k) * emb.sin()


def test_finch_scores_are_kvpress_on_random_tensors():
    from kvbench.methods.finch import finch_scores
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 6, 12, 16, generator=g), torch.randn(1, 2, 90, 16, generator=g)
    for norm in (True, False):
        torch.testing.assert_close(finch_scores(q[0], k[0], norm), ref_finch(q, k, norm)[0], rtol=1e-5, atol=1e-5)


def finch_run(hf, ids, method, chunk, question=None):
    """Prefill through generate (the question's extent passed as a task passes it); the tables of every layer right
    after compression: {layer: (keys [H, n, D], positions [H, n], values [H, n, D])}."""
    from kvbench.runtime.model.families import build_from_transformers
    from kvbench.runtime.serving.engine import Engine
    got = {}
    inner = method.after_attention

    def after_attention(ctx):
        inner(ctx)
        if ctx.phase == "prefill" and ctx.last_chunk:
            k, v, pos = ctx.cache.gather(ctx.layer, 0)
            got[ctx.layer] = (k.clone(), pos.clone(), v.clone())

    method.after_attention = after_attention
    engine = Engine(build_from_transformers(hf), method, block_size=16, num_blocks=512, prefill_chunk_size=chunk,
                    attention_backend="torch")
    engine.generate([ids.tolist()], max_new_tokens=1, question_tokens=None if question is None else [question])
    return got


@pytest.mark.parametrize("chunk", [T, 64])
def test_finch_keeps_and_rerotates_as_kvpress_on_the_tiny_model(hf, ids, hf_out, chunk):
    W = 20  # the question: the prompt's last 20 tokens
    n_kept = int(T * 0.5)
    kept, _ = kept_after_prefill(hf, ids, build_method("finch", None, compression_ratio=0.5, window=W,
                                                       rerotate_keys=False), chunk)
    rot = finch_run(hf, ids, build_method("finch", None, compression_ratio=0.5), chunk, question=W)
    for layer in range(2):
        q, k, _, _ = model_states(hf, hf_out, layer)
        s = ref_finch(q[:, :, -W:], k)
        idx = s.topk(n_kept, dim=-1).indices.sort(dim=-1).values  # [1, H, n]
        assert kept[layer] == [set(r.tolist()) for r in idx[0]], f"layer {layer}"
        assert set(range(T - W, T)) <= kept[layer][0]  # the question stays
        keys, pos, _ = rot[layer]
        assert bool((pos == torch.arange(n_kept)).all())  # re-rotated to 0..n-1
        want = ref_rerotate(k, idx, hf.model.rotary_emb.inv_freq)[0]
        torch.testing.assert_close(keys.float(), want, rtol=1e-4, atol=1e-4)


def test_finch_chunked_selection_is_kvpress(hf, ids, hf_out):
    W, L = 20, 60  # kvpress asserts chunk_length > window / (1 - ratio)
    kept, _ = kept_after_prefill(hf, ids, build_method("finch", None, compression_ratio=0.5, window=W,
                                                       chunk_length=L, rerotate_keys=False), T)
    for layer in range(2):
        q, k, _, _ = model_states(hf, hf_out, layer)
        s = ref_finch(q[:, :, -W:], k)
        idx = torch.cat([i + s[:, :, i: i + L].topk(max(1, int(s[:, :, i: i + L].shape[2] * 0.5)), dim=-1).indices
                         for i in range(0, T, L)], dim=-1)
        assert kept[layer] == [set(r.tolist()) for r in idx[0]], f"layer {layer}"


def test_finch_takes_the_questions_extent_from_the_task():
    """ruler with the question compressed (kvpress's query-aware loop): the request says how many tokens its
    question has and how many follow it uncompressed (the turn's end and the answer prefix), and the engine hands
    the question's extent to the method before the prompt's prefill (finch then keeps those tokens);
    compress_answer_prefix=true compresses what follows too, the window the question and it."""
    from kvbench.tasks.ruler import build_request
    from tests.fixtures.task_fixtures import smollm2_tokenizer
    tok = smollm2_tokenizer()
    sample = {"context": "The sky is blue. " * 30, "question": "What colour is the sky?", "answer_prefix": " Answer:",
              "answer": ["blue"], "task": "qa", "index": 0, "max_new_tokens": 4}
    words = tok("What colour is the sky?", add_special_tokens=False)["input_ids"]
    after = tok("\n Answer:", add_special_tokens=False)["input_ids"]
    req = build_request(tok, sample, 4096, False, True, 4, ())
    assert (req.question_tokens, req.uncompressed_tail) == (len(words), len(after))
    assert req.token_ids[-len(words) - len(after):] == words + after  # tokenized apart, as kvpress's parts
    both = tok("What colour is the sky?\n Answer:", add_special_tokens=False)["input_ids"]
    whole = build_request(tok, sample, 4096, False, True, 4, (), compress_answer_prefix=True)
    assert whole.uncompressed_tail == 0 and whole.question_tokens == len(both) > len(words)
    assert whole.token_ids[-len(both) + 1:] == both[1:]  # one encoding (its first token may merge with the context)
    m = tiny_model(vocab=max(req.token_ids) + 1)
    from kvbench.runtime.serving.engine import Engine
    for r in (req, whole):
        method = build_method("finch", None, compression_ratio=0.75)
        seen = []
        method.question_tokens = lambda slot, n, inner=method.question_tokens: (seen.append(n), inner(slot, n))
        engine = Engine(m, method, block_size=8, prefill_chunk_size=64, num_blocks=2048)
        engine.generate([r.token_ids], max_new_tokens=2, uncompressed_tails=[r.uncompressed_tail],
                        question_tokens=[r.question_tokens])
        assert set(seen) == {r.question_tokens}
    with pytest.raises(UserError, match="compress_question"):  # no question and no window: refused, one line
        Engine(m, build_method("finch", 32), block_size=8, num_blocks=2048).generate([req.token_ids], max_new_tokens=1)


# ------------------------------------------------------------------------ merging
def ref_merging(keys, values, indices, similarity_threshold=0.0, merge_fraction=1.0):  # MergingPress.merge
    bsz, num_heads, seq_len, head_dim = keys.shape
    n_kept = indices.shape[2]
    n_evict = seq_len - n_kept
    evict_mask = torch.ones(bsz, num_heads, seq_len, dtype=torch.bool)
    evict_mask.scatter_(2, indices, False)
    evict_idx = evict_mask.nonzero(as_tuple=False)[:, 2].reshape(bsz, num_heads, n_evict)
    keep_idx = indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    evict_idx = evict_idx.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    kept_keys, evict_keys = keys.gather(2, keep_idx).float(), keys.gather(2, evict_idx).float()
    kept_values, evict_values = values.gather(2, keep_idx), values.gather(2, evict_idx)
    kept_keys = kept_keys / kept_keys.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    evict_keys = evict_keys / evict_keys.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    max_sim, target = (evict_keys @ kept_keys.transpose(-2, -1)).max(dim=-1)
    merge_ok = max_sim >= similarity_threshold
    if merge_fraction < 1.0 and merge_ok.any():
        threshold = max_sim.masked_fill(~merge_ok, float("-inf")).quantile(1.0 - merge_fraction, dim=-1, keepdim=True)
        merge_ok = merge_ok & (max_sim >= threshold)
    weights = max_sim.clamp(min=0) * merge_ok.float()
    target_norm = kept_values.float().norm(dim=-1).gather(2, target)
    evict_norm = evict_values.float().norm(dim=-1)
    weights = weights * evict_norm / (evict_norm + target_norm + 1e-6)
    target = target.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    weights = weights.unsqueeze(-1)
    value_accum = torch.zeros(bsz, num_heads, n_kept, head_dim).scatter_add_(2, target, weights * evict_values.float())
    weight_accum = torch.zeros(bsz, num_heads, n_kept).scatter_add_(2, target[..., 0], weights[..., 0])
    kept_values = torch.where((weight_accum > 0).unsqueeze(-1),
                              ((kept_values.float() + value_accum) / (1.0 + weight_accum).unsqueeze(-1)),
                              kept_values)
    return kept_values, weight_accum  # the kept positions' values [B, H, n, D] (indices' order), weights


@pytest.mark.parametrize("thr,frac", [(0.0, 1.0), (0.2, 1.0), (0.0, 0.75)])
def test_merged_values_are_kvpress_on_random_tensors(thr, frac):
    from kvbench.methods.merge import merged_values
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 2, 60, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)
    idx = torch.rand(1, 2, 60, generator=g).topk(25, dim=-1).indices.sort(dim=-1).values
    want, _ = ref_merging(k, v, idx, thr, frac)
    for h in range(2):
        got, _ = merged_values(k[0, h], v[0, h], idx[0, h], thr, frac)
        torch.testing.assert_close(got, want[0, h])


def test_merging_conserves_the_total_value_weight():
    """Each kept value is a weighted mean; its weight (1 + W) times it, summed over the kept tokens, is the kept
    values' sum plus every evicted value times the weight it merged with: no value mass lost or counted twice."""
    from kvbench.methods.merge import merged_values
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(80, 16, generator=g), torch.randn(80, 16, generator=g)
    keep = torch.rand(80, generator=g).topk(30).indices.sort().values
    out, wsum = merged_values(k, v, keep)
    evicted = torch.ones(80, dtype=torch.bool)
    evicted[keep] = False
    # the weights each evicted token merged with, recomputed from the definition
    kn = F.normalize(k, dim=-1)
    sim, tgt = (kn[evicted] @ kn[keep].T).max(-1)
    e_norm = v[evicted].norm(dim=-1)
    w = sim.clamp(min=0) * e_norm / (e_norm + v[keep].norm(dim=-1)[tgt] + 1e-6)
    assert bool((wsum > 0).any()) and torch.allclose(wsum.sum(), w.sum(), atol=1e-5)
    torch.testing.assert_close(((1 + wsum)[:, None] * out).sum(0), v[keep].sum(0) + (w[:, None] * v[evicted]).sum(0),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [T, 64])
def test_merge_keeps_the_bases_tokens_with_kvpress_merged_values(hf, ids, hf_out, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("merge", BUDGET), chunk)
    got = finch_run(hf, ids, build_method("merge", BUDGET), chunk)
    for layer in range(2):
        k, v = layer_kv(hf_out, layer)
        want_sets = top_sets(-k.norm(dim=-1), BUDGET)  # the base: knorm
        assert kept[layer] == want_sets, f"layer {layer}"
        idx = torch.stack([torch.tensor(sorted(s)) for s in want_sets])[None]
        want_v, _ = ref_merging(k[None], v[None], idx)
        torch.testing.assert_close(got[layer][2], want_v[0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got[layer][2], v[:, idx[0][0]])  # values really changed


def ref_cam(scores, attentions, values, target_size, k, merge_budget, g):  # CAMPress.compress (B = 1)
    bsz, H, seq_len, head_dim = values.shape
    n_to_evict = seq_len - target_size
    mean_scores = scores.mean(dim=1)
    evict_indices = torch.sort(mean_scores.topk(n_to_evict, dim=-1, largest=False).indices, dim=-1).values
    evict_scores = mean_scores.gather(-1, evict_indices)
    order = evict_scores.flip(-1).argsort(dim=-1, descending=True, stable=True)[:, :k]
    merge_indices = torch.sort(evict_indices.gather(-1, n_to_evict - 1 - order), dim=-1).values
    kept_indices = torch.sort(mean_scores.topk(target_size, dim=-1).indices, dim=-1).values
    n_to_merge = merge_indices.shape[1]
    target_starts = torch.searchsorted(kept_indices, merge_indices, right=True)
    window_idx = target_starts.unsqueeze(-1) + torch.arange(merge_budget).view(1, 1, -1)
    valid_mask = window_idx < target_size
    window_idx = window_idx.clamp(max=target_size - 1)
    target_positions = kept_indices.gather(1, window_idx.view(bsz, -1)).view(bsz, n_to_merge, merge_budget)
    actual_budget = valid_mask.sum(dim=-1)
    window_attns = attentions.gather(2, target_positions.view(bsz, -1).unsqueeze(1).expand(-1, H, -1)).view(
        bsz, H, n_to_merge, merge_budget)
    window_attns = window_attns * valid_mask.view(bsz, 1, n_to_merge, merge_budget)
    mean_attn = window_attns.sum(dim=-1) / actual_budget.clamp(min=1).unsqueeze(1)
    merge_prob = attentions.gather(2, merge_indices.unsqueeze(1).expand(-1, H, -1)) / mean_attn
    merge_prob = torch.where(torch.isnan(merge_prob), torch.zeros_like(merge_prob), merge_prob)
    merge_prob = torch.where(torch.isinf(merge_prob), torch.ones_like(merge_prob), merge_prob).clamp(0, 1)
    merge_mask = torch.bernoulli(merge_prob, generator=g)
    merge_values = values.gather(2, merge_indices.view(bsz, 1, n_to_merge, 1).expand(-1, H, -1, head_dim))
    scale = (merge_mask / actual_budget.unsqueeze(1)).unsqueeze(-1)
    scale = torch.where(actual_budget.unsqueeze(1).unsqueeze(-1) == 0, torch.zeros_like(scale), scale)
    contributions = (merge_values * scale).unsqueeze(3).expand(-1, -1, -1, merge_budget, -1)
    contributions = contributions * valid_mask.view(bsz, 1, n_to_merge, merge_budget, 1)
    contributions = contributions.reshape(bsz, H, n_to_merge * merge_budget, head_dim)
    scatter_idx = target_positions.view(bsz, 1, n_to_merge * merge_budget, 1).expand(-1, H, -1, head_dim)
    values = values.clone().scatter_add_(2, scatter_idx, contributions)
    return kept_indices[0], values.gather(2, kept_indices.view(1, 1, -1, 1).expand(1, H, -1, head_dim))[0]


@pytest.mark.parametrize("k,mb", [(1, 32), (6, 4), (20, 3)])
def test_cam_merge_is_kvpress_on_random_tensors(k, mb):
    from kvbench.methods.merge import cam_merge
    g = torch.Generator().manual_seed(k)
    s, a, v = torch.rand(1, 2, 70, generator=g), torch.rand(1, 2, 70, generator=g), torch.randn(1, 2, 70, 8, generator=g)
    kept, got = cam_merge(s[0], a[0], v[0], 50, k, mb, torch.Generator().manual_seed(9))
    want_kept, want = ref_cam(s, a, v, 50, k, mb, torch.Generator().manual_seed(9))
    assert kept.tolist() == want_kept.tolist()
    torch.testing.assert_close(got, want)


def test_cam_merge_adds_each_merged_value_whole():
    """With the merged tokens' attention at least their window's (probability 1), the kept values' sum grows by
    exactly the merged values (the value is split over its window, nothing lost)."""
    from kvbench.methods.merge import cam_merge
    g = torch.Generator().manual_seed(3)
    s, v = torch.rand(2, 40, generator=g), torch.randn(2, 40, 8, generator=g)
    a = torch.ones(2, 40)  # every token attended alike: merge probability 1
    kept, got = cam_merge(s, a, v, 30, 4, 5, torch.Generator().manual_seed(0))
    ms = s.mean(0)
    ev = ms.topk(10, largest=False).indices.sort().values
    merged = ev[10 - 1 - ms[ev].flip(-1).argsort(descending=True, stable=True)[:4]]
    has_window = torch.searchsorted(kept, merged, right=True) < 30
    torch.testing.assert_close(got.sum(1), v[:, kept].sum(1) + v[:, merged[has_window]].sum(1), rtol=1e-5, atol=1e-5)


def test_finch_without_a_question_is_refused_before_the_model_loads():
    import kvbench.run.config as kconfig
    from tests.harness_fakes import compose
    for args in (["method=finch", "compression_ratio=0.5"], ["method=finch", "budget=64", "task=ruler"]):
        with pytest.raises(UserError, match="task.compress_question=true") as e:
            kconfig.validate(compose(args))
        assert "\n" not in str(e.value)
    kconfig.validate(compose(["method=finch", "budget=64", "task=ruler", "task.compress_question=true"]))
    kconfig.validate(compose(["method=finch", "budget=64", "method.window=32"]))  # any task: the last 32 tokens


def test_in_place_rewrites_over_a_codec_are_refused_before_the_model_loads():
    import kvbench.run.config as kconfig
    from tests.harness_fakes import compose
    for args in (["method=merge", "budget=64", "quant=kivi"],
                 ["method=finch", "budget=64", "method.window=16", "quant=int8"]):
        with pytest.raises(UserError, match="rewrites cached K/V") as e:
            kconfig.validate(compose(args))
        assert "\n" not in str(e.value)
    kconfig.validate(compose(["method=finch", "budget=64", "method.window=16", "method.rerotate_keys=false",
                              "quant=int8"]))


def test_new_methods_yaml_defaults_are_the_classes():
    """Each YAML states the class's defaults (kvpress's): nothing drifts between the two."""
    import yaml
    from pathlib import Path
    conf = Path(__file__).resolve().parents[2] / "conf" / "method"
    for name in ("compactor", "adakv_compactor", "cur", "chunkkv", "finch", "merge"):
        opts = yaml.safe_load((conf / f"{name}.yaml").read_text())
        assert opts.pop("name") == name
        m = build_method(name, 64)
        for k, v in opts.items():
            assert getattr(m, k) == v, (name, k)
