"""Compression methods, one module each, registered by their config name."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

from kvbench.errors import UserError
from methods.base import METHODS, Method, register_method

__all__ = ["Method", "register_method", "build_method", "available_methods", "METHODS"]


def _load_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def available_methods() -> list[str]:
    _load_all()
    return sorted(METHODS)


def build_method(name: str, budget: int | None = None, **options: Any) -> Method:
    """Instantiate a method by name; unknown names and options raise UserError naming the choices."""
    choices = available_methods()
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of: {', '.join(choices)}")
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    bad = sorted(set(options) - fields)
    if bad:
        raise UserError(f"unknown option(s) {', '.join(bad)} for method {name!r}; valid: {', '.join(sorted(fields - {'budget'}))}")
    try:
        return cls(budget=budget, **options)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for method {name!r}: {exc}") from None
