"""Storage codecs over MLA's latent cache (kvbench.runtime.cache.quantized_cache with value_dim set).

A codec's packed block holds one row per token, [latent ; RoPE key] of kv_lora_rank + qk_rope_head_dim, encoded
as keys (KIVI per channel, int8 / fp8 per token); the values are the decoded rows' latent part, so no value bytes
are stored. Checked on DeepSeek-V2's tiny shape (row 32 + 8, two layers, fp32):
  * decoding over the quantized latent stays close to full precision: mean NLL of 100 decoded tokens within the
    stated tolerance, logits moved (the packed rows are read), prefill's expanded form and the absorbed form agree
    over the same packed rows;
  * the pool's bytes: a packed block is exactly the codec's bytes for the latent rows (codes and scales of
    block_size x row elements, no value row), kv_bytes_per_token = layers x that / block_size, bytes in use and the
    peak counted from both pools, and the peak under the full-precision latent's;
  * keep_tokens (token-level eviction) over packed latent rows keeps exactly the kept rows as they decoded before;
  * kvquant (per-layer calibration on pre-RoPE keys) is refused in one line.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench.quant.registry import build_codec
from kvbench.runtime.cache.caches import build_cache
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.engine import Engine
from tests.runtime.test_architectures import _ids, kvbench_logits
from tests.runtime.test_quantized_cache import triton_dequant  # noqa: F401  (the fixture)
from tests.tiny_models import tiny_hf_model

PROMPT, TOTAL, CHUNK, BS = 100, 200, 32, 8
# |NLL(codec) - NLL(full)| over the decoded tokens, nats: 8-bit codecs and 4-bit KIVI
CODECS = [("int8", {}, 0.01), ("fp8", {}, 0.02), ("kivi", dict(bits=4, group_size=16, residual=32), 0.05),
          ("nvfp4", {}, 0.05), ("mxfp4", {}, 0.1)]


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean NLL of the decoded tokens (the logits predicting ids[PROMPT:])."""
    return F.cross_entropy(logits[PROMPT - 1: -1], torch.tensor(ids[PROMPT:])).item()


@pytest.fixture(scope="module")
def setup():
    hf = tiny_hf_model("deepseek_v2", seed=4, eager=True, qk_scale=3, lm_head_scale=20)
    model = build_from_transformers(hf)
    ids = _ids(hf, TOTAL)
    full = Engine(model, prefill_chunk_size=CHUNK, block_size=BS, num_blocks=1024)
    ref = kvbench_logits(full, ids, PROMPT)
    return model, ids, ref, full.cache.peak_kv_bytes()


@pytest.mark.parametrize("name,opts,tol", CODECS, ids=[c[0] for c in CODECS])
def test_decoding_over_the_quantized_latent_stays_close_to_full_precision(setup, name, opts, tol):
    model, ids, ref, full_peak = setup
    cfg = model.config
    row = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    codec = build_codec(name, **opts)
    model.mla_expanded_steps = 0
    engine = Engine(model, codec=codec, prefill_chunk_size=CHUNK, block_size=BS, num_blocks=1024)
    got = kvbench_logits(engine, ids, PROMPT)
    cache = engine.cache
    assert cache.latent and model.mla_expanded_steps == cfg.num_layers * -(-PROMPT // CHUNK)
    assert cache.block_counts()["packed"] > 0  # the rows read were packed
    assert (got - ref).abs().max().item() > 1e-6  # ... and quantization moved the logits
    assert abs(_nll(got, ids) - _nll(ref, ids)) <= tol
    # bytes: a packed block is the codec's bytes for block_size latent rows, nothing for values
    bs = cache.block_size
    packed = codec.packed_block_bytes(bs, row, "key")
    assert cache.kq_pool.shape[1] == packed and cache.vq_pool.shape[1] == 0 and cache.packed_block_bytes == packed
    assert cache.kv_bytes_per_token() == cfg.num_layers * packed / bs
    fp_block = bs * row * cache.k_pool.element_size()  # one full-precision row per token (the codec's fp dtype)
    assert cache.kv_bytes_in_use() == cache.pool.fp.in_use * fp_block + cache.pool.packed.in_use * packed
    assert cache.peak_kv_bytes() < full_peak
    # prefill's expanded form over the same packed rows equals the absorbed form
    model.mla_prefill_form = "absorbed"
    try:
        absorbed = kvbench_logits(Engine(model, codec=build_codec(name, **opts), prefill_chunk_size=CHUNK,
                                         block_size=BS, num_blocks=1024), ids, PROMPT)
    finally:
        model.mla_prefill_form = "expanded"
    assert (got - absorbed).abs().max().item() <= 1e-3


def test_int8_latent_row_bytes():
    """int8 stores each latent row as row int8 codes and one fp16 scale: (32 + 8) + 2 bytes per token and layer."""
    cache = build_cache(codec=build_codec("int8"), kv_memory_bytes=1 << 20, num_layers=2, num_kv_heads=1,
                        head_dim=40, block_size=16, dtype=torch.float32, device="cpu", value_dim=32)
    assert cache.packed_block_bytes == 16 * (40 + 2) and cache.kv_bytes_per_token() == 2 * (40 + 2)


def test_keep_tokens_keeps_the_packed_latent_rows():
    """keep_tokens over a latent codec cache: the kept rows decode as they did before (the whole block kept as it
    is, the partly kept ones decoded and stored again) and the values stay the rows' latent part."""
    cache = build_cache(codec=build_codec("int8"), kv_memory_bytes=1 << 20, num_layers=1, num_kv_heads=1,
                        head_dim=12, block_size=16, dtype=torch.float32, device="cpu", value_dim=8)
    slot = cache.add_sequence()
    plan = cache.prepare_append([slot], torch.arange(40)[None])
    rows = torch.randn(1, 1, 40, 12, generator=torch.Generator().manual_seed(0))
    cache.write(0, plan, rows, rows[..., :8])
    cache.pack_pending()
    assert cache.block_counts() == {"fp": 1, "packed": 2}
    k0, v0, _ = cache.gather(0, slot)
    assert torch.equal(v0, k0[..., :8]) and (k0 - rows[0]).abs().max() < 0.05 and not torch.equal(k0, rows[0])
    # block 0 kept whole (reused), block 1 re-packed from 16 kept tokens of two blocks, the last 6 in full precision
    keep = torch.tensor([[t for t in range(40) if t not in (20, 25)]])
    cache.keep_tokens(0, slot, keep)
    assert cache.block_counts() == {"fp": 1, "packed": 2}
    k1, v1, pos = cache.gather(0, slot)
    assert torch.equal(pos[0], keep[0].to(pos.dtype))
    assert torch.allclose(k1[0], k0[0, keep[0]], atol=0.02) and torch.equal(v1, k1[..., :8])


def test_kvquant_is_refused_on_the_latent_cache_in_one_line():
    from kvbench.quant.codecs import KVQuantCodec

    with pytest.raises(ValueError, match="cannot store MLA's latent cache") as info:
        build_cache(codec=KVQuantCodec(bits=4, levels="uniform"), kv_memory_bytes=1 << 20, num_layers=1,
                    num_kv_heads=1, head_dim=40, block_size=32, dtype=torch.float32, device="cpu", value_dim=32)
    assert "\n" not in str(info.value)


def test_triton_dequant_reads_the_latent_rows(triton_dequant):
    """The Triton dequantizer (KIVI-2/4, what a GPU run picks) decodes packed latent rows (width 40: not a power of
    two) as the torch decode does; the values are their latent part."""
    from kvbench.quant.codecs import KiviCodec
    from kvbench.runtime.cache.quantized_cache import QuantizedPagedKVCache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = QuantizedPagedKVCache(codec=KiviCodec(4, group_size=16, residual=16), num_layers=1, num_kv_heads=1,
                                  head_dim=40, block_size=16, max_bytes=1 << 20, value_dim=32, device=device)
    slot = cache.add_sequence()
    plan = cache.prepare_append([slot], torch.arange(64, device=device)[None])
    rows = torch.randn(1, 1, 64, 40, generator=torch.Generator().manual_seed(1)).to(device)
    cache.write(0, plan, rows, rows[..., :32])
    cache.pack_pending()
    assert cache.block_counts()["packed"] == 3
    cache.dequant = "torch"
    ref_k, _, _ = cache.gather(0, slot)
    cache.dequant = "triton"
    k, v, _ = cache.gather(0, slot)
    torch.testing.assert_close(k, ref_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(v, k[..., :32])
