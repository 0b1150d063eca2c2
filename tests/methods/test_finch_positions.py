"""finch after its prompt: the tokens that follow a compressed prompt take the positions kvpress's pipeline gives
them (kvpress pipeline.py `_forward` / `generate_answer`): after FinchPress with rerotate_keys (or KeyRerotationPress)
`context_length = cache.get_seq_length()`, the kept length n, so the question's tail and the generated tokens sit at
n, n + 1, ...; without re-rotation at the context's length T, T + 1, ... (kvbench: every token's own position).

Checked two ways: a plain-torch transcription of that rule over transformers' own model (runs everywhere), and, where
kvpress is importable (not in CI: `pip install --no-deps kvpress==0.5.5 cachetools fire termcolor` into a folder on
PYTHONPATH), kvpress's own pipeline and presses on the same weights. Both compare the next-token logits of the tail
and of each greedy step with kvbench's engine, fed as the scheduler feeds a query-aware request (the compressed
prompt, then the tail uncompressed, then decode steps)."""
from __future__ import annotations

import pytest
import torch

from kvbench.methods import build_method
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.batch import Segment
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.press_fixtures import PROMPT_TOKENS, hf, hf_out, ids  # noqa: F401  (fixtures)
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_kvpress_c import model_states, ref_finch, ref_rerotate

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)

T, W, RATIO, STEPS = PROMPT_TOKENS, 20, 0.5, 6  # prompt (its last W tokens the question), kvpress's ratio, greedy steps
N_KEPT = int(T * (1 - RATIO))  # kvpress's compute_n_kept
TAIL = [17, 203, 5, 88, 140]  # the question's suffix and answer prefix, appended after compression


def kvbench_logits(hf, prompt: list[int], tail: list[int], forced: list[int], **finch) -> list[torch.Tensor]:
    """kvbench's engine, as the scheduler runs a query-aware request: the prompt (its last W tokens the question)
    compressed at its last chunk, the tail kept uncompressed, then one decode step per forced token. The logits [V]
    after the tail and after each step; positions are given as token indices (the cache shifts them)."""
    method = build_method("finch", None, compression_ratio=RATIO, **finch)
    engine = Engine(build_from_transformers(hf), method, block_size=16, num_blocks=512, attention_backend="torch")
    slot = engine.new_sequence()
    method.question_tokens(slot, W)  # the method's channel (Engine._tell_method): the prompt's last W are the question
    engine.step([Segment(slot, prompt, 0, "prefill", last_chunk=True)])
    method.keep_uncompressed(slot, len(tail))  # the tail appended uncompressed
    out = [engine.step([Segment(slot, tail, len(prompt), "prefill", last_chunk=True)])[0]]
    start = len(prompt) + len(tail)
    for i, token in enumerate(forced):
        out.append(engine.step([Segment(slot, [token], start + i, "decode")])[0])
    return [o.float() for o in out]


def kvpress_transcribed(hf, hf_out, tail: list[int], rerotate: bool, context_length: int | None = None
                        ) -> list[torch.Tensor]:
    """kvpress's pipeline over FinchPress, in plain torch on transformers' model: each layer keeps its n best keys
    by FINCH's score (re-rotated to 0..n-1 when `rerotate`), then generate_answer feeds the tail at positions
    context_length.. (n after re-rotation, else T; or as given) and decodes greedily from there. The logits [V] of
    each step."""
    from transformers import DynamicCache
    cache = DynamicCache()
    inv_freq = hf.model.rotary_emb.inv_freq
    for layer in range(hf.config.num_hidden_layers):
        q, k, _, v = model_states(hf, hf_out, layer)
        idx = ref_finch(q[:, :, -W:], k).topk(N_KEPT, dim=-1).indices.sort(dim=-1).values  # [1, H, n]
        gather = idx.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
        keys = ref_rerotate(k, idx, inv_freq) if rerotate else k.gather(2, gather)
        cache.update(keys.to(hf.dtype), v.gather(2, gather).to(hf.dtype), layer)
    if context_length is None:  # pipeline._forward
        context_length = cache.get_seq_length() if rerotate else T
    position_ids = torch.arange(context_length, context_length + len(tail))[None]
    logits = []
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([tail]), cache=cache, position_ids=position_ids)
        logits.append(out.logits[0, -1].float())
        position_ids = position_ids[:, -1:] + 1
        for i in range(STEPS - 1):
            out = hf(input_ids=logits[-1].argmax().view(1, 1), cache=cache, position_ids=position_ids + i)
            logits.append(out.logits[0, -1].float())
    return logits


def assert_same_logits(want: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(want) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(want, got)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("rerotate", [True, False], ids=["rerotated", "original_positions"])
def test_finch_continues_where_kvpress_pipeline_does(hf, hf_out, ids, rerotate):
    want = kvpress_transcribed(hf, hf_out, TAIL, rerotate)
    forced = [int(w.argmax()) for w in want[:-1]]
    got = kvbench_logits(hf, ids.tolist(), TAIL, forced, rerotate_keys=rerotate)
    assert_same_logits(want, got)


def test_the_continuation_rule_is_what_separates_the_two(hf, hf_out, ids):
    """The transcription can tell the rules apart on this model: re-rotated keys continued at the original positions
    (kvbench before issue 68 item 6) give other logits than kvpress's continuation at n."""
    want = kvpress_transcribed(hf, hf_out, TAIL, rerotate=True)
    shifted = kvbench_logits(hf, ids.tolist(), TAIL, [int(w.argmax()) for w in want[:-1]])
    assert max(float((a - b).abs().max()) for a, b in zip(want, shifted)) < 1e-4
    original = kvpress_transcribed(hf, hf_out, TAIL, rerotate=False)
    assert max(float((a - b).abs().max()) for a, b in zip(original, shifted)) > 1e-3


def test_generate_follows_the_transcribed_greedy_answer(hf, hf_out, ids):
    """Through the scheduler (Engine.generate with an uncompressed tail and the question's extent): kvpress's
    greedy tokens, token for token."""
    want = [int(w.argmax()) for w in kvpress_transcribed(hf, hf_out, TAIL, rerotate=True)]
    engine = Engine(build_from_transformers(hf), build_method("finch", None, compression_ratio=RATIO),
                    block_size=16, num_blocks=512, attention_backend="torch")
    out = engine.generate([ids.tolist() + TAIL], max_new_tokens=STEPS, uncompressed_tails=[len(TAIL)],
                          question_tokens=[W])
    assert out[0].token_ids == want


# ------------------------------------------------------------------------ kvpress's own pipeline, where importable
@pytest.fixture()
def kvpress_pipeline(hf, monkeypatch):
    """kvpress's KVPressTextGenerationPipeline over the tiny model. kvpress 0.5.5 reads the attention's
    `past_key_values` and `cache_position` keyword arguments, which transformers >= 5.3 no longer passes (`cache`;
    no cache_position): its forward hook gets them back, the rest is kvpress's own code."""
    pytest.importorskip("kvpress", reason="kvpress is not installed (pip install --no-deps kvpress==0.5.5)")
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from kvpress.presses.base_press import BasePress

    from tests.fixtures.task_fixtures import smollm2_tokenizer
    hook = BasePress.forward_hook

    def forward_hook(self, module, inputs, kwargs, output):
        kwargs = dict(kwargs)
        cache = kwargs.setdefault("past_key_values", kwargs.get("cache"))
        if "cache_position" not in kwargs:  # the layer's tokens after this step's append: prefill iff they are q_len
            length, q_len = cache.get_seq_length(module.layer_idx), kwargs["hidden_states"].shape[1]
            kwargs["cache_position"] = torch.arange(length - q_len, length)
        return hook(self, module, inputs, kwargs, output)

    monkeypatch.setattr(BasePress, "forward_hook", forward_hook)
    return KVPressTextGenerationPipeline(model=hf, tokenizer=smollm2_tokenizer(), device="cpu")


def kvpress_logits(hf, pipeline, context_ids: torch.Tensor, press) -> list[torch.Tensor]:
    """The logits [V] the pipeline's generate_answer computes (the tail, then each greedy step), recorded from the
    model's outputs; the prefill runs the inner model (no logits)."""
    logits: list[torch.Tensor] = []
    handle = hf.register_forward_hook(lambda mod, args, out: logits.append(out.logits[0, -1].detach().float()))
    try:
        pipeline._forward({"context_ids": context_ids[None], "questions_ids": [torch.tensor([TAIL])]},
                          max_new_tokens=STEPS, press=press)
    finally:
        handle.remove()
    return logits


def finch_press_logits(hf, ids, pipeline, rerotate: bool) -> list[torch.Tensor]:
    """FinchPress finds its window after a delimiter token, which its embedding hook removes: the prompt given to
    kvpress is context + delimiter + question (the delimiter an id the prompt never holds)."""
    from kvpress import FinchPress
    press = FinchPress(compression_ratio=RATIO, rerotate_keys=rerotate)
    delimiter = min(set(range(hf.config.vocab_size)) - set(ids.tolist()))
    press.delimiter_token_id = delimiter
    context = torch.cat([ids[:-W], torch.tensor([delimiter]), ids[-W:]])
    want = kvpress_logits(hf, pipeline, context, press)
    assert press.window_size == W
    return want


def test_finch_matches_kvpress_finchpress_pipeline(hf, ids, kvpress_pipeline):
    want = finch_press_logits(hf, ids, kvpress_pipeline, rerotate=True)
    got = kvbench_logits(hf, ids.tolist(), TAIL, [int(w.argmax()) for w in want[:-1]])
    assert_same_logits(want, got)


def test_finchpress_without_rerotation_leaves_a_one_position_gap(hf, hf_out, ids, kvpress_pipeline):
    """FinchPress(rerotate_keys=False): the pipeline's context_length is the length of the ids it was given, the
    delimiter included, so the tail starts at T + 1, one position past the prompt (kvbench: at T, the next
    position; docs/methods.md names the difference). Both are the transcription, at their own start."""
    want = finch_press_logits(hf, ids, kvpress_pipeline, rerotate=False)
    assert_same_logits(kvpress_transcribed(hf, hf_out, TAIL, rerotate=False, context_length=T + 1), want)
    ours = kvpress_transcribed(hf, hf_out, TAIL, rerotate=False)
    assert_same_logits(ours, kvbench_logits(hf, ids.tolist(), TAIL, [int(w.argmax()) for w in ours[:-1]],
                                            rerotate_keys=False))


def test_finch_window_matches_kvpress_keyrerotationpress_over_finch_scores(hf, ids, kvpress_pipeline):
    """KeyRerotationPress (kvpress's wrapper that re-rotates any scorer's kept keys) continues at n as well: over a
    scorer press whose score is FINCH's with a fixed window (FinchPress.score, window_size = W) it is kvbench's
    finch with method.window=W."""
    from kvpress import FinchPress, KeyRerotationPress
    from kvpress.presses.scorer_press import ScorerPress

    class FinchScorer(ScorerPress):  # FinchPress's own score() as a ScorerPress
        window_size = W
        score = FinchPress.score
        normalize_scores = True

    press = KeyRerotationPress(FinchScorer(compression_ratio=RATIO))
    want = kvpress_logits(hf, kvpress_pipeline, ids, press)
    method_logits = kvbench_logits(hf, ids.tolist(), TAIL, [int(w.argmax()) for w in want[:-1]], window=W)
    assert_same_logits(want, method_logits)


# ------------------------------------------------------------------------ sliding-window layers
def prefill_with_finch(model, prompt: list[int]):
    """Prompt prefilled and compressed by finch (its last 8 tokens the window): the engine and the slot."""
    engine = Engine(model, build_method("finch", None, compression_ratio=RATIO, window=8), block_size=16,
                    num_blocks=512, attention_backend="torch")
    slot = engine.new_sequence()
    engine.step([Segment(slot, prompt, 0, "prefill", last_chunk=True)])
    return engine, slot


def test_a_sliding_layer_0_keeps_the_original_positions():
    """kvpress's continuation is cache.get_seq_length() of layer 0; a sliding layer 0 (never compressed) counts every
    token, so the tokens after the prompt keep their own positions (Gemma 3: layers 0-2 sliding, 3 full)."""
    from tests.tiny_models import tiny_model
    prompt = list(range(3, 83))
    engine, slot = prefill_with_finch(tiny_model("gemma3", vocab=128), prompt)
    assert engine.cache.method_layers == (3,)
    assert bool((engine.cache.positions[slot, 3, :, :40] == torch.arange(40)).all())  # re-rotated all the same
    assert engine.cache.position_shift[slot] == 0


def test_sliding_layers_after_a_full_layer_0_are_refused_with_rerotation():
    from kvbench.errors import UserError
    from tests.tiny_models import tiny_model
    model = tiny_model("gemma3", vocab=128, layer_types=["full_attention", "sliding_attention"] * 2)
    with pytest.raises(UserError, match="rerotate_keys=false") as info:
        prefill_with_finch(model, list(range(3, 83)))
    assert "\n" not in str(info.value)


def test_the_refusal_comes_before_the_load():
    """plan's method preflight reads the model's layer windows (config.json) and refuses before any weight loads;
    a sliding layer 0 (Gemma 3's pattern) or every layer full passes."""
    from types import SimpleNamespace

    from kvbench.errors import UserError
    from kvbench.methods.finch import Finch
    finch = Finch(compression_ratio=0.5)
    with pytest.raises(UserError, match="rerotate_keys=false"):
        finch.preflight(None, SimpleNamespace(layer_windows=(None, 8, None, 8)))
    finch.preflight(None, SimpleNamespace(layer_windows=(8, 8, 8, None)))
    finch.preflight(None, SimpleNamespace(layer_windows=()))
    Finch(compression_ratio=0.5, rerotate_keys=False).preflight(None, SimpleNamespace(layer_windows=(None, 8)))


def test_kvzip_runs_on_sliding_layers():
    """kvzip once refused a model with sliding layers (its reconstruction pass would slide their rings): its preflight
    now passes them, and on Gemma 3's pattern it compresses the full layer alone (the pass on a fork of the
    sequence: tests/methods/test_kvzip_sliding.py), the sliding layers' rings as full's."""
    from types import SimpleNamespace

    from tests.tiny_models import ByteTokenizer, tiny_model
    kvzip = build_method("kvzip", 8)
    kvzip.preflight(None, SimpleNamespace(layer_windows=(8, 8, None)))
    prompt = list(range(3, 83))
    lengths = []
    for method in (kvzip, None):
        engine = Engine(tiny_model("gemma3", vocab=128, tokenizer=ByteTokenizer(128)), method, block_size=16,
                        num_blocks=512, attention_backend="torch")
        slot = engine.new_sequence()
        engine.step([Segment(slot, prompt, 0, "prefill", last_chunk=True)])
        lengths.append(engine.cache.lengths[slot])
    assert int(lengths[0][3].sum()) == 2 * 8  # the full layer: kv_heads x budget
    assert torch.equal(lengths[0][:3], lengths[1][:3])  # the sliding layers: as full leaves them
