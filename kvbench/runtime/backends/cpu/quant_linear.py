"""Linear layers and embeddings whose weights stay in a GGUF file's own quantized blocks.

A `QuantMatrix` is one tensor of the file as it is stored: rows of blocks (ggml's layouts: Q8_0, Q4_0, Q5_0 of 32
values, Q4_K, Q5_K, Q6_K of 256), a uint8 tensor [rows, row_bytes]. `QuantLinear` (a `linear.Linear`) multiplies
such matrices, one or several stacked along the output (fused q/k/v of different types, as Q4_K_M files mix Q4_K
and Q6_K), with the C kernels of csrc/quant_matmul.c: a bandwidth-bound GEMV for decode steps (each block expanded to
fp32 in L1 as it is read) and a GEMM for prefill chunks (rows expanded once per thread, then multiplied with the
input rows in register tiles). Activations stay fp32 by default, so the result is dequantize-then-matmul's up to
the order of the sums; `activations="q8"` (ACTIVATIONS; QuantLinear.activations) quantizes decode-sized inputs to
Q8_0 blocks for integer dot products with the weights of Q8_TYPES, as llama.cpp does (csrc/quant_q8.h), which
changes the numbers by the activations' rounding. The fused decode step multiplies the same matrices with the same
kernels inside its own parallel region (`quant_matmul_team`, through `quant_matmul_team_address`).

The kernels are compiled for three instruction sets and one is chosen at run time: AVX-512, AVX2+FMA, or generic C
(scalar); ``KVBENCH_QUANT_ISA=generic|avx2|avx512`` forces one (``avx2_wide``, AVX2 code with AVX-512's 16-float
vectors, tests the wide form's logic on an AVX2 machine). The library is built and cached like the decode kernels
(kernels.py), without -march=native so that every path is in it.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.runtime.backends.cpu import kernels
from kvbench.runtime.backends.cpu.linear import Linear

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "quant_matmul.c"]
_HEADERS = [_CSRC / "quant_matmul_impl.h", _CSRC / "quant_blocks.h", _CSRC / "quant_q8.h"]
_FLAGS = ["-O3", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", "-Wno-psabi"]

# ggml's type ids (gguf.GGMLQuantizationType) of the block types the kernels multiply
QUANT_TYPES = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
ISAS = {"generic": 0, "avx2": 1, "avx512": 2, "avx2_wide": 3}
# the activations of a product (quant_q8.h): fp32 as they are, or each row quantized to Q8_0 blocks (32 values, an
# fp32 scale) for integer dot products, llama.cpp's scheme, with the weight types in Q8_TYPES (Q5_K stays fp32)
ACTIVATIONS = {"fp32": 0, "q8": 1}
Q8_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")
ISA_ENV = "KVBENCH_QUANT_ISA"
_lib = None
_error: str | None = None


def load_quant_kernel():
    """The compiled library, or None (the reason in `quant_kernel_error()`); built once per process."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    try:
        lib = kernels.open_library(_SOURCES, _HEADERS, _FLAGS, "kvbench_quant")
    except (OSError, RuntimeError) as err:
        _error = str(err)
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_matmul.argtypes = [i32, i32, p, i64, i64, i64, p, i64, i64, p, i64, i32, i32]
    lib.quant_dequantize_rows.argtypes = [i32, p, i64, i64, p, i64, p, i32]
    lib.quant_matmul_team.argtypes = [i32, i32, p, i64, i64, i64, p, i64, i64, p, i64, p, i32, i32]
    for fn in (lib.quant_matmul, lib.quant_dequantize_rows, lib.quant_isa_supported, lib.quant_block_values,
               lib.quant_block_bytes, lib.quant_matmul_team):
        fn.restype = i32
    lib.quant_isa_supported.argtypes = [i32]
    lib.quant_block_values.argtypes = lib.quant_block_bytes.argtypes = [i32]
    _lib = lib
    return lib


def quant_kernel_error() -> str | None:
    return _error


def quant_matmul_team_address() -> int:
    """The address of the library's `quant_matmul_team` (a work-shared product for a caller's parallel region), which
    the fused decode step calls (kernels.set_quant_matmul)."""
    lib = load_quant_kernel()
    assert lib is not None, _error
    return ctypes.cast(lib.quant_matmul_team, ctypes.c_void_p).value


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs `isa`'s kernels (and the library built)."""
    lib = load_quant_kernel()
    return lib is not None and bool(lib.quant_isa_supported(ISAS[isa]))


def chosen_isa() -> str:
    """$KVBENCH_QUANT_ISA when set (checked: UserError, one line), else the widest instruction set this CPU has."""
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise UserError(f"{ISA_ENV}={forced!r}: valid values are {', '.join(ISAS)}")
        if not isa_supported(forced):
            raise UserError(f"{ISA_ENV}={forced!r}: this CPU (or build) lacks it; it has "
                             f"{', '.join(i for i in ISAS if isa_supported(i))}")
        return forced
    return next(i for i in ("avx512", "avx2", "generic") if isa_supported(i))


def block_shape(type_id: int) -> tuple[int, int]:
    """(values, bytes) of one block of a type handled here."""
    name = next(n for n, t in QUANT_TYPES.items() if t == type_id)
    return {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q5_0": (32, 22), "Q4_K": (256, 144), "Q5_K": (256, 176),
            "Q6_K": (256, 210)}[name]


@dataclass
class QuantMatrix:
    """A weight [rows, cols] kept as the file's blocks: data uint8 [rows, cols / block values * block bytes]."""

    type_id: int
    data: torch.Tensor
    cols: int

    def __post_init__(self):
        values, nbytes = block_shape(self.type_id)
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2 and self.data.is_contiguous()
        assert self.cols % values == 0 and self.data.shape[1] == self.cols // values * nbytes, \
            (self.cols, tuple(self.data.shape))

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def type_name(self) -> str:
        return next(n for n, t in QUANT_TYPES.items() if t == self.type_id)

    def take_rows(self, index: torch.Tensor) -> "QuantMatrix":
        """The rows `index` (a permutation of rows: llama's q/k as transformers reorders them), still quantized."""
        return QuantMatrix(self.type_id, self.data[index].contiguous(), self.cols)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 [len(rows), cols] of the rows `rows` (int64)."""
        lib = load_quant_kernel()
        idx = rows.to(torch.int64).contiguous().view(-1)
        out = torch.empty(idx.numel(), self.cols, dtype=torch.float32)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.rows):
            raise IndexError(f"row index out of range for {self.rows} rows")
        rc = lib.quant_dequantize_rows(self.type_id, self.data.data_ptr(), self.data.shape[1], self.cols,
                                       idx.data_ptr(), idx.numel(), out.data_ptr(), torch.get_num_threads())
        assert rc == 0
        return out

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols]."""
        return self.dequantize_rows(torch.arange(self.rows))


def quant_matmul(x: torch.Tensor, w: QuantMatrix, out: torch.Tensor | None = None, isa: str | None = None,
                 activations: str = "fp32") -> torch.Tensor:
    """x [M, cols] fp32 @ w^T -> [M, rows]; into `out` (a [M, rows] view whose rows are contiguous) when given;
    activations "q8": x's rows quantized to Q8_0 blocks first where w's type is one of Q8_TYPES (ACTIVATIONS)."""
    lib = load_quant_kernel()
    if lib is None:
        raise RuntimeError(f"quantized-weight kernels unavailable: {_error}")
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == w.cols
    x = x if x.stride(1) == 1 else x.contiguous()
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, w.rows, dtype=torch.float32)
    assert out.shape == (M, w.rows) and out.stride(1) == 1
    if M == 0:
        return out
    rc = lib.quant_matmul(ISAS[isa or chosen_isa()], w.type_id, w.data.data_ptr(), w.data.shape[1], w.rows, w.cols,
                          x.data_ptr(), x.stride(0), M, out.data_ptr(), out.stride(0), torch.get_num_threads(),
                          ACTIVATIONS[activations])
    if rc != 0:
        raise ValueError(f"quant_matmul: unsupported type {w.type_id} or shape {w.rows}x{w.cols}")
    return out


class QuantLinear(Linear):
    """y = x @ W^T + b with W the row-wise stack of `parts` (each the file's own blocks); fp32 on CPU.
    `activations` "q8": inputs of at most kernels.GEMV_MAX_ROWS rows (decode steps; the fused decode step reads it
    too) are quantized to Q8_0 blocks for the parts of a type in Q8_TYPES (llama.cpp's integer dot products);
    "fp32" (default): as they are."""

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None = None, activations: str = "fp32"):
        cols = {p.cols for p in parts}
        assert len(cols) == 1, "the stacked matrices must share their input size"
        self.parts = parts
        self.in_features = cols.pop()
        self.out_features = sum(p.rows for p in parts)
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.bias = bias
        self.nbytes = sum(p.data.nbytes for p in parts) + (bias.nbytes if bias is not None else 0)
        self._packed = self._plain = self._w_t = None  # no dense copy: the fused decode step and oneDNN skip it
        self._dense: torch.Tensor | None = None
        self._isa = chosen_isa()
        assert activations in ACTIVATIONS, activations
        self.activations = activations

    @property
    def isa(self) -> str:
        """The instruction set its kernels run (chosen_isa at construction)."""
        return self._isa

    @property
    def backend(self) -> str:
        return f"quantized ({'+'.join(sorted({p.type_name for p in self.parts}))}, {self._isa})"

    def dense_weight(self) -> torch.Tensor:
        """The weight dequantized to fp32 [out, in] (a fresh copy)."""
        return torch.cat([p.dequantize() for p in self.parts])

    def __call__(self, x: torch.Tensor, gemv_rows: int | None = None) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # autograd (KVQuant's Fisher pass): through a dense copy
            w = self._dense if self._dense is not None else self.dense_weight()
            return F.linear(x, w, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        row = 0
        act = self.activations if x2.shape[0] <= kernels.GEMV_MAX_ROWS else "fp32"
        for p in self.parts:
            quant_matmul(x2, p, y[:, row: row + p.rows], self._isa, act)
            row += p.rows
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)


class QuantEmbedding:
    """An embedding table [V, E] kept quantized; `emb[token_ids]` gives the fp32 rows (a tensor's indexing)."""

    def __init__(self, matrix: QuantMatrix):
        self.matrix = matrix
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.shape = torch.Size([matrix.rows, matrix.cols])
        self.nbytes = matrix.data.nbytes

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens)
        return self.matrix.dequantize_rows(tokens.reshape(-1)).view(*tokens.shape, self.matrix.cols)

    def dense(self) -> torch.Tensor:
        return self.matrix.dequantize()


# byte offsets of each block's fp16 scales (d, and dmin for Q4_K / Q5_K)
_SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_quant_matrix(type_name: str, rows: int, cols: int, generator: torch.Generator | None = None
                        ) -> QuantMatrix:
    """A matrix of random blocks of a type (for tests and benches: gguf-py quantizes none of the K types): every
    quant and sub-scale byte random, the fp16 scales random in +-[0.5, 1.5] / 64."""
    values, nbytes = block_shape(QUANT_TYPES[type_name])
    blocks = rows * cols // values
    data = torch.randint(0, 256, (blocks, nbytes), dtype=torch.uint8, generator=generator)
    for off in _SCALE_OFFSETS[type_name]:
        scale = (torch.rand(blocks, generator=generator) + 0.5) / 64
        scale = scale * (torch.randint(0, 2, (blocks,), generator=generator) * 2 - 1)
        data[:, off: off + 2] = scale.to(torch.float16).view(torch.uint8).view(blocks, 2)
    return QuantMatrix(QUANT_TYPES[type_name], data.view(rows, -1).contiguous(), cols)
