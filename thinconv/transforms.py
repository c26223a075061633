"""Registered Python transforms, for the odd architecture a declarative recipe cannot express.

A recipe names one per role glob (`[transforms] "attn_q.weight" = "my_fix"`). A transform gets a
page's rows in source order and returns rows of the same shape (any float dtype):

    from thinconv.transforms import register_transform

    @register_transform("negate")
    def negate(rows, *, name, start, end, model):
        return -rows.astype("float32")

Transforms come from this module's registry, from installed packages that declare an entry
point in the group `thinconv.transforms` (name = transform name, value = "module:function"), or
from a `transforms.py` beside the TOML files of a user recipe folder. Such a file is Python: it
runs when the folder is named by `--recipes DIR` or $THINCONV_RECIPES, and only then — name only
folders you trust, as you would a script you run. None of the built-in families needs a transform.

A transform changes the tensor's values, so the converter records the tensor in
`validation.lossy` ("transform NAME") and `thinconv check` judges the archive by the float bounds.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
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


_LOADED: set[Path] = set()


def load_user_transforms(folder: Path) -> None:
    """Run `folder/transforms.py` once (its @register_transform calls register into this registry)."""
    path = (folder / "transforms.py").resolve()
    if path in _LOADED or not path.is_file():
        return
    _LOADED.add(path)
    spec = importlib.util.spec_from_file_location(f"thinconv_user_transforms_{len(_LOADED)}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # user code: report it in one line, as any bad recipe input
        raise RecipeError(f"{path}: loading the recipe folder's transforms failed ({type(e).__name__}: {e})") from None


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
                          f"thinconv.transforms.register_transform in a transforms.py beside the recipe, or a "
                          f"'thinconv.transforms' entry point)") from None
