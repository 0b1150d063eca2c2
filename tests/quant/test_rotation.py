"""quant.rotate=hadamard (kvbench.quant.rotation): the randomized Hadamard matrix, exactness without quantization
(a round trip, and the log-probabilities of a tiny model equal to no rotation to fp32 rounding), lower error than
no rotation on keys with planted outlier channels, and the refusals."""
from __future__ import annotations

import pytest
import torch

from kvbench.errors import UserError
from kvbench.run.model_info import ModelShape
from kvbench.quant.codecs import FullPrecisionCodec, KiviCodec
from kvbench.quant.fp4_codecs import Mxfp4Codec, Nvfp4Codec
from kvbench.quant.registry import build_codec, check_codec
from kvbench.quant.rotation import RotatedCodec, hadamard_matrix, random_hadamard
from kvbench.runtime.cache.quantized_cache import QuantizedPagedKVCache
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import HEAD_DIM_64, tiny_model

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


def test_random_hadamard_is_orthogonal_seeded_and_sylvester():
    for d in (1, 2, 16, 64, 128):
        r = random_hadamard(d, seed=5)
        torch.testing.assert_close(r @ r.T, torch.eye(d), rtol=0, atol=1e-6)
        assert torch.equal(r, random_hadamard(d, seed=5))
        assert torch.equal(r.abs(), torch.full((d, d), d**-0.5))  # every entry +-1/sqrt(d)
    assert not torch.equal(random_hadamard(64, 0), random_hadamard(64, 1))
    h = hadamard_matrix(4)
    assert h.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    with pytest.raises(ValueError, match="power of two, got 48"):
        random_hadamard(48)


def _outlier_keys(n=8, b=32, d=128, seed=0):
    """Keys whose channels 3, 50, 77 and 100 are 20x larger (and offset), as real models' keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, b, d, generator=g)
    out = [3, 50, 77, 100]
    x[..., out] = x[..., out] * 20 + 10
    return x


def test_rotation_without_quantization_is_exact_to_fp32_rounding():
    c = RotatedCodec(FullPrecisionCodec(torch.float32), seed=2)
    x = _outlier_keys()
    rows = c.encode_keys(x)
    assert not torch.equal(FullPrecisionCodec(torch.float32).decode_keys(rows, 32, 128), x)  # stored rotated
    tol = 1e-6 * float(x.abs().max())  # fp32 rounding of 128-term sums (values up to ~70)
    torch.testing.assert_close(c.decode_keys(rows, 32, 128), x, rtol=0, atol=tol)
    torch.testing.assert_close(c.decode_values(c.encode_values(x), 32, 128), x, rtol=0, atol=tol)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, **HEAD_DIM_64)


def _logprobs(model, codec, ids):
    eng = Engine(model, codec=codec, block_size=16, num_blocks=512, prefill_chunk_size=32)
    return Scorer(eng).score(ids, chunk_size=32), eng


def test_rotated_full_precision_cache_equals_no_rotation_on_a_tiny_model(model):
    ids = torch.randint(0, 256, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    ref, _ = _logprobs(model, None, ids)
    rotated = RotatedCodec(FullPrecisionCodec(torch.float32), seed=1)
    rotated.name = "full_rotated"  # not "full": the cache stores (rotated) packed rows instead of a plain pool
    calls = []
    decode = rotated.decode_keys
    rotated.decode_keys = lambda *a, **k: calls.append(1) or decode(*a, **k)
    got, eng = _logprobs(model, rotated, ids)
    assert isinstance(eng.cache, QuantizedPagedKVCache) and calls  # the rotated rows were really read
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("make,key_axis,gain", [
    (lambda: KiviCodec(2, residual=0, key_axis="token"), "token", 0.85),
    (lambda: KiviCodec(2, residual=0), "channel", 1.0),
    (Mxfp4Codec, "token", 0.8),
])
def test_rotation_lowers_the_error_on_outlier_channels(make, key_axis, gain):
    x = _outlier_keys()
    plain, rotated = make(), RotatedCodec(make(), seed=0)
    err = [((c.decode_keys(c.encode_keys(x), 32, 128) - x).norm() / x.norm()).item() for c in (plain, rotated)]
    assert err[1] < gain * err[0], err


def test_rotated_kivi_end_to_end_is_closer_to_full_than_kivi(model):
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    ref, _ = _logprobs(model, None, ids)
    opts = dict(bits=2, group_size=16, residual=32)
    plain, _ = _logprobs(model, build_codec("kivi", None, **opts), ids)
    rotated, eng = _logprobs(model, build_codec("kivi", None, rotate="hadamard", **opts), ids)
    assert isinstance(eng.cache.codec, RotatedCodec)
    assert (rotated - ref).abs().mean() < (plain - ref).abs().mean()


def test_registry_builds_and_refuses_rotations():
    for name in ("kivi", "nvfp4", "mxfp4"):
        c = build_codec(name, None, rotate="hadamard", rotate_seed=7)
        assert isinstance(c, RotatedCodec) and c.seed == 7 and c.describe()["rotate"] == "hadamard"
        assert not isinstance(build_codec(name, None), RotatedCodec)
    assert isinstance(build_codec("nvfp4", None, rotate="hadamard").inner, Nvfp4Codec)
    with pytest.raises(UserError, match="invalid quant.rotate='spin': choices are none, hadamard"):
        build_codec("kivi", None, rotate="spin")
    shape = ModelShape(num_layers=2, num_kv_heads=2, head_dim=48, max_positions=1024)
    with pytest.raises(UserError, match="head_dim 48 is not a power of two"):
        check_codec("mxfp4", {"rotate": "hadamard"}, shape)
    check_codec("mxfp4", {"rotate": "none"}, shape)  # no rotation: any head_dim
    latent = ModelShape(num_layers=2, num_kv_heads=1, head_dim=576, max_positions=1024, latent=True)
    with pytest.raises(UserError, match="MLA latent rows"):
        check_codec("kivi", {"rotate": "hadamard"}, latent)
    with pytest.raises(UserError, match="unknown option quant.rotate for codec 'int8'"):
        check_codec("int8", {"rotate": "hadamard"})
    with pytest.raises(ValueError, match="head_dim a power of two, got 48"):
        build_codec("kivi", None, rotate="hadamard").encode_keys(torch.zeros(1, 32, 48))
