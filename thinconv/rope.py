"""RoPE inverse frequencies and attention factor, as transformers 5 computes them (numpy only).

The input is the manifest's ``model.rope`` object (spec §2.1): ``theta``, ``rotary_dim`` and
``scaling`` (null, or the source's parameters under their HF names with the type in ``type``).
Everything is computed in float64 (from float32-rounded exponents, see `_exponents`) and cast
to float32 once, at the end.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from thinconv.errors import ConversionError, shown

#: Scaling types whose frequencies depend on the sequence length at run time (no `rope_freqs`).
DYNAMIC_SCALING_TYPES = frozenset({"dynamic", "longrope"})

_WHERE = "rope.scaling"


def _guarded(fn):
    """Any arithmetic failure (theta 1 divides by log 1, a list where a number belongs, overflow)
    becomes one ConversionError, and a table or factor that is not finite and positive is refused:
    a runtime cannot rotate by it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with np.errstate(all="ignore"):
                out = fn(*args, **kwargs)
        except ConversionError:
            raise
        except (ArithmeticError, ValueError, TypeError, KeyError) as e:
            raise ConversionError(f"rope: the RoPE parameters cannot be evaluated ({type(e).__name__}: {e})") from None
        values = np.atleast_1d(np.asarray(out, np.float64)) if out is not None else np.ones(1)
        if not (np.isfinite(values).all() and (values > 0).all()):
            raise ConversionError(f"rope: the RoPE parameters give {'a table' if np.ndim(out) else 'a factor'} that "
                                  f"is not finite and positive (theta, factors out of range?)")
        return out

    return wrapper


@_guarded
def rope_inv_freq(
    rope: Mapping[str, Any], *, head_dim: int, max_position_embeddings: int
) -> np.ndarray | None:
    """The final inverse frequencies, float32 [rotary_dim/2], for the manifest's `model.rope` object
    (keys theta, rotary_dim, layout, scaling, attention_factor). None for scaling types with no static
    table (dynamic, longrope)."""
    theta = _number(rope, "theta", "rope")
    if theta <= 0:
        raise ConversionError(f"rope: 'theta' must be positive, got {shown(theta)}")
    dim = rope.get("rotary_dim")
    if not _is_int(dim) or dim <= 0 or dim % 2 or dim > head_dim:
        raise ConversionError(
            f"rope: 'rotary_dim' must be an even positive integer <= head_dim {head_dim}, got {shown(dim)}"
        )
    scaling = rope.get("scaling")
    kind = scaling_type(scaling)
    if kind in DYNAMIC_SCALING_TYPES:
        return None
    base = _default_inv_freq(theta, dim)
    if kind is None:
        inv = base
    elif kind == "linear":
        inv = base / _number(scaling, "factor", _WHERE)
    elif kind == "llama3":
        inv = _llama3(base, scaling)
    elif kind == "yarn":
        inv = _yarn(theta, dim, scaling, max_position_embeddings)
    else:
        raise ConversionError(f"{_WHERE}: unsupported RoPE scaling type {kind!r}")
    return inv.astype(np.float32)


@_guarded
def runtime_inv_freq(rope: Mapping[str, Any], *, head_dim: int, max_position_embeddings: int,
                     seq_len: int) -> np.ndarray:
    """The inverse frequencies a forward pass over positions [0, seq_len) uses, float32 — for the
    scalings whose table depends on the sequence length (transformers' `dynamic_rope_update`):

    * dynamic (NTK): theta · ((factor · L / max_pos) − (factor − 1))^(d / (d − 2)) with
      L = max(seq_len, max_position_embeddings), then the default table;
    * longrope: 1 / (ext_i · theta^(2i/d)), ext = long_factor when seq_len >
      original_max_position_embeddings, else short_factor.
    Static scalings return their fixed table (`rope_inv_freq`)."""
    scaling = rope.get("scaling")
    kind = scaling_type(scaling)
    if kind not in DYNAMIC_SCALING_TYPES:
        return rope_inv_freq(rope, head_dim=head_dim, max_position_embeddings=max_position_embeddings)
    theta, dim = _number(rope, "theta", "rope"), int(rope["rotary_dim"])
    if kind == "dynamic":
        if dim <= 2:
            raise ConversionError(f"rope: dynamic scaling needs rotary_dim > 2, got {dim}")
        factor = _number(scaling, "factor", _WHERE)
        length = max(seq_len, max_position_embeddings)
        base = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return (1.0 / base ** _exponents(dim)).astype(np.float32)
    original = _original_max(scaling, max_position_embeddings)
    ext = scaling.get("long_factor" if seq_len > original else "short_factor")
    if not isinstance(ext, list) or len(ext) != dim // 2:
        raise ConversionError(f"{_WHERE}: longrope factors must list rotary_dim/2 = {dim // 2} numbers")
    ext32 = np.asarray(ext, np.float32).astype(np.float64)
    return (1.0 / (ext32 * theta ** _exponents(dim))).astype(np.float32)


def model_rope_freqs(model: Mapping[str, Any]) -> np.ndarray | None:
    """`rope_inv_freq` for a manifest `model` object: the table its `rope_freqs` tensor holds."""
    return rope_inv_freq(model["rope"], head_dim=model["head_dim"],
                         max_position_embeddings=model["max_position_embeddings"])


def derived_tables(model: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The model's derived tensors (spec §2.2, addendum §2): `rope_freqs`, and `rope_freqs_sliding` for
    a sliding-layer RoPE — each present when its scaling has a static table."""
    out = {}
    for name, rope in (("rope_freqs", model["rope"]), ("rope_freqs_sliding", model["rope"].get("sliding"))):
        if rope is None:
            continue
        params = {**rope, "rotary_dim": model["rope"]["rotary_dim"]}
        table = rope_inv_freq(params, head_dim=model["head_dim"], max_position_embeddings=model["max_position_embeddings"])
        if table is not None:
            out[name] = table
    return out


def check_rope(model: Mapping[str, Any]) -> None:
    """Refuse a `model` whose RoPE cannot be computed or is not finite: its static tables, and a
    sequence-dependent table at the context's end."""
    derived_tables(model)
    for rope in (model["rope"], model["rope"].get("sliding")):
        if rope is not None:
            params = {**rope, "rotary_dim": model["rope"]["rotary_dim"]}
            runtime_inv_freq(params, head_dim=model["head_dim"], max_position_embeddings=model["max_position_embeddings"],
                             seq_len=model["max_position_embeddings"] + 1)


@_guarded
def rope_attention_factor(rope_parameters: Mapping[str, Any] | None, *, max_position_embeddings: int) -> float:
    """The factor on cos and sin for `rope.scaling` (`type` or HF's `rope_type` key): yarn and
    longrope as transformers computes it (explicit `attention_factor` wins); 1.0 otherwise."""
    kind = scaling_type(rope_parameters)
    if kind not in ("yarn", "longrope"):
        return 1.0  # transformers ignores an attention_factor given to other types
    assert rope_parameters is not None
    explicit = rope_parameters.get("attention_factor")
    if explicit is not None:
        return _number(rope_parameters, "attention_factor", _WHERE)
    factor = _factor_or_ratio(rope_parameters, max_position_embeddings)
    if kind == "yarn":
        mscale = rope_parameters.get("mscale")
        mscale_all_dim = rope_parameters.get("mscale_all_dim")
        # transformers tests truthiness: a 0 for either falls back to the plain formula
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return _yarn_mscale(factor, 1.0)
    if factor <= 1.0:
        return 1.0
    original = _original_max(rope_parameters, max_position_embeddings)
    return math.sqrt(1.0 + math.log(factor) / math.log(original))


def scaling_type(scaling: Mapping[str, Any] | None) -> str | None:
    """The scaling type of a `rope.scaling` object (None for no scaling / "default")."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ConversionError(f"{_WHERE}: must be an object or null, got {shown(scaling)}")
    kind = scaling.get("type", scaling.get("rope_type", "default"))
    if not isinstance(kind, str):
        raise ConversionError(f"{_WHERE}: 'type' must be a string, got {shown(kind)}")
    return None if kind == "default" else kind


def _exponents(dim: int) -> np.ndarray:
    """2i/dim for i < dim/2, rounded to float32 as every reference implementation computes it
    (transformers, Meta's): for dims that are not powers of two the rounding moves theta**x by up
    to ~1e-6 relative, more than the float64 math would otherwise differ."""
    return (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / theta ** _exponents(dim)


def _llama3(inv_freq: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
    factor = _number(p, "factor", _WHERE)
    low = _number(p, "low_freq_factor", _WHERE)
    high = _number(p, "high_freq_factor", _WHERE)
    old_context = _number(p, "original_max_position_embeddings", _WHERE)
    if high == low:
        raise ConversionError(f"{_WHERE}: llama3 needs high_freq_factor != low_freq_factor, both are {low!r}")
    low_wavelen = old_context / low
    high_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, p: Mapping[str, Any], max_position_embeddings: int) -> np.ndarray:
    factor = _factor_or_ratio(p, max_position_embeddings)
    original = _original_max(p, max_position_embeddings)
    # transformers: `get("beta_fast") or 32` — a 0 or null means the default too
    beta_fast = float(p.get("beta_fast") or 32)
    beta_slow = float(p.get("beta_slow") or 1)
    truncate = p.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    # The blend weight is rounded to float32 as transformers computes it: its error is multiplied
    # by (factor - 1) in the result, so float64 weights would drift from the reference by > 1e-6.
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolation = (np.float32(1) - np.clip(ramp, 0, 1)).astype(np.float64)  # weight of the unscaled frequency
    pos_freqs = theta ** _exponents(dim)
    return (1.0 / (factor * pos_freqs)) * (1.0 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_mscale(scale: float, mscale: float) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _factor_or_ratio(p: Mapping[str, Any], max_position_embeddings: int) -> float:
    """`factor`, or (yarn/longrope, when null or absent) max_position_embeddings / original."""
    if p.get("factor") is not None:
        return _number(p, "factor", _WHERE)
    return max_position_embeddings / _original_max(p, max_position_embeddings)


def _original_max(p: Mapping[str, Any], max_position_embeddings: int) -> float:
    if p.get("original_max_position_embeddings") is None:
        return float(max_position_embeddings)  # transformers' standardize_rope_params default
    value = _number(p, "original_max_position_embeddings", _WHERE)
    if value <= 0:
        raise ConversionError(f"{_WHERE}: 'original_max_position_embeddings' must be positive, got {shown(value)}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConversionError(f"{where}: '{key}' must be a finite number, got {shown(value)}")
    return float(value)
