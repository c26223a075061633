"""thinconv.rope against transformers 5 (ROPE_INIT_FUNCTIONS and the models' rotary embeddings)."""

from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding  # noqa: E402

from thinconv.errors import ConversionError  # noqa: E402
from thinconv.modelmeta import MetadataRules, read_model_metadata  # noqa: E402
from thinconv.rope import rope_attention_factor, rope_inv_freq  # noqa: E402

CONFIGS = Path(__file__).parent / "data" / "configs"
MAX_POS = 131072
REL_TOL = 1e-6

# transformers warns (e.g. yarn factor vs max_position_embeddings) on purpose-built configs
logging.getLogger("transformers").setLevel(logging.ERROR)

SCALINGS = {
    "default": None,
    "linear": {"type": "linear", "factor": 4.0},
    "linear_int": {"type": "linear", "factor": 2},
    "llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "llama3_32": {"type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                  "original_max_position_embeddings": 4096},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn_betas": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                   "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn_no_truncate": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192,
                         "truncate": False},
    "yarn_mscale": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn_attention_factor": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536,
                              "attention_factor": 0.9},
    "yarn_no_original": {"type": "yarn", "factor": 4.0},
    "yarn_null_factor": {"type": "yarn", "factor": None, "original_max_position_embeddings": 8192},
}
THETAS = [10000.0, 500000.0, 1000000.0, 1234.5]
HEAD_DIMS = [64, 128, 80]
PARTIALS = [1.0, 0.5, 0.25]


def _hf_config(theta: float, head_dim: int, partial: float, scaling: dict | None) -> LlamaConfig:
    params = {"rope_type": "default"} if scaling is None else {
        ("rope_type" if key == "type" else key): value for key, value in scaling.items()
    }
    params["rope_theta"] = theta
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       num_hidden_layers=1, intermediate_size=8, vocab_size=8,
                       max_position_embeddings=MAX_POS, rope_parameters=params)


def _reference(config: LlamaConfig, scaling: dict | None) -> tuple[np.ndarray, float]:
    if scaling is None:
        # Llama's default ignores partial_rotary_factor; GPT-NeoX's default honours it
        inv, factor = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[scaling["type"]](config, "cpu")
    return inv.numpy().astype(np.float64), float(factor)


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32
    assert got.shape == want.shape
    rel = np.max(np.abs(got.astype(np.float64) - want) / np.abs(want))
    assert rel <= REL_TOL, f"relative error {rel:.3g}"


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inv_freq_and_attention_factor_match_transformers(name: str) -> None:
    scaling = SCALINGS[name]
    for theta, head_dim, partial in itertools.product(THETAS, HEAD_DIMS, PARTIALS):
        rotary_dim = int(head_dim * partial)
        config = _hf_config(theta, head_dim, partial, scaling)
        want, want_factor = _reference(config, scaling)
        rope = {"theta": theta, "rotary_dim": rotary_dim, "layout": "half", "scaling": scaling}
        got = rope_inv_freq(rope, head_dim=head_dim, max_position_embeddings=MAX_POS)
        assert got is not None
        _assert_close(got, want)
        assert rope_attention_factor(scaling, max_position_embeddings=MAX_POS) == pytest.approx(
            want_factor, rel=1e-12
        )


def test_default_matches_llama_default_init() -> None:
    for theta, head_dim in itertools.product(THETAS, HEAD_DIMS):
        config = _hf_config(theta, head_dim, 1.0, None)
        want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
        got = rope_inv_freq({"theta": theta, "rotary_dim": head_dim, "scaling": None},
                            head_dim=head_dim, max_position_embeddings=MAX_POS)
        _assert_close(got, want.numpy().astype(np.float64))


def test_scaling_really_changes_the_table() -> None:
    rope = {"theta": 500000.0, "rotary_dim": 128, "scaling": None}
    plain = rope_inv_freq(rope, head_dim=128, max_position_embeddings=MAX_POS)
    for name in ("linear", "llama3", "yarn"):
        scaled = rope_inv_freq({**rope, "scaling": SCALINGS[name]}, head_dim=128, max_position_embeddings=MAX_POS)
        assert not np.allclose(plain, scaled), name
    assert plain[0] == 1.0 and plain.shape == (64,)


def test_rope_type_key_is_accepted_like_type() -> None:
    hf_style = {"rope_type": "linear", "factor": 4.0}
    a = rope_inv_freq({"theta": 1e4, "rotary_dim": 64, "scaling": hf_style}, head_dim=64, max_position_embeddings=MAX_POS)
    b = rope_inv_freq({"theta": 1e4, "rotary_dim": 64, "scaling": SCALINGS["linear"]}, head_dim=64,
                      max_position_embeddings=MAX_POS)
    np.testing.assert_array_equal(a, b)


def test_attention_factor_yarn_formulas() -> None:
    yarn = SCALINGS["yarn"]
    assert rope_attention_factor(yarn, max_position_embeddings=MAX_POS) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    mscale = SCALINGS["yarn_mscale"]
    want = (0.1 * 1.0 * math.log(40.0) + 1.0) / (0.1 * 0.707 * math.log(40.0) + 1.0)
    assert rope_attention_factor(mscale, max_position_embeddings=MAX_POS) == pytest.approx(want)
    assert rope_attention_factor(SCALINGS["yarn_attention_factor"], max_position_embeddings=MAX_POS) == 0.9
    # null factor: max_position_embeddings / original = 16
    assert rope_attention_factor(SCALINGS["yarn_null_factor"], max_position_embeddings=MAX_POS) == pytest.approx(
        0.1 * math.log(16.0) + 1.0
    )
    for scaling in (None, {"type": "default"}, SCALINGS["linear"], SCALINGS["llama3"], {"type": "dynamic", "factor": 2.0}):
        assert rope_attention_factor(scaling, max_position_embeddings=MAX_POS) == 1.0
    # linear has no attention factor even when one is written (transformers ignores it)
    assert rope_attention_factor({"type": "linear", "factor": 2.0, "attention_factor": 3.0},
                                 max_position_embeddings=MAX_POS) == 1.0


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": 4096},
        {"original_max_position_embeddings": 4096},  # factor from max / original
        {"factor": 1.0, "original_max_position_embeddings": 4096},
        {"factor": 2.0, "original_max_position_embeddings": 4096, "attention_factor": 1.25},
    ],
)
def test_longrope_attention_factor_matches_transformers(params: dict) -> None:
    factors = [1.0] * 32
    hf = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors, "long_factor": factors, **params}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, intermediate_size=8,
                         vocab_size=8, max_position_embeddings=MAX_POS, rope_parameters=hf)
    _, want = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    scaling = {"type": "longrope", "short_factor": factors, "long_factor": factors, **params}
    assert rope_attention_factor(scaling, max_position_embeddings=MAX_POS) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_dynamic_types_have_no_static_table(kind: str) -> None:
    rope = {"theta": 1e4, "rotary_dim": 64, "scaling": {"type": kind, "factor": 2.0}}
    assert rope_inv_freq(rope, head_dim=64, max_position_embeddings=MAX_POS) is None


RUNTIME_CLASSES = {
    "llama": LlamaRotaryEmbedding,
    "mistral": MistralRotaryEmbedding,
    "qwen2": Qwen2RotaryEmbedding,
    "qwen3": Qwen3RotaryEmbedding,
}
RULES = {
    "llama": MetadataRules(),
    "mistral": MetadataRules(sliding_window="always"),
    "qwen2": MetadataRules(sliding_window="use_sliding_window", qkv_bias=True),
    "qwen3": MetadataRules(head_dim_default=128, sliding_window="use_sliding_window", qk_norm=True),
}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.config.json")), ids=lambda p: p.name.split(".config")[0])
def test_published_configs_match_the_models_rotary_embedding(path: Path) -> None:
    """The manifest's rope object reproduces the buffer the transformers model itself builds."""
    raw = json.loads(path.read_text())
    family = raw["model_type"]
    model = read_model_metadata(raw, None, architecture=family, rules=RULES[family])
    embedding = RUNTIME_CLASSES[family](AutoConfig.for_model(**raw))
    got = rope_inv_freq(model["rope"], head_dim=model["head_dim"],
                        max_position_embeddings=model["max_position_embeddings"])
    _assert_close(got, embedding.inv_freq.numpy().astype(np.float64))
    assert model["rope"]["attention_factor"] == embedding.attention_scaling


def test_yarn_top_level_original_max_wins_like_transformers() -> None:
    """transformers re-standardizes when the RoPE is built: a top-level original_max_position_embeddings
    overrides the one inside rope_scaling (its Phi3 rule). The manifest records the value used."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
           "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 8,
           "max_position_embeddings": 16384, "original_max_position_embeddings": 2048,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
    model = read_model_metadata(raw, None, architecture="llama", rules=MetadataRules())
    assert model["rope"]["scaling"]["original_max_position_embeddings"] == 2048
    embedding = LlamaRotaryEmbedding(AutoConfig.for_model(**raw))
    got = rope_inv_freq(model["rope"], head_dim=64, max_position_embeddings=16384)
    _assert_close(got, embedding.inv_freq.numpy().astype(np.float64))
    assert model["rope"]["attention_factor"] == pytest.approx(embedding.attention_scaling)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"theta": 1e4, "rotary_dim": 63, "scaling": None}, "'rotary_dim' must be an even positive integer <= head_dim 64, got 63"),
        ({"theta": 1e4, "rotary_dim": 128, "scaling": None}, "'rotary_dim' must be an even positive integer <= head_dim 64, got 128"),
        ({"theta": 1e4, "rotary_dim": 64.0, "scaling": None}, "got 64.0"),
        ({"theta": 0, "rotary_dim": 64, "scaling": None}, "rope: 'theta' must be positive, got 0.0"),
        ({"theta": "big", "rotary_dim": 64, "scaling": None}, "rope: 'theta' must be a finite number, got 'big'"),
        ({"theta": 1e4, "rotary_dim": 64, "scaling": {"type": "linear"}}, "rope.scaling: 'factor' must be a finite number, got None"),
        ({"theta": 1e4, "rotary_dim": 64, "scaling": {"type": "su", "factor": 2.0}}, "rope.scaling: unsupported RoPE scaling type 'su'"),
        ({"theta": 1e4, "rotary_dim": 64, "scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}, "high_freq_factor != low_freq_factor"),
        ({"theta": 1e4, "rotary_dim": 64, "scaling": [1]}, "rope.scaling: must be an object or null, got [1]"),
    ],
)
def test_errors(rope: dict, message: str) -> None:
    with pytest.raises(ConversionError) as info:
        rope_inv_freq(rope, head_dim=64, max_position_embeddings=MAX_POS)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
