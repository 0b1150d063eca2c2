"""Issue 69's presses (kvpress's evaluation registry beyond the board): observed_attention, block_keydiff and qfilter
keep exactly the tokens of kvpress's presses (ObservedAttentionPress, BlockPress(KeyDiffPress), QFilterPress),
written out here in plain torch from a transformers model's own attention probabilities, keys and hidden states;
prefill in one chunk or several."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench.methods import METHODS, build_method
from tests.fixtures.press_fixtures import PROMPT_TOKENS, hf, hf_out, ids  # noqa: F401  (fixtures)
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_kvpress_a import kept_after_prefill, layer_kv, top_sets

T, BUDGET = PROMPT_TOKENS, 120

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


# ------------------------------------------------------------------------------------------------ definitions
def observed_attention_reference(out, layer: int, budget: int) -> list[set]:
    """kvpress ObservedAttentionPress.score: the prompt's attention summed over the queries, / (n_tokens - i), the
    GQA group averaged."""
    probs = out.attentions[layer][0].float()  # [Hq, T, T]
    n = probs.shape[-1]
    H = out.past_key_values.layers[layer].keys.shape[1]
    s = probs.sum(1) / torch.arange(n, 0, -1, dtype=torch.float32)  # [Hq, T]
    s = s.view(H, -1, n).mean(1)  # [H, T]
    return top_sets(s, budget)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("chunk", [T, 64])
def test_observed_attention_keeps_the_mean_observed_attention(hf, ids, hf_out, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("observed_attention", BUDGET), chunk)
    for layer in range(2):
        assert kept[layer] == observed_attention_reference(hf_out, layer, BUDGET), f"layer {layer}"


def test_observed_attention_is_not_h2os_sum(hf, ids, hf_out):
    """The division by the observing queries matters: the attention sum alone (H2O's score) keeps other tokens."""
    probs = hf_out.attentions[0][0].float()
    H = hf_out.past_key_values.layers[0].keys.shape[1]
    summed = top_sets(probs.sum(1).view(H, -1, T).mean(1), BUDGET)
    assert summed != observed_attention_reference(hf_out, 0, BUDGET)


@pytest.mark.parametrize("name", ["observed_attention"])
def test_method_yaml_composes_to_the_dataclass_defaults(name):
    from kvbench.config import validate
    from tests.harness_fakes import compose

    s = validate(compose([f"method={name}", "budget=256"]))
    assert s.method_name == name
    assert build_method(s.method_name, s.budget, **s.method_options) == METHODS[name](budget=256)
