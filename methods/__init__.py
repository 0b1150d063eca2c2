"""Compression methods, one module each, registered by their config name (`method=<name>`).

Storage codecs (KIVI, KVQuant, int8, fp8) are not methods: they are chosen with `quant=<codec>`
(`method=kivi` is shorthand for `method=full quant=kivi`, see kvbench.spec.resolve_storage).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from kvbench.errors import UserError
from kvbench.methods.base import METHODS, Method, register_method
from kvbench.spec import check_budget, check_compression

__all__ = ["Method", "register_method", "build_method", "available_methods", "METHODS"]


def available_methods() -> list[str]:
    return METHODS.names()


def build_method(name: str, budget: Optional[int] = None, *, seed: Optional[int] = None,
                 compression_ratio: Optional[float] = None, **options: Any) -> Method:
    """Instantiate a method by name. `budget` and `compression_ratio` are the top-level knobs (one of them);
    `seed` (the run's top-level seed) reaches methods with a `seed` option left null. Unknown names and options
    raise UserError naming the choices; budget and compression_ratio are checked by kvbench.spec."""
    cls = METHODS.get(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - {"budget", "compression_ratio"}
    bad = sorted(set(options) - fields)
    if bad:
        valid = ", ".join(sorted(fields)) or "(none)"
        raise UserError(f"unknown option method.{bad[0]} for method {name!r}; valid options are {valid}")
    if "seed" in fields and options.get("seed") is None and seed is not None:
        options["seed"] = seed
    compression_ratio = check_compression(check_budget(budget), compression_ratio)
    try:
        if compression_ratio is not None:
            options["compression_ratio"] = compression_ratio
        return cls(budget=budget, **options)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for method {name!r}: {exc}") from None
