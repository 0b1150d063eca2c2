"""think prunes the key channels of kvpress's ThinKPress (written out here in plain torch, batched as kvpress writes
it) on random tensors and on a transformers model's own queries and keys, alone and after SnapKV's token eviction;
the cache built for it (kvbench.runtime.cache.pruned_key_cache) reads what a full-precision cache with those channels
zeroed reads, and its pool holds the pruned blocks in fewer bytes, by exactly the pruned channels."""
from __future__ import annotations

import pytest
import torch

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.methods.think import ThinK, pruned_channels, think_channel_scores
from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.cache.pruned_key_cache import PrunedKeyKVCache
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer
from tests.fixtures.press_fixtures import PROMPT_TOKENS, hf, hf_out, ids  # noqa: F401  (fixtures)
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_kvpress_a import top_sets
from tests.methods.test_kvpress_c import model_states, ref_snapkv
from tests.tiny_models import tiny_model

T = PROMPT_TOKENS  # the prompt of the shared ids fixture

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


# ------------------------------------------------------------------------ kvpress's ThinKPress.compress, batched
def ref_think(queries, keys, ratio):
    """queries [B, Hq, W, D] (the window's, post-RoPE), keys [B, H, T, D] -> (key_scores [B, H, D], pruned
    indices [B, H, n_pruned], keys with the pruned channels zeroed)."""
    bsz, num_key_value_heads, k_len, head_dim = keys.shape
    num_key_value_groups = queries.shape[1] // num_key_value_heads
    queries_norm = torch.pow(queries, 2).mean(dim=2)  # (bsz, num_heads, head_dim)
    queries_norm = queries_norm.view(bsz, num_key_value_heads, num_key_value_groups, head_dim).mean(2)
    keys_norm = torch.pow(keys, 2).mean(dim=2)
    key_scores = queries_norm * keys_norm  # (bsz, num_key_value_heads, head_dim)
    n_pruned = int(head_dim * ratio)
    indices = key_scores.topk(n_pruned, dim=-1, largest=False).indices
    zeroed = keys.clone().scatter_(-1, indices.unsqueeze(2).expand(-1, -1, k_len, -1), 0)
    return key_scores, indices, zeroed


def test_channel_scores_are_kvpress_on_random_tensors():
    g = torch.Generator().manual_seed(0)
    H, G, W, S, D = 2, 3, 32, 150, 16
    q, k = torch.randn(1, H * G, W, D, generator=g), torch.randn(1, H, S, D, generator=g)
    for ratio in (0.25, 0.5, 0.9):
        want_scores, want_idx, _ = ref_think(q, k, ratio)
        got = think_channel_scores(q[0], k[0], torch.full((H,), S))
        torch.testing.assert_close(got, want_scores[0])
        got_idx = pruned_channels(got, int(D * ratio))
        assert [set(r.tolist()) for r in got_idx] == [set(r.tolist()) for r in want_idx[0]]
    # heads of different lengths (a head-adaptive base): each head's mean over its own tokens, as kvpress per head
    lengths = torch.tensor([S, 90])
    got = think_channel_scores(q[0], k[0], lengths)
    for h in range(H):
        want, _, _ = ref_think(q[:, h * G:(h + 1) * G], k[:, h:h + 1, : int(lengths[h])], 0.5)
        torch.testing.assert_close(got[h], want[0, 0])


def _pruned_after_prefill(hf, ids, method, chunk, block_size=16):
    """The engine's dense keys of every layer once the prompt is compressed -> ({layer: keys [H, n, D]}, {layer:
    kept positions per kv-head}, engine)."""
    keys, kept = {}, {}
    inner = method.after_attention

    def after_attention(ctx):
        inner(ctx)
        if ctx.phase == "prefill" and ctx.last_chunk:
            k, _, pos = ctx.cache.gather(ctx.layer, 0)
            keys[ctx.layer] = k.clone()
            kept[ctx.layer] = [set(p[p >= 0].tolist()) for p in pos]

    method.after_attention = after_attention
    engine = Engine(build_from_transformers(hf), method, block_size=block_size, num_blocks=512,
                    prefill_chunk_size=chunk, attention_backend="torch")
    engine.generate([ids.tolist()], max_new_tokens=1)
    assert engine.cache.pool.in_use == 0
    return keys, kept, engine


@pytest.mark.parametrize("chunk", [T, 64])
@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_think_prunes_kvpress_channels_on_the_tiny_model(hf, ids, hf_out, chunk, ratio):
    """ThinK alone (compression_ratio=0: no token evicted): the cache reads kvpress's zeroed keys."""
    method = build_method("think", None, compression_ratio=0.0, key_channel_compression_ratio=ratio)
    keys, kept, engine = _pruned_after_prefill(hf, ids, method, chunk)
    assert isinstance(engine.cache, PrunedKeyKVCache)
    for layer in range(2):
        q, k, _, _ = model_states(hf, hf_out, layer)
        _, idx, zeroed = ref_think(q[:, :, -32:], k, ratio)
        assert kept[layer] == [set(range(T))] * 2
        got_pruned = [set(torch.nonzero(~(keys[layer][h] != 0).any(0)).squeeze(1).tolist()) for h in range(2)]
        assert got_pruned == [set(r.tolist()) for r in idx[0]], f"layer {layer}"
        torch.testing.assert_close(keys[layer], zeroed[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [T, 64])
def test_think_over_snapkv_is_kvpress_composed_press(hf, ids, hf_out, chunk):
    """ComposedPress([SnapKVPress(0.5), ThinKPress(0.5)]): SnapKV's tokens, then ThinK's channels over them."""
    method = build_method("think", None, compression_ratio=0.5, key_channel_compression_ratio=0.5)
    keys, kept, _ = _pruned_after_prefill(hf, ids, method, chunk)
    n_kept = int(T * 0.5)
    for layer in range(2):
        q, k, _, _ = model_states(hf, hf_out, layer)
        want = top_sets(ref_snapkv(q[:, :, -64:], k)[0], n_kept)
        assert kept[layer] == want, f"layer {layer}"
        idx = torch.stack([torch.tensor(sorted(s)) for s in want])  # [H, n_kept]
        k_kept = k[0].gather(1, idx[..., None].expand(-1, -1, k.shape[-1]))[None]
        _, _, zeroed = ref_think(q[:, :, -32:], k_kept, 0.5)
        torch.testing.assert_close(keys[layer], zeroed[0], atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------ the engine: full, zeros, bytes
@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab=256, max_positions=512)


def _run(model, method, prompts, new_tokens, backend="torch", bs=8, chunk=32):
    engine = Engine(model, method, block_size=bs, prefill_chunk_size=chunk, num_blocks=2048,
                    attention_backend=backend)
    gens = engine.generate(prompts, max_new_tokens=new_tokens)
    stats = engine.memory_stats()
    lp = Scorer(engine).score(prompts[-1], chunk_size=chunk)
    return [g.token_ids for g in gens], lp, stats, engine


def _prompts(*lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def test_ratio_zero_equals_full(tiny):
    prompts = _prompts(70, 101)
    ref = _run(tiny, None, prompts, 20)
    got = _run(tiny, build_method("think", None, compression_ratio=0.0, key_channel_compression_ratio=0.0),
               prompts, 20)
    assert type(got[3].cache) is PagedKVCache  # nothing pruned: the plain cache
    assert got[0] == ref[0]
    assert torch.equal(got[1], ref[1])


class _ZeroedInPlace(ThinK):
    """ThinK on a plain full-precision cache: the pruned channels written as zeros (PagedKVCache.prune_key_channels),
    no layout of its own: the reference the pruned layout must read like."""

    def pruned_key_channels(self, head_dim: int) -> int:
        return 0 if getattr(self, "_building", True) else super().pruned_key_channels(head_dim)

    def attach(self, cache, model_config):
        super().attach(cache, model_config)
        self._building = False


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("opts", [{"compression_ratio": 0.0}, {"compression_ratio": 0.5, "decode": "evict"}])
def test_pruned_layout_reads_as_zeroed_keys(tiny, backend, opts):
    """Greedy tokens and the streamed NLL (every chunk ends a prompt: pruned again each time) through the pruned
    cache equal those of a full-precision cache whose pruned channels are zeroed in place."""
    prompts = _prompts(70, 101)
    opts = {"key_channel_compression_ratio": 0.5, "window_size": 8, **opts}
    ref = _run(tiny, _ZeroedInPlace(compression_ratio=opts.pop("compression_ratio"), **opts), prompts, 20, backend)
    assert type(ref[3].cache) is PagedKVCache
    got = _run(tiny, build_method("think", None, compression_ratio=ref[3].method.compression_ratio, **opts),
               prompts, 20, backend)
    assert isinstance(got[3].cache, PrunedKeyKVCache)
    assert got[0] == ref[0]
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)
    full = _run(tiny, None, prompts, 20, backend)
    assert not torch.equal(got[1], full[1])  # the channels were pruned


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_peak_kv_bytes_shows_the_pruned_channels(tiny, ratio):
    """One 64-token prompt (8 full blocks of 8 per table), 41 new tokens: the pool's peak is at the end of decoding,
    and it is below full's by exactly the pruned channels of the prompt's blocks (minus their channel indices)."""
    prompts = _prompts(64)
    full = _run(tiny, None, prompts, 41, chunk=64)[2]
    method = build_method("think", None, compression_ratio=0.0, key_channel_compression_ratio=ratio)
    got = _run(tiny, method, prompts, 41, chunk=64)[2]
    cfg = tiny.config
    D, bs, e = cfg.head_dim, 8, 4  # fp32
    P = int(D * ratio)
    blocks = cfg.num_layers * cfg.num_kv_heads * (64 // bs)
    saving = blocks * (bs * P * e - (D - P) * 1)  # uint8 channel indices, counted in the pool's bytes
    assert full["peak_kv_bytes"] - got["peak_kv_bytes"] == saving, (full, got)
    assert got["peak_kv_bytes"] < full["peak_kv_bytes"]


def test_think_composes_with_token_eviction_bytes(tiny):
    """Over snapkv at compression_ratio 0.5 (a 128-token prompt: 64 kept per table, 8 full blocks), 100 new tokens:
    the same tokens kept, and the pool's peak below snapkv's alone by exactly the pruned channels of the kept
    blocks."""
    prompts = _prompts(128)
    snap = _run(tiny, build_method("snapkv", None, compression_ratio=0.5, window=8), prompts, 100, chunk=128)
    think = _run(tiny, build_method("think", None, compression_ratio=0.5, key_channel_compression_ratio=0.5,
                                    base_options={"window": 8}), prompts, 100, chunk=128)
    cfg = tiny.config
    D, bs, e, P = cfg.head_dim, 8, 4, cfg.head_dim // 2
    blocks = cfg.num_layers * cfg.num_kv_heads * (64 // bs)
    assert snap[2]["peak_kv_bytes"] - think[2]["peak_kv_bytes"] == blocks * (bs * P * e - (D - P)), (snap[2], think[2])


@pytest.mark.parametrize("value", [1.0, -0.1, 1.5, "abc", True, None])
def test_bad_ratio_is_refused_in_one_line(value):
    with pytest.raises(UserError, match="think.key_channel_compression_ratio") as err:
        build_method("think", 64, key_channel_compression_ratio=value)
    assert "\n" not in str(err.value) and "[0, 1)" in str(err.value)


def test_prefix_caching_true_is_refused(tiny):
    with pytest.raises(ValueError, match="prunes key channels"):
        Engine(tiny, build_method("think", 64, key_channel_compression_ratio=0.5), block_size=8, num_blocks=256,
               prefix_caching=True)
    Engine(tiny, build_method("think", 64, key_channel_compression_ratio=0.5), block_size=8, num_blocks=256,
           prefix_caching="auto")


def test_bad_options_are_refused():
    with pytest.raises(UserError, match="think.base"):
        build_method("think", 64, base="nope")
    with pytest.raises(UserError, match="window_size"):
        build_method("think", 64, window_size=0)


def test_yaml_defaults_are_the_class_and_compose():
    """conf/method/think.yaml states the class's defaults (kvpress's), and an override reaches the method."""
    from pathlib import Path

    import yaml

    from kvbench.run.config import validate
    from tests.harness_fakes import compose

    opts = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "method" / "think.yaml").read_text())
    assert opts.pop("name") == "think"
    m = build_method("think", 64)
    for k, v in opts.items():
        assert getattr(m, k) == v, k
    s = validate(compose(["method=think", "compression_ratio=0", "method.key_channel_compression_ratio=0.5"]))
    method = build_method(s.method_name, s.budget, compression_ratio=s.compression_ratio, **s.method_options)
    assert method.key_channel_compression_ratio == 0.5 and method.pruned_key_channels(64) == 32
    assert method.compression_ratio == 0.0
