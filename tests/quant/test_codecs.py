"""Storage codecs: byte counts, lossless layouts over the tensor quantizers, grouping, bits per element."""
import pytest
import torch

from kvbench.quant.fp4_codecs import Mxfp4Codec, Nvfp4Codec
from kvbench.quant.rotation import RotatedCodec
from kvbench.quant import (Fp8Codec, FullPrecisionCodec, Int8Codec, KiviCodec, KVQuantCodec,
                           dequantize_asym, fit_channel_ranges, fit_nuq_levels, nuq_dequantize, nuq_quantize,
                           quantize_asym, uniform_levels)

B, D = 32, 64  # the geometry the bit budgets are stated at


def _tile(n=5, seed=0, b=B, d=D):
    g = torch.Generator().manual_seed(seed)
    # channel-wise magnitudes, like real keys: a few channels much larger than the rest
    mag = torch.ones(d)
    mag[: max(1, d // 16)] = 8.0
    return torch.randn(n, b, d, generator=g) * mag + torch.randn(d, generator=g)


def _nuq_tables(bits, n_layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([fit_nuq_levels(torch.randn(4000, generator=g).clamp(-1, 1) * (1 - 0.3 * i), bits)
                        for i in range(n_layers)])


def _all_codecs():
    return [FullPrecisionCodec(), FullPrecisionCodec(torch.float32), KiviCodec(2), KiviCodec(4),
            KiviCodec(2, key_axis="token"), Int8Codec(), Fp8Codec(), KVQuantCodec(3, levels="uniform"),
            Nvfp4Codec(), Nvfp4Codec(tensor_amax=100.0), Mxfp4Codec(), RotatedCodec(KiviCodec(2, key_axis="token")),
            RotatedCodec(Mxfp4Codec(), seed=1),
            KVQuantCodec(3, key_levels=_nuq_tables(3), value_levels=_nuq_tables(3, seed=1)),
            KVQuantCodec(2, key_levels=_nuq_tables(2), value_levels=_nuq_tables(2, seed=1),
                         key_ranges=fit_channel_ranges(_tile(3, seed=9).reshape(1, 1, -1, D).expand(2, 3, -1, -1)))]


@pytest.mark.parametrize("codec", _all_codecs(), ids=lambda c: f"{c.name}{c.bits}")
def test_encode_decode_shapes_and_byte_counts(codec):
    x = _tile()
    for kind, enc, dec in (("key", codec.encode_keys, codec.decode_keys),
                           ("value", codec.encode_values, codec.decode_values)):
        blocks = enc(x)
        nbytes = codec.packed_block_bytes(B, D, kind)
        assert blocks.dtype == torch.uint8 and blocks.shape == (5, nbytes)
        assert codec.bits_per_element(B, D, kind) == 8 * blocks.shape[1] / (B * D)
        out = dec(blocks, B, D)
        assert out.shape == x.shape and out.dtype == torch.float32
        # blocks are independent: encoding one block alone gives the same bytes
        assert torch.equal(enc(x[2:3]), blocks[2:3])
        # the bytes are the whole state: decode rows gathered from a pool
        pool = torch.zeros(9, nbytes, dtype=torch.uint8)
        pool[[8, 1, 4, 0, 6]] = blocks
        assert torch.equal(dec(pool[[8, 1, 4, 0, 6]], B, D), out)
        rel = ((out - x).norm() / x.norm()).item()
        # MXFP4: a power-of-two scale leaves a group's amax anywhere in [4, 8) x scale (clipped to 6): coarser
        tol = {16: 1e-3, 32: 1e-7, 8: 0.05, 4: 0.15, 3: 0.3, 2: 0.6}[codec.bits]
        assert rel < (0.2 if codec.name == "mxfp4" else tol)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_codec_equals_tensor_quantizer(bits):
    c, x = KiviCodec(bits), _tile(seed=1)
    kc, kmn, ks = quantize_asym(x, bits, dim=1, group_size=32)  # keys: per channel over 32 tokens
    vc, vmn, vs = quantize_asym(x, bits, dim=2, group_size=32)  # values: per token over 32 channels
    assert torch.equal(c.decode_keys(c.encode_keys(x), B, D), dequantize_asym(kc, kmn, ks, 1, 32))
    assert torch.equal(c.decode_values(c.encode_values(x), B, D), dequantize_asym(vc, vmn, vs, 2, 32))
    err = (c.decode_keys(c.encode_keys(x), B, D) - x).abs()
    assert (err <= ks.float() / 2 + 1e-5).all()  # ks: [n, 1, D], one scale per channel for the block


def test_kivi_key_block_is_one_group_per_channel():
    c = KiviCodec(2, group_size=32)
    assert c.block_size_hint == 32
    x = _tile(1, seed=2)
    y = x.clone()
    y[0, 11, 3] += 30.0  # stretches channel 3 only: the other channels decode identically
    dx, dy = c.decode_keys(c.encode_keys(x), B, D), c.decode_keys(c.encode_keys(y), B, D)
    changed = (dx != dy).any(dim=1)[0]  # [D]
    assert changed.nonzero().flatten().tolist() == [3]
    dvx, dvy = c.decode_values(c.encode_values(x), B, D), c.decode_values(c.encode_values(y), B, D)
    changed_v = (dvx != dvy).any(dim=2)[0]  # [B]: only token 11's values change
    assert changed_v.nonzero().flatten().tolist() == [11]
    with pytest.raises(ValueError):
        c.encode_keys(torch.randn(1, 16, D))  # a per-channel key block must hold whole groups


def test_kivi_per_channel_keys_beat_per_token_on_outlier_channels():
    x = _tile(8, seed=3)  # channel-outlier structure, as in real keys
    err = {}
    for axis in ("channel", "token"):
        c = KiviCodec(2, key_axis=axis)
        err[axis] = (c.decode_keys(c.encode_keys(x), B, D) - x).pow(2).mean().item()
    assert err["channel"] < 0.5 * err["token"]


def test_kvquant_codec_equals_tensor_quantizer_and_keeps_outliers():
    kl, vl = _nuq_tables(3), _nuq_tables(3, seed=1)
    c = KVQuantCodec(3, key_levels=kl, value_levels=vl)
    x = _tile(seed=4).half().float()
    x[1, 7, 20] = 1000.0
    x[3, 0, 63] = -777.0
    for kind, dim, lv in (("key", 1, kl[1]), ("value", 2, vl[1])):
        enc = c.encode_keys if kind == "key" else c.encode_values
        dec = c.decode_keys if kind == "key" else c.decode_values
        out = dec(enc(x, layer=1), B, D, layer=1)
        ref = nuq_dequantize(nuq_quantize(x, lv, dim, 0.01), lv)
        assert torch.equal(out, ref)
        assert out[1, 7, 20] == 1000.0 and out[3, 0, 63] == -777.0
        assert not torch.equal(out, dec(enc(x, layer=0), B, D, layer=0))  # per-layer level sets are used


def test_kvquant_calibrated_key_ranges_follow_the_head():
    calib = torch.stack([_tile(4, seed=5) * s for s in (1.0, 10.0)]).reshape(2, -1, D)  # [H=2, N, D]
    ranges = fit_channel_ranges(calib, 0.01)[None]  # [layers=1, H, 2, D]
    c = KVQuantCodec(3, levels="uniform", key_ranges=ranges)
    x = torch.cat([_tile(2, seed=6), _tile(2, seed=7) * 10])  # blocks 0, 1 from head 0; 2, 3 from head 1
    heads = torch.tensor([0, 0, 1, 1])
    out = c.decode_keys(c.encode_keys(x, head=heads), B, D, head=heads)
    wrong = c.decode_keys(c.encode_keys(x, head=0), B, D, head=0)
    err_right = (out - x)[2:].pow(2).mean()
    assert err_right < 0.25 * (wrong - x)[2:].pow(2).mean()
    assert torch.equal(out[:2], wrong[:2])
    assert "lo" not in c.layout("key", B, D).fields and "lo" in c.layout("value", B, D).fields


def test_nuq_with_outliers_beats_uniform_without():
    g = torch.Generator().manual_seed(11)
    calib = torch.randn(64, B, D, generator=g) * (1 + 5 * (torch.rand(64, B, D, generator=g) < 0.005))
    from kvbench.quant import dense_normalized
    xn, mask = dense_normalized(calib, dim=2, outlier_fraction=0.01)
    vl = fit_nuq_levels(xn[mask], 3)
    nuq = KVQuantCodec(3, levels="nuq", key_levels=vl, value_levels=vl)
    uni = KVQuantCodec(3, levels="uniform", outlier_fraction=0.0)
    x = torch.randn(16, B, D, generator=g) * (1 + 5 * (torch.rand(16, B, D, generator=g) < 0.005))
    e = {name: (c.decode_values(c.encode_values(x), B, D) - x).pow(2).mean().item()
         for name, c in (("nuq", nuq), ("uni", uni))}
    assert e["nuq"] < 0.6 * e["uni"]


def test_bits_per_element_budgets():
    """head_dim 64, block 32, all metadata counted (see the arithmetic in the codecs' docstrings)."""
    kivi2, kivi4 = KiviCodec(2), KiviCodec(4)
    assert kivi2.bits_per_element(B, D) == 3.0 <= 3.5  # 512 B codes + 64 x (fp16 mn + fp16 scale) = 768 B
    assert kivi4.bits_per_element(B, D) == 5.0 <= 5.5
    assert KiviCodec(2, key_axis="token").bits_per_element(B, D) == 3.0
    ranges = torch.zeros(1, 1, 2, D)
    ranges[..., 1, :] = 1
    kvq3 = KVQuantCodec(3, levels="uniform", key_ranges=ranges)
    # keys: 768 B codes + 21 outliers x (2 B fp16 + 11 bit index) = 768 + 42 + 29 = 839 -> 840 (align)
    assert kvq3.packed_block_bytes(B, D, "key") == 840
    # values: + 32 tokens x (fp16 lo + fp16 hi) = 128 B -> 968
    assert kvq3.packed_block_bytes(B, D, "value") == 968
    assert kvq3.bits_per_element(B, D) == pytest.approx(3.53125) and kvq3.bits_per_element(B, D) <= 4.0
    # online key ranges cost 64 x 4 B per key block: 4.28 bits for keys, 4.03 on average (over 4.0)
    assert KVQuantCodec(3, levels="uniform").bits_per_element(B, D) == pytest.approx(4.03125)
    assert Int8Codec().bits_per_element(B, D) == Fp8Codec().bits_per_element(B, D) == 8.25
    assert FullPrecisionCodec().bits_per_element(B, D) == 16.0
    # FP4: 1024 B codes (two a byte) + 32 x 4 E4M3 scales + a 4 B fp32 tensor scale = 1156 B; MXFP4: + 32 x 2 E8M0
    assert Nvfp4Codec().bits_per_element(B, D) == 8 * 1156 / (B * D) == 4.515625
    assert Mxfp4Codec().bits_per_element(B, D) == 8 * 1088 / (B * D) == 4.25
    assert RotatedCodec(Mxfp4Codec()).bits_per_element(B, D) == 4.25  # the rotation stores nothing


def _pool_bits(codec, num_tokens, block_size, head_dim):
    """Bits per element of one (layer, head) table as a pool holds it: packed blocks + full-precision blocks."""
    packed = len(codec.packed_block_range(num_tokens, block_size))
    n_blocks = -(-num_tokens // block_size)
    fp_bytes = block_size * head_dim * torch.finfo(codec.fp_block_dtype or torch.float32).bits // 8
    nbytes = sum(packed * codec.packed_block_bytes(block_size, head_dim, k) + (n_blocks - packed) * fp_bytes
                 for k in ("key", "value"))
    return 8 * nbytes / (2 * num_tokens * head_dim)


def test_pool_bits_at_4096_tokens_with_fp16_residual():
    ranges = torch.zeros(1, 1, 2, D)
    kvq3 = KVQuantCodec(3, levels="uniform", key_ranges=ranges)
    assert KiviCodec(2).packed_block_range(4096, 32) == range(0, 124)  # 128 newest tokens stay fp16
    assert kvq3.packed_block_range(4096, 32) == range(1, 128)  # block 0 (token 0) stays fp16
    kivi2 = _pool_bits(KiviCodec(2), 4096, 32, D)
    assert kivi2 == pytest.approx(3.40625) and kivi2 <= 3.5  # (124 x 768 + 4 x 4096) B per K, same for V
    assert _pool_bits(KiviCodec(4), 4096, 32, D) <= 5.5
    assert _pool_bits(kvq3, 4096, 32, D) <= 4.0


def test_packed_block_range():
    c = KiviCodec(2, group_size=32, residual=128)
    assert c.packed_block_range(159, 32) == range(0, 0)
    assert c.packed_block_range(160, 32) == range(0, 1)
    assert KiviCodec(2, residual=0).packed_block_range(70, 32) == range(0, 2)
    assert FullPrecisionCodec().packed_block_range(70, 32) == range(0, 2)


def test_validation_and_describe():
    with pytest.raises(ValueError):
        KiviCodec(3)
    with pytest.raises(ValueError):
        KiviCodec(2, group_size=32, residual=100)
    with pytest.raises(ValueError):
        KiviCodec(2, key_axis="head")
    with pytest.raises(ValueError):
        KVQuantCodec(3)  # nuq needs level tables
    with pytest.raises(ValueError):
        KVQuantCodec(3, key_levels=uniform_levels(3).flip(0), value_levels=uniform_levels(3))
    with pytest.raises(ValueError):
        KVQuantCodec(3, key_levels=uniform_levels(2), value_levels=uniform_levels(2))
    with pytest.raises(ValueError):
        Int8Codec().packed_block_bytes(B, D, "both")
    d = KiviCodec(4, key_axis="token").describe()
    assert d["codec"] == "kivi" and d["bits"] == 4 and d["key_axis"] == "token" and d["residual"] == 128
    assert KVQuantCodec(3, levels="uniform").describe()["key_ranges"] == "online"
    from kvbench.quant.registry import CODECS

    assert set(CODECS.names()) == {"none", "full", "kivi", "kvquant", "int8", "fp8", "nvfp4", "mxfp4"}


@pytest.fixture(scope="module")
def triton_dequant():
    """The Triton module, imported with TRITON_INTERPRET=1 when there is no GPU (set before the import)."""
    pytest.importorskip("triton")
    import importlib
    import os
    import sys

    name = "kvbench.runtime.backends.triton.dequant"
    if name in sys.modules:
        return sys.modules[name]
    old = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(name)
    finally:  # the kernel keeps its mode; other tests see the environment unchanged
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("geom", [(32, 64, 32), (32, 40, 16)])  # (B, D, G); D=40, G=16: a partial group
def test_triton_kivi_dequant_matches_torch(triton_dequant, bits, key_axis, geom):
    b, d, g = geom
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = KiviCodec(bits, group_size=g, residual=4 * g, key_axis=key_axis)
    x = _tile(3, seed=12, b=b, d=d)
    for kind in ("key", "value"):
        blocks = (c.encode_keys if kind == "key" else c.encode_values)(x)
        ref = (c.decode_keys if kind == "key" else c.decode_values)(blocks, b, d)
        out = triton_dequant.dequantize_rows(c, blocks.to(device), kind, b, d)
        assert out.shape == (3, b, d) and out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)
        assert (out.cpu() - x).abs().max() > 0  # it really is quantized data
