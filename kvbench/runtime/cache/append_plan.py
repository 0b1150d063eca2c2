"""Where the new tokens of one forward step go: the plan `PagedKVCache.prepare_append` returns and every layer's
write and attention read (kvbench.runtime.cache.kv_cache, kv_layout, quantized_reading).

Its own module so that the layouts, which the cache mixes in, read it without importing the cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch


@dataclass
class AppendPlan:
    """Where the new tokens of one forward step go, for every layer and head."""

    slots: torch.Tensor  # [S] int64 sequence slots
    write_index: torch.Tensor  # [S, L, H, Q] int64 flat row in k_pool.view(-1, D)
    tables: torch.Tensor  # [S, L, H, nb] int32 snapshot after allocation (nb = most blocks any table holds)
    lengths: torch.Tensor  # [S, L, H] int64 after the append
    query_positions: torch.Tensor  # [S, Q] int64
    # [S, L, H, nb*bs] int32 snapshot of key positions after the append, read through `positions`; or a function
    # that takes the snapshot at that first read (the CPU decode kernels never read it: an O(context) copy saved)
    key_positions: torch.Tensor | Callable[[], torch.Tensor]
    slot_list: list[int]
    host_lengths: Optional[np.ndarray] = field(default=None, repr=False)  # [S, L, H] lengths, on the host
    max_position: Optional[int] = None  # the largest query position, when the caller knows it on the host

    @property
    def positions(self) -> torch.Tensor:
        """[S, L, H, nb*bs] int32: the original position of every key slot of the step's tables (-1: none)."""
        if callable(self.key_positions):
            self.key_positions = self.key_positions()
        return self.key_positions

    def table_lengths(self, i: int, layer: int) -> list[int]:
        """lengths[i, layer] (one per kv-head) as Python ints, from the host copy the cache keeps (no device
        read). Exact for a layer until its own hook evicts: layers never change each other's tables."""
        if self.host_lengths is None:
            self.host_lengths = self.lengths.cpu().numpy()
        return self.host_lengths[i, layer].tolist()

    def host_lengths_array(self) -> np.ndarray:
        """lengths [S, L, H] from the host copy (no device read; see table_lengths)."""
        if self.host_lengths is None:
            self.host_lengths = self.lengths.cpu().numpy()
        return self.host_lengths
