"""Per-block key summaries: the element-wise min and max of the keys each block holds (Quest's page metadata).

    summary: [num_blocks, 2, head_dim] fp32     summary[b, 0] = min over b's valid slots, summary[b, 1] = max

A block is one (sequence, layer, kv-head) table's page, so a block's summary is one kv-head's page summary. The
cache keeps them only when a method asks (`PagedKVCache.enable_block_summaries`): they are memory, counted per block
in use with the K/V bytes (kv_accounting.bytes_per_block). Appends update them as keys are written (slot 0 of a block
starts it afresh), operations that move keys between slots recompute the touched tables from the pool, and a block's
summary goes with it (freed with the block: a block id handed out again starts afresh at its slot 0).
The fused CPU decode step updates them in C as it writes each key (csrc/decode_layer.c), with the same rule.
"""
from __future__ import annotations

import torch

from kvbench.runtime.cache.kv_geometry import SCRATCH_BLOCK

SUMMARY_DTYPE = torch.float32


class BlockSummaries:
    """min / max keys of every block of a pool (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, head_dim: int, device: torch.device):
        self.block_size, self.head_dim = block_size, head_dim
        self.summary = torch.zeros(num_blocks, 2, head_dim, dtype=SUMMARY_DTYPE, device=device)  # [N, 2, D]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block's summary occupies (min and max, fp32)."""
        return 2 * self.head_dim * self.summary.element_size()

    def update(self, rows: torch.Tensor, k: torch.Tensor) -> None:
        """Keys k [n, D] were written at flat pool rows `rows` [n] (block = row // block_size): fold them into their
        blocks' summaries; a block written at its slot 0 starts afresh (its earlier contents belong to whoever held
        the id before)."""
        bs = self.block_size
        blocks = rows // bs
        kf = k.to(SUMMARY_DTYPE)
        # a key written at slot 0 replaces its block's summary (no shape depends on a value: no host read; the other
        # rows' copies land in the scratch block, whose summary nothing reads)
        target = torch.where(rows % bs == 0, blocks, SCRATCH_BLOCK)
        self.summary.index_copy_(0, target, torch.stack([kf, kf], dim=1))
        idx = blocks[:, None].expand(-1, self.head_dim)
        self.summary[:, 0].scatter_reduce_(0, idx, kf, "amin")  # include_self: earlier slots of the block count
        self.summary[:, 1].scatter_reduce_(0, idx, kf, "amax")

    def recompute(self, keys: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor) -> None:
        """Summaries of every block of the tables `table` [H, MB] (lengths [H]) from their keys [H, MB, bs, D] as
        attention reads them (a codec's decoded), slots past a table's length excluded (after an operation that
        moved keys between slots or re-stored them)."""
        bs = self.block_size
        nb = int(((lengths + bs - 1) // bs).max()) if lengths.numel() else 0
        if nb == 0:
            return
        ids = table[:, :nb].to(torch.int64)  # [H, nb]
        keys = keys[:, :nb].to(SUMMARY_DTYPE)  # [H, nb, bs, D]
        slot = torch.arange(nb * bs, device=ids.device).view(1, nb, bs, 1)
        valid = slot < lengths.view(-1, 1, 1, 1)
        mn = torch.where(valid, keys, float("inf")).amin(2)  # [H, nb, D]
        mx = torch.where(valid, keys, float("-inf")).amax(2)
        held = (torch.arange(nb, device=ids.device)[None, :] * bs) < lengths[:, None]  # [H, nb] blocks in use
        self.summary[ids[held]] = torch.stack([mn[held], mx[held]], dim=1)

    def set_full_blocks(self, ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Blocks `ids` [n], every slot valid, hold keys [n, bs, D] (a codec's packed blocks, decoded)."""
        k = keys.to(SUMMARY_DTYPE)
        self.summary[ids] = torch.stack([k.amin(1), k.amax(1)], dim=1)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Blocks dst got src's contents (copy-on-write, swap-in): their summaries too."""
        self.summary[dst] = self.summary[src]
