"""Strict JSON for every file thinconv reads (manifests, config.json, safetensors headers, indexes):
no duplicate keys, no NaN / Infinity, no number that overflows (1e400 would parse as inf), no
integer longer than 20 digits (beyond u64: nothing it could size is valid, and Python's digit
limit would otherwise turn into a traceback), and no nesting deeper than the stack allows.

Every problem is raised as `error(message)`: one line naming `where`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

MAX_INT_DIGITS = 20


class _Bad(ValueError):
    pass


def finite_number(text: str) -> float:
    """json's parse_float hook: a number that overflows to inf is refused (ValueError)."""
    value = float(text)
    if not math.isfinite(value):
        raise _Bad(f"number {text[:30]} overflows (JSON numbers must be finite)")
    return value


def bounded_integer(text: str) -> int:
    """json's parse_int hook: integers beyond MAX_INT_DIGITS digits are refused (ValueError)."""
    digits = text.lstrip("-")
    if len(digits) > MAX_INT_DIGITS:
        raise _Bad(f"an integer of {len(digits)} digits is out of range")
    return int(text)


# For loaders with their own messages: pass these to json.loads, and catch ValueError.
HOOKS = {"parse_float": finite_number, "parse_int": bounded_integer}


def loads(text: str, where: str, error: Callable[[str], Exception]) -> Any:
    """Parse `text` strictly; any problem raises `error(f"{where}: …")`."""

    def pairs(items: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in items:
            if key in out:  # json would silently keep the last: which one is meant?
                raise _Bad(f"duplicate key {key!r}")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise _Bad(f"{name} is not allowed (JSON numbers must be finite)")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant, **HOOKS)
    except _Bad as e:
        raise error(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:
        raise error(f"{where}: invalid JSON: {str(e).split(';')[0]}") from None
