"""Weights kept in GGUF's quantized blocks (backends/cpu/quant_linear.py, csrc/quant_matmul.c) against gguf-py's
dequantize followed by an fp32 (float64 here) matmul: every block type, each instruction-set path the CPU runs,
ragged shapes (rows not a multiple of the 4-row tile, input rows not a multiple of the 2-row register tile, the
decode path's 1-2 rows and the prefill path's more), and K a multiple of 256 for K-quants, of 32 otherwise."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from kvbench.errors import UserError  # noqa: E402
from kvbench.runtime.backends.cpu import quant_linear as ql  # noqa: E402

pytestmark = pytest.mark.skipif(ql.load_quant_kernel() is None, reason="no C compiler for the kernels")

TYPES = list(ql.QUANT_TYPES)
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}
RUNNABLE_ISAS = [isa for isa in ql.ISAS if ql.isa_supported(isa)]


def reference(qm: ql.QuantMatrix) -> torch.Tensor:
    """gguf-py's dequantize of the same bytes: [rows, cols] float64."""
    kind = gguf.GGMLQuantizationType[qm.type_name]
    return torch.from_numpy(np.array(quants.dequantize(qm.data.numpy(), kind), dtype=np.float64)).view(qm.rows,
                                                                                                      qm.cols)


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_matches_gguf_bit_for_bit(type_name):
    g = torch.Generator().manual_seed(1)
    cols = 512 if type_name in K_QUANTS else 96
    qm = ql.random_quant_matrix(type_name, 7, cols, g)
    assert torch.equal(qm.dequantize().double(), reference(qm))
    rows = torch.tensor([6, 0, 3, 3])
    assert torch.equal(qm.dequantize_rows(rows).double(), reference(qm)[rows])


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("type_name", TYPES)
def test_matmul_matches_dequantize_then_matmul(type_name, isa):
    g = torch.Generator().manual_seed(2)
    ks = (256, 768) if type_name in K_QUANTS else (32, 96, 288)
    for cols in ks:
        for out_rows in (1, 5, 13):  # a partial 4-row tile, alone and after whole ones
            qm = ql.random_quant_matrix(type_name, out_rows, cols, g)
            ref = reference(qm)
            x = torch.randn(9, cols, generator=g)
            for m in (1, 2, 3, 5, 9):  # decode path (<= 2 rows) and prefill path, ragged register tiles
                y = ql.quant_matmul(x[:m], qm, isa=isa)
                expect = x[:m].double() @ ref.T
                scale = x[:m].double().abs() @ ref.abs().T  # the size of the terms: fp32 rounding is relative to it
                err = ((y.double() - expect).abs() / scale.clamp_min(1e-30)).max().item()
                assert err < 1e-5, (type_name, isa, cols, out_rows, m, err)


def test_every_isa_path_gives_the_same_products():
    """The wide (16-lane) form's logic, run on AVX2 when the CPU lacks AVX-512, against the other paths."""
    g = torch.Generator().manual_seed(3)
    qm = ql.random_quant_matrix("Q4_K", 6, 512, g)
    x = torch.randn(4, 512, generator=g)
    ys = {isa: ql.quant_matmul(x, qm, isa=isa) for isa in RUNNABLE_ISAS}
    for isa, y in ys.items():
        torch.testing.assert_close(y, ys["generic"], rtol=1e-5, atol=1e-5, msg=isa)


def test_output_into_a_column_slice_and_strided_input():
    """QuantLinear writes each stacked part into its columns of one output (ldy) and reads strided rows (ldx)."""
    g = torch.Generator().manual_seed(4)
    q, v = ql.random_quant_matrix("Q4_K", 6, 256, g), ql.random_quant_matrix("Q6_K", 3, 256, g)
    bias = torch.randn(9, generator=g)
    lin = ql.QuantLinear([q, v], bias)
    x = torch.randn(3, 2, 512, generator=g)[..., :256]  # rows 512 floats apart
    dense = torch.cat([reference(q), reference(v)])
    expect = (x.double() @ dense.T + bias.double()).float()
    torch.testing.assert_close(lin(x), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.dense_weight().double(), dense)
    assert lin.out_features == 9 and lin.in_features == 256 and lin.nbytes == q.data.nbytes + v.data.nbytes + 36


def test_forced_isa_env_checked(monkeypatch):
    monkeypatch.setenv(ql.ISA_ENV, "sse9")
    with pytest.raises(UserError, match="valid values are generic, avx2, avx512"):
        ql.chosen_isa()
    monkeypatch.setenv(ql.ISA_ENV, "generic")
    assert ql.chosen_isa() == "generic"


def test_embedding_rows():
    g = torch.Generator().manual_seed(5)
    qm = ql.random_quant_matrix("Q8_0", 10, 64, g)
    emb = ql.QuantEmbedding(qm)
    tokens = torch.tensor([[3, 9], [0, 3]])
    out = emb[tokens]
    assert out.shape == (2, 2, 64)
    torch.testing.assert_close(out.double(), reference(qm)[tokens])
    with pytest.raises(IndexError):
        emb[torch.tensor([10])]


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("type_name", TYPES)
def test_team_product_adds_bias_and_accumulates(type_name, isa):
    """quant_matmul_team (the fused decode step's entry, run here by one thread outside any region): y = x W^T + b,
    or y += x W^T + b, into a strided output, equal to quant_matmul's product plus the bias in that order, with fp32
    and Q8 activations."""
    import ctypes

    lib = ql.load_quant_kernel()
    g = torch.Generator().manual_seed(6)
    cols = 256 if type_name in K_QUANTS else 96
    qm = ql.random_quant_matrix(type_name, 7, cols, g)
    bias = torch.randn(7, generator=g)
    for m, act in itertools.product((1, 2, 5), ql.ACTIVATIONS):  # the decode GEMV and the expanded-tile path
        x = torch.randn(m, cols, generator=g)
        base = torch.randn(m, 10, generator=g)
        prod = ql.quant_matmul(x, qm, isa=isa, activations=act)
        for accumulate in (0, 1):
            y = base.clone()
            rc = lib.quant_matmul_team(ql.ISAS[isa], qm.type_id, qm.data.data_ptr(), qm.data.shape[1], qm.rows,
                                       qm.cols, x.data_ptr(), cols, m, ctypes.c_void_p(y.data_ptr() + 4 * 2), 10,
                                       bias.data_ptr(), accumulate, ql.ACTIVATIONS[act])
            assert rc == 0
            expect = base.clone()
            expect[:, 2:9] = base[:, 2:9] + (prod + bias) if accumulate else prod + bias
            assert torch.equal(y, expect), (m, act, accumulate)


def q8_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] quantized to Q8_0 blocks in torch as the kernels do (d = max|x| / 127 per 32 values, q =
    round-half-even(x * (1 / d)), a zero block stays zero) and dequantized: float64 [M, K]."""
    xb = x.view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0  # fp32, as in C
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)
    assert q.abs().max() <= 127
    return (q.double() * d.double()).view_as(x)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("type_name", ql.Q8_TYPES)
def test_q8_activations_match_quantize_then_float64_matmul(type_name, isa):
    """activations="q8" (csrc/quant_q8.h: integer dot products): x's rows quantized to Q8_0 blocks, then the product
    with the weight's blocks equals both dequantized and multiplied in float64, up to fp32 rounding of the per-block
    scaled sums (the K-quants' 32-value sub-blocks with their own scales and Q4_K's minimum times the codes' sum); ragged
    shapes, the generic C path and the SIMD one, a zero block and a row with one large value."""
    g = torch.Generator().manual_seed(7)
    for cols in ((256, 768) if type_name in K_QUANTS else (32, 96, 288)):
        for out_rows in (1, 5, 13):
            qm = ql.random_quant_matrix(type_name, out_rows, cols, g)
            ref = reference(qm)
            x = torch.randn(9, cols, generator=g)
            x[1, :32] = 0.0  # a zero block: scale 0
            x[2, 5] = 40.0  # one large value: the rest of its block rounds coarsely
            xq = q8_reference(x)
            for m in (1, 2, 3, 5, 9):  # up to 4 rows share an unpacked weight block; ragged remainders
                y = ql.quant_matmul(x[:m], qm, isa=isa, activations="q8")
                expect = xq[:m] @ ref.T
                scale = xq[:m].abs() @ ref.abs().T
                err = ((y.double() - expect).abs() / scale.clamp_min(1e-30)).max().item()
                assert err < 1e-5, (type_name, isa, cols, out_rows, m, err)
                fp32 = ql.quant_matmul(x[:m], qm, isa=isa)
                assert not torch.equal(y, fp32)  # the activations' rounding shows: it is not the fp32 path


@pytest.mark.parametrize("type_name", sorted(set(TYPES) - set(ql.Q8_TYPES)))
def test_q8_activations_leave_other_types_in_fp32(type_name):
    """A type with no Q8-activation kernel here (Q5_K): activations="q8" gives the fp32 product bit for bit."""
    g = torch.Generator().manual_seed(8)
    qm = ql.random_quant_matrix(type_name, 5, 256, g)
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(ql.quant_matmul(x, qm, activations="q8"), ql.quant_matmul(x, qm))


def test_quant_linear_uses_q8_activations_for_decode_sized_inputs_only():
    """QuantLinear(activations="q8"): up to kernels.GEMV_MAX_ROWS rows quantized, more (prefill chunks) in fp32."""
    from kvbench.runtime.backends.cpu import kernels

    g = torch.Generator().manual_seed(9)
    qm = ql.random_quant_matrix("Q8_0", 6, 64, g)
    lin, plain = ql.QuantLinear([qm], activations="q8"), ql.QuantLinear([qm])
    small, big = torch.randn(kernels.GEMV_MAX_ROWS, 64, generator=g), torch.randn(kernels.GEMV_MAX_ROWS + 1, 64)
    assert torch.equal(lin(small), ql.quant_matmul(small, qm, activations="q8"))
    assert not torch.equal(lin(small), plain(small))
    assert torch.equal(lin(big), plain(big))
