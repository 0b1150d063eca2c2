"""What a speed benchmark computed, checked before it prints a speed: a figure is work done, never a cache's.

A prefill speed is prompt tokens computed over the time they took. With prefix caching on (the engine's `auto` turns
it on for the full cache), a repeated prompt is served from the cache and a "speed" over the whole prompt would time
a lookup. Every bench states the tokens it computed and calls `require_computed` before printing a figure.
"""
from __future__ import annotations


class CachedWorkError(RuntimeError):
    """A bench was about to print a speed for work that a cache did instead."""


def require_computed(computed: int, expected: int, what: str) -> int:
    """Return `computed` (prompt tokens the engine actually prefilled); raise CachedWorkError when it is fewer than
    `expected` (the prompt tokens the figure claims), naming both counts."""
    if computed < expected:
        raise CachedWorkError(
            f"{what}: the engine computed {computed} of {expected} prompt tokens (a cache served the rest); "
            "refusing to print a speed for work it did not do (run the engine with prefix_caching=False)")
    return computed
