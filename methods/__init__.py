"""Compression methods, one module each, registered by their config name (`method=<name>`).

The contract a method is written against, all importable from here:
  ScorerMethod        one `score(obs) -> [H_kv, T]` (higher = keep); selection, budgets and timing inherited
  BlockScorerMethod   the same with whole blocks evicted while decoding (PagedEviction's rules)
  ScorerWrapper       a behaviour over any registered scorer (head-adaptive budgets, CriticalKV)
  EvictionMethod      the driver (when to evict) for a method that selects in its own way
  Method              the hook protocol's defaults (a method that never evicts)
  Observation         what a scorer reads (kvbench.runtime.contract)
  register_method     `@register_method("name")`: reachable as `method=name` (plus conf/method/name.yaml)
Storage codecs (KIVI, KVQuant, int8, fp8) are not methods: they are chosen with `quant=<codec>`
(`method=kivi` is shorthand for `method=full quant=kivi`, see kvbench.run.spec.resolve_storage).
"""
from __future__ import annotations

from kvbench.methods.base import METHODS, Method, available_methods, build_method, register_method
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.scorer import ScorerMethod
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.methods.paged_eviction import BlockScorerMethod
from kvbench.runtime.contract import Observation

__all__ = ["Method", "EvictionMethod", "ScorerMethod", "BlockScorerMethod", "ScorerWrapper", "Observation",
           "register_method", "build_method", "available_methods", "METHODS"]
