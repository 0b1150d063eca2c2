"""R-KV's selection against a plain-torch transcription of the official one (Zefan-Cai/R-KV: R1KV.update_kv,
utils.compute_attention_scores and utils.cal_similarity with retain_direction="last"), on random K/V, as kvpress's
parity tests do; and the method in the engine: prompt compressed to budget, then every `buffer` tokens."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.methods.rkv import rkv_keep
from kvbench.runtime.serving.engine import Engine
from tests.tiny_models import tiny_model


# ------------------------------------------------------------------ the official selection, transcribed
def official_attention_logits(query_states, key_states):
    """[B, Hq, Q, D], [B, H, T, D] -> [B, H, Q, T]: per kv-head the max over its query heads' logits."""
    b, hq, q_len, d = query_states.shape
    h = key_states.shape[1]
    if hq == h:
        return torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(d)
    qs = query_states.view(b, h, hq // h, q_len, d)
    w = torch.matmul(qs, key_states.unsqueeze(2).transpose(3, 4)) / math.sqrt(d)
    return w.max(dim=2).values


def official_similarity(key_states, threshold=0.5):
    k = key_states[0]
    num_heads = k.shape[0]
    k_norm = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = torch.matmul(k_norm, k_norm.transpose(-1, -2))
    for h in range(num_heads):
        sim[h].fill_diagonal_(0.0)
    mask = sim > threshold
    idx = torch.where(mask, torch.arange(mask.size(-1)), torch.zeros_like(mask, dtype=torch.long))
    retain = torch.max(idx, dim=-1)[0]
    rows = torch.arange(num_heads).unsqueeze(1).repeat(1, retain.size(1))
    cols = torch.arange(retain.size(1)).unsqueeze(0).repeat(num_heads, 1)
    sim[rows, cols, retain] = 0
    return sim.mean(dim=1).softmax(dim=-1)


def official_kept_indices(key_states, query_states, budget, window, kernel, mix_lambda):
    """The slots R1KV.update_kv keeps (its top-k of the older tokens, then the window), as a sorted set per head."""
    T = key_states.shape[-2]
    attn = official_attention_logits(query_states, key_states)
    attn_sum = F.softmax(attn[:, :, -window:, :-window], dim=-1, dtype=torch.float32).mean(dim=-2)
    attn_cache = F.max_pool1d(attn_sum, kernel_size=kernel, padding=kernel // 2, stride=1)
    sim = official_similarity(key_states)[:, :-window]
    final = attn_cache * mix_lambda - sim * (1 - mix_lambda)
    idx = final.topk(budget - window, dim=-1).indices[0]  # [H, budget - window]
    recent = torch.arange(T - window, T).expand(idx.shape[0], -1)
    return torch.cat([idx, recent], dim=-1).sort(dim=-1).values


@pytest.mark.parametrize("seed,T,budget,window,heads,kv_heads,kernel,lam", [
    (0, 200, 64, 8, 6, 2, 7, 0.07),
    (1, 300, 128, 8, 4, 4, 7, 0.07),
    (2, 97, 40, 4, 8, 2, 5, 0.5),
    (3, 150, 100, 16, 6, 3, 3, 0.9),
])
def test_selection_equals_the_official_code(seed, T, budget, window, heads, kv_heads, kernel, lam):
    g = torch.Generator().manual_seed(seed)
    D = 32
    k = torch.randn(1, kv_heads, T, D, generator=g)
    # near-duplicate keys, so the redundancy term matters
    k[:, :, T // 3: T // 3 + 20] = k[:, :, T // 4: T // 4 + 1] + 0.05 * torch.randn(1, kv_heads, 20, D, generator=g)
    q = torch.randn(1, heads, window, D, generator=g) * 2
    want = official_kept_indices(k, q, budget, window, kernel, lam)
    got = rkv_keep(q[0], k[0], budget, window, kernel, lam)
    assert torch.equal(got, want)


def test_redundancy_penalises_repeated_keys():
    """Many copies of one key: the copies score as redundant, and most of them leave."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 120, 16, generator=g)
    k[0, 10:60] = k[0, 5] + 0.01 * torch.randn(50, 16, generator=g)
    q = torch.zeros(1, 8, 16)  # uniform attention: only redundancy ranks
    keep = rkv_keep(q, k, 48, 8, 1, 0.07)[0].tolist()
    assert sum(10 <= t < 60 for t in keep) < 5


def test_engine_compresses_every_buffer_tokens():
    model = tiny_model(vocab=256, max_positions=1024)
    method = build_method("rkv", 48, buffer=16)
    engine = Engine(model, method, block_size=16, num_blocks=512)
    lengths = []
    inner = method.after_attention

    def after_attention(ctx):
        inner(ctx)
        if ctx.layer == 0:
            lengths.append(int(ctx.cache.lengths[ctx.plan.slot_list[0], 0].max()))

    method.after_attention = after_attention
    engine.generate([list(range(1, 101))], max_new_tokens=60)
    assert lengths[0] == 48  # the prompt (100 tokens) compressed to the budget
    assert max(lengths) == 48 + 15 and min(lengths[1:]) == 48  # then grows by the buffer and is cut back
    assert engine.memory_stats()["peak_kv_bytes"] < engine.memory_stats()["full_kv_bytes"]


def test_budget_must_exceed_the_window():
    with pytest.raises(UserError, match="must exceed rkv.window=8"):
        build_method("rkv", 8)
    with pytest.raises(UserError, match="rkv.gqa_pooling"):
        build_method("rkv", 64, gqa_pooling="min")
