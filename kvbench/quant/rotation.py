"""A fixed randomized Hadamard rotation of the cached keys and values before a low-bit codec (QuaRot, SpinQuant).

R = diag(s) @ H / sqrt(D): a seeded sign flip s in {-1, +1}^D, then the normalized Walsh-Hadamard matrix H
(Sylvester order, D a power of two); R is orthogonal. Rows are rotated as x @ R, which spreads an outlier channel
over every channel, so it stops setting a whole group's scale.

    keys    after RoPE (the cache holds post-RoPE keys): stored Q(k R). QuaRot and SpinQuant rotate the query by the
            same R (q R . k R = q . k); here the dequantized key is rotated back, k^ = Q(k R) R^T, and
            q . k^ = (q R) . Q(k R): the same scores as rotating the query.
    values  QuaRot rotates values per head through W_v and folds the inverse into W_o per head (SpinQuant's R2
            likewise, learned): stored Q(v R); attention's output sum_i p_i Q(v_i R) is multiplied by R^T before
            W_o. Rotating each dequantized value back, Q(v R) R^T, gives the same output (attention is linear in
            the values).
In full precision the rotation changes nothing but float rounding (tests/quant/test_rotation.py).

`RotatedCodec` wraps a codec: its rows are the inner codec's rows of the rotated tiles. Kernels that read rows in
place would need the query rotated (keys) and the output rotated back (values); the wrapper offers only the
Triton dequantizer (the rows are dequantized, then rotated back, by `unrotate`).
"""
from __future__ import annotations

import torch

from kvbench.quant.codecs import KVCodec

ROTATIONS = ("none", "hadamard")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard_matrix(d: int) -> torch.Tensor:
    """The Sylvester Walsh-Hadamard matrix of order d (a power of two), entries +-1: float32 [d, d]."""
    if not is_power_of_two(d):
        raise ValueError(f"a Hadamard rotation needs head_dim a power of two, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_hadamard(d: int, seed: int = 0) -> torch.Tensor:
    """R = diag(s) @ H / sqrt(d) with seeded random signs s: float32 [d, d], orthogonal (R @ R.T = I)."""
    g = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1  # [d]
    return signs[:, None] * hadamard_matrix(d) / d**0.5


class RotatedCodec(KVCodec):
    """`inner` over rows rotated by `random_hadamard(head_dim, seed)` (keys and values, see the module docstring)."""

    def __init__(self, inner: KVCodec, seed: int = 0):
        if getattr(inner, "pre_rope_keys", False):
            raise ValueError(f"codec {inner.name!r} stores keys before RoPE: the rotation applies after RoPE")
        self.inner = inner
        self.seed = int(seed)
        self.name = inner.name
        for attr in ("bits", "block_size_hint", "residual", "first_token_fp", "fp_block_dtype", "layer_independent"):
            setattr(self, attr, getattr(inner, attr))
        self._rotations: dict[tuple[int, torch.device], torch.Tensor] = {}

    @property
    def kernels(self) -> frozenset[str]:
        return frozenset(self.inner.kernels) & {"triton_dequant"}

    def rotation(self, head_dim: int, device) -> torch.Tensor:
        """R for `head_dim` on `device`: float32 [head_dim, head_dim] (built once per head_dim and device)."""
        key = (head_dim, torch.device(device))
        if key not in self._rotations:
            self._rotations[key] = random_hadamard(head_dim, self.seed).to(device)
        return self._rotations[key]

    def rotate(self, tile: torch.Tensor) -> torch.Tensor:
        """tile [..., D] -> tile @ R (float32)."""
        return tile.float() @ self.rotation(tile.shape[-1], tile.device)

    def unrotate(self, tile: torch.Tensor, kind: str = "key") -> torch.Tensor:
        """tile [..., D] -> tile @ R^T (float32): the inverse of `rotate` (same for keys and values)."""
        return tile.float() @ self.rotation(tile.shape[-1], tile.device).T

    # ---- the codec interface, delegated to `inner` over rotated tiles
    def layout(self, kind, block_size, head_dim):
        self._check_geometry(kind, block_size, head_dim)
        return self.inner.layout(kind, block_size, head_dim)

    def _check_geometry(self, kind, block_size, head_dim):
        super()._check_geometry(kind, block_size, head_dim)
        if not is_power_of_two(head_dim):
            raise ValueError(f"quant.rotate=hadamard needs head_dim a power of two, got {head_dim}")

    def encode_keys(self, tile, layer=0, head=0):
        return self.inner.encode_keys(self.rotate(tile), layer, head)

    def encode_values(self, tile, layer=0, head=0):
        return self.inner.encode_values(self.rotate(tile), layer, head)

    def decode_keys(self, blocks, block_size, head_dim, layer=0, head=0, dtype=torch.float32):
        out = self.inner.decode_keys(blocks, block_size, head_dim, layer, head, torch.float32)
        return self.unrotate(out).to(dtype)

    def decode_values(self, blocks, block_size, head_dim, layer=0, head=0, dtype=torch.float32):
        out = self.inner.decode_values(blocks, block_size, head_dim, layer, head, torch.float32)
        return self.unrotate(out).to(dtype)

    def affine_rows(self, kind, block_size, head_dim):
        return self.inner.affine_rows(kind, block_size, head_dim)

    def fp4_rows(self, kind, block_size, head_dim):
        return self.inner.fp4_rows(kind, block_size, head_dim)

    def packed_block_range(self, num_tokens, block_size):
        return self.inner.packed_block_range(num_tokens, block_size)

    def describe(self) -> dict:
        return {**self.inner.describe(), "rotate": "hadamard", "rotate_seed": self.seed}
