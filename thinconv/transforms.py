"""Registered Python transforms, for the odd architecture a declarative recipe cannot express.

A recipe names one per role glob (`[transforms] "attn_q.weight" = "my_fix"`). A transform gets a
page's rows in source order and returns rows of the same shape (any float dtype):

    from thinconv.transforms import register_transform

    @register_transform("negate")
    def negate(rows, *, name, start, end, model):
        return -rows.astype("float32")

Transforms come from this module's registry or from installed packages that declare an entry
point in the group `thinconv.transforms` (name = transform name, value = "module:function").
None of the built-in families needs one.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable, Protocol

import numpy as np

from thinconv.errors import RecipeError


class Transform(Protocol):
    def __call__(self, rows: np.ndarray, *, name: str, start: int, end: int, model: dict) -> np.ndarray: ...


_REGISTRY: dict[str, Transform] = {}


def register_transform(name: str) -> Callable[[Transform], Transform]:
    """Decorator: make `fn` available to recipes under `name`."""

    def add(fn: Transform) -> Transform:
        _REGISTRY[name] = fn
        return fn

    return add


def get_transform(name: str, where: str) -> Transform:
    if name not in _REGISTRY:
        for ep in entry_points(group="thinconv.transforms"):
            if ep.name == name:
                _REGISTRY[name] = ep.load()
                break
    try:
        return _REGISTRY[name]
    except KeyError:
        raise RecipeError(f"{where}: transform {name!r} is not registered (register it with "
                          f"thinconv.transforms.register_transform or a 'thinconv.transforms' entry point)") from None
