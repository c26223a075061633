"""The arithmetic of the reference decoder, one function per operation the manifest names (spec §2.1,
addendum §2–§3): norms, activations, rotary embedding, attention, expert routing.

Each works in the precision of its input (float32 when decoding, float64 for the probe) and is
tested against PyTorch / transformers.
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)  # numpy has no erf; math's is correctly rounded in float64


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = x · rsqrt(mean(x²) + eps) · w over the last axis, in x's precision."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=x.dtype)
    return (x / np.sqrt(ms + x.dtype.type(eps))) * w


def layer_norm(x: np.ndarray, w: np.ndarray, eps: float, b: np.ndarray | None = None) -> np.ndarray:
    """y = (x − mean(x)) · rsqrt(var(x) + eps) · w (+ b) over the last axis; var is the biased variance."""
    mean = np.mean(x, axis=-1, keepdims=True, dtype=x.dtype)
    centred = x - mean
    var = np.mean(centred * centred, axis=-1, keepdims=True, dtype=x.dtype)
    y = centred / np.sqrt(var + x.dtype.type(eps)) * w
    return y if b is None else y + b


def norm(kind: str, x: np.ndarray, w: np.ndarray, eps: float, b: np.ndarray | None = None) -> np.ndarray:
    """`norm.type` applied with (offset-adjusted) weight `w` and optional bias `b`."""
    return rms_norm(x, w, eps) if kind == "rmsnorm" else layer_norm(x, w, eps, b)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (x.dtype.type(1.0) + np.exp(-x))


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact (erf) GELU: x · Φ(x)."""
    return (0.5 * x * (1.0 + _erf(x.astype(np.float64) / math.sqrt(2.0)).astype(np.float64))).astype(x.dtype)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """PyTorch's gelu(approximate="tanh"): 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    return x.dtype.type(0.5) * x * (x.dtype.type(1.0) + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh}


def sigmoid(x: np.ndarray) -> np.ndarray:
    return x.dtype.type(1.0) / (x.dtype.type(1.0) + np.exp(-x))


def softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    """c · tanh(x / c), or x when there is no cap."""
    return x if cap is None else cap * np.tanh(x / cap)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, layout: str) -> np.ndarray:
    """Rotate the first 2·len(cos) dims of each head of x [heads, head_dim]; the rest pass."""
    half = cos.shape[0]
    rd = 2 * half
    out = x.copy()
    if layout == "half":  # dim i pairs with i + rd/2 (HF rotate_half)
        a, b = x[:, :half], x[:, half:rd]
        out[:, :half] = a * cos - b * sin
        out[:, half:rd] = b * cos + a * sin
    else:  # "interleaved": dim 2i pairs with 2i + 1
        a, b = x[:, 0:rd:2], x[:, 1:rd:2]
        out[:, 0:rd:2] = a * cos - b * sin
        out[:, 1:rd:2] = b * cos + a * sin
    return out


def rope_tables(inv_freq: np.ndarray, pos: int, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (× attention_factor) of position `pos` for each rotation pair."""
    angle = np.float32(pos) * inv_freq  # f32 product, as the HF reference computes it
    cos = (np.cos(angle.astype(np.float64)) * factor).astype(np.float32)
    sin = (np.sin(angle.astype(np.float64)) * factor).astype(np.float32)
    return cos, sin


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, cap: float | None = None) -> np.ndarray:
    """GQA attention of one query q [H, d] over k, v [KV, n, d] (already windowed) → [H·d]:
    scores = softcap((q · k) × scale), softmax in float64."""
    kv_heads, _, d = k.shape
    qg = q.reshape(kv_heads, -1, d)  # query head h uses kv head h // (H / KV)
    scores = softcap(np.einsum("gqd,gnd->gqn", qg, k).astype(np.float64) * scale, cap)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("gqn,gnd->gqd", p.astype(v.dtype), v).reshape(-1)


def route(logits: np.ndarray, k: int, norm_topk: bool) -> tuple[np.ndarray, np.ndarray]:
    """MoE routing of one token (addendum §3): p = softmax(router logits), the k largest (ties →
    lower index), divided by their sum when `norm_topk`. Returns (expert ids, weights)."""
    z = logits - logits.max()
    p = np.exp(z)
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")[:k]
    weights = p[ids]
    if norm_topk:
        weights = weights / weights.sum()
    return ids, weights
