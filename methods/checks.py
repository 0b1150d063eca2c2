"""Validation of a method's options: one-line UserErrors that name the option, the bad value and the valid choices."""
from __future__ import annotations

from typing import Any

from kvbench.errors import UserError


def check_choice(method: str, option: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"invalid {method}.{option}={value!r}: choose one of {', '.join(choices)}")


def check_int(method: str, option: str, value: Any, lo: int, hi: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UserError(f"invalid {method}.{option}={value!r}: expected an integer {rng}")


def check_float(method: str, option: str, value: Any, lo: float, hi: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= float(value) <= hi
    if not ok:
        raise UserError(f"invalid {method}.{option}={value!r}: expected a number in [{lo}, {hi}]")


def check_bool(method: str, option: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise UserError(f"invalid {method}.{option}={value!r}: expected true or false")
