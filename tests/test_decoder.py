"""The numpy reference decoder against transformers (eager, float32) on tiny random models.

Each case maps the HF state dict to canonical names with an explicit table, takes `rope_freqs`
from the model's own `rotary_emb.inv_freq`, and writes the manifest `model` object by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hfnames import canonical_name
from thinconv.decoder import Decoder, DictProvider, prefill_logits
from thinconv.errors import ConversionError, UsageError

REL_TOL = 1e-5  # max |Δlogit| ≤ REL_TOL × max |logit| (observed ≤ 8e-7; the brief allows 1e-4)
FAR = 1e-2  # a broken model must differ by at least this much (relative)



def canonical(hf: torch.nn.Module, tied: bool) -> dict[str, np.ndarray]:
    """Canonical tensors of an HF causal LM; every HF tensor must map (or be the tied head)."""
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    state = _split_fused(state, hf.config)
    out = {"rope_freqs": hf.model.rotary_emb.inv_freq.detach().float().numpy()}
    for name, arr in state.items():
        if tied and name == "lm_head.weight":
            continue
        out[canonical_name(name)] = arr  # fused Phi-3 tensors were split above
    return out


def _split_fused(state: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """Phi-3 fuses qkv_proj = [q; k; v] and gate_up_proj = [gate; up] along dim 0."""
    out = {}
    for name, arr in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            hd = cfg.hidden_size // cfg.num_attention_heads
            q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
            base = name[: -len("qkv_proj.weight")]
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = (
                arr[:q], arr[q : q + kv], arr[q + kv :]
            )
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = np.split(arr, 2)
        else:
            out[name] = arr
    return out


def manifest(
    cfg,
    architecture: str,
    *,
    head_dim: int,
    rotary_dim: int,
    scaling: dict | None = None,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
    window: int | None = None,
    layer_types: list[str] | None = None,
    attention_factor: float = 1.0,
) -> dict:
    """The manifest `model` object (spec §2.1) for an HF config, written out key by key."""
    return {
        "architecture": architecture,
        "source_architecture": cfg.architectures[0] if cfg.architectures else architecture,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "norm": {"type": "rmsnorm", "eps": cfg.rms_norm_eps},
        "mlp": {"type": "gated", "activation": "silu"},
        "attention": {
            "qkv_bias": qkv_bias,
            "o_bias": o_bias,
            "qk_norm": qk_norm,
            "sliding_window": window,
            "layer_types": layer_types or ["full"] * cfg.num_hidden_layers,
            "scale": head_dim**-0.5,
        },
        "rope": {
            "theta": float(cfg.rope_parameters["rope_theta"]),
            "rotary_dim": rotary_dim,
            "layout": "half",
            "scaling": scaling,
            "attention_factor": attention_factor,
        },
        "special_tokens": {"bos": cfg.bos_token_id, "eos": [cfg.eos_token_id], "pad": None},
    }


def randomize(hf: torch.nn.Module, seed: int) -> None:
    """Scale-aware random weights: HF init leaves biases at 0 and norms at 1, hiding bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # a tied head is shared, so set once
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def _build(cls, cfg, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    hf = cls(cfg).eval().float()
    randomize(hf, seed)
    return hf


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def case_llama3() -> tuple[torch.nn.Module, dict]:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                      tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    m = manifest(cfg, "llama", head_dim=16, rotary_dim=16, scaling=scaling)
    return _build(LlamaForCausalLM, cfg, 1), m


def case_llama2() -> tuple[torch.nn.Module, dict]:
    cfg = LlamaConfig(**{**TINY, "vocab_size": 200}, num_attention_heads=4, num_key_value_heads=4,
                      rope_theta=10000.0, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return _build(LlamaForCausalLM, cfg, 2), manifest(cfg, "llama", head_dim=16, rotary_dim=16)


def case_llama_bias() -> tuple[torch.nn.Module, dict]:
    cfg = LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    m = manifest(cfg, "llama", head_dim=16, rotary_dim=16, qkv_bias=True, o_bias=True)
    return _build(LlamaForCausalLM, cfg, 3), m


def case_mistral() -> tuple[torch.nn.Module, dict]:
    cfg = MistralConfig(**TINY, num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                        tie_word_embeddings=False, architectures=["MistralForCausalLM"])
    m = manifest(cfg, "mistral", head_dim=16, rotary_dim=16, window=4, layer_types=["sliding", "sliding"])
    return _build(MistralForCausalLM, cfg, 4), m


def case_qwen2() -> tuple[torch.nn.Module, dict]:
    cfg = Qwen2Config(**TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    return _build(Qwen2ForCausalLM, cfg, 5), manifest(cfg, "qwen2", head_dim=16, rotary_dim=16, qkv_bias=True)


def case_qwen2_sliding() -> tuple[torch.nn.Module, dict]:
    cfg = Qwen2Config(**TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      use_sliding_window=True, sliding_window=4, max_window_layers=1,
                      architectures=["Qwen2ForCausalLM"])
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    m = manifest(cfg, "qwen2", head_dim=16, rotary_dim=16, qkv_bias=True, window=4,
                 layer_types=["full", "sliding"])
    return _build(Qwen2ForCausalLM, cfg, 6), m


def case_qwen3() -> tuple[torch.nn.Module, dict]:
    cfg = Qwen3Config(**{**TINY, "hidden_size": 32}, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    return _build(Qwen3ForCausalLM, cfg, 7), manifest(cfg, "qwen3", head_dim=16, rotary_dim=16, qk_norm=True)


def case_phi3_partial() -> tuple[torch.nn.Module, dict]:
    """Phi-3 rotates only the first rotary_dim = head_dim/2 dims (partial_rotary_factor)."""
    cfg = Phi3Config(**TINY, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
                     sliding_window=None, tie_word_embeddings=False, architectures=["Phi3ForCausalLM"])
    return _build(Phi3ForCausalLM, cfg, 8), manifest(cfg, "phi3", head_dim=16, rotary_dim=8)


def case_llama_yarn() -> tuple[torch.nn.Module, dict]:
    """YaRN: a static table and an attention factor of 0.1·ln(4) + 1 on cos and sin."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    m = manifest(cfg, "llama", head_dim=16, rotary_dim=16, scaling=scaling, attention_factor=0.1 * math.log(4.0) + 1)
    return _build(LlamaForCausalLM, cfg, 9), m


def case_llama_dynamic() -> tuple[torch.nn.Module, dict]:
    """Dynamic NTK: the table grows with the sequence once it passes max_position_embeddings (16 < 24)."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    cfg = LlamaConfig(**{**TINY, "max_position_embeddings": 16}, num_attention_heads=4, num_key_value_heads=2,
                      rope_parameters=rope, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    m = manifest(cfg, "llama", head_dim=16, rotary_dim=16, scaling={"type": "dynamic", "factor": 2.0})
    return _build(LlamaForCausalLM, cfg, 10), m


def case_phi3_longrope() -> tuple[torch.nn.Module, dict]:
    """Longrope: long factors once the sequence passes original_max_position_embeddings (16 < 24),
    attention factor sqrt(1 + ln(64/16) / ln 16), partial rotary."""
    rng = np.random.default_rng(11)
    short, long = (1 + rng.random(4)).round(3).tolist(), (2 + 4 * rng.random(4)).round(3).tolist()
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}
    cfg = Phi3Config(**{**TINY, "max_position_embeddings": 64}, num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters=rope, original_max_position_embeddings=16, sliding_window=None,
                     tie_word_embeddings=False, architectures=["Phi3ForCausalLM"])
    scaling = {"type": "longrope", "short_factor": short, "long_factor": long, "original_max_position_embeddings": 16,
               "factor": 4.0}
    m = manifest(cfg, "phi3", head_dim=16, rotary_dim=8, scaling=scaling,
                 attention_factor=math.sqrt(1 + math.log(4.0) / math.log(16)))
    return _build(Phi3ForCausalLM, cfg, 11), m


CASES: dict[str, Callable[[], tuple[torch.nn.Module, dict]]] = {
    "llama3-tied": case_llama3,
    "llama2-mha": case_llama2,
    "llama-bias": case_llama_bias,
    "mistral-window4": case_mistral,
    "qwen2-bias": case_qwen2,
    "qwen2-sliding": case_qwen2_sliding,
    "qwen3-qknorm": case_qwen3,
    "phi3-partial-rotary": case_phi3_partial,
    "llama-yarn": case_llama_yarn,
    "llama-dynamic": case_llama_dynamic,
    "phi3-longrope": case_phi3_longrope,
}
_BUILT: dict[str, tuple] = {}


def built(name: str) -> tuple[torch.nn.Module, dict, dict[str, np.ndarray], list[int], np.ndarray]:
    """(hf model, manifest model, canonical tensors, tokens, HF logits), built once per case."""
    if name not in _BUILT:
        hf, m = CASES[name]()
        n = 12 if name == "mistral-window4" else 24  # 24 > the decoder's initial cache capacity
        tokens = np.random.default_rng(len(name)).integers(0, m["vocab_size"], n).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0].float().numpy()
        tensors = canonical(hf, m["tie_word_embeddings"])
        if (m["rope"]["scaling"] or {}).get("type") in ("dynamic", "longrope"):
            del tensors["rope_freqs"]  # the table depends on the sequence length: there is none to store
        _BUILT[name] = (hf, m, tensors, tokens, ref)
    return _BUILT[name]


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def decode(m: dict, tensors: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    return Decoder(DictProvider(m, tensors)).logits_for(tokens)


def with_(m: dict, **changes: dict) -> dict:
    """A copy of manifest m with sub-objects updated: with_(m, rope={"layout": …})."""
    out = {**m}
    for key, sub in changes.items():
        out[key] = {**m[key], **sub}
    return out


def interleave(m: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Spec §2.1: within each head, new row 2i = old row i, new 2i+1 = old i + rotary_dim/2."""
    hd, rd = m["head_dim"], m["rope"]["rotary_dim"]
    perm = np.arange(hd)
    perm[0:rd:2], perm[1:rd:2] = np.arange(rd // 2), np.arange(rd // 2) + rd // 2
    out = dict(tensors)
    for name, arr in tensors.items():
        role = name.split(".", 2)[-1]
        if role in ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias"):
            heads = arr.reshape(-1, hd, *arr.shape[1:])
            out[name] = heads[:, perm].reshape(arr.shape)
        elif role in ("attn_q_norm.weight", "attn_k_norm.weight"):
            out[name] = arr[perm]
    return out


# ---- agreement with transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(name: str) -> None:
    _, m, tensors, tokens, ref = built(name)
    got = decode(m, tensors, tokens)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert rel_err(got, ref) <= REL_TOL


@pytest.mark.parametrize("name", CASES)
def test_prefill_matches_transformers_in_small_chunks(name: str) -> None:
    """The layer-major, weight-streaming forward (the converter's probe) computes the same model;
    chunks of 64 values force every matrix to be read in many row slices."""
    _, m, tensors, tokens, ref = built(name)
    got = prefill_logits(DictProvider(m, tensors), tokens, chunk_values=64)
    assert got.shape == ref.shape and rel_err(got, ref) <= REL_TOL
    got = prefill_logits(DictProvider(with_(m, rope={"layout": "interleaved"}), interleave(m, tensors)), tokens)
    assert rel_err(got, ref) <= REL_TOL


@pytest.mark.parametrize("name", CASES)
def test_interleaved_layout_gives_same_logits(name: str) -> None:
    _, m, tensors, tokens, ref = built(name)
    permuted = interleave(m, tensors)
    assert not np.array_equal(permuted["blk.0.attn_q.weight"], tensors["blk.0.attn_q.weight"])
    got = decode(with_(m, rope={"layout": "interleaved"}), permuted, tokens)
    assert rel_err(got, ref) <= REL_TOL


@pytest.mark.parametrize("name", ["llama3-tied", "mistral-window4", "qwen2-sliding"])
def test_generate_matches_transformers_greedy(name: str) -> None:
    hf, m, tensors, tokens, _ = built(name)
    prompt, n_new = tokens[:6], 12  # 6 + 12 positions: beyond the sliding window of 4
    eos = m["vocab_size"] - 1
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n_new, eos_token_id=eos, pad_token_id=0)
    want = ref[0, len(prompt):].tolist()
    dec = Decoder(DictProvider(m, tensors))
    assert list(dec.generate(prompt, n_new, eos={eos})) == want
    assert len(want) == n_new and eos not in want
    # Stop on an eos token: make the 4th generated token the end token, in both.
    stop = want[3]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n_new, eos_token_id=stop, pad_token_id=0)
    cut = ref[0, len(prompt):].tolist()
    assert list(dec.generate(prompt, n_new, eos={stop})) == cut == want[: want.index(stop) + 1]


def test_generate_defaults_to_manifest_eos_and_is_lazy() -> None:
    _, m, tensors, tokens, _ = built("llama3-tied")
    dec = Decoder(DictProvider(m, tensors))
    free = list(dec.generate(tokens[:5], 8, eos=set()))
    m2 = {**m, "special_tokens": {**m["special_tokens"], "eos": [free[2]]}}
    assert list(Decoder(DictProvider(m2, tensors)).generate(tokens[:5], 8)) == free[: free.index(free[2]) + 1]
    assert next(dec.generate(tokens[:5], 8, eos=set())) == free[0]
    assert list(dec.generate(tokens[:5], 0)) == []


def test_step_after_logits_for_continues_the_sequence() -> None:
    _, m, tensors, tokens, ref = built("qwen3-qknorm")
    dec = Decoder(DictProvider(m, tensors))
    dec.logits_for(tokens[:10])
    rest = np.stack([dec.step(t) for t in tokens[10:]])
    assert rel_err(rest, ref[10:]) <= REL_TOL
    assert dec.pos == len(tokens)


# ---- the comparison can fail: broken models differ noticeably ---------------------------------


def test_wrong_layout_differs() -> None:
    _, m, tensors, tokens, ref = built("llama3-tied")
    got = decode(with_(m, rope={"layout": "interleaved"}), tensors, tokens)
    assert rel_err(got[:1], ref[:1]) <= REL_TOL  # position 0 has no rotation
    assert rel_err(got, ref) > FAR


@pytest.mark.parametrize("name", ["llama3-tied", "llama2-mha"])
def test_wrong_theta_differs(name: str) -> None:
    _, m, tensors, tokens, ref = built(name)
    got = decode(m, {**tensors, "rope_freqs": tensors["rope_freqs"] * np.float32(0.7)}, tokens)
    assert rel_err(got[:1], ref[:1]) <= REL_TOL
    assert rel_err(got, ref) > FAR


def test_llama3_scaling_matters() -> None:
    """Unscaled theta-only frequencies (scaling ignored) give different logits."""
    _, m, tensors, tokens, ref = built("llama3-tied")
    plain = (1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    assert not np.allclose(plain, tensors["rope_freqs"])
    assert rel_err(decode(m, {**tensors, "rope_freqs": plain}, tokens), ref) > FAR


@pytest.mark.parametrize("name", ["mistral-window4", "qwen2-sliding"])
def test_window_removed_differs_after_the_window(name: str) -> None:
    _, m, tensors, tokens, ref = built(name)
    full = with_(m, attention={"sliding_window": None, "layer_types": ["full", "full"]})
    got = decode(full, tensors, tokens)
    assert rel_err(got[:4], ref[:4]) <= REL_TOL  # identical while the sequence fits the window
    assert rel_err(got[4:], ref[4:]) > FAR


def test_qwen2_sliding_only_on_sliding_layers() -> None:
    _, m, tensors, tokens, ref = built("qwen2-sliding")
    both = with_(m, attention={"layer_types": ["sliding", "sliding"]})
    assert rel_err(decode(both, tensors, tokens), ref) > FAR


@pytest.mark.parametrize("name", ["qwen2-bias", "llama-bias"])
def test_dropped_bias_differs(name: str) -> None:
    _, m, tensors, tokens, ref = built(name)
    no_bias = {k: v for k, v in tensors.items() if not k.endswith(".bias")}
    got = decode(with_(m, attention={"qkv_bias": False, "o_bias": False}), no_bias, tokens)
    assert rel_err(got, ref) > FAR
    zero_q = {k: np.zeros_like(v) if k.endswith("attn_q.bias") else v for k, v in tensors.items()}
    assert rel_err(decode(m, zero_q, tokens), ref) > FAR  # the q bias alone matters


def test_qk_norm_and_scale_matter() -> None:
    _, m, tensors, tokens, ref = built("qwen3-qknorm")
    ones = {k: np.ones_like(v) if "_norm." in k and "attn_" in k else v for k, v in tensors.items()}
    assert rel_err(decode(m, ones, tokens), ref) > FAR
    assert rel_err(decode(with_(m, attention={"scale": 32**-0.5}), tensors, tokens), ref) > FAR


# ---- provider and manifest errors --------------------------------------------------------------


def test_dict_provider_upcasts_to_f32() -> None:
    _, m, tensors, tokens, ref = built("llama2-mha")
    bf16 = {k: v.astype(ml_dtypes.bfloat16) if v.ndim == 2 else v for k, v in tensors.items()}
    p = DictProvider(m, bf16)
    w = p.get("blk.0.attn_q.weight")
    assert w.dtype == np.float32 and np.array_equal(w, bf16["blk.0.attn_q.weight"].astype(np.float32))
    err = rel_err(Decoder(p).logits_for(tokens), ref)
    assert REL_TOL < err < 0.05  # bf16 rounding shows, but the model is intact


def test_rope_freqs_is_required_for_a_static_table() -> None:
    _, m, tensors, _, _ = built("llama2-mha")
    no_freqs = {k: v for k, v in tensors.items() if k != "rope_freqs"}
    with pytest.raises(ConversionError, match="tensor rope_freqs: missing"):
        Decoder(DictProvider(m, no_freqs))


@pytest.mark.parametrize("name", ["llama-dynamic", "phi3-longrope"])
def test_sequence_dependent_rope_acts_past_its_switch(name: str) -> None:
    """Dynamic and longrope: the first 16 positions alone use the base table (the sequence is short),
    the whole 24 the scaled one — both as transformers computes them."""
    _, m, tensors, tokens, ref = built(name)
    fresh, _ = CASES[name]()  # same seed, same weights; transformers' dynamic table is stateful
    with torch.no_grad():
        short = fresh(torch.tensor([tokens[:16]])).logits[0].float().numpy()
    assert rel_err(decode(m, tensors, tokens[:16]), short) <= REL_TOL
    assert rel_err(short, ref[:16]) > FAR  # the scaling really changed the first 16 positions
    plain = with_(m, rope={"scaling": None, "attention_factor": 1.0})
    base = (1.0 / 10000.0 ** (np.arange(0, m["rope"]["rotary_dim"], 2) / m["rope"]["rotary_dim"])).astype(np.float32)
    assert rel_err(decode(plain, {**tensors, "rope_freqs": base}, tokens), ref) > FAR


def test_yarn_attention_factor_matters_in_both_paths() -> None:
    """The factor on cos and sin (0.1·ln 4 + 1 here): dropping it must show, token by token and streamed."""
    _, m, tensors, tokens, ref = built("llama-yarn")
    assert m["rope"]["attention_factor"] > 1.1
    dec = Decoder(DictProvider(m, tensors))  # token by token, each position its own pass
    assert rel_err(np.stack([dec.step(t) for t in tokens]), ref) <= REL_TOL
    lie = with_(m, rope={"attention_factor": 1.0})
    assert rel_err(decode(lie, tensors, tokens), ref) > FAR
    assert rel_err(prefill_logits(DictProvider(lie, tensors), tokens), ref) > FAR
    dec = Decoder(DictProvider(lie, tensors))
    dec.logits_for(tokens[:3])
    assert rel_err(dec.step(tokens[3])[None], ref[3:4]) > FAR


def _drop(t: dict, name: str) -> dict:
    return {k: v for k, v in t.items() if k != name}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m, t: (m, _drop(t, "blk.1.attn_v.bias")), r"tensor blk\.1\.attn_v\.bias: missing"),
        (lambda m, t: (with_(m, attention={"qkv_bias": False}), t),
         r"attn_q\.bias: present but manifest model\.attention\.qkv_bias is false"),
        (lambda m, t: (m, {**t, "blk.0.attn_k.weight": t["blk.0.attn_k.weight"][:16]}),
         r"blk\.0\.attn_k\.weight: shape \[16, 64\], expected \[32, 64\]"),
        (lambda m, t: (m, {**t, "output.weight": t["token_embd.weight"]}),
         r"output\.weight: present but .*tie_word_embeddings"),
        (lambda m, t: (with_(m, attention={"layer_types": ["full", "sliding"]}), t),
         r"sliding_window=None: layer 1 is 'sliding'"),
        (lambda m, t: (with_(m, rope={"layout": "neox"}), t), r"rope\.layout='neox'"),
        (lambda m, t: (_drop(m, "head_dim"), t), r"model\.head_dim: missing"),
    ],
)
def test_manifest_and_tensor_errors(edit, message: str) -> None:
    _, m, tensors, _, _ = built("qwen2-bias")
    m2, t2 = edit(m, tensors)
    with pytest.raises(ConversionError, match=message):
        Decoder(DictProvider(m2, t2))


def test_bad_token_and_prompt() -> None:
    _, m, tensors, _, _ = built("qwen2-bias")
    dec = Decoder(DictProvider(m, tensors))
    with pytest.raises(UsageError, match=r"token id 256: outside the vocabulary \[0, 256\)"):
        dec.step(256)
    with pytest.raises(UsageError, match="prompt"):
        dec.generate([], 3)


# ---- the shipped example checkpoint -------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama"


def test_example_checkpoint_decodes_its_text() -> None:
    """examples/tiny-llama (bf16, tied, llama3 rope) decodes like HF and recites its training text."""
    tok = AutoTokenizer.from_pretrained(EXAMPLE)
    hf = LlamaForCausalLM.from_pretrained(EXAMPLE, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = hf.config
    assert (cfg.vocab_size, len(tok), tok.bos_token_id, tok.eos_token_id) == (384, 384, 0, 1)
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    m = manifest(cfg, "llama", head_dim=16, rotary_dim=16, scaling=scaling)
    m["special_tokens"] = {"bos": 0, "eos": [1, 2], "pad": None}
    dec = Decoder(DictProvider(m, canonical(hf, tied=True)))
    prompt = tok("The river ran slowly").input_ids
    assert prompt[0] == 0
    new = list(dec.generate(prompt, 24))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
        ref_logits = hf(ref).logits[0].numpy()
    assert new == ref[0, len(prompt):].tolist()
    assert rel_err(dec.logits_for(ref[0].tolist()), ref_logits) <= REL_TOL
    assert "past the mill" in tok.decode(new)
