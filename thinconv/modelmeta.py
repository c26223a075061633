"""The manifest `model` section (spec §2.1), read from config.json the way transformers 5 reads it.

Family differences (head_dim default, which sliding-window rule applies, bias / qk-norm flags)
come from :class:`MetadataRules`, which a recipe's ``[metadata]`` table fills in. Defaults that
every supported family shares in transformers 5 (rope_theta 10000, rms_norm_eps 1e-6, hidden_act
silu, untied embeddings, ...) are applied here when a key is absent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from thinconv import family as fam
from thinconv.errors import ConversionError, RecipeError, UsageError, shown
from thinconv.format import schema
from thinconv.format.manifest import validate_model

_CONFIG = "config.json"
_GENERATION = "generation_config.json"
_SLIDING_RULES = ("none", "always", "use_sliding_window")
_ROPE_LAYOUTS = schema.BY_PATH["rope.layout"].choices

# Accepted keys of a source's rope parameters per type, as transformers 5 validates them. A key
# outside these is refused: transformers ignores it with a warning, but it may mean a RoPE variant
# (e.g. `mrope_section`) that the manifest cannot express.
_ROPE_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {  # type -> (required, optional)
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "yarn": (
        frozenset({"factor"}),
        frozenset(
            {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"}
        ),
    ),
    "longrope": (
        frozenset({"short_factor", "long_factor"}),
        frozenset({"original_max_position_embeddings", "attention_factor", "factor"}),
    ),
    "llama3": (
        frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
        frozenset({"original_max_position_embeddings"}),
    ),
}
# Keys the rope object carries elsewhere (theta, rotary_dim) or that name the type.
_ROPE_META_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# transformers' standardize_rope_params fills this in for these types.
_NEEDS_ORIGINAL_MAX = frozenset({"llama3", "yarn", "longrope"})
_INT_ROPE_KEYS = frozenset({"original_max_position_embeddings"})
_FLOAT_ROPE_KEYS = frozenset(
    {"factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
     "mscale_all_dim"}
)


@dataclass(frozen=True)
class MetadataRules:
    """Per-family quirks; a recipe's [metadata] TOML table maps onto these fields."""

    head_dim_default: int | None = None  # None → hidden_size // num_attention_heads (Llama, Mistral); Qwen3: 128
    sliding_window: str = "none"  # "none" (Llama) | "always" (Mistral) | "use_sliding_window" (Qwen2, Qwen3)
    qkv_bias: bool | str = False  # a bool, or the name of a boolean config key (e.g. "attention_bias")
    o_bias: bool | str = False
    qk_norm: bool = False
    rope_per_layer_type: bool = False  # rope_parameters may be {"full_attention": {…}, "sliding_attention": {…}}
    rope_source_layout: str = "half"  # how the checkpoint pairs rotary dims: HF's rotate_half, or "interleaved" (Cohere)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_rule(field.name, getattr(self, field.name), "MetadataRules")

    @classmethod
    def from_table(cls, table: dict, where: str) -> MetadataRules:
        """Rules from a recipe's [metadata] table; unknown keys or wrong types → RecipeError."""
        if not isinstance(table, Mapping):
            raise RecipeError(f"{where}: must be a table, got {shown(table)}")
        names = [field.name for field in dataclasses.fields(cls)]
        for key, value in table.items():
            if key not in names:
                raise RecipeError(f"{where}: unknown key {key!r} (expected one of: {', '.join(names)})")
            _check_rule(key, value, where)
        return cls(**table)


def _check_rule(name: str, value: Any, where: str) -> None:
    if name == "head_dim_default":
        if value is not None and (not _is_int(value) or value <= 0):
            raise RecipeError(f"{where}: 'head_dim_default' must be a positive integer, got {shown(value)}")
    elif name == "sliding_window":
        if value not in _SLIDING_RULES:
            choices = ", ".join(_SLIDING_RULES)
            raise RecipeError(f"{where}: 'sliding_window' must be one of {choices}, got {shown(value)}")
    elif name in ("qkv_bias", "o_bias"):
        if not isinstance(value, bool) and not (isinstance(value, str) and value):
            raise RecipeError(f"{where}: {name!r} must be a boolean or a config key name, got {shown(value)}")
    elif name in ("qk_norm", "rope_per_layer_type") and not isinstance(value, bool):
        raise RecipeError(f"{where}: {name!r} must be a boolean, got {shown(value)}")
    elif name == "rope_source_layout" and value not in _ROPE_LAYOUTS:
        raise RecipeError(f"{where}: 'rope_source_layout' must be one of {', '.join(_ROPE_LAYOUTS)}, got {shown(value)}")


def read_model_metadata(config: dict, generation_config: dict | None, **kwargs: Any) -> dict:
    """The manifest `model` object (spec §2.1 and the addendum), read the way transformers 5 reads
    the config; any config key nothing accounts for is a ConversionError (see `read_model`)."""
    return read_model(config, generation_config, **kwargs)[0]


def read_model(
    config: dict,
    generation_config: dict | None,
    *,
    architecture: str,
    rules: MetadataRules,
    rope_layout: str = "half",
    family: fam.FamilyRules = fam.FamilyRules(),
    weights_dtype: str = "bf16",
    allowed_keys: tuple[str, ...] = (),
    check_keys: bool = True,
    consumed: tuple[str, ...] = (),
    max_layers: int | None = None,
    max_elements: int | None = None,
) -> tuple[dict, list[str]]:
    """(the `model` object, the config keys nothing accounts for): the Llama reading below, refined
    by the recipe's `[model]` expressions (`family`), then every config key accounted for
    (`thinconv.family`; with `check_keys`, unaccounted keys raise). `weights_dtype` is the
    checkpoint's weight dtype (expressions see it as `dtype`)."""
    if not isinstance(config, Mapping):
        raise ConversionError(f"{_CONFIG}: must be a JSON object")
    if generation_config is not None and not isinstance(generation_config, Mapping):
        raise ConversionError(f"{_GENERATION}: must be a JSON object")
    if not isinstance(architecture, str) or not architecture:
        raise RecipeError(f"recipe: architecture must be a non-empty string, got {shown(architecture)}")
    if rope_layout not in _ROPE_LAYOUTS:
        raise UsageError(f"rope layout must be one of {', '.join(_ROPE_LAYOUTS)}, got {shown(rope_layout)}")
    seen = fam.RecordingConfig(config)
    seen.read.update(consumed)  # keys the caller reads itself (e.g. quantization_config)
    if max_layers is not None:  # bound the per-layer work by the tensors present, before doing any
        layers = _positive_int(seen, "num_hidden_layers")
        if layers > max_layers:
            raise ConversionError(f"{_CONFIG}: field 'num_hidden_layers' is {layers}, but the checkpoint holds only "
                                  f"{max_layers} tensors")
    model = _base_model(seen, generation_config, architecture=architecture, rules=rules, rope_layout=rope_layout)
    model = fam.apply(model, seen, family, recipe=architecture, weights_dtype=weights_dtype)
    model = schema.canonical_model(_normalized(model))
    problems = validate_model(model).lines()
    if not problems:
        _check_dims_fit(model, max_elements)
        from thinconv.rope import check_rope  # numpy: see _attention_factor

        try:
            check_rope(model)
        except ConversionError as e:
            rope = model["rope"]
            kind = (rope.get("scaling") or {}).get("type", "none")
            raise ConversionError(f"{_CONFIG}: fields 'rope_theta' / 'rope_parameters' (theta {shown(rope['theta'])}, "
                                  f"scaling {shown(kind)}): {e}") from None
    if problems:
        raise ConversionError(f"recipe {architecture}: the model section it computes is invalid: "
                              + "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    if check_keys:
        problem = config_keys_problem(config, fam.unaccounted_keys(seen, family, allowed_keys), architecture)
        if problem:
            raise ConversionError(problem)
    return model, fam.unaccounted_keys(seen, family, allowed_keys)


def _check_dims_fit(model: dict, max_elements: int | None) -> None:
    """head_dim is bounded by the largest tensor present (q_proj alone holds head_dim × heads ×
    hidden values): refused before the RoPE tables it sizes are computed. (Other dimensions size
    nothing before the tensors' shapes are compared with them.)"""
    head_dim = model.get("head_dim")
    if max_elements is not None and isinstance(head_dim, int) and head_dim > max_elements:
        raise ConversionError(f"{_CONFIG}: head_dim is {head_dim}, but the largest tensor of the checkpoint holds "
                              f"only {max_elements} values")


def config_keys_problem(config: Mapping[str, Any], keys: list[str], recipe: str) -> str | None:
    """The one-line refusal for config keys nothing accounts for (None when there are none)."""
    if not keys:
        return None
    values = ", ".join(f"{k!r} = {shown(config[k])}" for k in keys[:3])
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    return (f"config.json: {values}{more}: not understood by recipe {recipe} and may change the computation; use a "
            f"recipe that handles {'it' if len(keys) == 1 else 'them'}, or pass --allow-config-key {keys[0]} to take "
            f"responsibility")


def _normalized(model: dict) -> dict:
    """Generic rules applied after the recipe's expressions: a window no layer uses is null, and a
    mixture of experts with no sparse layer is no mixture."""
    att = model["attention"]
    if att.get("sliding_window") is None or "sliding" not in att.get("layer_types", []):
        if att.get("sliding_window") is None and "sliding" in att.get("layer_types", []):
            raise ConversionError("config.json: layer_types names sliding layers but sliding_window is null "
                                  "(transformers refuses this config too)")
        att["sliding_window"], att["layer_types"] = None, ["full"] * model["num_layers"]
    moe = model.get("moe")
    if isinstance(moe, dict) and isinstance(moe.get("layers"), list) and not any(moe["layers"]):
        model["moe"] = None
    return model


def _base_model(config: Mapping, generation_config: dict | None, *, architecture: str, rules: MetadataRules,
                rope_layout: str) -> dict:
    """The Llama reading of config.json (with the family's [metadata] rules)."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ConversionError(
            f"{_CONFIG}: field 'architectures' must be a non-empty list of names, got {shown(architectures)}"
        )

    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    layers = _positive_int(config, "num_hidden_layers")
    max_pos = _positive_int(config, "max_position_embeddings")
    vocab = _positive_int(config, "vocab_size")
    # null: one KV head per attention head (every family's __post_init__); absent: the same, as
    # LlamaConfig does (MistralConfig / Qwen2Config's class defaults 8 / 32 are sizes, not a rule)
    kv_heads = heads if config.get("num_key_value_heads") is None else _positive_int(config, "num_key_value_heads")
    if heads % kv_heads:
        raise ConversionError(
            f"{_CONFIG}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}"
        )
    head_dim = _head_dim(config, hidden, heads, rules)

    hidden_act = config.get("hidden_act", "silu")
    if not isinstance(hidden_act, str) or hidden_act not in fam.ACTIVATIONS:
        raise ConversionError(f"{_CONFIG}: field 'hidden_act' is {shown(hidden_act)}, an activation mlp.activation cannot "
                              f"say ({', '.join(sorted(fam.ACTIVATIONS))})")
    eps = _positive_number(config, "rms_norm_eps", 1e-6)

    rope, rope_sliding = _rope_per_layer_type(config, head_dim=head_dim, max_pos=max_pos, layout=rope_layout,
                                              nested=rules.rope_per_layer_type)
    sliding_window, layer_types = _sliding(config, layers, rules.sliding_window)

    return {
        "architecture": architecture,
        "source_architecture": architectures[0],
        "hidden_size": hidden,
        "intermediate_size": _positive_int(config, "intermediate_size"),
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": _bool(config, "tie_word_embeddings", False),
        "norm": {"type": "rmsnorm", "eps": eps},
        "mlp": {"type": "gated", "activation": fam.ACTIVATIONS[hidden_act], "bias": _bool(config, "mlp_bias", False)},
        "attention": {
            "qkv_bias": _flag(config, rules.qkv_bias),
            "o_bias": _flag(config, rules.o_bias),
            "qk_norm": rules.qk_norm,
            "sliding_window": sliding_window,
            "layer_types": layer_types,
            "scale": float(head_dim**-0.5),
        },
        "rope": {**rope, "sliding": rope_sliding},
        "special_tokens": _special_tokens(config, generation_config or {}, vocab),
    }


def _head_dim(config: Mapping[str, Any], hidden: int, heads: int, rules: MetadataRules) -> int:
    if config.get("head_dim") is not None:
        return _positive_int(config, "head_dim")
    if rules.head_dim_default is not None:
        return rules.head_dim_default
    if hidden % heads:
        raise ConversionError(
            f"{_CONFIG}: hidden_size {hidden} is not divisible by num_attention_heads {heads} "
            "and there is no 'head_dim'"
        )
    return hidden // heads


def _rope_per_layer_type(config: Mapping[str, Any], *, head_dim: int, max_pos: int, layout: str,
                         nested: bool) -> tuple[dict, dict | None]:
    """(rope, rope.sliding): a flat rope_parameters gives one RoPE; transformers 5's per-layer-type
    form {"full_attention": {…}, "sliding_attention": {…}} (families that allow it) gives both."""
    params = config.get("rope_parameters")
    if not nested or config.get("rope_scaling") or not isinstance(params, Mapping) or \
            not any(isinstance(v, Mapping) for v in params.values()):
        return _rope(config, head_dim=head_dim, max_pos=max_pos, layout=layout), None
    unknown = sorted(set(params) - set(fam.LAYER_TYPES))
    if unknown:
        raise ConversionError(f"{_CONFIG}: rope_parameters: unknown layer type {unknown[0]!r}")
    ropes = {}
    for kind in ("full_attention", "sliding_attention"):
        # not {**config, …}: that would read (and so account for) every key of config.json
        sub = _Overlay(config, {"rope_parameters": params.get(kind) or {}, "rope_scaling": None})
        ropes[kind] = _rope(sub, head_dim=head_dim, max_pos=max_pos, layout=layout)
    s = ropes["sliding_attention"]
    return ropes["full_attention"], {"theta": s["theta"], "scaling": s["scaling"], "attention_factor": s["attention_factor"]}


class _Overlay(Mapping):
    """`base` with some keys replaced (a None value: absent). Every other key is looked up in `base`
    only when asked for, so a RecordingConfig base records exactly the keys read."""

    def __init__(self, base: Mapping[str, Any], over: dict[str, Any]):
        self._base, self._over = base, over

    def __getitem__(self, key: str) -> Any:
        if key in self._over:
            if self._over[key] is None:
                raise KeyError(key)
            return self._over[key]
        return self._base[key]

    def __contains__(self, key: object) -> bool:
        return self._over[key] is not None if key in self._over else key in self._base

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self):
        yield from (k for k, v in self._over.items() if v is not None)
        yield from (k for k in self._base if k not in self._over)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _rope(config: Mapping[str, Any], *, head_dim: int, max_pos: int, layout: str) -> dict:
    """The `rope` object. Mirrors RotaryEmbeddingConfigMixin: legacy `rope_scaling` wins over
    `rope_parameters`; `rope_theta` inside the parameters wins over the top-level key."""
    source_key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    for key in ("rope_parameters", "rope_theta", "partial_rotary_factor"):
        config.get(key)  # transformers folds these together; whichever wins below, all are accounted for
    params = config.get(source_key) or {}
    if not isinstance(params, Mapping):
        raise ConversionError(f"{_CONFIG}: field {source_key!r} must be an object or null, got {shown(params)}")
    where = f"{_CONFIG}: {source_key}"
    if any(isinstance(value, Mapping) for value in params.values()):
        raise ConversionError(f"{where}: per-layer-type RoPE parameters are not supported")

    theta_where = where if "rope_theta" in params else _CONFIG
    theta = params["rope_theta"] if "rope_theta" in params else config.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ConversionError(f"{theta_where}: field 'rope_theta' must be a positive number, got {shown(theta)}")

    factor_src = params if "partial_rotary_factor" in params else config
    partial = factor_src.get("partial_rotary_factor")
    rotary_dim = head_dim
    if partial is not None:
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise ConversionError(f"{_CONFIG}: field 'partial_rotary_factor' must be in (0, 1], got {shown(partial)}")
        rotary_dim = int(head_dim * partial)  # transformers truncates, as here
    if rotary_dim <= 0 or rotary_dim % 2:
        how = f"head_dim {head_dim}" + ("" if partial is None else f" × partial_rotary_factor {partial}")
        raise ConversionError(f"{_CONFIG}: rotary dimension {rotary_dim} ({how}) must be even and positive")

    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        raise ConversionError(f"{where}: unsupported RoPE type {kind!r} (supported: {', '.join(_ROPE_KEYS)})")
    required, optional = _ROPE_KEYS[kind]
    own = {key: value for key, value in params.items() if key not in _ROPE_META_KEYS}
    for key in sorted(own):
        if key not in required | optional:
            raise ConversionError(f"{where}: key {key!r} is not a parameter of RoPE type {kind!r}")
    for key in sorted(required - own.keys()):
        raise ConversionError(f"{where}: RoPE type {kind!r} needs {key!r}")

    scaling = None
    if kind != "default":
        scaling = {"type": kind}
        for key, value in own.items():
            if value is None and (key not in required or (key == "factor" and kind in ("yarn", "longrope"))):
                continue  # a null optional key means its default; yarn's null factor is resolved below
            scaling[key] = _rope_value(key, value, where)
        if kind in _NEEDS_ORIGINAL_MAX:
            # A top-level value wins (transformers' Phi3 rule, re-applied when the RoPE is built);
            # else the parameters' own; else max_position_embeddings.
            key = "original_max_position_embeddings"
            if key in config:
                original = _rope_value(key, config[key], _CONFIG)
            else:
                original = _rope_value(key, params.get(key, max_pos), where)
            scaling[key] = original
            if "factor" not in scaling and kind != "llama3":
                # transformers: a null factor means max_position_embeddings / original; written out
                # so that a runtime need not know the rule
                scaling["factor"] = max_pos / original

    return {
        "theta": float(theta),
        "rotary_dim": rotary_dim,
        "layout": layout,
        "scaling": scaling,
        "attention_factor": _attention_factor(scaling, max_pos),
    }


def _rope_value(key: str, value: Any, where: str) -> Any:
    if key in _INT_ROPE_KEYS:
        if not _is_int(value) or value <= 0:
            raise ConversionError(f"{where}: '{key}' must be a positive integer, got {shown(value)}")
        return value
    if key == "truncate":
        if not isinstance(value, bool):
            raise ConversionError(f"{where}: 'truncate' must be a boolean, got {shown(value)}")
        return value
    if key in ("short_factor", "long_factor"):
        if not isinstance(value, list) or not all(_is_number(item) for item in value):
            raise ConversionError(f"{where}: {key!r} must be a list of numbers, got {shown(value)}")
        return [float(item) for item in value]
    if not _is_number(value):
        raise ConversionError(f"{where}: {key!r} must be a finite number, got {shown(value)}")
    return float(value)


def _sliding(config: Mapping[str, Any], layers: int, rule: str) -> tuple[int | None, list[str]]:
    """(sliding_window, layer_types) as each transformers 5 config class applies them."""
    window: int | None = None
    kinds = ["full"] * layers
    if rule == "always":
        # MistralConfig: the window (default 4096) applies to every layer; layer_types is ignored.
        window = _window(config)
        config.get("layer_types")  # accounted for: ignored, as transformers ignores it
        kinds = ["sliding"] * layers
    elif rule == "use_sliding_window":
        # Qwen2Config / Qwen3Config: no window unless use_sliding_window; then layer_types, or
        # every layer from max_window_layers on.
        if _bool(config, "use_sliding_window", False):
            window = _window(config)
        else:
            config.get("sliding_window")  # read (and nulled), as Qwen2Config does without use_sliding_window
        explicit = config.get("layer_types")
        config.get("max_window_layers")  # accounted for: only used when layer_types is absent
        if explicit is not None:
            kinds = _layer_types(explicit, layers)
        else:
            first = _non_negative_int(config, "max_window_layers", 28)
            kinds = ["sliding" if i >= first else "full" for i in range(layers)]
    if window is None or "sliding" not in kinds:
        return None, ["full"] * layers
    return window, kinds


def _window(config: Mapping[str, Any]) -> int | None:
    if "sliding_window" not in config:
        return 4096  # the MistralConfig / Qwen2Config / Qwen3Config default
    if config["sliding_window"] is None:
        return None
    return _positive_int(config, "sliding_window")


def _layer_types(value: Any, layers: int) -> list[str]:
    names = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding"}
    if not isinstance(value, list) or len(value) != layers:
        raise ConversionError(f"{_CONFIG}: field 'layer_types' must list {layers} layer types, got {shown(value)}")
    for item in value:
        if item not in names:
            raise ConversionError(
                f"{_CONFIG}: field 'layer_types' entries must be full_attention or sliding_attention, got {shown(item)}"
            )
    return [names[item] for item in value]


def _special_tokens(config: Mapping[str, Any], generation: Mapping[str, Any], vocab: int) -> dict:
    eos: list[int] = []
    for source, name in ((config, _CONFIG), (generation, _GENERATION)):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            token = _token_id(token, name, "eos_token_id", vocab)
            if token not in eos:
                eos.append(token)
    return {
        "bos": _config_then_generation(config, generation, "bos_token_id", vocab),
        "eos": eos,
        "pad": _config_then_generation(config, generation, "pad_token_id", vocab),
    }


def _config_then_generation(
    config: Mapping[str, Any], generation: Mapping[str, Any], key: str, vocab: int
) -> int | None:
    if config.get(key) is not None:
        return _token_id(config[key], _CONFIG, key, vocab)
    if generation.get(key) is not None:
        return _token_id(generation[key], _GENERATION, key, vocab)
    return None


def _token_id(value: Any, file: str, key: str, vocab: int) -> int:
    if not _is_int(value) or not 0 <= value < vocab:
        raise ConversionError(f"{file}: field {key!r} must be a token id in [0, {vocab}), got {shown(value)}")
    return value


def _flag(config: Mapping[str, Any], rule: bool | str) -> bool:
    return rule if isinstance(rule, bool) else _bool(config, rule, False)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    if key not in config:
        raise ConversionError(f"{_CONFIG}: field {key!r} is missing (expected a positive integer)")
    value = config[key]
    if not _is_int(value) or value <= 0:
        raise ConversionError(f"{_CONFIG}: field {key!r} must be a positive integer, got {shown(value)}")
    return value


def _non_negative_int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if not _is_int(value) or value < 0:
        raise ConversionError(f"{_CONFIG}: field {key!r} must be a non-negative integer, got {shown(value)}")
    return value


def _positive_number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if not _is_number(value) or value <= 0:
        raise ConversionError(f"{_CONFIG}: field {key!r} must be a positive number, got {shown(value)}")
    return float(value)


def _bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ConversionError(f"{_CONFIG}: field {key!r} must be true or false, got {shown(value)}")
    return value


def _attention_factor(scaling: Any, max_pos: int) -> float:
    # thinconv.rope needs numpy; importing it here keeps recipe loading (CLI start-up) light.
    from thinconv.rope import rope_attention_factor

    return rope_attention_factor(scaling, max_position_embeddings=max_pos)
