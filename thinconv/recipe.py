"""Recipes: declarative per-family TOML files, and the registry that finds them.

A recipe says which HF architectures it handles, how source tensor names map onto canonical
THIN names (spec §2.2), which source tensors to ignore, the family's config quirks
(`[metadata]`, see `thinconv.modelmeta.MetadataRules`) and which roles may be quantized.
Families share through `extends`. The engine (`thinconv.plan`) is generic.

Discovery order (later wins on a name or architecture clash): built-in recipes, each folder
in $THINCONV_RECIPES (os.pathsep-separated), each `--recipes DIR`.
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from thinconv.errors import RecipeError
from thinconv.format import dtypes, spec
from thinconv.modelmeta import MetadataRules

LAYER = "{L}"
# Each recipe becomes a sub-command, so it cannot take a built-in command's name.
RESERVED_NAMES = frozenset({"inspect", "verify", "pack", "unpack", "convert", "recipes", "recipe", "check", "run",
                            "batch"})
_LAYER_RE = r"(0|[1-9][0-9]*)"
_RECIPE_KEYS = {"name", "description", "extends", "architectures", "tensors", "ignore", "metadata",
                "quantizable", "keep", "transforms"}
# Tables that `extends` merges key by key (docs/adding-an-architecture.md); other keys replace.
_TABLE_KEYS = ("tensors", "metadata", "keep", "transforms")


@dataclass(frozen=True)
class TensorRule:
    """One canonical tensor and the source pattern(s) it is read from (concatenated along dim 0)."""

    canonical: str  # e.g. "blk.{L}.attn_q.weight"
    sources: tuple[str, ...]  # e.g. ("model.layers.{L}.self_attn.q_proj.weight",)

    @property
    def role(self) -> str:
        return spec.split_name(self.canonical.replace(LAYER, "0"))[0]

    @property
    def per_layer(self) -> bool:
        return LAYER in self.canonical


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    architectures: tuple[str, ...]
    tensors: tuple[TensorRule, ...]
    ignore: tuple[str, ...]
    metadata: MetadataRules
    quantizable: tuple[str, ...]  # role globs
    keep: tuple[tuple[str, str], ...]  # (role glob, dtype) defaults, like --keep
    transforms: tuple[tuple[str, str], ...]  # (role glob, registered transform name)
    path: str  # where it was loaded from, for messages
    chain: tuple[str, ...] = field(default=())  # the extends chain, most derived first

    def is_quantizable(self, role: str) -> bool:
        return any(fnmatch.fnmatchcase(role, g) for g in self.quantizable)

    def match_source(self, source_name: str) -> str | None:
        """The canonical name a source tensor maps to, or None."""
        for rule in self.tensors:
            for pattern in rule.sources:
                m = _compile(pattern).fullmatch(source_name)
                if m:
                    return rule.canonical.replace(LAYER, m.group(1)) if rule.per_layer else rule.canonical
        return None

    def is_ignored(self, source_name: str) -> bool:
        return any(_compile(p).fullmatch(source_name) for p in self.ignore)

    def sources_for(self, canonical: str) -> list[str] | None:
        """The source names a canonical tensor is read from, or None if the recipe has no rule."""
        role, layer = spec.split_name(canonical)
        for rule in self.tensors:
            if rule.role == role and rule.per_layer == (layer is not None):
                return [s.replace(LAYER, str(layer)) for s in rule.sources]
        return None


_COMPILED: dict[str, re.Pattern] = {}


def _compile(pattern: str) -> re.Pattern:
    rx = _COMPILED.get(pattern)
    if rx is None:
        rx = _COMPILED[pattern] = re.compile(re.escape(pattern).replace(re.escape(LAYER), _LAYER_RE))
    return rx


# ---------------------------------------------------------------- loading

def _read_toml(path: Path | Any, label: str) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{label}: invalid TOML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{label}: cannot read ({e})") from None


def _merge(base: dict, child: dict) -> dict:
    """`extends`: tables merge key by key (a tensor mapped to "" is removed); lists and scalars replace."""
    out = dict(base)
    for key, value in child.items():
        if key in _TABLE_KEYS and isinstance(value, dict) and isinstance(base.get(key), dict):
            merged = {**base[key], **value}
            out[key] = {k: v for k, v in merged.items() if v != ""}
        elif key == "ignore" and isinstance(value, list) and isinstance(base.get(key), list):
            out[key] = base[key] + [v for v in value if v not in base[key]]
        else:
            out[key] = value
    out.pop("extends", None)
    return out


def _build(raw: dict, label: str, chain: tuple[str, ...]) -> Recipe:
    def err(key: str, msg: str) -> RecipeError:
        return RecipeError(f"{label}: {key}: {msg}")

    unknown = sorted(set(raw) - _RECIPE_KEYS)
    if unknown:
        raise err(unknown[0], f"unknown key (expected one of {', '.join(sorted(_RECIPE_KEYS))})")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
        raise err("name", f"expected a lowercase identifier, got {name!r}")
    archs = raw.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs)):
        raise err("architectures", "expected a non-empty list of HF class names (e.g. ['LlamaForCausalLM'])")
    table = raw.get("tensors")
    if not isinstance(table, dict) or not table:
        raise err("tensors", "expected a table of canonical name = source pattern(s)")
    rules = []
    for canonical, src in table.items():
        sources = [src] if isinstance(src, str) else src
        if not (isinstance(sources, list) and sources and all(isinstance(s, str) and s for s in sources)):
            raise err(f"tensors.{canonical!r}", "expected a source name pattern or a list of them")
        role, layer = spec.split_name(canonical.replace(LAYER, "0"))
        per_layer = LAYER in canonical
        if role not in spec.ROLES or per_layer != (role in spec.LAYER_ROLES) or role == "rope_freqs" or \
                (per_layer and canonical != f"blk.{LAYER}.{role}"):
            raise err(f"tensors.{canonical!r}", "not a canonical THIN name (layer tensors are 'blk.{L}.<role>', "
                                               f"roles: {', '.join(spec.LAYER_ROLES)}; globals: token_embd.weight, "
                                               "output_norm.weight, output.weight)")
        for s in sources:
            if (LAYER in s) != per_layer or s.count(LAYER) > 1:
                raise err(f"tensors.{canonical!r}", f"source pattern {s!r} must contain {{L}} exactly when the "
                                                   "canonical name does")
        rules.append(TensorRule(canonical, tuple(sources)))
    ignore = raw.get("ignore", [])
    if not (isinstance(ignore, list) and all(isinstance(s, str) and s for s in ignore)):
        raise err("ignore", "expected a list of source name patterns")
    quantizable = raw.get("quantizable", [])
    if not (isinstance(quantizable, list) and all(isinstance(s, str) for s in quantizable)):
        raise err("quantizable", "expected a list of role globs")
    for g in quantizable:
        if not any(fnmatch.fnmatchcase(r, g) for r in spec.MATRIX_ROLES):
            raise err("quantizable", f"{g!r} matches no matrix role ({', '.join(spec.MATRIX_ROLES)})")
        bad = [r for r in spec.ROLES if fnmatch.fnmatchcase(r, g) and r not in spec.MATRIX_ROLES]
        if bad:
            raise err("quantizable", f"{g!r} matches {bad[0]!r}, which stays f32 (only matrices are quantized)")
    keep = raw.get("keep", {})
    if not isinstance(keep, dict) or not all(isinstance(v, str) for v in keep.values()):
        raise err("keep", "expected a table of role glob = dtype")
    for g, dt in keep.items():
        if dt not in dtypes.ARCHIVE_DTYPES:
            raise err(f"keep.{g!r}", f"unknown dtype {dt!r}")
    transforms = raw.get("transforms", {})
    if not isinstance(transforms, dict) or not all(isinstance(v, str) for v in transforms.values()):
        raise err("transforms", "expected a table of role glob = registered transform name")
    meta = raw.get("metadata", {})
    if not isinstance(meta, dict):
        raise err("metadata", "expected a table")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise err("description", "expected a string")
    return Recipe(name=name, description=description, architectures=tuple(archs), tensors=tuple(rules),
                  ignore=tuple(ignore), metadata=MetadataRules.from_table(meta, f"{label}: metadata"),
                  quantizable=tuple(quantizable), keep=tuple(keep.items()), transforms=tuple(transforms.items()),
                  path=label, chain=chain)


@dataclass
class Registry:
    """Every recipe found, by name; `for_architecture` picks one from config.architectures."""

    recipes: dict[str, Recipe]
    shadowed: list[str]  # "name from A overrides B" notes for `thinconv recipes`

    def get(self, name: str) -> Recipe:
        try:
            return self.recipes[name]
        except KeyError:
            raise RecipeError(f"no recipe named {name!r} (available: {', '.join(sorted(self.recipes))})") from None

    def for_architecture(self, architectures: Iterable[str], where: str = "config.json") -> Recipe:
        archs = list(architectures)
        for arch in archs:
            for recipe in reversed(list(self.recipes.values())):  # user recipes (added last) win
                if arch in recipe.architectures:
                    return recipe
        supported = sorted({a for r in self.recipes.values() for a in r.architectures})
        raise RecipeError(f"{where}: architecture {', '.join(archs) or '(none)'} is not handled by any recipe "
                          f"(supported: {', '.join(supported)}); add one with --recipes DIR or $THINCONV_RECIPES "
                          f"(see docs/adding-an-architecture.md)")


def recipe_dirs(extra: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """User recipe folders in priority order (lowest first): $THINCONV_RECIPES, then `extra`."""
    env = os.environ.get("THINCONV_RECIPES", "")
    dirs = [Path(p) for p in env.split(os.pathsep) if p] + [Path(p) for p in extra]
    for d in dirs:
        if not d.is_dir():
            raise RecipeError(f"recipe folder {d} does not exist")
    return dirs


def load_registry(extra_dirs: Iterable[str | os.PathLike] = (), extra_files: Iterable[str | os.PathLike] = ()) -> Registry:
    """Load built-in recipes, then user folders, then single recipe files (highest priority);
    resolve `extends`; validate each recipe."""
    raw: dict[str, tuple[dict, str]] = {}
    shadowed: list[str] = []
    builtin = importlib.resources.files("thinconv.builtin_recipes")
    sources: list[tuple[Any, str]] = [(f, f"recipes/{f.name}") for f in sorted(builtin.iterdir(), key=lambda f: f.name)
                                      if f.name.endswith(".toml")]
    for d in recipe_dirs(extra_dirs):
        sources += [(f, str(f)) for f in sorted(d.glob("*.toml"))]
    for f in extra_files:
        if not Path(f).is_file():
            raise RecipeError(f"{f}: recipe file not found")
        sources.append((Path(f), str(f)))
    for f, label in sources:
        data = _read_toml(f, label)
        name = data.get("name")
        if not isinstance(name, str):
            raise RecipeError(f"{label}: name: missing (every recipe has a lowercase name)")
        if name in RESERVED_NAMES:
            raise RecipeError(f"{label}: name: {name!r} is a thinconv command; choose another name")
        if name in raw:
            shadowed.append(f"{name}: {label} overrides {raw[name][1]}")
            del raw[name]  # re-inserted last: a later source also wins on the architectures it claims
        raw[name] = (data, label)

    resolved: dict[str, Recipe] = {}

    def resolve(name: str, stack: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
        data, label = raw[name]
        parent = data.get("extends")
        if parent is None:
            return data, (name,)
        if not isinstance(parent, str) or parent not in raw:
            raise RecipeError(f"{label}: extends: no recipe named {parent!r}")
        if parent in stack:
            raise RecipeError(f"{label}: extends: cycle {' -> '.join(stack + (parent,))}")
        base, chain = resolve(parent, stack + (parent,))
        return _merge(base, data), (name,) + chain

    for name, (_, label) in raw.items():
        merged, chain = resolve(name, (name,))
        resolved[name] = _build(merged, label, chain)
    claimed: dict[str, str] = {}
    for r in resolved.values():
        for a in r.architectures:
            if a in claimed and claimed[a] != r.name and not _extends(resolved, r.name, claimed[a]):
                shadowed.append(f"{a}: recipe {r.name} ({r.path}) takes it over from {claimed[a]}")
            claimed[a] = r.name
    return Registry(resolved, shadowed)


def _extends(resolved: dict[str, Recipe], child: str, parent: str) -> bool:
    return parent in resolved[child].chain
