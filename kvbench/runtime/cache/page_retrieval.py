"""Query-aware page retrieval in decode steps: the runtime's "read only these blocks" operation.

A method that retrieves (methods/quest.py) sets `page_retrieval` on itself (a `PageRetrieval`): per layer, how many
pages each query head picks (0: the layer reads every block). The cache then keeps per-block key summaries
(block_summaries.py), and every decode step (one query per sequence) of such a layer scores each block of each
(sequence, kv-head) table with the upper bound of q.k over its keys,

    bound[s, hq, j] = sum_d max(q_d * kmin[j, d], q_d * kmax[j, d])            (Quest, Tang et al. 2024)

keeps each query head's top `pages` blocks, and gives the attention kernel, per (sequence, kv-head), the union of
its query heads' blocks as a compacted table (ascending table order, so a partly filled last block stays last and
the usual `lengths` describe it). Every query head of the kv-head attends over that union: a kv-head's blocks are
read once for its whole GQA group. Prefill chunks and multi-token steps (speculative verification) read every
block. The selection runs on the device, with no host read (`select_pages`); the fused CPU decode step does the
same in C (backends/cpu/csrc/page_select.c).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.runtime.cache.kv_geometry import SCRATCH_BLOCK


@dataclass(frozen=True)
class PageRetrieval:
    """What a retrieval method asks of decode attention: `pages[layer]` top blocks per query head (0: dense).
    per_head: each query head attends over its own blocks only (the kernels then get one table per query head);
    False: every query head of a kv-head attends over the union of the group's blocks (one table per kv-head)."""

    pages: tuple[int, ...]
    per_head: bool = False

    def pages_for(self, layer: int) -> int:
        return self.pages[layer] if layer < len(self.pages) else 0


def page_bounds(q: torch.Tensor, summary: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k over each block's keys: q [S, Hq, D], summary [N, 2, D] (min, max; fp16 or fp32),
    tables [S, H, MB] ->
    [S, Hq, MB] fp32 (every column of the tables, valid or not)."""
    S, Hq, D = q.shape
    H, MB = tables.shape[1], tables.shape[2]
    G = Hq // H
    summ = summary[tables.reshape(-1).to(torch.int64)].view(S, H, MB, 2, D).float()
    qg = q.float().reshape(S, H, G, D)
    pos, neg = qg.clamp(min=0), qg.clamp(max=0)  # q_d > 0 takes the max key, q_d < 0 the min
    bound = pos @ summ[..., 1, :].transpose(-1, -2) + neg @ summ[..., 0, :].transpose(-1, -2)  # [S, H, G, MB]
    return bound.reshape(S, Hq, MB)


def select_pages(q: torch.Tensor, summary: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                 block_size: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks a decode step reads: each query head's top `pages` blocks by `page_bounds` (of the blocks its
    table holds), united per kv-head. q [S, Hq, D]; tables [S, H, MB] int32; lengths [S, H]. Returns (tables
    [S, H, U] int32, lengths [S, H] int64): the selected blocks in table order, U = min(G * pages, MB) columns
    (entries past a row's selection name SCRATCH_BLOCK; its length ends before them). No shape depends on a
    value."""
    S, Hq, _ = q.shape
    H, MB = tables.shape[1], tables.shape[2]
    G = Hq // H
    k = min(pages, MB)
    col = torch.arange(MB, device=tables.device)
    held = col[None, None, :] * block_size < lengths[..., None]  # [S, H, MB] blocks the table holds
    bound = page_bounds(q, summary, tables).view(S, H, G, MB)
    bound = bound.masked_fill(~held[:, :, None, :], float("-inf"))
    top = bound.topk(k, dim=-1).indices  # [S, H, G, k]
    chosen = torch.zeros(S, H, MB, dtype=torch.bool, device=tables.device)
    chosen.scatter_(-1, top.reshape(S, H, G * k), True)
    chosen &= held  # a table of fewer than `pages` blocks: topk also named empty columns
    U = min(G * k, MB)
    # chosen columns first, in ascending order: key MB - col for chosen, 0 otherwise
    order = torch.where(chosen, MB - col, 0).topk(U, dim=-1).indices  # [S, H, U]
    n_chosen = chosen.sum(-1, keepdim=True)  # [S, H, 1]
    # columns past a row's selection name the scratch block (zeros): a kernel that reads a table's whole width
    # (the torch reference) touches no block that was not selected
    sel_tables = torch.where(torch.arange(U, device=tables.device) < n_chosen,
                             tables.gather(-1, order.to(torch.int64)), SCRATCH_BLOCK).to(torch.int32)
    block_len = (lengths[..., None] - col * block_size).clamp(0, block_size)  # [S, H, MB] tokens in each block
    sel_lengths = (block_len * chosen).sum(-1)
    return sel_tables, sel_lengths.to(torch.int64)



def select_pages_per_head(q: torch.Tensor, summary: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                          block_size: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query head's own top `pages` blocks (as select_pages, without the union): (tables [S, Hq, k] int32 in
    table order, padded with SCRATCH_BLOCK; lengths [S, Hq] int64), k = min(pages, MB). A kernel given these reads
    them as Hq tables of one query head each."""
    S, Hq, _ = q.shape
    H, MB = tables.shape[1], tables.shape[2]
    G = Hq // H
    k = min(pages, MB)
    col = torch.arange(MB, device=tables.device)
    held = (col[None, None, :] * block_size < lengths[..., None])  # [S, H, MB]
    held_q = held[:, :, None, :].expand(S, H, G, MB).reshape(S, Hq, MB)
    bound = page_bounds(q, summary, tables).masked_fill(~held_q, float("-inf"))  # [S, Hq, MB]
    chosen = torch.zeros(S, Hq, MB, dtype=torch.bool, device=tables.device)
    chosen.scatter_(-1, bound.topk(k, dim=-1).indices, True)
    chosen &= held_q
    order = torch.where(chosen, MB - col, 0).topk(k, dim=-1).indices  # [S, Hq, k] chosen columns ascending
    tables_q = tables[:, :, None, :].expand(S, H, G, MB).reshape(S, Hq, MB)
    sel_tables = torch.where(torch.arange(k, device=tables.device) < chosen.sum(-1, keepdim=True),
                             tables_q.gather(-1, order), SCRATCH_BLOCK).to(torch.int32)
    lengths_q = lengths[:, :, None].expand(S, H, G).reshape(S, Hq)
    block_len = (lengths_q[..., None] - col * block_size).clamp(0, block_size)  # [S, Hq, MB]
    return sel_tables, (block_len * chosen).sum(-1).to(torch.int64)


def kv_head_selection(tables: torch.Tensor, lengths: torch.Tensor, num_kv_heads: int,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each kv-head's query heads read in a per-query-head selection (select_pages_per_head's tables
    [S, Hq, k], lengths [S, Hq]), each block once: (tables [S, H, G * k] int32, the distinct blocks first, then
    SCRATCH_BLOCK; lengths [S, H] = distinct blocks x block_size). What the read figures count: a block two query
    heads of one kv-head pick is one block of that kv-head's cache. No host read."""
    S, Hq, k = tables.shape
    H = num_kv_heads
    G = Hq // H
    big = torch.iinfo(torch.int32).max
    held = torch.arange(k, device=tables.device) < ((lengths + block_size - 1) // block_size)[..., None]
    ids = torch.where(held, tables.to(torch.int32), big).view(S, H, G * k).sort(-1).values
    dup = torch.zeros_like(ids, dtype=torch.bool)
    dup[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(dup, big, ids).sort(-1).values  # distinct ids first
    n = (ids != big).sum(-1)  # [S, H]
    return torch.where(ids == big, SCRATCH_BLOCK, ids).to(torch.int32), (n * block_size).to(torch.int64)
