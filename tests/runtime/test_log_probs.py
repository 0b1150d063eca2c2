"""Issue 66 item 6: a token's log-probability over a 262k vocabulary matches float64 to 1e-6 nats (float32's
log_softmax reads ~1e-5 low there), in row slices of bounded size, and the scorer uses it."""
from __future__ import annotations

import torch

from kvbench.runtime.serving import log_probs
from kvbench.runtime.serving.log_probs import target_log_probs
from kvbench.runtime.serving.scoring import Scorer
from kvbench.runtime.serving.engine import Engine
from tests.tiny_models import tiny_hf_model
from kvbench.runtime.model.families import build_from_transformers


def _logits(rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """LM-like logits [rows, vocab]: a broad spread with the target well above it, as a trained model's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2.5 + 2.0
    t = torch.randint(0, vocab, (rows,), generator=g)
    x[torch.arange(rows), t] += 12.0
    return x, t


def _float64_reference(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.double(), dim=-1).gather(-1, t[:, None]).squeeze(-1)


def test_matches_float64_over_a_262k_vocabulary_where_float32_does_not():
    x, t = _logits(24, 262_144)
    ref = _float64_reference(x, t)
    got = target_log_probs(x, t)
    assert got.dtype == torch.float64 and got.shape == (24,)
    assert (got - ref).abs().max().item() <= 1e-6
    float32 = torch.log_softmax(x, dim=-1).gather(-1, t[:, None]).squeeze(-1).double()
    assert (float32 - ref).abs().max().item() > 2e-6  # what the float64 sum fixes (the check can fail)


def test_row_slices_give_the_same_values(monkeypatch):
    x, t = _logits(13, 1000, seed=1)  # 13 rows: slices of 3 leave a ragged last one
    whole = target_log_probs(x, t)
    monkeypatch.setattr(log_probs, "ROW_ELEMENTS", 3 * 1000)
    sliced = target_log_probs(x, t)
    assert torch.equal(whole, sliced)
    assert (sliced - _float64_reference(x, t)).abs().max().item() <= 1e-7
    assert target_log_probs(x.bfloat16(), t).dtype == torch.float64  # any float dtype in


def test_scorer_returns_float64_equal_to_a_float64_log_softmax():
    hf = tiny_hf_model("llama", seed=2)
    engine = Engine(build_from_transformers(hf), prefill_chunk_size=8, block_size=8, num_blocks=64)
    ids = torch.randint(0, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    got = Scorer(engine).score(ids, chunk_size=8)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    ref = _float64_reference(logits[:-1], torch.tensor(ids[1:]))
    assert got.dtype == torch.float64 and (got - ref).abs().max().item() <= 1e-4  # kvbench's forward vs HF's
