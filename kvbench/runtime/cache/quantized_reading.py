"""Reading a codec's blocks (kvbench.runtime.cache.quantized_cache): attention over a layer, read in place by the
backend where it has a kernel for the codec, else over the layer's blocks dequantized into a dense buffer; and the dense
(dequantized) K/V of one sequence's layer for methods.

`PackedReading` is mixed into `QuantizedPagedKVCache`: its tables, lengths, pools and codec are the cache's.
"""
from __future__ import annotations

import torch

from kvbench.runtime.backends import triton as triton_backend
from kvbench.runtime.cache.append_plan import AppendPlan
from kvbench.runtime.cache.kv_geometry import blocks_for_tokens


class PackedReading:
    """Dequantizing reads of a QuantizedPagedKVCache's full-precision and packed blocks."""

    def _dense_blocks(self, layer: int, tables: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The first nb blocks of each table, decoded: (k, v [S*H*nb, bs, D] in the model dtype, nb).

        tables [S, H, MB], lengths [S, H]; row (s*H + h)*nb + c is block c of table (s, h). Columns past a
        table's own length are zeros.
        """
        S, H = tables.shape[:2]
        bs, D = self.block_size, self.head_dim
        T = int(lengths.max()) if lengths.numel() else 0
        nb = max(1, blocks_for_tokens(T, bs))
        ids = tables[:, :, :nb].reshape(-1).to(torch.int64)  # [S*H*nb]
        own = blocks_for_tokens(lengths, bs).reshape(-1, 1)  # [S*H, 1]
        valid = (torch.arange(nb, device=self.device) < own).reshape(-1)
        k = torch.zeros(S * H * nb, bs, D, dtype=self.dtype, device=self.device)
        v = k[..., : self.value_dim] if self.latent else torch.zeros_like(k)  # latent: the values inside the rows
        fp_pos = torch.nonzero(valid & (ids < self.num_fp_blocks)).squeeze(1)
        if fp_pos.numel():
            fid = ids[fp_pos]
            k.index_copy_(0, fp_pos, self.k_pool.index_select(0, fid).to(self.dtype))
            if not self.latent:
                v.index_copy_(0, fp_pos, self.v_pool.index_select(0, fid).to(self.dtype))
        pk_pos = torch.nonzero(valid & (ids >= self.num_fp_blocks)).squeeze(1)
        if pk_pos.numel():
            pid = ids[pk_pos] - self.num_fp_blocks
            heads = (pk_pos // nb) % H
            k.index_copy_(0, pk_pos, self._decode("key", self.kq_pool.index_select(0, pid), layer, heads))
            if not self.latent:
                v.index_copy_(0, pk_pos, self._decode("value", self.vq_pool.index_select(0, pid), layer, heads))
        return k, v, nb

    def _dense_table_blocks(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every block of the tables' width MB, decoded, with no host sync (no shape depends on values): (k, v
        [S*H*MB, bs, D] in the model dtype, MB). Full-precision entries are read from the fp pool; the packed rows
        are decoded for every entry (a full-precision entry decodes a zero row, discarded)."""
        S, H, MB = tables.shape
        ids = tables.reshape(-1).to(torch.int64)  # [S*H*MB]
        packed = ids >= self.num_fp_blocks
        fid = torch.where(packed, 0, ids)
        pid = torch.where(packed, ids - self.num_fp_blocks, 0)
        heads = (torch.arange(ids.numel(), device=self.device) // MB) % H
        zero = torch.zeros((), dtype=torch.uint8, device=self.device)
        out = []
        kinds = (("key", self.k_pool, self.kq_pool),) if self.latent else (
            ("key", self.k_pool, self.kq_pool), ("value", self.v_pool, self.vq_pool))
        for kind, fp_pool, q_pool in kinds:
            rows = torch.where(packed[:, None], q_pool.index_select(0, pid), zero)
            dec = self._decode(kind, rows, layer, heads)
            out.append(torch.where(packed[:, None, None], dec, fp_pool.index_select(0, fid).to(self.dtype)))
        if self.latent:  # the values: the decoded rows' latent part
            out.append(out[0][..., : self.value_dim])
        return out[0], out[1], MB

    def _decode(self, kind: str, rows: torch.Tensor, layer: int, heads: torch.Tensor) -> torch.Tensor:
        bs, D = self.block_size, self.head_dim
        if self.dequant == "triton":
            dequantize_rows = triton_backend.load("dequant").dequantize_rows
            return dequantize_rows(self.codec, rows.contiguous(), kind, bs, D).to(self.dtype)
        if kind == "key":
            return self.codec.decode_keys(rows, bs, D, layer, heads, dtype=self.dtype)
        return self.codec.decode_values(rows, bs, D, layer, heads, dtype=self.dtype)

    def attend(self, layer: int, q: torch.Tensor, plan: AppendPlan, scale: float, *, backend,
               return_key_scores: bool = False, rotate_keys=None, causal: bool = True):
        """Attention over this layer's blocks: read in place by the backend where it can (`attend_packed`), else
        dequantized and attended by `backend.attend`, as PagedKVCache.attend does."""
        res = backend.attend_packed(self, layer, q, plan, scale, return_key_scores=return_key_scores,
                                    rotate_keys=rotate_keys, causal=causal)
        if res is not None:
            return res
        tables, lengths = plan.tables[:, layer], plan.lengths[:, layer]
        S, H = tables.shape[:2]
        if q.shape[2] == 1 and not causal:  # decode: every block of the tables' width, no host sync
            k, v, nb = self._dense_table_blocks(layer, tables)
        else:
            k, v, nb = self._dense_blocks(layer, tables, lengths)
        dense_tables = torch.arange(S * H * nb, dtype=torch.int32, device=self.device).view(S, H, nb)
        return backend.attend(
            q, k, v, dense_tables, lengths, plan.positions[:, layer, :, : nb * self.block_size],
            plan.query_positions, scale,
            return_key_scores=return_key_scores, rotate_keys=rotate_keys, causal=causal,
        )

    def latent_rows(self, layer: int, plan: AppendPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [N, bs, D], tables [S, H, nb]) such that the tables' blocks of `rows` are this layer's cached
        rows as attention reads them (decoded): a dense buffer of the layer's blocks (MLA's expanded form)."""
        tables, lengths = plan.tables[:, layer], plan.lengths[:, layer]
        S, H = tables.shape[:2]
        k, _, nb = self._dense_blocks(layer, tables, lengths)
        return k, torch.arange(S * H * nb, dtype=torch.int32, device=self.device).view(S, H, nb)

    def gather(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense (dequantized) K, V [H, T, D] and positions [H, T] of one sequence's layer (pad = -1)."""
        self._check_live(slot)
        lengths = self.lengths[slot, layer]
        T = int(self.host_lengths[slot, layer].max())  # from the host copy: no device read
        H, D = self.num_kv_heads, self.head_dim
        nb = max(1, blocks_for_tokens(T, self.block_size))
        k, v, _ = self._dense_table_blocks(layer, self.tables[slot, layer, :, :nb][None])
        k = k.view(H, nb * self.block_size, D)[:, :T]
        v = k[..., : self.value_dim] if self.latent else v.view(H, nb * self.block_size, D)[:, :T]
        pad = torch.arange(T, device=self.device)[None, :] >= lengths[:, None]
        pos = torch.where(pad, -1, self.positions[slot, layer, :, :T])
        return k, v, pos
