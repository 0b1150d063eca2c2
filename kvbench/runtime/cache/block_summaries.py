"""Per-block key summaries: the element-wise min and max of the keys each block holds (Quest's page metadata).

    summary: [num_blocks, 2, head_dim] fp16     summary[b, 0] <= min over b's valid slots, summary[b, 1] >= max

Stored in fp16 (Quest's kernels keep page metadata in the model's fp16 too) and rounded outward: a key's fp16 min is
rounded toward -inf and its max toward +inf, so for any query the bound computed from them is still >= q.k of every
key of the block (exact where the keys are fp16 or bf16 values in fp16's range; a key beyond 65504 gives an infinite
bound, which always selects its block). Half the bytes of fp32 summaries: a decode step reads every summary of every
retrieving layer, 1/32 of an fp32 block's K/V.

A block is one (sequence, layer, kv-head) table's page, so a block's summary is one kv-head's page summary. The
cache keeps them only when a method asks (`PagedKVCache.enable_page_retrieval`), and only for the blocks of the
layers that retrieve pages (not the layers the method leaves dense, nor sliding-window layers, which never read
them): appends to those layers update them as keys are written (slot 0 of a block starts it afresh), operations that
move keys between slots recompute the touched tables from the pool, and a block's summary goes with it (copied with
a copy-on-write or a swap; a block id handed out again starts afresh at its slot 0). The fused CPU decode step
updates them in C as it writes each key of a retrieving layer (csrc/decode_layer.c), with the same rule.

They are memory: the pool tags each block of a retrieving layer as it is allocated and counts its summary with its
K/V (block_pool.py, kv_accounting.py); a block of any other layer costs its K/V only. The tensor itself stays
pool-sized, one row per block id, because the pool has one free list for every layer: an id holds a dense layer's
block now and a retrieving layer's later, and the readers (the torch selection, the C bound loop of
csrc/page_select.c, swap) index the summaries by block id. Keeping rows for the tagged blocks only would need an
id -> row map in each of them; the untagged blocks' rows are allocated but neither written nor read.
"""
from __future__ import annotations

import torch

from kvbench.runtime.cache.kv_geometry import SCRATCH_BLOCK

SUMMARY_DTYPE = torch.float16
_NEG_TINY = -32767  # int16 bits of the fp16 just below -0 (0x8001)


def round_down_half(x: torch.Tensor) -> torch.Tensor:
    """x (fp32 or narrower) as fp16 rounded toward -inf: the greatest fp16 <= x (-65504 clamps to -inf below)."""
    x = x.float()
    h = x.to(torch.float16)
    bits = h.view(torch.int16)
    # the next fp16 toward -inf: a positive one loses an ulp, a negative one gains one, +0 steps to -tiny
    lower = torch.where(bits > 0, bits - 1, torch.where(bits == 0, torch.full_like(bits, _NEG_TINY), bits + 1))
    return torch.where(h.float() > x, lower, bits).view(torch.float16)


def round_up_half(x: torch.Tensor) -> torch.Tensor:
    """x (fp32 or narrower) as fp16 rounded toward +inf: the least fp16 >= x."""
    return round_down_half(-x.float()).neg()


class BlockSummaries:
    """min / max keys of every block of a pool (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, head_dim: int, device: torch.device):
        self.block_size, self.head_dim = block_size, head_dim
        self.summary = torch.zeros(num_blocks, 2, head_dim, dtype=SUMMARY_DTYPE, device=device)  # [N, 2, D]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block's summary occupies (min and max, fp16)."""
        return 2 * self.head_dim * self.summary.element_size()

    def update(self, rows: torch.Tensor, k: torch.Tensor) -> None:
        """Keys k [n, D] were written at flat pool rows `rows` [n] (block = row // block_size): fold them into their
        blocks' summaries; a block written at its slot 0 starts afresh (its earlier contents belong to whoever held
        the id before). Touches the written blocks only: O(n log n), whatever the pool's size (a scatter-reduce
        into the pool-sized summary costs time in proportion to the pool on CPU: seconds per step on a large one)."""
        bs, D = self.block_size, self.head_dim
        n = rows.numel()
        if n == 0:
            return
        blocks, order = torch.sort(rows // bs, stable=True)  # [n]: the rows of one block side by side
        lo, hi = round_down_half(k[order]), round_up_half(k[order])  # [n, D]
        fresh = (rows[order] % bs == 0).to(torch.int32)  # [n] the row starts its block afresh
        # one local segment per written block (no shape depends on a value: no host read)
        starts = torch.ones(n, dtype=torch.bool, device=rows.device)
        starts[1:] = blocks[1:] != blocks[:-1]
        seg = torch.cumsum(starts, 0) - 1  # [n] segment of each row, 0 .. segments-1
        seg_block = torch.full((n,), SCRATCH_BLOCK, dtype=blocks.dtype, device=rows.device)
        seg_block.scatter_(0, seg, blocks)  # [n] each segment's block; unused segments: the scratch block
        seg_fresh = torch.zeros(n, dtype=torch.int32, device=rows.device).index_add_(0, seg, fresh) > 0
        idx = seg[:, None].expand(-1, D).contiguous()  # [n, D] (an expanded index takes a slow CPU path)
        seg_lo = torch.full((n, D), float("inf"), dtype=SUMMARY_DTYPE, device=rows.device)
        seg_lo.scatter_reduce_(0, idx, lo, "amin")  # [n, D] min of the segment's new keys
        seg_hi = torch.full((n, D), float("-inf"), dtype=SUMMARY_DTYPE, device=rows.device)
        seg_hi.scatter_reduce_(0, idx, hi, "amax")
        held = self.summary[seg_block]  # [n, 2, D] the blocks' summaries so far (earlier slots count)
        keep = ~seg_fresh[:, None]
        seg_lo = torch.where(keep, torch.minimum(seg_lo, held[:, 0]), seg_lo)
        seg_hi = torch.where(keep, torch.maximum(seg_hi, held[:, 1]), seg_hi)
        # unused segments all write the scratch block, whose summary nothing reads
        self.summary.index_copy_(0, seg_block, torch.stack([seg_lo, seg_hi], dim=1))

    def recompute(self, keys: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor) -> None:
        """Summaries of every block of the tables `table` [H, MB] (lengths [H]) from their keys [H, MB, bs, D] as
        attention reads them (a codec's decoded), slots past a table's length excluded (after an operation that
        moved keys between slots or re-stored them)."""
        bs = self.block_size
        nb = int(((lengths + bs - 1) // bs).max()) if lengths.numel() else 0
        if nb == 0:
            return
        ids = table[:, :nb].to(torch.int64)  # [H, nb]
        keys = keys[:, :nb].float()  # [H, nb, bs, D]
        slot = torch.arange(nb * bs, device=ids.device).view(1, nb, bs, 1)
        valid = slot < lengths.view(-1, 1, 1, 1)
        mn = torch.where(valid, keys, float("inf")).amin(2)  # [H, nb, D]
        mx = torch.where(valid, keys, float("-inf")).amax(2)
        held = (torch.arange(nb, device=ids.device)[None, :] * bs) < lengths[:, None]  # [H, nb] blocks in use
        self.summary[ids[held]] = torch.stack([round_down_half(mn[held]), round_up_half(mx[held])], dim=1)

    def set_full_blocks(self, ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Blocks `ids` [n], every slot valid, hold keys [n, bs, D] (a codec's packed blocks, decoded)."""
        k = keys.float()
        self.summary[ids] = torch.stack([round_down_half(k.amin(1)), round_up_half(k.amax(1))], dim=1)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Blocks dst got src's contents (copy-on-write, swap-in): their summaries too."""
        self.summary[dst] = self.summary[src]
