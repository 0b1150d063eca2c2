"""A GGUF file's weight matrices kept in their own quantized blocks (model.weights=quantized).

`QuantizedWeights.from_gguf(file, hf_model)` maps each 2-D tensor of the file to the transformers parameter it
becomes (transformers' own GGUF name map, get_gguf_hf_weights_map) and keeps, as a backends.cpu.quant_linear
QuantMatrix over the file's memory map (no copy), every tensor whose block type the CPU kernels multiply (Q8_0, Q4_0,
Q5_0, Q4_K, Q5_K, Q6_K). What transformers' reader does to a tensor must be a reordering of rows (llama's q/k
permutation): it is found by running the reader's own processor on the row indices, and applied to the blocks. Any
other tensor (F32, F16, another block type, a tensor the reader transforms otherwise) is read de-quantized from the
fp32 model as before; `summary()` is the one line that says which.

families.build_from_transformers asks `linear(modules)` for each projection (q/k/v and gate/up stacked) and
`embedding(module)` for the token embeddings (the tied output head multiplies the same blocks).
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import torch

from kvbench.runtime.backends.cpu.quant_linear import (ACTIVATIONS, QUANT_TYPES, QuantEmbedding, QuantLinear,
                                                      QuantMatrix)

WEIGHT_MODES = ("quantized", "dequantize")


class QuantizedWeights:
    """The kept matrices by transformers parameter name, and what was not kept (by reason) for `summary`."""

    def __init__(self, matrices: dict[str, QuantMatrix], dequantized: Counter, file_name: str):
        self.matrices = matrices
        self.dequantized = dequantized  # reason (the block type, or why) -> tensors read de-quantized
        self.file_name = file_name
        self._names: dict[int, str] = {}
        self.used: Counter = Counter()  # block type -> matrices the model holds quantized

    @classmethod
    def from_gguf(cls, path: str, hf_model: Any, text_config: Any) -> "QuantizedWeights":
        import gguf
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        reader = gguf.GGUFReader(path)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        heads = {"num_attention_heads": text_config.num_attention_heads,
                 "num_key_value_heads": getattr(text_config, "num_key_value_heads", None)
                 or text_config.num_attention_heads}
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=heads)
        to_hf = get_gguf_hf_weights_map(hf_model, processor)
        params = dict(hf_model.named_parameters())
        matrices: dict[str, QuantMatrix] = {}
        dequantized: Counter = Counter()
        for tensor in reader.tensors:
            if len(tensor.shape) != 2:
                continue  # norms, biases: small, read from the fp32 model
            type_name = tensor.tensor_type.name
            hf_name = to_hf.get(tensor.name)
            if hf_name is None or hf_name not in params:
                continue  # not a parameter of this model (transformers' load report refused a mismatch already)
            if type_name not in QUANT_TYPES:
                dequantized[type_name] += 1
                continue
            cols, rows = int(tensor.shape[0]), int(tensor.shape[1])  # GGUF lists the fastest dimension first
            if tuple(params[hf_name].shape) != (rows, cols):
                dequantized[f"{type_name} of another shape"] += 1
                continue
            order = _row_order(processor, tensor.name, rows)
            if order is None:
                dequantized[f"{type_name} transformed by the reader"] += 1
                continue
            with warnings.catch_warnings():  # a read-only memory map: the kernels never write weights
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(np.asarray(tensor.data).reshape(rows, -1))
            matrix = QuantMatrix(QUANT_TYPES[type_name], data, cols)
            if not torch.equal(order, torch.arange(rows)):
                matrix = matrix.take_rows(order)
            matrices[hf_name] = matrix
        return cls(matrices, dequantized, path.rsplit("/", 1)[-1])

    def _name_of(self, module: Any, hf_model: Any) -> str | None:
        if not self._names:
            self._names = {id(p): n for n, p in hf_model.named_parameters()}
        return self._names.get(id(getattr(module, "weight", None)))

    def linear(self, modules: tuple, hf_model: Any, bias: torch.Tensor | None) -> QuantLinear | None:
        """A QuantLinear stacking the modules' weights, when every one of them is kept; else None (fp32)."""
        parts = [self.matrices.get(self._name_of(m, hf_model) or "") for m in modules]
        if any(p is None for p in parts):
            return None
        self.used.update(p.type_name for p in parts)
        return QuantLinear(parts, bias)

    def embedding(self, module: Any, hf_model: Any) -> QuantEmbedding | None:
        matrix = self.matrices.get(self._name_of(module, hf_model) or "")
        if matrix is None:
            return None
        self.used[matrix.type_name] += 1
        return QuantEmbedding(matrix)

    def summary(self) -> str:
        """One line: the matrices kept quantized by type, and those read de-quantized with why."""
        kept = ", ".join(f"{n} {t}" for t, n in sorted(self.used.items()))
        line = f"kvbench: {self.file_name}: weights kept quantized ({kept or 'none'})"
        if self.dequantized:
            line += "; de-quantized to fp32 (no kernel for their blocks): " + ", ".join(
                f"{n} {t}" for t, n in sorted(self.dequantized.items()))
        return line


def _row_order(processor: Any, gguf_name: str, rows: int) -> torch.Tensor | None:
    """The rows of the file's tensor in transformers' order (its processor run on the row indices), or None when
    the processor does more than reorder rows."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    try:
        out = processor.process(weights=index, name=gguf_name)
    except Exception:  # a processor that needs more than the weights (MoE experts): not a plain matrix
        return None
    w = np.asarray(out.weights)
    if out.name != gguf_name or w.shape != (rows, 1) or out.metadata:
        return None
    order = w[:, 0]
    if not np.array_equal(np.sort(order), np.arange(rows)):
        return None
    return torch.from_numpy(order.astype(np.int64))


def set_quant_activations(model: Any, activations: str) -> int:
    """Every QuantLinear of `model` (projections and output head) multiplies decode-sized inputs with `activations`
    ("fp32", or "q8": rows quantized to Q8_0 blocks for integer dot products, quant_linear.ACTIVATIONS); the fused
    decode step's form of the weights is rebuilt. Returns how many QuantLinears it set."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: choices are {', '.join(ACTIVATIONS)}")
    names = ("qkv", "o", "gate_up", "down")
    linears = [getattr(lw, name, None) for lw in getattr(model, "layers", ()) for name in names]
    n = 0
    for lin in [*linears, getattr(model, "lm_head", None)]:
        if isinstance(lin, QuantLinear):
            lin.activations = activations
            n += 1
    view = model.__dict__.get("_decode_weights")
    if view is not None:
        view.kernel_form = None  # built again, with the new activations, at the next fused step
    return n
