"""SnapKV with its official defaults (window 64, kernel 5, avgpool) keeps, per kv-head, exactly the tokens of the
official definition (FasterDecoding/SnapKV `SnapKVCluster.update_kv`), computed here from plain (eager) attention
of the transformers model over the prompt: the last `window` queries' probabilities over the earlier keys, summed
over the window, the query heads of each kv-head averaged, avg_pool1d(kernel 5, padding 2, stride 1), top
(budget - window) per head, plus the window itself."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench.methods import build_method
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.engine import Engine
from tests.tiny_models import DISTINCT_SCORES, tiny_hf_model

T, BUDGET = 230, 120


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(vocab=256, eager=True, **DISTINCT_SCORES)


def official_keep(probs: torch.Tensor, num_kv_heads: int, window: int, kernel: int, budget: int) -> list[set]:
    """probs [Hq, T, T] (softmax rows of one layer) -> the kept token indices per kv-head."""
    Hq, n, _ = probs.shape
    scores = probs[:, -window:, :-window].sum(dim=-2)  # [Hq, T - window]
    scores = scores.view(num_kv_heads, Hq // num_kv_heads, -1).mean(dim=1)  # GQA: the group's query heads averaged
    pooled = F.avg_pool1d(scores[:, None, :], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0, :]
    top = pooled.topk(budget - window, dim=-1).indices  # [H, budget - window]
    return [set(top[h].tolist()) | set(range(n - window, n)) for h in range(num_kv_heads)]


@pytest.mark.parametrize("chunk", [T, 64])
def test_snapkv_defaults_keep_the_official_tokens(hf, chunk):
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(ids[None], output_attentions=True)
    method = build_method("snapkv", BUDGET)
    assert (method.window, method.kernel_size, method.pooling, method.decode) == (64, 5, "avgpool", "none")
    kept = {}
    inner = method.after_attention

    def after_attention(ctx):
        inner(ctx)
        if ctx.last_chunk:
            lengths = ctx.cache.lengths[0, ctx.layer]
            kept[ctx.layer] = [set(ctx.cache.positions[0, ctx.layer, h, : int(lengths[h])].tolist())
                               for h in range(lengths.shape[0])]

    method.after_attention = after_attention
    engine = Engine(build_from_transformers(hf), method, block_size=16, num_blocks=512, prefill_chunk_size=chunk,
                    attention_backend="torch")
    engine.generate([ids.tolist()], max_new_tokens=1)
    for layer, probs in enumerate(out.attentions):
        want = official_keep(probs[0].float(), 2, 64, 5, BUDGET)
        assert kept[layer] == want, f"layer {layer}"
