"""The kvbench forward over the paged cache against transformers (same weights, fp32)."""
from __future__ import annotations

import pytest
import torch

from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer
from tests.tiny_models import FAMILIES, hf_logprobs, tiny_hf_model


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_transformers(family):
    hf = tiny_hf_model(family)
    model = build_from_transformers(hf)
    ids = torch.randint(0, hf.config.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logprobs(hf, ids)
    got = Scorer(Engine(model, prefill_chunk_size=128)).score(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(family):
    hf = tiny_hf_model(family, seed=3)
    model = build_from_transformers(hf)
    prompt = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    got = Engine(model, prefill_chunk_size=16).generate([prompt], max_new_tokens=64)[0]
    assert got.token_ids == ref
    assert got.finish_reason == "length"


def test_pre_rope_storage_gives_the_same_logprobs():
    """Keys cached before RoPE and rotated at read time at their original positions change nothing."""
    from kvbench.methods.full import FullCache

    class PreRope(FullCache):
        @property
        def store_pre_rope(self) -> bool:
            return True

    hf = tiny_hf_model("llama")
    model = build_from_transformers(hf)
    ids = torch.randint(0, 320, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    eng = Engine(model, PreRope(), prefill_chunk_size=50)
    assert eng.cache.store_pre_rope
    assert (Scorer(eng).score(ids) - hf_logprobs(hf, ids)).abs().max().item() <= 1e-3


def test_smollm2_packaged_matches_transformers(smollm2):
    text_ids = smollm2.tokenizer("The history of the city begins with a small harbour. " * 60)["input_ids"][:512]
    ref = hf_logprobs(smollm2.hf_model, text_ids)
    got = Scorer(Engine(smollm2.model, prefill_chunk_size=256)).score(text_ids)
    assert (got - ref).abs().max().item() <= 1e-3
    prompt = text_ids[:64]
    with torch.no_grad():
        ref_gen = smollm2.hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64,
                                            do_sample=False)[0, 64:].tolist()
    got_gen = Engine(smollm2.model).generate([prompt], max_new_tokens=64)[0].token_ids
    assert got_gen == ref_gen


def test_unsupported_architecture_is_refused():
    import transformers as tf

    hf = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        build_from_transformers(hf)
