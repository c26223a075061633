"""Recipes: declarative per-family TOML files, and the registry that finds them.

A recipe says which HF architectures it handles, how source tensor names map onto canonical
THIN names (spec §2.2), which source tensors to ignore, the family's config quirks
(`[metadata]`, see `thinconv.modelmeta.MetadataRules`) and which roles may be quantized.
Families share through `extends`. The engine (`thinconv.plan`) is generic.

Discovery order (later wins on a name or architecture clash): built-in recipes, each folder
in $THINCONV_RECIPES (os.pathsep-separated), each `--recipes DIR`.
"""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import importlib.resources
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from thinconv import expr
from thinconv.errors import ConversionError, RecipeError, listed, shown
from thinconv.family import FamilyRules
from thinconv.format import dtypes, spec
from thinconv.modelmeta import MetadataRules
from thinconv.transforms import load_user_transforms

LAYER = "{L}"
EXPERT = "{E}"
HEAD = "{H}"
# {H} stands for every attention head whose rows a tensor holds, in order: the query heads of the
# query-side roles, the key/value heads of the key- and value-side roles (per-head source tensors,
# e.g. StableLM's q_layernorm.norms.{h}.weight, concatenated on dim 0).
HEAD_COUNTS = {"attn_q.weight": "num_attention_heads", "attn_q.bias": "num_attention_heads",
               "attn_q_norm.weight": "num_attention_heads", "attn_k.weight": "num_kv_heads",
               "attn_k.bias": "num_kv_heads", "attn_k_norm.weight": "num_kv_heads", "attn_v.weight": "num_kv_heads",
               "attn_v.bias": "num_kv_heads"}
# Each recipe becomes a sub-command, so it cannot take a built-in command's name.
RESERVED_NAMES = frozenset({"inspect", "verify", "pack", "unpack", "convert", "recipes", "recipe", "check", "run",
                            "batch", "export", "upload"})
_INDEX_RE = r"(0|[1-9][0-9]*)"
# The recipe author's guide ships beside the built-in recipes (package thinconv.builtin_recipes), so
# an installed wheel has it; errors name its installed path (`guide_path`).
GUIDE_NAME = "adding-an-architecture.md"
_RECIPE_KEYS = {"name", "description", "extends", "architectures", "tensors", "ignore", "metadata",
                "quantizable", "keep", "transforms", "model", "config"}
# Tables that `extends` merges key by key (the recipe guide, GUIDE_NAME); other keys replace.
_TABLE_KEYS = ("tensors", "metadata", "keep", "transforms", "model")


@dataclass(frozen=True)
class SourceSpec:
    """One way to read a canonical tensor: source name patterns concatenated along dim 0, a
    pattern with {E} standing for every expert in order (stacked), one with {H} for every head
    of the tensor in order (concatenated; see HEAD_COUNTS), and optionally `rows`, an expression
    giving the [a, b) row ranges of the one pattern to read (addendum §4: NAME[a:b])."""

    patterns: tuple[str, ...]
    rows: ast.Expression | None = None

    def names(self, layer: int | None, model: dict, where: str, heads: int | None = None) -> list[str]:
        """The manifest `source` entries for one tensor (slices spelled NAME[a:b]); `heads` is
        the number of heads {H} stands for."""
        out = []
        experts = ((model.get("moe") or {}).get("num_experts") or 0)
        for p in self.patterns:
            p = p.replace(LAYER, str(layer)) if layer is not None else p
            if HEAD in p:
                out += [p.replace(HEAD, str(h)) for h in range(heads or 0)]
                continue
            out += [p.replace(EXPERT, str(e)) for e in range(experts)] if EXPERT in p else [p]
        if self.rows is None:
            return out
        ranges = expr.evaluate(self.rows, model, expr.BASE_FUNCTIONS, f"{where}: rows")
        if not (isinstance(ranges, list) and ranges and all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                and 0 <= r[0] < r[1] for r in ranges)):
            raise ConversionError(f"{where}: rows must give a non-empty list of [a, b] ranges with 0 ≤ a < b, "
                                  f"got {shown(ranges)}")
        return [f"{out[0]}[{a}:{b}]" for a, b in ranges]


@dataclass(frozen=True)
class TensorRule:
    """One canonical tensor and the ways it may be read (the first whose tensors all exist wins:
    e.g. the Hub's per-expert tensors, or the fused expert tensors transformers holds in memory)."""

    canonical: str  # e.g. "blk.{L}.attn_q.weight"
    alternatives: tuple[SourceSpec, ...]

    @property
    def role(self) -> str:
        return spec.split_name(self.canonical.replace(LAYER, "0"))[0]

    @property
    def per_layer(self) -> bool:
        return LAYER in self.canonical

    @property
    def sources(self) -> tuple[str, ...]:
        """Every source pattern of every alternative."""
        return tuple(p for alt in self.alternatives for p in alt.patterns)


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
    family: FamilyRules = field(default=FamilyRules())  # [model] expressions, [config] accounting
    # User recipe files of the chain (most derived first): (recipe name, file name, sha256); () for a built-in.
    files: tuple[tuple[str, str, str], ...] = field(default=())
    shadows: tuple[str, ...] = field(default=())  # the built-in recipes a user recipe stands in for

    @property
    def user(self) -> bool:
        """Whether the recipe itself comes from a user file (--recipes DIR, $THINCONV_RECIPES)."""
        return bool(self.files) and self.files[0][0] == self.name

    def is_quantizable(self, role: str) -> bool:
        return any(fnmatch.fnmatchcase(role, g) for g in self.quantizable)

    def match_source(self, source_name: str) -> list[str]:
        """The canonical names whose rules name this source tensor (several when it is sliced)."""
        out = []
        for rule in self.tensors:
            for pattern in rule.sources:
                m = _compile(pattern).fullmatch(source_name)
                if m:
                    name = rule.canonical.replace(LAYER, m.group("L")) if rule.per_layer else rule.canonical
                    if name not in out:
                        out.append(name)
        return out

    def expert_index(self, source_name: str) -> int | None:
        """The expert a source tensor is, when a rule's {E} pattern names it (else None)."""
        for rule in self.tensors:
            for pattern in rule.sources:
                m = _compile(pattern).fullmatch(source_name) if EXPERT in pattern else None
                if m:
                    return int(m.group("E"))
        return None

    def is_ignored(self, source_name: str) -> bool:
        return any(_compile(p).fullmatch(source_name) for p in self.ignore)

    def rule_for(self, canonical: str) -> TensorRule | None:
        role, layer = spec.split_name(canonical)
        return next((r for r in self.tensors if r.role == role and r.per_layer == (layer is not None)), None)

    def alternatives_for(self, canonical: str, model: dict | None = None) -> list[list[str]] | None:
        """Each alternative's source entries for a canonical tensor (None: the recipe has no rule)."""
        rule = self.rule_for(canonical)
        if rule is None:
            return None
        layer = spec.split_name(canonical)[1]
        where = f"{self.path}: tensors.{rule.canonical!r}"
        heads = (model or {}).get(HEAD_COUNTS.get(rule.role, ""))
        return [alt.names(layer, model or {}, where, heads) for alt in rule.alternatives]

    def sources_for(self, canonical: str, model: dict | None = None) -> list[str] | None:
        """The first alternative's source entries for a canonical tensor (None: no rule)."""
        alternatives = self.alternatives_for(canonical, model)
        return None if alternatives is None else alternatives[0]


_COMPILED: dict[str, re.Pattern] = {}


def _compile(pattern: str) -> re.Pattern:
    rx = _COMPILED.get(pattern)
    if rx is None:
        text = re.escape(pattern).replace(re.escape(LAYER), f"(?P<L>{_INDEX_RE})", 1)
        text = text.replace(re.escape(LAYER), "(?P=L)")
        text = text.replace(re.escape(EXPERT), f"(?P<E>{_INDEX_RE})", 1).replace(re.escape(EXPERT), "(?P=E)")
        text = text.replace(re.escape(HEAD), _INDEX_RE)
        rx = _COMPILED[pattern] = re.compile(text)
    return rx


# ---------------------------------------------------------------- loading

def _read_toml(path: Path | Any, label: str) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{label}: invalid TOML ({e})") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise RecipeError(f"{label}: invalid TOML (nested too deeply)") from None
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
        elif key == "config" and isinstance(value, dict) and isinstance(base.get(key), dict):
            old = base[key]
            understood = list(old.get("understood", [])) + [k for k in value.get("understood", [])
                                                            if k not in old.get("understood", [])]
            out[key] = {**old, **value, "understood": understood,
                        "require": {**old.get("require", {}), **value.get("require", {})}}
        else:
            out[key] = value
    out.pop("extends", None)
    return out


def _rule(canonical: str, value: Any, err: Callable[[str, str], RecipeError]) -> TensorRule:
    """One [tensors] entry: "NAME", ["A", "B"] (concatenated), {source = …, rows = "…"}, or a list
    of such tables (alternatives)."""
    where = f"tensors.{canonical!r}"
    role, _ = spec.split_name(canonical.replace(LAYER, "0"))
    per_layer = LAYER in canonical
    if role not in spec.ROLES or per_layer != (role in spec.LAYER_ROLES) or role.startswith("rope_freqs") or \
            (per_layer and canonical != f"blk.{LAYER}.{role}"):
        raise err(where, "not a canonical THIN name (layer tensors are 'blk.{L}.<role>', roles: "
                         f"{', '.join(spec.LAYER_ROLES)}; globals: token_embd.weight, output_norm.weight, "
                         "output_norm.bias, output.weight)")
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        alternatives = [_spec(v, where, err) for v in value]
    elif isinstance(value, dict):
        alternatives = [_spec(value, where, err)]
    else:
        alternatives = [_spec({"source": value}, where, err)]
    for alt in alternatives:
        for pat in alt.patterns:
            if (LAYER in pat) != per_layer or pat.count(LAYER) > 1:
                raise err(where, f"source pattern {pat!r} must contain {{L}} exactly when the canonical name does")
            if EXPERT in pat and (not spec.ROLE[role].experts or pat.count(EXPERT) > 1):
                raise err(where, f"source pattern {pat!r}: {{E}} (once) stands for the experts of an expert tensor "
                                 f"(ffn_*_exps) only")
            if HEAD in pat and (role not in HEAD_COUNTS or pat.count(HEAD) > 1):
                raise err(where, f"source pattern {pat!r}: {{H}} (once) stands for the heads of a per-head tensor "
                                 f"({', '.join(HEAD_COUNTS)}) only")
    return TensorRule(canonical, tuple(alternatives))


def _spec(table: dict, where: str, err: Callable[[str, str], RecipeError]) -> SourceSpec:
    unknown = sorted(set(table) - {"source", "rows"})
    if unknown:
        raise err(where, f"unknown key {unknown[0]!r} (a source table has source and rows)")
    src = table.get("source")
    patterns = [src] if isinstance(src, str) else src
    if not (isinstance(patterns, list) and patterns and all(isinstance(p, str) and p for p in patterns)):
        raise err(where, "expected a source name pattern or a list of them")
    rows = table.get("rows")
    if rows is not None and (len(patterns) != 1 or EXPERT in patterns[0] or HEAD in patterns[0]):
        raise err(where, "rows slice one source pattern (without {E} or {H})")
    return SourceSpec(tuple(patterns), expr.parse(rows, f"{where}: rows") if rows is not None else None)


def _build(raw: dict, label: str, chain: tuple[str, ...]) -> Recipe:
    def err(key: str, msg: str) -> RecipeError:
        return RecipeError(f"{label}: {key}: {msg}")

    unknown = sorted(set(raw) - _RECIPE_KEYS)
    if unknown:
        raise err(unknown[0], f"unknown key (expected one of {', '.join(sorted(_RECIPE_KEYS))})")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
        raise err("name", f"expected a lowercase identifier, got {shown(name)}")
    archs = raw.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs)):
        raise err("architectures", "expected a non-empty list of HF class names (e.g. ['LlamaForCausalLM'])")
    table = raw.get("tensors")
    if not isinstance(table, dict) or not table:
        raise err("tensors", "expected a table of canonical name = source pattern(s)")
    rules = [_rule(canonical, src, err) for canonical, src in table.items()]
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
    family = FamilyRules.from_tables(raw.get("model", {}), raw.get("config", {}), label)
    return Recipe(name=name, description=description, architectures=tuple(archs), tensors=tuple(rules),
                  ignore=tuple(ignore), metadata=MetadataRules.from_table(meta, f"{label}: metadata"),
                  quantizable=tuple(quantizable), keep=tuple(keep.items()), transforms=tuple(transforms.items()),
                  path=label, chain=chain, family=family)


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

    def select(self, config: dict, recipe_name: str | None, label: str) -> Recipe:
        """The recipe for a checkpoint: by config.json's architectures, or the named one if it handles them."""
        archs = config.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise RecipeError(f"{label}/config.json: field 'architectures' must be a list of class names, got "
                              f"{str(archs)[:60]}")
        if recipe_name is None:
            return self.for_architecture(archs, f"{label}/config.json")
        recipe = self.get(recipe_name)
        if not set(map(str, archs)) & set(recipe.architectures):
            raise RecipeError(f"{label}/config.json: architecture {listed(archs) or '(none)'} is not handled "
                              f"by recipe {recipe.name!r} ({listed(recipe.architectures)}); try `thinconv convert`")
        return recipe

    def for_architecture(self, architectures: Iterable[str], where: str = "config.json") -> Recipe:
        archs = list(architectures)
        for arch in archs:
            for recipe in reversed(list(self.recipes.values())):  # user recipes (added last) win
                if arch in recipe.architectures:
                    return recipe
        supported = sorted({a for r in self.recipes.values() for a in r.architectures})
        raise RecipeError(f"{where}: architecture {listed(archs, 2) or '(none)'} is not handled by any recipe "
                          f"(`thinconv recipes` lists the {len(supported)} supported); add one with --recipes DIR "
                          f"or $THINCONV_RECIPES (guide: {guide_path()})")


def guide_path() -> str:
    """Where the installed recipe guide is: a file path a user can open (the wheel installs the
    package unpacked), or, from a zipped install, its resource name inside the package."""
    resource = importlib.resources.files("thinconv.builtin_recipes") / GUIDE_NAME
    return str(resource) if isinstance(resource, Path) else f"thinconv/builtin_recipes/{GUIDE_NAME} in the package"


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
    builtin = importlib.resources.files("thinconv.builtin_recipes")
    sources: list[tuple[Any, str]] = [(f, f"recipes/{f.name}") for f in sorted(builtin.iterdir(), key=lambda f: f.name)
                                      if f.name.endswith(".toml")]
    builtin_count = len(sources)
    for d in recipe_dirs(extra_dirs):
        sources += [(f, str(f)) for f in sorted(d.glob("*.toml"))]
        load_user_transforms(d)
    for f in extra_files:
        if not Path(f).is_file():
            raise RecipeError(f"{f}: recipe file not found")
        sources.append((Path(f), str(f)))
    raw, shadowed, user_files, builtin_raw = _read_sources(sources, builtin_count)
    builtin_archs = _builtin_architectures(builtin_raw)
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
        recipe = _build(merged, label, chain)
        files = tuple(user_files[n] for n in chain if n in user_files)
        if files:  # a built-in recipe no user file touches keeps files=(): its archives keep their bytes
            recipe = replace(recipe, files=files,
                             shadows=_shadowed_builtins(recipe, builtin_archs) if name in user_files else ())
        resolved[name] = recipe
    claimed: dict[str, str] = {}
    for r in resolved.values():
        for a in r.architectures:
            if a in claimed and claimed[a] != r.name and not _extends(resolved, r.name, claimed[a]):
                shadowed.append(f"{a}: recipe {r.name} ({r.path}) takes it over from {claimed[a]}")
            claimed[a] = r.name
    return Registry(resolved, shadowed)


def _read_sources(sources: list[tuple[Any, str]], builtin_count: int) -> tuple[dict, list[str], dict, dict]:
    """Each source's TOML by recipe name (a later source replaces an earlier one of that name),
    the override notes, (file name, sha256) of every user recipe file by recipe name, and the
    built-in recipes' TOML by name (the first `builtin_count` sources)."""
    raw: dict[str, tuple[dict, str]] = {}
    shadowed: list[str] = []
    user_files: dict[str, tuple[str, str, str]] = {}
    builtin_raw: dict[str, dict] = {}
    for k, (f, label) in enumerate(sources):
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
        if k < builtin_count:
            builtin_raw[name] = data
        else:
            try:
                digest = hashlib.sha256(Path(f).read_bytes()).hexdigest()
            except OSError as e:
                raise RecipeError(f"{label}: cannot read ({e.strerror or e})") from None
            user_files[name] = (name, Path(f).name, digest)
    return raw, shadowed, user_files, builtin_raw


def _builtin_architectures(builtin_raw: dict[str, dict]) -> dict[str, tuple[str, ...]]:
    """Each built-in recipe's architectures (its own list, or the one it extends)."""
    out: dict[str, tuple[str, ...]] = {}
    for name in builtin_raw:
        seen, data = {name}, builtin_raw[name]
        while "architectures" not in data and data.get("extends") in builtin_raw and data["extends"] not in seen:
            seen.add(data["extends"])
            data = builtin_raw[data["extends"]]
        archs = data.get("architectures", [])
        out[name] = tuple(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else ()
    return out


def _shadowed_builtins(recipe: Recipe, builtin_archs: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """What a user recipe stands in for: the built-in recipe of its name, and the built-ins that
    claim one of its architectures (a conversion picks the user recipe for those)."""
    out = [f"the built-in recipe {recipe.name}"] if recipe.name in builtin_archs else []
    for name, archs in builtin_archs.items():
        common = [a for a in recipe.architectures if a in archs]
        if common and name != recipe.name:
            out.append(f"the built-in recipe {name} for {', '.join(common)}")
    return tuple(out)


def _extends(resolved: dict[str, Recipe], child: str, parent: str) -> bool:
    return parent in resolved[child].chain
