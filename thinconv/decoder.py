"""Numpy reference decoder for THIN v0 models (spec §2): slow, plain, and exact.

It is driven only by the manifest ``model`` object and the canonical tensors, so it checks an
archive (or a converter's tensor mapping) against the spec rather than against any one HF class.
All arithmetic is float32 except the softmax (float64); weights are upcast to f32 once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from thinconv.errors import ConversionError, UsageError
from thinconv.format import spec

_INITIAL_CAPACITY = 16


class WeightProvider(Protocol):
    """Where the decoder reads the manifest `model` object and canonical tensors from."""

    model: dict

    def has(self, name: str) -> bool:
        """Whether canonical tensor `name` (e.g. "blk.0.attn_q.bias") exists."""
        ...

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as float32, shaped as the manifest says ([out, in] for matrices)."""
        ...

    def rows(self, name: str, start: int, end: int) -> np.ndarray:
        """Rows [start, end) of tensor `name` as float32 (used by `prefill_logits`)."""
        ...

    def shape(self, name: str) -> list[int]:
        """The shape of tensor `name`, without reading it."""
        ...


class DictProvider:
    """A WeightProvider over a dict of canonical name → array (any float dtype; upcast to f32)."""

    def __init__(self, model: dict, tensors: Mapping[str, Any]) -> None:
        self.model = model
        self._tensors = dict(tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise ConversionError(f"tensor {name}: missing")
        return np.asarray(self._tensors[name]).astype(np.float32)

    def rows(self, name: str, start: int, end: int) -> np.ndarray:
        return self.get(name)[start:end]

    def shape(self, name: str) -> list[int]:
        return list(np.shape(self._tensors[name]))


@dataclass
class _Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    window: int | None  # sliding window size, or None on a "full" layer


def _field(model: dict, path: str) -> Any:
    """model[a][b]… for path "a.b…", or a ConversionError naming the missing key."""
    node: Any = model
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConversionError(f"manifest model.{path}: missing")
        node = node[part]
    return node


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = x · rsqrt(mean(x²) + eps) · w over the last axis, in x's precision (f32 for decode)."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=x.dtype)
    return (x / np.sqrt(ms + x.dtype.type(eps))) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


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


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """GQA attention of one query q [H, d] over k, v [KV, n, d] (already windowed) → [H·d]."""
    kv_heads, _, d = k.shape
    qg = q.reshape(kv_heads, -1, d)  # query head h uses kv head h // (H / KV)
    scores = np.einsum("gqd,gnd->gqn", qg, k).astype(np.float64) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("gqn,gnd->gqd", p.astype(v.dtype), v).reshape(-1)


class Decoder:
    """Greedy single-sequence decoder over a WeightProvider, with a growing KV cache."""

    def __init__(self, provider: WeightProvider) -> None:
        self._p = provider
        m = provider.model
        self.model = m
        self.hidden = int(_field(m, "hidden_size"))
        self.n_layers = int(_field(m, "num_layers"))
        self.n_heads = int(_field(m, "num_attention_heads"))
        self.n_kv = int(_field(m, "num_kv_heads"))
        self.head_dim = int(_field(m, "head_dim"))
        self.vocab = int(_field(m, "vocab_size"))
        self.inter = int(_field(m, "intermediate_size"))
        self.eps = float(_field(m, "norm.eps"))
        self.scale = float(_field(m, "attention.scale"))
        self._check_supported(m)
        if self.n_heads % self.n_kv:
            raise ConversionError(
                f"manifest model.num_attention_heads={self.n_heads} is not a multiple of "
                f"num_kv_heads={self.n_kv}"
            )
        self.inv_freq, self.attention_factor, self.layout = self._load_rope(m)
        self.embd = self._tensor("token_embd.weight", [self.vocab, self.hidden])
        self.layers = [self._load_layer(m, i) for i in range(self.n_layers)]
        self.out_norm = self._tensor("output_norm.weight", [self.hidden])
        self.head = self._load_head(m)
        self.reset()

    # ---- loading -------------------------------------------------------------------------

    @staticmethod
    def _check_supported(m: dict) -> None:
        if _field(m, "norm.type") != "rmsnorm":
            raise ConversionError(f"manifest model.norm.type={m['norm']['type']!r}: expected 'rmsnorm'")
        mlp = (_field(m, "mlp.type"), _field(m, "mlp.activation"))
        if mlp != ("gated", "silu"):
            raise ConversionError(f"manifest model.mlp={m['mlp']!r}: expected gated silu")

    def _tensor(self, name: str, shape: list[int]) -> np.ndarray:
        if not self._p.has(name):
            raise ConversionError(f"tensor {name}: missing")
        arr = np.ascontiguousarray(self._p.get(name), dtype=np.float32)
        if list(arr.shape) != shape:
            raise ConversionError(f"tensor {name}: shape {list(arr.shape)}, expected {shape}")
        return arr

    def _optional(self, name: str, shape: list[int], present: bool, flag: str) -> np.ndarray | None:
        """Load `name` when the manifest flag says it exists; reject it when the flag says not."""
        if present:
            return self._tensor(name, shape)
        if self._p.has(name):
            raise ConversionError(f"tensor {name}: present but manifest model.{flag} is false")
        return None

    def _load_rope(self, m: dict) -> tuple[np.ndarray, float, str]:
        rotary_dim = int(_field(m, "rope.rotary_dim"))
        layout = _field(m, "rope.layout")
        scaling = _field(m, "rope.scaling")
        kind = None if scaling is None else scaling.get("type")
        if layout not in ("half", "interleaved"):
            raise ConversionError(f"manifest model.rope.layout={layout!r}: expected 'half' or 'interleaved'")
        if rotary_dim % 2 or not 0 < rotary_dim <= self.head_dim:
            raise ConversionError(
                f"manifest model.rope.rotary_dim={rotary_dim}: expected even and ≤ head_dim={self.head_dim}"
            )
        if kind not in spec.STATIC_ROPE_SCALINGS:
            raise ConversionError(
                f"manifest model.rope.scaling.type={kind!r}: not supported by the reference decoder "
                "(it needs the rope_freqs tensor)"
            )
        inv_freq = self._tensor("rope_freqs", [rotary_dim // 2])
        return inv_freq, float(_field(m, "rope.attention_factor")), layout

    def _load_layer(self, m: dict, i: int) -> _Layer:
        h, hd, inter = self.hidden, self.head_dim, self.inter
        q_out, kv_out = self.n_heads * hd, self.n_kv * hd
        qkv_bias = bool(_field(m, "attention.qkv_bias"))
        o_bias = bool(_field(m, "attention.o_bias"))
        qk_norm = bool(_field(m, "attention.qk_norm"))
        b = f"blk.{i}."
        return _Layer(
            attn_norm=self._tensor(b + "attn_norm.weight", [h]),
            wq=self._tensor(b + "attn_q.weight", [q_out, h]),
            wk=self._tensor(b + "attn_k.weight", [kv_out, h]),
            wv=self._tensor(b + "attn_v.weight", [kv_out, h]),
            wo=self._tensor(b + "attn_output.weight", [h, q_out]),
            bq=self._optional(b + "attn_q.bias", [q_out], qkv_bias, "attention.qkv_bias"),
            bk=self._optional(b + "attn_k.bias", [kv_out], qkv_bias, "attention.qkv_bias"),
            bv=self._optional(b + "attn_v.bias", [kv_out], qkv_bias, "attention.qkv_bias"),
            bo=self._optional(b + "attn_output.bias", [h], o_bias, "attention.o_bias"),
            q_norm=self._optional(b + "attn_q_norm.weight", [hd], qk_norm, "attention.qk_norm"),
            k_norm=self._optional(b + "attn_k_norm.weight", [hd], qk_norm, "attention.qk_norm"),
            ffn_norm=self._tensor(b + "ffn_norm.weight", [h]),
            w_gate=self._tensor(b + "ffn_gate.weight", [inter, h]),
            w_up=self._tensor(b + "ffn_up.weight", [inter, h]),
            w_down=self._tensor(b + "ffn_down.weight", [h, inter]),
            window=self._window(m, i),
        )

    def _window(self, m: dict, i: int) -> int | None:
        types = _field(m, "attention.layer_types")
        window = _field(m, "attention.sliding_window")
        if not isinstance(types, list) or len(types) != self.n_layers:
            raise ConversionError(f"manifest model.attention.layer_types: expected {self.n_layers} entries")
        kind = types[i]
        if kind == "full":
            return None
        if kind != "sliding":
            raise ConversionError(
                f"manifest model.attention.layer_types[{i}]={kind!r}: expected 'full' or 'sliding'"
            )
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ConversionError(
                f"manifest model.attention.sliding_window={window!r}: layer {i} is 'sliding', "
                "expected a positive int"
            )
        return window

    def _load_head(self, m: dict) -> np.ndarray:
        if bool(_field(m, "tie_word_embeddings")):
            if self._p.has("output.weight"):
                raise ConversionError(
                    "tensor output.weight: present but manifest model.tie_word_embeddings is true"
                )
            return self.embd
        return self._tensor("output.weight", [self.vocab, self.hidden])

    # ---- decoding ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the sequence: empty KV cache, next token at position 0."""
        self.pos = 0
        shape = (self.n_kv, _INITIAL_CAPACITY, self.head_dim)
        self._k = [np.zeros(shape, np.float32) for _ in self.layers]
        self._v = [np.zeros(shape, np.float32) for _ in self.layers]

    def _grow_cache(self) -> None:
        """Double every layer's cache capacity (amortised O(1) appends)."""
        for cache in (self._k, self._v):
            for i, old in enumerate(cache):
                new = np.zeros((old.shape[0], 2 * old.shape[1], old.shape[2]), np.float32)
                new[:, : old.shape[1]] = old
                cache[i] = new

    def _rope_tables(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        return rope_tables(self.inv_freq, pos, self.attention_factor)

    def _attention(
        self, li: int, layer: _Layer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray
    ) -> np.ndarray:
        """Self-attention of the token at self.pos; appends its k, v to layer li's cache."""
        hd = self.head_dim
        q, k, v = layer.wq @ x, layer.wk @ x, layer.wv @ x
        if layer.bq is not None:
            q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
        q, k, v = q.reshape(-1, hd), k.reshape(-1, hd), v.reshape(-1, hd)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin, self.layout), apply_rope(k, cos, sin, self.layout)
        self._k[li][:, self.pos], self._v[li][:, self.pos] = k, v
        end = self.pos + 1
        start = 0 if layer.window is None else max(0, end - layer.window)  # i − w < j ≤ i
        out = attend(q, self._k[li][:, start:end], self._v[li][:, start:end], self.scale)
        out = layer.wo @ out
        return out if layer.bo is None else out + layer.bo

    @staticmethod
    def _mlp(layer: _Layer, x: np.ndarray) -> np.ndarray:
        return layer.w_down @ (silu(layer.w_gate @ x) * (layer.w_up @ x))

    def step(self, token_id: int) -> np.ndarray:
        """Feed one token at the next position; return f32 logits [vocab] for the position after."""
        if not 0 <= token_id < self.vocab:
            raise UsageError(f"token id {token_id}: outside the vocabulary [0, {self.vocab})")
        if self.pos == self._k[0].shape[1]:
            self._grow_cache()
        cos, sin = self._rope_tables(self.pos)
        x = self.embd[token_id].copy()
        for li, layer in enumerate(self.layers):
            x = x + self._attention(li, layer, rms_norm(x, layer.attn_norm, self.eps), cos, sin)
            x = x + self._mlp(layer, rms_norm(x, layer.ffn_norm, self.eps))
        self.pos += 1
        return (self.head @ rms_norm(x, self.out_norm, self.eps)).astype(np.float32)

    def logits_for(self, tokens: list[int]) -> np.ndarray:
        """Reset, then step through tokens; logits [len(tokens), vocab] (row t predicts t + 1)."""
        self.reset()
        out = np.empty((len(tokens), self.vocab), np.float32)
        for t, tok in enumerate(tokens):
            out[t] = self.step(tok)
        return out

    def generate(self, prompt: list[int], max_new_tokens: int, eos: set[int] | None = None) -> Iterator[int]:
        """Greedy decoding from a fresh cache; yields each new token, stopping after an eos token.

        eos=None uses the manifest's special_tokens.eos; pass an empty set to never stop early.
        Arguments are checked here, before the first token is requested.
        """
        if not prompt:
            raise UsageError("prompt: expected at least one token id")
        if max_new_tokens < 0:
            raise UsageError(f"max_new_tokens={max_new_tokens}: expected ≥ 0")
        stop = set(_field(self.model, "special_tokens.eos")) if eos is None else set(eos)
        return self._greedy(prompt, max_new_tokens, stop)

    def _greedy(self, prompt: list[int], max_new_tokens: int, stop: set[int]) -> Iterator[int]:
        if max_new_tokens == 0:
            return
        logits = self.logits_for(prompt)[-1]
        for n in range(max_new_tokens):
            tok = int(np.argmax(logits))  # first maximum on ties, like torch.argmax
            yield tok
            if tok in stop or n + 1 == max_new_tokens:
                return
            logits = self.step(tok)


def prefill_logits(provider: WeightProvider, tokens: list[int], chunk_values: int = 1 << 19,
                   dtype: type = np.float32) -> np.ndarray:
    """Logits [len(tokens), vocab] of a short sequence, computed layer by layer.

    The same model as `Decoder` (row t predicts token t + 1), but every weight is read once, in
    row chunks of ~chunk_values values through `provider.rows`, and dropped: memory stays at a
    few chunks whatever the model size. The converter computes its probe this way in float64
    (`dtype`), so that the stored float32 logits do not depend on the host's BLAS kernels."""
    m = provider.model
    heads, kv, hd = int(m["num_attention_heads"]), int(m["num_kv_heads"]), int(m["head_dim"])
    eps, scale, n = float(m["norm"]["eps"]), float(m["attention"]["scale"]), len(tokens)
    att, rope = m["attention"], m["rope"]

    def vec(name: str) -> np.ndarray:
        return np.asarray(provider.get(name), dtype)

    def linear(name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        """x @ W.T for W [out, in], W streamed in row chunks."""
        out_rows = provider.shape(name)[0]
        step = max(1, chunk_values // x.shape[1])
        y = np.empty((x.shape[0], out_rows), dtype)
        for a in range(0, out_rows, step):
            b = min(a + step, out_rows)
            y[:, a:b] = x @ np.asarray(provider.rows(name, a, b), dtype).T
        return y + vec(bias) if bias else y

    x = np.concatenate([np.asarray(provider.rows("token_embd.weight", t, t + 1), dtype) for t in tokens])
    tables = [rope_tables(vec("rope_freqs"), pos, float(rope["attention_factor"])) for pos in range(n)]
    for li in range(int(m["num_layers"])):
        b = f"blk.{li}."
        h = rms_norm(x, vec(b + "attn_norm.weight"), eps)
        bias = att["qkv_bias"]
        q = linear(b + "attn_q.weight", h, b + "attn_q.bias" if bias else None).reshape(n, heads, hd)
        k = linear(b + "attn_k.weight", h, b + "attn_k.bias" if bias else None).reshape(n, kv, hd)
        v = linear(b + "attn_v.weight", h, b + "attn_v.bias" if bias else None).reshape(n, kv, hd)
        if att["qk_norm"]:
            q, k = rms_norm(q, vec(b + "attn_q_norm.weight"), eps), rms_norm(k, vec(b + "attn_k_norm.weight"), eps)
        q = np.stack([apply_rope(q[i], *tables[i], rope["layout"]) for i in range(n)])
        k = np.stack([apply_rope(k[i], *tables[i], rope["layout"]) for i in range(n)])
        window = att["sliding_window"] if att["layer_types"][li] == "sliding" else None
        mixed = np.empty((n, heads * hd), dtype)
        for i in range(n):
            start = 0 if window is None else max(0, i + 1 - window)  # i − w < j ≤ i
            mixed[i] = attend(q[i], k[start:i + 1].transpose(1, 0, 2), v[start:i + 1].transpose(1, 0, 2), scale)
        x = x + linear(b + "attn_output.weight", mixed, b + "attn_output.bias" if att["o_bias"] else None)
        h = rms_norm(x, vec(b + "ffn_norm.weight"), eps)
        x = x + linear(b + "ffn_down.weight", silu(linear(b + "ffn_gate.weight", h)) * linear(b + "ffn_up.weight", h))
    head = "token_embd.weight" if m["tie_word_embeddings"] else "output.weight"
    return linear(head, rms_norm(x, vec("output_norm.weight"), eps))
