"""Numpy reference decoder for THIN v0 models (spec §2): slow, plain, and exact.

It is driven only by the manifest `model` object (read through `format.schema`, so absent optional
keys mean their defaults) and the canonical tensors, so it checks an archive — or a converter's
tensor mapping — against the spec rather than against any one HF class.

One forward pass serves both ways of running it: `Decoder` keeps the weights resident in float32
and decodes token by token with a KV cache; `prefill_logits` streams every weight once, in row
chunks, over a whole short sequence (bounded memory; float64 for the probe). Both run `forward`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from thinconv.errors import ConversionError, UsageError
from thinconv.format import schema, spec

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


# ---------------------------------------------------------------- what the manifest says

def _field(model: dict, path: str) -> Any:
    """The value of `model.<path>` (its default when an optional key is absent), or a
    ConversionError naming the missing key."""
    try:
        return schema.value(model, path)
    except (KeyError, TypeError):
        raise ConversionError(f"manifest model.{path}: missing") from None


@dataclass(frozen=True)
class Arch:
    """What the decoder computes, from the manifest `model` object, checked once."""

    hidden: int
    n_layers: int
    n_heads: int
    n_kv: int
    head_dim: int
    vocab: int
    eps: float
    scale: float
    layout: str
    attention_factor: float
    windows: tuple[int | None, ...]  # per layer: the sliding window, or None on a "full" layer
    tied: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @classmethod
    def from_model(cls, m: dict) -> "Arch":
        dims = {k: int(_field(m, k)) for k in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
                                                "head_dim", "vocab_size", "intermediate_size")}
        if _field(m, "norm.type") != "rmsnorm":
            raise ConversionError(f"manifest model.norm.type={m['norm']['type']!r}: expected 'rmsnorm'")
        if (_field(m, "mlp.type"), _field(m, "mlp.activation")) != ("gated", "silu"):
            raise ConversionError(f"manifest model.mlp={m['mlp']!r}: expected gated silu")
        if dims["num_attention_heads"] % dims["num_kv_heads"]:
            raise ConversionError(f"manifest model.num_attention_heads={dims['num_attention_heads']} is not a "
                                  f"multiple of num_kv_heads={dims['num_kv_heads']}")
        layout = _field(m, "rope.layout")
        if layout not in schema.BY_PATH["rope.layout"].choices:
            raise ConversionError(f"manifest model.rope.layout={layout!r}: expected 'half' or 'interleaved'")
        rotary_dim = int(_field(m, "rope.rotary_dim"))
        if rotary_dim % 2 or not 0 < rotary_dim <= dims["head_dim"]:
            raise ConversionError(f"manifest model.rope.rotary_dim={rotary_dim}: expected even and ≤ "
                                  f"head_dim={dims['head_dim']}")
        scaling = _field(m, "rope.scaling")
        kind = None if scaling is None else scaling.get("type")
        if kind not in spec.STATIC_ROPE_SCALINGS:
            raise ConversionError(f"manifest model.rope.scaling.type={kind!r}: not supported by the reference decoder "
                                  "(it needs the rope_freqs tensor)")
        return cls(hidden=dims["hidden_size"], n_layers=dims["num_layers"], n_heads=dims["num_attention_heads"],
                   n_kv=dims["num_kv_heads"], head_dim=dims["head_dim"], vocab=dims["vocab_size"],
                   eps=float(_field(m, "norm.eps")), scale=float(_field(m, "attention.scale")), layout=layout,
                   attention_factor=float(_field(m, "rope.attention_factor")),
                   windows=_windows(m, dims["num_layers"]), tied=bool(_field(m, "tie_word_embeddings")),
                   qkv_bias=bool(_field(m, "attention.qkv_bias")), o_bias=bool(_field(m, "attention.o_bias")),
                   qk_norm=bool(_field(m, "attention.qk_norm")))


def _windows(m: dict, n_layers: int) -> tuple[int | None, ...]:
    types = _field(m, "attention.layer_types")
    window = _field(m, "attention.sliding_window")
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConversionError(f"manifest model.attention.layer_types: expected {n_layers} entries")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == "full":
            out.append(None)
        elif kind != "sliding":
            raise ConversionError(f"manifest model.attention.layer_types[{i}]={kind!r}: expected 'full' or 'sliding'")
        elif not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ConversionError(f"manifest model.attention.sliding_window={window!r}: layer {i} is 'sliding', "
                                  "expected a positive int")
        else:
            out.append(window)
    return tuple(out)


def check_tensors(provider: WeightProvider) -> None:
    """Every tensor the model's flags imply exists with the shape its dimensions imply; none that
    the flags rule out is present."""
    m = provider.model
    want = spec.tensor_names(m)
    for name in want:
        role, _ = spec.split_name(name)
        if not provider.has(name):
            raise ConversionError(f"tensor {name}: missing")
        shape, expected = list(provider.shape(name)), spec.expected_shape(m, role)
        if shape != expected:
            raise ConversionError(f"tensor {name}: shape {shape}, expected {expected}")
    wanted = set(want)
    for r in spec.ROLE_TABLE:
        names = [f"blk.{i}.{r.name}" for i in range(int(m["num_layers"]))] if r.per_layer else [r.name]
        for name in names:
            if name not in wanted and provider.has(name):
                value = json.dumps(schema.value(m, r.flag)) if r.flag else "what the flags say"
                raise ConversionError(f"tensor {name}: present but manifest model.{r.flag} is {value}")


# ---------------------------------------------------------------- the arithmetic

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = x · rsqrt(mean(x²) + eps) · w over the last axis, in x's precision (f32 for decode)."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=x.dtype)
    return (x / np.sqrt(ms + x.dtype.type(eps))) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (x.dtype.type(1.0) + np.exp(-x))


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


# ---------------------------------------------------------------- weights, two ways

class _Weights:
    """The decoder's view of the tensors: vectors, matrix products and embedding rows."""

    def __init__(self, provider: WeightProvider, dtype: type):
        self.p, self.dtype = provider, dtype

    def has(self, name: str) -> bool:
        return self.p.has(name)

    def vec(self, name: str) -> np.ndarray:
        return np.asarray(self.p.get(name), self.dtype)

    def embed(self, tokens: list[int]) -> np.ndarray:
        return np.concatenate([np.asarray(self.p.rows("token_embd.weight", t, t + 1), self.dtype) for t in tokens])

    def linear(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        raise NotImplementedError


class _Resident(_Weights):
    """Every tensor loaded once as float32: token-by-token decoding."""

    def __init__(self, provider: WeightProvider):
        super().__init__(provider, np.float32)
        self._cache: dict[str, np.ndarray] = {}

    def vec(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = np.ascontiguousarray(self.p.get(name), dtype=np.float32)
        return self._cache[name]

    def embed(self, tokens: list[int]) -> np.ndarray:
        return self.vec("token_embd.weight")[tokens]

    def linear(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        y = x @ self.vec(name).T
        return y + self.vec(bias) if bias else y


class _Streamed(_Weights):
    """Every matrix read once, in row chunks of ~chunk_values values, then dropped: bounded memory."""

    def __init__(self, provider: WeightProvider, dtype: type, chunk_values: int):
        super().__init__(provider, dtype)
        self.chunk_values = chunk_values

    def linear(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        """x @ W.T for W [out, in], W streamed in row chunks."""
        out_rows = self.p.shape(name)[0]
        step = max(1, self.chunk_values // x.shape[1])
        y = np.empty((x.shape[0], out_rows), self.dtype)
        for a in range(0, out_rows, step):
            b = min(a + step, out_rows)
            y[:, a:b] = x @ np.asarray(self.p.rows(name, a, b), self.dtype).T
        return y + self.vec(bias) if bias else y


# ---------------------------------------------------------------- one forward pass

class KVCache:
    """Per layer, the keys and values of every position so far ([kv_heads, capacity, head_dim])."""

    def __init__(self, arch: Arch, dtype: type):
        self.arch, self.dtype, self.length = arch, dtype, 0
        shape = (arch.n_kv, _INITIAL_CAPACITY, arch.head_dim)
        self.k = [np.zeros(shape, dtype) for _ in range(arch.n_layers)]
        self.v = [np.zeros(shape, dtype) for _ in range(arch.n_layers)]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store [n, kv_heads, head_dim] new keys and values at positions length … length + n − 1."""
        end = self.length + k.shape[0]
        while end > self.k[layer].shape[1]:  # double the capacity: amortised O(1) appends
            for cache in (self.k, self.v):
                old = cache[layer]
                cache[layer] = np.zeros((old.shape[0], 2 * old.shape[1], old.shape[2]), self.dtype)
                cache[layer][:, : old.shape[1]] = old
        self.k[layer][:, self.length:end] = k.transpose(1, 0, 2)
        self.v[layer][:, self.length:end] = v.transpose(1, 0, 2)


def forward(arch: Arch, w: _Weights, tokens: list[int], cache: KVCache) -> np.ndarray:
    """Logits [len(tokens), vocab] for `tokens` at positions cache.length …; the cache grows by them."""
    start, n = cache.length, len(tokens)
    positions = range(start, start + n)
    inv_freq = w.vec("rope_freqs")
    tables = [rope_tables(inv_freq, pos, arch.attention_factor) for pos in positions]
    x = w.embed(tokens)
    for li in range(arch.n_layers):
        b = f"blk.{li}."
        h = rms_norm(x, w.vec(b + "attn_norm.weight"), arch.eps)
        x = x + _attention(arch, w, li, h, tables, cache)
        h = rms_norm(x, w.vec(b + "ffn_norm.weight"), arch.eps)
        x = x + w.linear(b + "ffn_down.weight", silu(w.linear(b + "ffn_gate.weight", h)) * w.linear(b + "ffn_up.weight", h))
    cache.length += n
    head = "token_embd.weight" if arch.tied else "output.weight"
    return w.linear(head, rms_norm(x, w.vec("output_norm.weight"), arch.eps))


def _attention(arch: Arch, w: _Weights, li: int, h: np.ndarray, tables: list, cache: KVCache) -> np.ndarray:
    """Self-attention of positions cache.length … over the cache and themselves; appends their k, v."""
    b, n, hd = f"blk.{li}.", h.shape[0], arch.head_dim
    bias = arch.qkv_bias
    q = w.linear(b + "attn_q.weight", h, b + "attn_q.bias" if bias else None).reshape(n, arch.n_heads, hd)
    k = w.linear(b + "attn_k.weight", h, b + "attn_k.bias" if bias else None).reshape(n, arch.n_kv, hd)
    v = w.linear(b + "attn_v.weight", h, b + "attn_v.bias" if bias else None).reshape(n, arch.n_kv, hd)
    if arch.qk_norm:
        q = rms_norm(q, w.vec(b + "attn_q_norm.weight"), arch.eps)
        k = rms_norm(k, w.vec(b + "attn_k_norm.weight"), arch.eps)
    q = np.stack([apply_rope(q[i], *tables[i], arch.layout) for i in range(n)])
    k = np.stack([apply_rope(k[i], *tables[i], arch.layout) for i in range(n)])
    cache.append(li, k, v)
    window = arch.windows[li]
    mixed = np.empty((n, arch.n_heads * hd), q.dtype)
    for i in range(n):
        end = cache.length + i + 1
        first = 0 if window is None else max(0, end - window)  # i − w < j ≤ i
        mixed[i] = attend(q[i], cache.k[li][:, first:end], cache.v[li][:, first:end], arch.scale)
    return w.linear(b + "attn_output.weight", mixed, b + "attn_output.bias" if arch.o_bias else None)


# ---------------------------------------------------------------- the two entry points

class Decoder:
    """Greedy single-sequence decoder over a WeightProvider, with a growing KV cache."""

    def __init__(self, provider: WeightProvider) -> None:
        self.model = provider.model
        self.arch = Arch.from_model(provider.model)
        check_tensors(provider)
        self._w = _Resident(provider)
        for name in spec.tensor_names(provider.model):  # load (and upcast) everything once, up front
            self._w.vec(name)
        self.vocab = self.arch.vocab
        self.reset()

    def reset(self) -> None:
        """Forget the sequence: empty KV cache, next token at position 0."""
        self._cache = KVCache(self.arch, np.float32)

    @property
    def pos(self) -> int:
        return self._cache.length

    def step(self, token_id: int) -> np.ndarray:
        """Feed one token at the next position; return f32 logits [vocab] for the position after."""
        if not 0 <= token_id < self.vocab:
            raise UsageError(f"token id {token_id}: outside the vocabulary [0, {self.vocab})")
        return forward(self.arch, self._w, [token_id], self._cache)[0].astype(np.float32)

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
    arch = Arch.from_model(provider.model)
    return forward(arch, _Streamed(provider, dtype, chunk_values), list(tokens), KVCache(arch, dtype))

