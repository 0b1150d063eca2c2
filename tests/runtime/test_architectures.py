"""Issue 60: the architectures beyond the Llama family on the same paged runtime, against transformers' eager forward.

For each family of tests/tiny_models.ARCH_FAMILIES (Mistral with its window set, Gemma 3, Gemma 2, Phi-3, Phi-4-mini's
partial rotary, an MQA Llama, GPT-OSS with its sinks and experts; tiny random weights, a window of WINDOW tokens shorter than the context):
  * kvbench's logits equal transformers' eager logits to 1e-4 (fp32) over a prompt longer than the window, prefilled
    in chunks, and over 32 decode steps after it; the window matters (transformers without it differs), so the
    comparison can fail;
  * a sliding layer's tables hold at most its ring (window - 1 + block_size - 1 tokens) after every step, and the pool's
    bytes in use are exactly the full layers' blocks plus those rings (measured from the pool); within a step the
    sliding layers' peak is the ring plus the step's chunk (metrics' peak_kv_bytes_sliding_layers);
  * metrics split the KV bytes by layer type; a method's budget binds the full layers only (the sliding layers keep
    their ring), and every method equals the full cache when its budget covers the context.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvbench.runtime.cache.kv_geometry import blocks_for_tokens
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.engine import Engine
from tests.tiny_models import ARCH_FAMILIES, WINDOW, tiny_hf_model

PROMPT, DECODE, CHUNK = 70, 32, 32
WINDOWED = ["mistral_window", "gemma3", "gemma2", "phi4mini", "gpt_oss"]


def _ids(hf, n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kvbench_logits(engine: Engine, ids: list[int], prompt: int, chunk: int = CHUNK, check=None) -> torch.Tensor:
    """Logits [len(ids), V] of kvbench: the first `prompt` ids prefilled in chunks, the rest one decode step each;
    check(engine, slot) after every step."""
    slot = engine.new_sequence()
    out = []
    with torch.no_grad():
        for s0 in range(0, prompt, chunk):
            part = ids[s0:min(prompt, s0 + chunk)]
            out.append(engine.forward_chunk(slot, part, s0, last_chunk=s0 + chunk >= prompt, logits_for="all")[0])
            if check is not None:
                check(engine, slot)
        for t in range(prompt, len(ids)):
            out.append(engine.runner.forward([slot], torch.tensor([[ids[t]]]), torch.tensor([[t]]), phase="decode",
                                             last_chunk=True, logits_for="last", max_position=t))
            if check is not None:
                check(engine, slot)
    return torch.cat(out)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ARCH_FAMILIES)
def test_logits_equal_transformers_in_prefill_and_decode(family):
    hf = tiny_hf_model(family, seed=1, eager=True, qk_scale=3)
    model = build_from_transformers(hf)
    ids = _ids(hf, PROMPT + DECODE)
    ref = hf_logits(hf, ids)
    got = kvbench_logits(Engine(model, prefill_chunk_size=CHUNK, block_size=8, num_blocks=512), ids, PROMPT)
    assert (got[:PROMPT] - ref[:PROMPT]).abs().max().item() <= 1e-4  # prefill
    assert (got[PROMPT:] - ref[PROMPT:]).abs().max().item() <= 1e-4  # 32 decode steps
    if family in WINDOWED:  # the window is exercised: without it the model's logits differ
        windows = model.config.layer_windows
        assert WINDOW in windows and PROMPT > WINDOW
        hf.config.sliding_window = 10 ** 6
        assert (hf_logits(hf, ids)[WINDOW:] - ref[WINDOW:]).abs().max().item() > 1e-3


def test_layer_types_read_from_the_configs():
    gemma3 = build_from_transformers(tiny_hf_model("gemma3"))
    assert gemma3.config.layer_windows == (WINDOW, WINDOW, WINDOW, None)
    assert gemma3.rotary_local is not None  # local layers' RoPE base differs from the global layers'
    assert not torch.equal(gemma3.rotary_local.inv_freq, gemma3.rotary.inv_freq)
    gemma2 = build_from_transformers(tiny_hf_model("gemma2"))
    assert gemma2.config.layer_windows == (WINDOW, None)
    assert [a.softcap for a in gemma2.config.layer_attention] == [2.0, 2.0] and gemma2.config.final_softcap == 3.0
    assert build_from_transformers(tiny_hf_model("mistral_window")).config.layer_windows == (WINDOW, WINDOW)
    phi4 = build_from_transformers(tiny_hf_model("phi4mini"))
    assert phi4.config.rotary_dim == 12 and phi4.config.head_dim == 16  # partial_rotary_factor 0.75
    assert build_from_transformers(tiny_hf_model("mqa")).config.num_kv_heads == 1
    oss = build_from_transformers(tiny_hf_model("gpt_oss"))
    assert oss.config.layer_windows == (WINDOW, None)
    assert all(a.has_sinks for a in oss.config.layer_attention) and oss.layers[0].sinks.shape == (4,)
    assert oss.layers[0].moe is not None and oss.layers[0].gate_up is None
    assert build_from_transformers(tiny_hf_model("mistral")).config.plain  # no window: every fast path


@pytest.mark.parametrize("family,bs", [("gemma3", 8), ("gemma2", 16), ("mistral_window", 8), ("gpt_oss", 8)])
def test_sliding_layer_pool_bytes_stay_bounded_by_the_window(family, bs):
    """Measured from the tables and the pool after every step of a prompt 8x the window and 32 decode steps."""
    hf = tiny_hf_model(family, seed=2)
    model = build_from_transformers(hf)
    windows = model.config.layer_windows
    sliding = [i for i, w in enumerate(windows) if w is not None]
    full = [i for i, w in enumerate(windows) if w is None]
    ring = WINDOW - 1 + bs - 1  # the most tokens a sliding table keeps between steps
    engine = Engine(model, prefill_chunk_size=CHUNK, block_size=bs, num_blocks=1024)
    H = model.config.num_kv_heads
    seen = []

    def check(eng, slot):
        lengths = eng.cache.host_lengths[slot]  # [L, H]
        n = eng.cache.tokens_seen[slot]
        assert (lengths[sliding] <= min(n, ring)).all(), lengths
        assert (lengths[full] == n).all()  # full layers keep every token (no method)
        want = (len(full) * H * blocks_for_tokens(n, bs)
                + int(blocks_for_tokens(lengths[sliding], bs).sum()))
        assert eng.cache.pool.in_use == want  # the pool holds exactly that: the freed ring blocks went back
        seen.append(int(blocks_for_tokens(lengths[sliding], bs).sum()))

    ids = _ids(hf, 8 * WINDOW + DECODE)
    kvbench_logits(engine, ids, 8 * WINDOW, check=check)
    engine.meter.track()
    stats = engine.memory_stats()
    bound = len(sliding) * H * blocks_for_tokens(ring, bs) * engine.cache.bytes_per_block
    assert max(seen) * engine.cache.bytes_per_block <= bound  # between steps: the rings
    # within a step, right after its allocation, each sliding table also holds the step's new tokens (a chunk)
    in_step = len(sliding) * H * blocks_for_tokens(ring + CHUNK, bs) * engine.cache.bytes_per_block
    assert bound < stats["peak_kv_bytes_sliding_layers"] <= in_step
    n = len(ids)
    assert stats["peak_kv_bytes_full_layers"] == len(full) * H * blocks_for_tokens(n, bs) * engine.cache.bytes_per_block
    assert stats["full_kv_bytes"] == stats["full_kv_bytes_full_layers"] + stats["full_kv_bytes_sliding_layers"]
    assert (stats["full_layers"], stats["sliding_layers"]) == (len(full), len(sliding))


def test_methods_act_on_full_layers_only():
    """SnapKV with a budget below the context: the full layer holds the budget, the sliding layers their ring, and
    the method's hook never sees a sliding layer."""
    from kvbench.methods import build_method

    hf = tiny_hf_model("gemma3", seed=4)
    model = build_from_transformers(hf)
    method = build_method("snapkv", 40)
    layers_seen = set()
    inner = method.after_attention

    def spy(ctx):
        layers_seen.add(ctx.layer)
        inner(ctx)

    method.after_attention = spy
    engine = Engine(model, method, block_size=8, prefill_chunk_size=CHUNK, num_blocks=1024)
    assert engine.cache.method_layers == (3,)
    prompt = _ids(hf, 150)
    gen = engine.generate([prompt], max_new_tokens=4)[0]
    assert layers_seen == {3} and gen.finish_reason == "length"
    stats = engine.memory_stats()
    # what the method removed (uncompressed minus held, at the uncompressed peak) is all on layer 3: at most that
    # layer's bytes, and the sliding layers' uncompressed bytes are their rings as held
    saved = stats["full_kv_bytes"] - stats["held_kv_bytes"]
    assert 0 < saved < stats["full_kv_bytes_full_layers"]
    per_token = 2 * 16 * 4  # K and V of one kv-head: 2 kv-heads, 16 dims, fp32
    assert saved <= stats["full_kv_bytes_full_layers"] - 40 * 2 * per_token


def _methods_with_full_budget():
    from tests.methods.variants import VARIANTS, variant_id

    # duo_attention's fixture patterns and kvzap's fixture surrogates are the tiny Llama's (2 layers); kvcompose's
    # own pass spans every layer (refused with sliding layers; kvzip runs its pass on a fork); think prunes key
    # channels at every budget (ThinK at ratio 0 equals full: tests/methods/test_think.py); dms over kvzap (its
    # default base) needs kvzap's surrogates
    # qfilter's filters, lukv's curve and fastkvzip's gates are fixtures of the tiny Llama's shape too
    skip = ("duo_attention", "kvcompose", "kvzap", "think", "qfilter", "lukv", "fastkvzip")
    variants = [v for v in VARIANTS if v[0] not in skip and not (v[0] == "dms" and "base" not in v[1])]
    # by default each variant runs on one of the two models (they alternate), and the methods that rotate queries
    # or keys themselves (a partial rotary is their edge case) on both; every pair under `make test-all`
    rotary = ("expected_attention", "finch", "compactor", "adakv_compactor")
    families = (("gemma3", {}), ("phi4mini", {"sliding_window": None}))
    return [pytest.param(f, c, v, id=f"{f}-{variant_id(v)}",
                         marks=[] if v[0] in rotary or j == i % 2 else [pytest.mark.slow])
            for i, v in enumerate(variants) for j, (f, c) in enumerate(families)]


@pytest.mark.parametrize("family,config,variant", _methods_with_full_budget())
def test_every_method_equals_full_when_its_budget_covers_the_context(family, config, variant):
    """Gemma 3 (methods on its global layer only) and Phi-4-mini's partial rotary without a window (methods that
    undo RoPE on the queries see a table narrower than the head)."""
    from kvbench.methods import build_method

    name, opts = variant
    hf = tiny_hf_model(family, seed=5, **config)
    model = build_from_transformers(hf)
    if name == "kvzip":  # it writes its reconstruction prompt
        from tests.tiny_models import ByteTokenizer
        model.tokenizer = ByteTokenizer(hf.config.vocab_size)
    prompt = _ids(hf, 90)

    def run(method):
        engine = Engine(model, method, block_size=8, prefill_chunk_size=CHUNK, num_blocks=1024)
        return engine.generate([prompt], max_new_tokens=12)[0].token_ids

    if name == "dms":  # no budget: a threshold no score is below keeps every token
        method = build_method(name, None, **{**opts, "threshold": -1e30})
    else:
        method = build_method(name, 4096, **opts)
    assert run(method) == run(None)


@pytest.mark.parametrize("name", ["kvcompose"])  # kvzip runs (tests/methods/test_kvzip_sliding.py)
def test_kvcompose_is_refused_on_a_model_with_sliding_layers(name):
    from kvbench.errors import UserError
    from kvbench.methods import build_method
    from tests.tiny_models import ByteTokenizer

    model = build_from_transformers(tiny_hf_model("gemma3"))
    model.tokenizer = ByteTokenizer(256)
    with pytest.raises(UserError, match=f"{name}.*sliding layers"):
        Engine(model, build_method(name, 64), block_size=8, num_blocks=256)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "phi4mini", "deepseek_v2"])
def test_every_attention_backend_runs_the_new_families(family, backend):
    """The CPU backend (C kernels, its fused decode step where the model is plain) and Triton (interpreted here) run
    the full plain layers; a layer with a window, sinks or soft-capping attends through the torch reference
    (attention_types.VariantBackend). Same logits as transformers either way."""
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            pytest.skip("Triton attention on CPU needs TRITON_INTERPRET=1 (run: TRITON_INTERPRET=1 pytest "
                        "tests/runtime/test_architectures.py -k triton)")
    hf = tiny_hf_model(family, seed=6, eager=True, qk_scale=3)
    model = build_from_transformers(hf)
    ids = _ids(hf, 48 + 8)
    engine = Engine(model, prefill_chunk_size=CHUNK, block_size=8, num_blocks=512, attention_backend=backend)
    assert engine.attention_backend == backend
    got = kvbench_logits(engine, ids, 48)
    assert (got - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_a_storage_codec_runs_over_sliding_layers():
    """A codec (kivi, 4 bits) stores every layer, the rings included (a storage format, not a method): the ring
    still frees its blocks and the run stays close to the full-precision one."""
    from kvbench.quant.registry import build_codec

    hf = tiny_hf_model("gemma3", seed=7)
    model = build_from_transformers(hf)
    ids = _ids(hf, 8 * WINDOW + 8)
    engine = Engine(model, codec=build_codec("kivi", bits=4), prefill_chunk_size=CHUNK, block_size=16,
                    num_blocks=512)
    got = kvbench_logits(engine, ids, 8 * WINDOW)
    slot = next(iter(engine.cache.live))
    assert (engine.cache.host_lengths[slot][:3] < 2 * WINDOW).all()
    ref = hf_logits(hf, ids)
    assert (got - ref).abs().max().item() < 0.5


def test_gemma3_multimodal_checkpoint_runs_its_language_model():
    """model_type gemma3 (Gemma-3-4B's checkpoint: Gemma3ForConditionalGeneration): kvbench reads the language
    model's weights and runs text only; logits equal transformers' on text input in prefill and decode."""
    import transformers as tf

    from tests.tiny_models import tiny_config

    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=300, boi_token_index=301, eoi_token_index=302)
    cfg._attn_implementation = cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if "language_model" in name and name.endswith(("layernorm", "q_norm", "k_norm")):
                mod.weight.normal_(0, 0.3)
    model = build_from_transformers(hf)
    assert model.config.model_type == "gemma3" and model.config.layer_windows == (WINDOW, WINDOW, WINDOW, None)
    ids = torch.randint(0, 290, (PROMPT + 8,), generator=torch.Generator().manual_seed(1)).tolist()
    got = kvbench_logits(Engine(model, prefill_chunk_size=CHUNK, block_size=8, num_blocks=512), ids, PROMPT)
    assert (got - hf_logits(hf, ids)).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------- MLA (DeepSeek-V2-Lite's shape)
def test_mla_pool_holds_the_latent_per_token():
    """One cached row per token and layer: kv_lora_rank + qk_rope_head_dim (32 + 8) fp32 values, no separate V;
    measured from the pool: its blocks in use x bytes per block."""
    hf = tiny_hf_model("deepseek_v2", seed=2)
    model = build_from_transformers(hf)
    cfg = model.config
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.mla.kv_lora_rank) == (1, 40, 32)
    engine = Engine(model, prefill_chunk_size=CHUNK, block_size=8, num_blocks=256)
    ids = _ids(hf, 100)
    kvbench_logits(engine, ids, 90)
    L, row = cfg.num_layers, 32 + 8
    assert engine.memory_stats()["kv_bytes_per_token"] == L * row * 4
    assert engine.cache.pool.in_use * engine.cache.bytes_per_block == L * blocks_for_tokens(100, 8) * 8 * row * 4
    assert engine.cache.v_pool.data_ptr() == engine.cache.k_pool.data_ptr()  # values read inside the rows


def test_mla_prefill_takes_the_expanded_form_and_decode_the_absorbed_one():
    """Prefill chunks attend in the expanded form (per-head K/V from the cached latents), decode steps in the absorbed
    form: the model counts the expanded attentions (one per layer and chunk, none in decode), and the logits equal
    those of the absorbed form at every step on the same inputs (and transformers', checked above)."""
    hf = tiny_hf_model("deepseek_v2", seed=3, eager=True, qk_scale=3)
    model = build_from_transformers(hf)
    ids = _ids(hf, PROMPT + 8)
    chunks = -(-PROMPT // CHUNK)

    def logits(form):
        model.mla_prefill_form, model.mla_expanded_steps = form, 0
        return kvbench_logits(Engine(model, prefill_chunk_size=CHUNK, block_size=8, num_blocks=512), ids, PROMPT)

    expanded = logits("expanded")
    assert model.mla_expanded_steps == model.config.num_layers * chunks
    absorbed = logits("absorbed")
    assert model.mla_expanded_steps == 0
    assert (expanded - absorbed).abs().max().item() <= 1e-4
    assert (expanded - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_mla_expanded_attention_equals_the_absorbed_one_on_ragged_sequences():
    """mla.attend_expanded against the absorbed form through the torch reference (absorbed query over the rows, output
    through W_UV) on random rows: two sequences of different lengths, three queries each at the end of their sequence,
    a block table in random order; outputs and key scores (probability per row, summed over heads and queries)."""
    from kvbench.runtime.backends.torch.attention import paged_attention_torch
    from kvbench.runtime.model.mla import MLAConfig, MLAWeights, absorb, attend_expanded

    g = torch.Generator().manual_seed(0)
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    Hq, bs, Q, r, D = 3, 4, 3, 16, 20
    w = MLAWeights(kv_a=None, kv_a_norm=None, w_uk=torch.randn(Hq, 8, r, generator=g),
                   w_uv=torch.randn(Hq, 6, r, generator=g))
    pool = torch.randn(12, bs, D, generator=g)
    tables = torch.randperm(12, generator=g)[:10].view(2, 1, 5).to(torch.int32)
    lengths = torch.tensor([[17], [9]])
    key_positions = torch.arange(20, dtype=torch.int32).expand(2, 1, 20).contiguous()
    query_positions = lengths - Q + torch.arange(Q)  # [2, Q]
    q_nope, q_pe = torch.randn(2, Hq, Q, 8, generator=g), torch.randn(2, Hq, Q, 4, generator=g)
    scale = 0.3
    out, scores = attend_expanded(mla, w, q_nope, q_pe, pool, tables, lengths, key_positions, query_positions, scale,
                                  return_key_scores=True)
    qa = absorb(w, q_nope.transpose(1, 2), q_pe.transpose(1, 2)).transpose(1, 2)  # [2, Hq, Q, r + rope]
    lat, ref_scores = paged_attention_torch(qa, pool, pool[..., :r], tables, lengths, key_positions, query_positions,
                                            scale, return_key_scores=True)
    ref = torch.einsum("shqr,hvr->shqv", lat, w.w_uv)
    assert out.shape == (2, Hq, Q, 6) and scores.shape == ref_scores.shape == (2, 1, 17)
    assert torch.allclose(out, ref, atol=1e-4) and torch.allclose(scores, ref_scores, atol=1e-5)
    no_scores, none = attend_expanded(mla, w, q_nope, q_pe, pool, tables, lengths, key_positions, query_positions,
                                      scale)
    assert none is None and torch.allclose(no_scores, ref, atol=1e-4)


def _latent_variants():
    from kvbench.methods import METHODS
    from tests.methods.variants import VARIANTS, variant_id

    ok = [v for v in VARIANTS if METHODS[v[0]].supports_latent and v[1].get("position_mode") != "reindex"]
    refused = [v for v in VARIANTS if v not in ok]
    return ([pytest.param(v, id=variant_id(v)) for v in ok], [pytest.param(v, id=variant_id(v)) for v in refused])


@pytest.mark.parametrize("variant", _latent_variants()[0])
def test_mla_methods_equal_full_when_the_budget_covers_the_context(variant):
    """The methods whose scores are defined on latent tokens (attention mass over the one latent row, positions,
    chance) run on MLA; with a budget over the context they equal the full cache, with a small one they evict."""
    from kvbench.methods import build_method
    from tests.tiny_models import ByteTokenizer

    name, opts = variant
    model = build_from_transformers(tiny_hf_model("deepseek_v2", seed=5, lm_head_scale=20))
    model.tokenizer = ByteTokenizer(256)  # kvzip writes its reconstruction prompt
    prompt = _ids(tiny_hf_model("deepseek_v2"), 90)

    def run(method):
        engine = Engine(model, method, block_size=8, prefill_chunk_size=CHUNK, num_blocks=1024)
        return engine.generate([prompt], max_new_tokens=12)[0].token_ids, engine

    ref, _ = run(None)
    assert run(build_method(name, 4096, **opts))[0] == ref
    if name != "full":
        _, engine = run(build_method(name, 40, **opts))
        assert engine.memory_stats()["held_kv_bytes"] < engine.memory_stats()["full_kv_bytes"]


@pytest.mark.parametrize("variant", _latent_variants()[1])
def test_mla_refuses_methods_whose_scores_are_not_defined_on_latents(variant):
    from kvbench.errors import UserError
    from kvbench.methods import build_method

    name, opts = variant
    model = build_from_transformers(tiny_hf_model("deepseek_v2"))
    try:
        method = build_method(name, 64, **opts)
    except UserError:  # duo_attention's fixture patterns are another model's
        pytest.skip("the variant does not build for this model")
    with pytest.raises(UserError) as info:
        Engine(model, method, block_size=8, num_blocks=256)
    assert "\n" not in str(info.value) and "MLA" in str(info.value)


def test_mla_refuses_kvquant_and_tensor_parallel_in_one_line():
    """kvquant (levels calibrated per layer on pre-RoPE keys) cannot pack the latent rows; kivi, int8 and fp8 can
    (tests/runtime/test_mla_codecs.py)."""
    from kvbench.quant.codecs import KVQuantCodec
    from kvbench.runtime.model.tensor_parallel import shard_model

    model = build_from_transformers(tiny_hf_model("deepseek_v2"))
    with pytest.raises(ValueError, match="cannot store MLA's latent cache"):
        Engine(model, codec=KVQuantCodec(bits=4, levels="uniform"), block_size=16, num_blocks=256)
    with pytest.raises(ValueError, match="cannot shard the model over 2 ranks: model_type 'deepseek_v2'"):
        shard_model(model, 0, 2, None)


def test_full_attention_on_mla_reads_what_an_uncompressed_latent_cache_holds():
    """kv_read_fraction of full attention is 1: the uncompressed read counts MLA's one latent row per token (not a K
    and a V row, which made it 0.5)."""
    model = build_from_transformers(tiny_hf_model("deepseek_v2"))
    engine = Engine(model, block_size=8, num_blocks=256)
    engine.generate([list(range(1, 40))], max_new_tokens=6)
    stats = engine.memory_stats()
    assert stats["kv_read_fraction"] == pytest.approx(1.0)
    rows = 39 + 6 - 1  # tokens in the cache when the last decode step reads
    assert stats["kv_read_bytes_per_token"] <= blocks_for_tokens(rows, 8) * 8 * stats["kv_bytes_per_token"]
