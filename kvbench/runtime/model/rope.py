"""Rotary position embeddings with a precomputed cos/sin table (HF "rotate_half" convention)."""
from __future__ import annotations

import torch


class RotaryTable:
    """cos/sin for positions 0..max_positions-1, grown on demand.

    inv_freq and attention_scaling come from the transformers model's rotary module, so every rope
    type transformers supports (default, llama3, linear, dynamic-free yarn, ...) is covered.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype, max_positions: int = 4096):
        self.inv_freq = inv_freq.float()  # [D/2]
        self.scaling = float(attention_scaling)
        self.dtype = dtype
        self._build(max_positions)

    def _build(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)  # [n, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, D]
        self.cos = (emb.cos() * self.scaling).to(self.dtype)
        self.sin = (emb.sin() * self.scaling).to(self.dtype)

    def lookup(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, D] for integer positions (negative = padding, treated as 0). max_position:
        the largest of them when the caller knows it on the host (else it is read from the device)."""
        if max_position is not None:
            need = max_position + 1
        else:
            need = int(positions.max()) + 1 if positions.numel() else 1
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        p = positions.clamp(min=0).to(torch.int64)
        return self.cos[p], self.sin[p]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by cos/sin broadcastable to x."""
    return x * cos + rotate_half(x) * sin
