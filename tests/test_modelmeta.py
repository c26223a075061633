"""thinconv.modelmeta: the manifest `model` object from published configs, checked against
hand-written expectations and against transformers 5's own config classes."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from thinconv.errors import ConversionError, RecipeError, UsageError
from thinconv.modelmeta import MetadataRules, read_model_metadata

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)  # e.g. Mistral's layer_types warning

CONFIGS = Path(__file__).parent / "data" / "configs"

# What the recipes' [metadata] tables are expected to say for each family.
RULES = {
    "llama": MetadataRules(qkv_bias="attention_bias", o_bias="attention_bias"),
    "mistral": MetadataRules(sliding_window="always"),
    "qwen2": MetadataRules(sliding_window="use_sliding_window", qkv_bias=True),
    "qwen3": MetadataRules(head_dim_default=128, sliding_window="use_sliding_window", qkv_bias="attention_bias",
                           o_bias="attention_bias", qk_norm=True),
}

LLAMA31_SCALING = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

# The published values, written out by hand (not derived from the code under test).
EXPECTED: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": dict(
        architecture="llama", source="LlamaForCausalLM", hidden=4096, ffn=14336, layers=32, heads=32, kv=8,
        head_dim=128, vocab=128256, max_pos=131072, tie=False, eps=1e-5, theta=500000.0, scaling=LLAMA31_SCALING,
        window=None, sliding_layers=0, qkv_bias=False, o_bias=False, qk_norm=False, bos=128000, eos=[128001],
        pad=None,
    ),
    "Llama-3.2-1B": dict(
        architecture="llama", source="LlamaForCausalLM", hidden=2048, ffn=8192, layers=16, heads=32, kv=8,
        head_dim=64, vocab=128256, max_pos=131072, tie=True, eps=1e-5, theta=500000.0,
        scaling={**LLAMA31_SCALING, "factor": 32.0}, window=None, sliding_layers=0, qkv_bias=False, o_bias=False,
        qk_norm=False, bos=128000, eos=[128001], pad=None,
    ),
    "Mistral-7B-v0.1": dict(
        architecture="mistral", source="MistralForCausalLM", hidden=4096, ffn=14336, layers=32, heads=32, kv=8,
        head_dim=128, vocab=32000, max_pos=32768, tie=False, eps=1e-5, theta=10000.0, scaling=None, window=4096,
        sliding_layers=32, qkv_bias=False, o_bias=False, qk_norm=False, bos=1, eos=[2], pad=None,
    ),
    "Mistral-7B-v0.3": dict(
        architecture="mistral", source="MistralForCausalLM", hidden=4096, ffn=14336, layers=32, heads=32, kv=8,
        head_dim=128, vocab=32768, max_pos=32768, tie=False, eps=1e-5, theta=1000000.0, scaling=None, window=None,
        sliding_layers=0, qkv_bias=False, o_bias=False, qk_norm=False, bos=1, eos=[2], pad=None,
    ),
    "Qwen2.5-0.5B": dict(
        architecture="qwen2", source="Qwen2ForCausalLM", hidden=896, ffn=4864, layers=24, heads=14, kv=2,
        head_dim=64, vocab=151936, max_pos=32768, tie=True, eps=1e-6, theta=1000000.0, scaling=None, window=None,
        sliding_layers=0, qkv_bias=True, o_bias=False, qk_norm=False, bos=151643, eos=[151643], pad=None,
    ),
    "Qwen2.5-7B": dict(
        architecture="qwen2", source="Qwen2ForCausalLM", hidden=3584, ffn=18944, layers=28, heads=28, kv=4,
        head_dim=128, vocab=152064, max_pos=131072, tie=False, eps=1e-6, theta=1000000.0, scaling=None, window=None,
        sliding_layers=0, qkv_bias=True, o_bias=False, qk_norm=False, bos=151643, eos=[151643], pad=None,
    ),
    "Qwen3-0.6B": dict(
        architecture="qwen3", source="Qwen3ForCausalLM", hidden=1024, ffn=3072, layers=28, heads=16, kv=8,
        head_dim=128, vocab=151936, max_pos=40960, tie=True, eps=1e-6, theta=1000000.0, scaling=None, window=None,
        sliding_layers=0, qkv_bias=False, o_bias=False, qk_norm=True, bos=151643, eos=[151645, 151643], pad=151643,
    ),
    "Qwen3-8B": dict(
        architecture="qwen3", source="Qwen3ForCausalLM", hidden=4096, ffn=12288, layers=36, heads=32, kv=8,
        head_dim=128, vocab=151936, max_pos=40960, tie=False, eps=1e-6, theta=1000000.0, scaling=None, window=None,
        sliding_layers=0, qkv_bias=False, o_bias=False, qk_norm=True, bos=151643, eos=[151645, 151643], pad=151643,
    ),
}

MODEL_KEYS = {
    "architecture", "source_architecture", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
    "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "norm", "mlp",
    "attention", "rope", "special_tokens",
}


def _load(name: str) -> tuple[dict, dict | None]:
    config = json.loads((CONFIGS / f"{name}.config.json").read_text())
    generation_path = CONFIGS / f"{name}.generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else None
    return config, generation


def _read(config: dict, generation: dict | None = None, family: str | None = None, **kwargs: Any) -> dict:
    family = family or config.get("model_type", "llama")
    return read_model_metadata(config, generation, architecture=family, rules=RULES[family], **kwargs)


def _summary(model: dict) -> dict[str, Any]:
    attention, rope, tokens = model["attention"], model["rope"], model["special_tokens"]
    return dict(
        architecture=model["architecture"], source=model["source_architecture"], hidden=model["hidden_size"],
        ffn=model["intermediate_size"], layers=model["num_layers"], heads=model["num_attention_heads"],
        kv=model["num_kv_heads"], head_dim=model["head_dim"], vocab=model["vocab_size"],
        max_pos=model["max_position_embeddings"], tie=model["tie_word_embeddings"], eps=model["norm"]["eps"],
        theta=rope["theta"], scaling=rope["scaling"], window=attention["sliding_window"],
        sliding_layers=attention["layer_types"].count("sliding"), qkv_bias=attention["qkv_bias"],
        o_bias=attention["o_bias"], qk_norm=attention["qk_norm"], bos=tokens["bos"], eos=tokens["eos"],
        pad=tokens["pad"],
    )


def _transformers_view(config: dict) -> dict[str, Any]:
    """The same facts, as transformers 5's config class (and its modeling code) sees them."""
    hf = AutoConfig.for_model(**config)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    params = dict(hf.rope_parameters)
    kind = params.pop("rope_type")
    theta = params.pop("rope_theta")
    params.pop("type", None)
    if hf.model_type == "mistral":  # MistralModel applies config.sliding_window to every layer
        window = hf.sliding_window
        layer_types = ["sliding" if window is not None else "full"] * hf.num_hidden_layers
    elif hf.model_type == "llama":
        window, layer_types = None, ["full"] * hf.num_hidden_layers
    else:  # Qwen2/Qwen3: per layer_types, window from config.sliding_window (None unless use_sliding_window)
        window = hf.sliding_window
        names = {"full_attention": "full", "sliding_attention": "sliding"}
        layer_types = [names[t] if window is not None else "full" for t in hf.layer_types]
    if "sliding" not in layer_types:
        window = None
    return dict(
        head_dim=head_dim, kv=hf.num_key_value_heads, window=window, layer_types=layer_types,
        theta=float(theta), scaling=None if kind == "default" else {"type": kind, **params},
        tie=hf.tie_word_embeddings, eps=hf.rms_norm_eps, scale=head_dim**-0.5,
    )


def _ours(model: dict) -> dict[str, Any]:
    attention = model["attention"]
    return dict(
        head_dim=model["head_dim"], kv=model["num_kv_heads"], window=attention["sliding_window"],
        layer_types=attention["layer_types"], theta=model["rope"]["theta"], scaling=model["rope"]["scaling"],
        tie=model["tie_word_embeddings"], eps=model["norm"]["eps"], scale=attention["scale"],
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_gives_published_values(name: str) -> None:
    config, generation = _load(name)
    model = _read(config, generation)
    assert _summary(model) == EXPECTED[name]
    assert set(model) == MODEL_KEYS
    assert model["norm"] == {"type": "rmsnorm", "eps": EXPECTED[name]["eps"]}
    assert model["mlp"] == {"type": "gated", "activation": "silu"}
    assert model["rope"]["layout"] == "half" and model["rope"]["rotary_dim"] == model["head_dim"]
    assert model["rope"]["attention_factor"] == 1.0
    assert model["attention"]["scale"] == model["head_dim"] ** -0.5
    assert len(model["attention"]["layer_types"]) == model["num_layers"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_agrees_with_transformers(name: str) -> None:
    config, generation = _load(name)
    assert _ours(_read(config, generation)) == _transformers_view(config)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_types_are_exact_and_manifest_encodable(name: str) -> None:
    model = _read(*_load(name))
    ints = ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
            "vocab_size", "max_position_embeddings")
    assert all(type(model[key]) is int for key in ints)
    assert type(model["rope"]["theta"]) is float  # Qwen3 publishes rope_theta as the integer 1000000
    assert type(model["rope"]["rotary_dim"]) is int
    assert all(type(model[k][f]) is float for k, f in (("norm", "eps"), ("attention", "scale"), ("rope", "attention_factor")))
    assert type(model["tie_word_embeddings"]) is bool
    json.dumps(model, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# -- synthetic configs, each checked against transformers ------------------------------------------

def _tiny(family: str, **overrides: Any) -> dict:
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[family]
    config = {"architectures": [arch], "model_type": family, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 4096}
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not _DROP}


_DROP = object()

SYNTHETIC = {
    "qwen2 window from max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    "qwen2 window default size": ("qwen2", dict(use_sliding_window=True, max_window_layers=1)),
    "qwen2 window default max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, num_hidden_layers=30)),
    "qwen2 window named but unused": ("qwen2", dict(use_sliding_window=False, sliding_window=16, max_window_layers=0)),
    "qwen2 explicit layer_types": ("qwen2", dict(use_sliding_window=True, sliding_window=32,
                                   layer_types=["sliding_attention", "full_attention"] * 2)),
    "qwen2 explicit layer_types without window": ("qwen2", dict(
        sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2)),
    "qwen2 head_dim key": ("qwen2", dict(head_dim=32)),
    "qwen3 head_dim default": ("qwen3", dict()),
    "qwen3 window": ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=3)),
    "mistral window default": ("mistral", dict()),
    "mistral window null": ("mistral", dict(sliding_window=None)),
    "mistral layer_types ignored": ("mistral", dict(sliding_window=64, layer_types=["full_attention"] * 4)),
    "llama kv null": ("llama", dict(num_key_value_heads=None)),
    "llama kv absent": ("llama", dict(num_key_value_heads=_DROP)),
    "llama tie absent": ("llama", dict()),
    "llama tied": ("llama", dict(tie_word_embeddings=True)),
    "llama theta absent": ("llama", dict()),
    "llama legacy linear": ("llama", dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5000.0)),
    "llama legacy both type keys": ("llama", dict(rope_scaling={"type": "dynamic", "rope_type": "linear", "factor": 2.0})),
    "llama v5 rope_parameters": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                 "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 1024})),
    "llama rope_parameters theta wins": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 3.0e5},
                                         rope_theta=1.0e4)),
    "llama rope_scaling wins over rope_parameters": ("llama", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "linear", "factor": 4.0},
        rope_theta=2.0e4)),
    "llama yarn original defaults to max_pos": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
    "llama dynamic": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama default rope_type explicit": ("llama", dict(rope_scaling={"rope_type": "default"}, rope_theta=7.0e4)),
}


@pytest.mark.parametrize("case", sorted(SYNTHETIC))
def test_synthetic_config_agrees_with_transformers(case: str) -> None:
    family, overrides = SYNTHETIC[case]
    config = _tiny(family, **overrides)
    assert _ours(_read(config)) == _transformers_view(config)


def test_keys_the_family_does_not_know_are_refused_unless_allowed() -> None:
    """LlamaConfig has no sliding window: transformers ignores the keys, but the converter cannot know
    the model was not meant to use them, so it asks; allowed, they are ignored as transformers does."""
    config = _tiny("llama", sliding_window=64, use_sliding_window=True)
    with pytest.raises(ConversionError, match=r"'sliding_window' = 64, 'use_sliding_window' = True: not understood by "
                                              r"recipe llama .* --allow-config-key sliding_window"):
        _read(config)
    allowed = _read(config, allowed_keys=("sliding_window", "use_sliding_window"))
    assert _ours(allowed) == _transformers_view(config)
    assert allowed["attention"]["sliding_window"] is None
    assert _read(_tiny("llama", sliding_window=None, use_sliding_window=False))  # "off" values need no recipe


def test_synthetic_sliding_values() -> None:
    """Spot checks with literal values, so the transformers comparison cannot pass vacuously."""
    model = _read(_tiny("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2))
    assert model["attention"]["sliding_window"] == 16
    assert model["attention"]["layer_types"] == ["full", "full", "sliding", "sliding"]
    model = _read(_tiny("qwen2", use_sliding_window=False, sliding_window=16, max_window_layers=0))
    assert model["attention"]["sliding_window"] is None
    assert model["attention"]["layer_types"] == ["full"] * 4
    model = _read(_tiny("mistral"))  # MistralConfig's default window
    assert model["attention"]["sliding_window"] == 4096 and model["attention"]["layer_types"] == ["sliding"] * 4
    model = _read(_tiny("qwen2", use_sliding_window=True, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention", "attention", "sliding_attention"]))
    assert model["attention"]["layer_types"] == ["sliding", "full", "full", "sliding"]


def test_rope_scaling_forms() -> None:
    legacy = _read(_tiny("llama", rope_scaling={"type": "linear", "factor": 2}, rope_theta=5000))
    assert legacy["rope"]["scaling"] == {"type": "linear", "factor": 2.0}
    assert legacy["rope"]["theta"] == 5000.0 and type(legacy["rope"]["scaling"]["factor"]) is float
    v5 = _read(_tiny("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1.0e6, "factor": 4.0,
                                               "beta_fast": 32, "truncate": False, "attention_factor": None}))
    assert v5["rope"]["theta"] == 1.0e6
    assert v5["rope"]["scaling"] == {"type": "yarn", "factor": 4.0, "beta_fast": 32.0, "truncate": False,
                                     "original_max_position_embeddings": 4096}
    assert v5["rope"]["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1.0)
    null_factor = _read(_tiny("llama", rope_scaling={"rope_type": "yarn", "factor": None,
                                                     "original_max_position_embeddings": 1024}))
    assert null_factor["rope"]["scaling"]["factor"] == 4.0  # max_position_embeddings / original, written out
    default = _read(_tiny("llama", rope_scaling={"rope_type": "default"}))
    assert default["rope"]["scaling"] is None


def test_partial_rotary_factor() -> None:
    model = _read(_tiny("llama", partial_rotary_factor=0.5))
    assert model["rope"]["rotary_dim"] == 8 and model["head_dim"] == 16
    inside = _read(_tiny("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.25}, head_dim=32))
    assert inside["rope"]["rotary_dim"] == 8


def test_rope_layout_and_biases() -> None:
    model = _read(_tiny("llama", attention_bias=True), rope_layout="interleaved")
    assert model["rope"]["layout"] == "interleaved"
    assert model["attention"]["qkv_bias"] is True and model["attention"]["o_bias"] is True
    qwen3 = _read(_tiny("qwen3", attention_bias=True))
    assert qwen3["attention"]["qkv_bias"] is True and qwen3["attention"]["qk_norm"] is True
    assert qwen3["head_dim"] == 128 and qwen3["attention"]["scale"] == 128**-0.5


def test_activation_and_mlp_bias_as_transformers_reads_them() -> None:
    """LlamaMLP runs ACT2FN[hidden_act] and puts biases on gate/up/down with mlp_bias: the archive says so."""
    model = _read(_tiny("llama", hidden_act="gelu", mlp_bias=True))
    assert model["mlp"] == {"type": "gated", "activation": "gelu", "bias": True}
    assert _read(_tiny("llama", hidden_act="gelu_pytorch_tanh"))["mlp"] == {"type": "gated", "activation": "gelu_tanh"}


def test_eos_union_is_ordered_and_deduplicated() -> None:
    config = _tiny("llama", eos_token_id=[5, 7, 5], bos_token_id=None, pad_token_id=None)
    generation = {"eos_token_id": [7, 9, 5, 11], "bos_token_id": 1, "pad_token_id": 3}
    tokens = _read(config, generation)["special_tokens"]
    assert tokens == {"bos": 1, "eos": [5, 7, 9, 11], "pad": 3}
    tokens = _read(_tiny("llama", eos_token_id=4, pad_token_id=2), {"eos_token_id": 6, "pad_token_id": 3})["special_tokens"]
    assert tokens == {"bos": None, "eos": [4, 6], "pad": 2}
    assert _read(_tiny("llama"))["special_tokens"] == {"bos": None, "eos": [], "pad": None}


# -- errors ---------------------------------------------------------------------------------------

ERRORS = {
    "kv string": (dict(num_key_value_heads="x"),
                  "config.json: field 'num_key_value_heads' must be a positive integer, got 'x'"),
    "kv zero": (dict(num_key_value_heads=0), "field 'num_key_value_heads' must be a positive integer, got 0"),
    "hidden missing": (dict(hidden_size=_DROP), "config.json: field 'hidden_size' is missing (expected a positive integer)"),
    "hidden float": (dict(hidden_size=64.0), "field 'hidden_size' must be a positive integer, got 64.0"),
    "layers bool": (dict(num_hidden_layers=True), "field 'num_hidden_layers' must be a positive integer, got True"),
    "kv not dividing": (dict(num_key_value_heads=3),
                        "config.json: num_attention_heads 4 is not divisible by num_key_value_heads 3"),
    "hidden not dividing": (dict(hidden_size=66),
                            "hidden_size 66 is not divisible by num_attention_heads 4 and there is no 'head_dim'"),
    "activation": (dict(hidden_act="relu"), "config.json: field 'hidden_act' is 'relu', an activation mlp.activation "
                                            "cannot say (gelu, gelu_fast, gelu_new, gelu_pytorch_tanh, silu, swish)"),
    "mlp bias type": (dict(mlp_bias="yes"), "config.json: field 'mlp_bias' must be true or false, got 'yes'"),
    "eps": (dict(rms_norm_eps="small"), "config.json: field 'rms_norm_eps' must be a positive number, got 'small'"),
    "tie": (dict(tie_word_embeddings="yes"), "config.json: field 'tie_word_embeddings' must be true or false, got 'yes'"),
    "architectures": (dict(architectures=[]), "config.json: field 'architectures' must be a non-empty list of names"),
    "odd rotary": (dict(head_dim=18, partial_rotary_factor=0.5),
                   "config.json: rotary dimension 9 (head_dim 18 × partial_rotary_factor 0.5) must be even and positive"),
    "odd head": (dict(head_dim=15), "config.json: rotary dimension 15 (head_dim 15) must be even and positive"),
    "partial range": (dict(partial_rotary_factor=1.5), "field 'partial_rotary_factor' must be in (0, 1], got 1.5"),
    "theta": (dict(rope_theta=-1.0), "config.json: field 'rope_theta' must be a positive number, got -1.0"),
    "theta in params": (dict(rope_parameters={"rope_type": "default", "rope_theta": "x"}),
                        "config.json: rope_parameters: field 'rope_theta' must be a positive number, got 'x'"),
    "rope type": (dict(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                  "config.json: rope_scaling: unsupported RoPE type 'mrope'"),
    "rope key": (dict(rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
                 "config.json: rope_scaling: key 'mrope_section' is not a parameter of RoPE type 'default'"),
    "rope missing key": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
                         "config.json: rope_scaling: RoPE type 'llama3' needs 'high_freq_factor'"),
    "rope factor null": (dict(rope_scaling={"rope_type": "linear", "factor": None}),
                         "config.json: rope_scaling: 'factor' must be a finite number, got None"),
    "rope nested": (dict(rope_parameters={"full_attention": {"rope_type": "default"}}),
                    "per-layer-type RoPE parameters are not supported"),
    "rope not object": (dict(rope_scaling="linear"), "config.json: field 'rope_scaling' must be an object or null"),
    "original max": (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}),
                     "'original_max_position_embeddings' must be a positive integer, got 0"),
    "eos negative": (dict(eos_token_id=-1), "config.json: field 'eos_token_id' must be a token id in [0, 512), got -1"),
    "pad out of vocab": (dict(pad_token_id=512), "field 'pad_token_id' must be a token id in [0, 512), got 512"),
    "attention_bias type": (dict(attention_bias="no"), "config.json: field 'attention_bias' must be true or false, got 'no'"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_config_errors(case: str) -> None:
    overrides, message = ERRORS[case]
    with pytest.raises(ConversionError) as info:
        read_model_metadata(_tiny("llama", **overrides), None, architecture="llama", rules=RULES["llama"])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_family_specific_errors() -> None:
    with pytest.raises(ConversionError, match=r"field 'sliding_window' must be a positive integer, got 'wide'"):
        _read(_tiny("mistral", sliding_window="wide"))
    with pytest.raises(ConversionError, match=r"field 'layer_types' must list 4 layer types"):
        _read(_tiny("qwen2", layer_types=["full_attention"] * 3))
    with pytest.raises(ConversionError, match=r"entries must be full_attention or sliding_attention, got 'chunked"):
        _read(_tiny("qwen2", layer_types=["chunked_attention"] * 4))
    with pytest.raises(ConversionError, match=r"field 'use_sliding_window' must be true or false"):
        _read(_tiny("qwen2", use_sliding_window="yes"))
    with pytest.raises(ConversionError, match=r"field 'max_window_layers' must be a non-negative integer"):
        _read(_tiny("qwen2", use_sliding_window=True, max_window_layers=-1))
    with pytest.raises(ConversionError, match=r"generation_config.json: field 'eos_token_id' must be a token id"):
        _read(_tiny("llama"), {"eos_token_id": ["2"]})
    with pytest.raises(UsageError, match=r"rope layout must be one of half, interleaved, got 'rotated'"):
        _read(_tiny("llama"), rope_layout="rotated")


# -- MetadataRules ----------------------------------------------------------------------------------

def test_rules_from_table() -> None:
    rules = MetadataRules.from_table(
        {"head_dim_default": 128, "sliding_window": "use_sliding_window", "qkv_bias": "attention_bias",
         "o_bias": False, "qk_norm": True},
        "recipes/qwen3.toml [metadata]",
    )
    assert rules == MetadataRules(head_dim_default=128, sliding_window="use_sliding_window",
                                  qkv_bias="attention_bias", o_bias=False, qk_norm=True)
    assert MetadataRules.from_table({}, "x") == MetadataRules()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"head_dim": 128}, "qwen.toml [metadata]: unknown key 'head_dim' (expected one of: head_dim_default,"),
        ({"head_dim_default": "128"}, "qwen.toml [metadata]: 'head_dim_default' must be a positive integer, got '128'"),
        ({"head_dim_default": 0}, "'head_dim_default' must be a positive integer, got 0"),
        ({"head_dim_default": True}, "'head_dim_default' must be a positive integer, got True"),
        ({"sliding_window": "sometimes"}, "'sliding_window' must be one of none, always, use_sliding_window, got 'sometimes'"),
        ({"qkv_bias": 1}, "qwen.toml [metadata]: 'qkv_bias' must be a boolean or a config key name, got 1"),
        ({"o_bias": ""}, "'o_bias' must be a boolean or a config key name, got ''"),
        ({"qk_norm": "yes"}, "qwen.toml [metadata]: 'qk_norm' must be a boolean, got 'yes'"),
    ],
)
def test_rules_from_table_is_strict(table: dict, message: str) -> None:
    with pytest.raises(RecipeError) as info:
        MetadataRules.from_table(table, "qwen.toml [metadata]")
    assert message in str(info.value)


def test_rules_constructor_checks_too() -> None:
    with pytest.raises(RecipeError, match="MetadataRules: 'sliding_window' must be one of"):
        MetadataRules(sliding_window="sometimes")
