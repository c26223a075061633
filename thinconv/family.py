"""A family's own reading of config.json, from its recipe: `[model]` expressions that compute
`model` keys, `[config]` requirements, and the accounting of every config key.

The accounting is what keeps a converter from writing an archive for a model it does not fully
understand: every key present in config.json must be read by the reader or an expression, be
one of the keys that never change the computation (`NO_EFFECT_KEYS`, or the recipe's own
`understood` list), hold an "off" value (null, false, empty; not for `DEFAULT_ON_KEYS`), or be
allowed by the user with `--allow-config-key` — else the conversion stops, naming the key.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from thinconv import expr
from thinconv.errors import ConversionError, RecipeError, shown
from thinconv.format import schema

# Keys that never change what the network computes at inference (transformers 5 and the 4.x keys
# still found on the Hub): bookkeeping, token ids, generation defaults, training-only settings
# (`pretraining_tp`: a 4.x Llama training detail that transformers 5 no longer reads).
NO_EFFECT_KEYS = frozenset("""
transformers_version architectures model_type dtype torch_dtype _name_or_path name_or_path _commit_hash
output_attentions output_hidden_states return_dict torchscript use_bfloat16 tf_legacy_loss pruned_heads
chunk_size_feed_forward is_encoder_decoder is_decoder cross_attention_hidden_size add_cross_attention
tie_encoder_decoder finetuning_task id2label label2id num_labels task_specific_params problem_type tokenizer_class
prefix sep_token_id decoder_start_token_id _attn_implementation_autoset attn_implementation _attn_implementation
auto_map model_max_length gradient_checkpointing bos_token_id eos_token_id pad_token_id use_cache
initializer_range attention_dropout hidden_dropout classifier_dropout embd_pdrop resid_pdrop pretraining_tp
max_length min_length do_sample early_stopping num_beams temperature top_k top_p typical_p repetition_penalty
length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores
return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
exponential_decay_length_penalty suppress_tokens begin_suppress_tokens num_beam_groups diversity_penalty
""".split())

# Keys transformers reads with a TRUE default (`getattr(config, key, True)`): there, null or false is
# not "off" but a change (`is_causal`: masking_utils makes every family's attention bidirectional).
DEFAULT_ON_KEYS = frozenset({"is_causal"})

# transformers' activation names → `mlp.activation`
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh"}
# transformers' layer type names → `attention.layer_types`
LAYER_TYPES = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding"}


class RecordingConfig(Mapping):
    """config.json as a mapping that remembers which keys were read."""

    def __init__(self, data: Mapping[str, Any]):
        self._data, self.read = data, set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self._data[key]

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return key in self._data

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self._data.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@dataclass(frozen=True)
class FamilyRules:
    """A recipe's `[model]`, `[config]` and `[config.require]` tables, parsed."""

    model: tuple[tuple[str, ast.Expression], ...] = ()  # model key path → expression, in order
    understood: tuple[str, ...] = ()  # config keys that do not change this family's computation
    require: tuple[tuple[str, ast.Expression], ...] = ()  # config key → expression that must hold

    @classmethod
    def from_tables(cls, model: Any, config: Any, where: str) -> "FamilyRules":
        if not isinstance(model, Mapping):
            raise RecipeError(f"{where}: model: expected a table of model key = expression")
        exprs = []
        for path, text in model.items():
            if path not in schema.BY_PATH:
                raise RecipeError(f"{where}: model.{path!r}: not a model key (see FORMAT.md §2.3)")
            exprs.append((path, expr.parse(text, f"{where}: model.{path!r}")))
        if not isinstance(config, Mapping):
            raise RecipeError(f"{where}: config: expected a table")
        unknown = sorted(set(config) - {"understood", "require"})
        if unknown:
            raise RecipeError(f"{where}: config.{unknown[0]}: unknown key (expected understood, require)")
        understood = config.get("understood", [])
        if not (isinstance(understood, list) and all(isinstance(k, str) and k for k in understood)):
            raise RecipeError(f"{where}: config.understood: expected a list of config key names")
        require = config.get("require", {})
        if not isinstance(require, Mapping):
            raise RecipeError(f"{where}: config.require: expected a table of config key = expression")
        reqs = tuple((k, expr.parse(v, f"{where}: config.require.{k}")) for k, v in require.items())
        return cls(tuple(exprs), tuple(understood), reqs)


def _round_to(x: float, dtype: str) -> float:
    """x rounded to a float dtype ("bf16", "f16", "f32") and back, as a model running in it sees it."""
    import ml_dtypes  # lazy: only Gemma-style recipes round (recipe loading, CLI start-up, stays light)
    import numpy as np

    code = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32, "f64": np.float64}.get(dtype)
    if code is None:
        raise ValueError(f"round_to: unknown dtype {dtype!r}")
    return float(np.asarray(x, np.float64).astype(code).astype(np.float64))


def _functions(config: RecordingConfig, recipe: str) -> dict:
    missing = object()

    def cfg(key: str, default: Any = missing) -> Any:
        if key not in config:
            if default is missing:
                raise ConversionError(f"config.json: field {key!r} is missing (recipe {recipe} reads it)")
            return default
        return config[key]

    def has(key: str) -> bool:
        return config.get(key) is not None

    def get(obj: Any, key: Any, default: Any = None) -> Any:
        return obj.get(key, default) if isinstance(obj, Mapping) else default

    def activation(name: Any) -> str:
        if not isinstance(name, str) or name not in ACTIVATIONS:
            raise ConversionError(f"config.json: activation {shown(name)} is none that mlp.activation can say "
                                  f"({', '.join(sorted(ACTIVATIONS))})")
        return ACTIVATIONS[name]

    def layer_kinds(types: Any) -> list[str]:
        if not isinstance(types, list) or not all(t in LAYER_TYPES for t in types):
            raise ConversionError(f"config.json: field 'layer_types' entries must be full_attention or "
                                  f"sliding_attention, got {shown(types)}")
        return [LAYER_TYPES[t] for t in types]

    return {**expr.BASE_FUNCTIONS, "cfg": cfg, "has": has, "get": get, "activation": activation,
            "layer_kinds": layer_kinds, "round_to": _round_to, "isfinite": math.isfinite}


def apply(model: dict, config: RecordingConfig, rules: FamilyRules, *, recipe: str, weights_dtype: str) -> dict:
    """`model` with the recipe's `[model]` expressions applied in order (each sees the keys set
    before it), after its `[config.require]` conditions are checked."""
    functions = _functions(config, recipe)
    for key, tree in rules.require:
        names = {**model, "num_layers": model["num_layers"], "dtype": weights_dtype}
        if not expr.evaluate(tree, names, functions, f"recipe {recipe}: config.require.{key}"):
            raise ConversionError(f"config.json: field {key!r} = {shown(config.get(key))}: recipe {recipe} cannot "
                                  f"convert this value (it requires {ast.unparse(tree)})")
    for path, tree in rules.model:
        names = {**model, "dtype": weights_dtype}
        value = expr.evaluate(tree, names, functions, f"recipe {recipe}: model.{path!r}")
        _set(model, path, value)
    return model


def _set(model: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = model
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[last] = value


def unaccounted_keys(config: RecordingConfig, rules: FamilyRules, allowed: tuple[str, ...]) -> list[str]:
    """Keys of config.json that nothing accounts for (see the module docstring)."""
    out = []
    for key in config:
        value = config._data[key]
        if key in config.read or key in NO_EFFECT_KEYS or key in rules.understood or key in allowed:
            continue
        if key in DEFAULT_ON_KEYS:
            if value is True:  # the default: nothing changes
                continue
        elif value is None or value is False or value == [] or value == {}:
            continue
        out.append(key)
    return out

