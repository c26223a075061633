"""Numpy reference decoder for THIN v0 models (spec §2, the vocabulary addendum): slow, plain, exact.

It is driven only by the manifest `model` object (read through `format.schema`, so absent optional
keys mean their defaults) and the canonical tensors, so it checks an archive — or a converter's
tensor mapping — against the spec rather than against any one HF class. The arithmetic of each
operation is in `thinconv.nn`.

One forward pass serves both ways of running it: `Decoder` keeps the weights resident in float32
and decodes with a KV cache; `prefill_logits` streams every weight once, in row chunks, over a
whole short sequence (bounded memory; float64 for the probe). Both run `forward`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from thinconv import nn
from thinconv.errors import ConversionError, UsageError
from thinconv.format import schema, spec
from thinconv.rope import DYNAMIC_SCALING_TYPES, runtime_inv_freq

_INITIAL_CAPACITY = 16


class WeightProvider(Protocol):
    """Where the decoder reads the manifest `model` object and canonical tensors from."""

    model: dict

    def has(self, name: str) -> bool:
        """Whether canonical tensor `name` (e.g. "blk.0.attn_q.bias") exists."""
        ...

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as float32, shaped as the manifest says ([out, in]; [E, out, in] for experts)."""
        ...

    def rows(self, name: str, start: int, end: int) -> np.ndarray:
        """Rows [start, end) of tensor `name` as a float32 matrix (a 3-D [E, r, c] tensor counts
        rows of its [E·r, c] view), for streaming."""
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
        t = self.get(name)
        return (t.reshape(-1, t.shape[-1]) if t.ndim == 3 else t)[start:end]

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
class Rope:
    """One rotary embedding: its table (a tensor, or computed per sequence length) and factor."""

    table: str | None  # the tensor holding the static inverse frequencies, or None (dynamic, longrope)
    params: dict  # theta, rotary_dim, scaling: what a sequence-dependent table is computed from
    factor: float  # attention_factor: multiplies cos and sin


@dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int
    norm_topk: bool
    layers: tuple[bool, ...]
    shared: bool
    shared_gate: bool


@dataclass(frozen=True)
class Arch:
    """Everything the decoder computes, from the manifest `model` object, checked once."""

    hidden: int
    n_layers: int
    n_heads: int
    n_kv: int
    head_dim: int
    vocab: int
    max_pos: int
    tied: bool
    norm_type: str
    eps: float
    norm_offset: float
    norm_bias: bool
    gated: bool
    act: str
    mlp_bias: bool
    parallel: bool
    shared_norm: bool
    pre_norm: bool
    post_norm: bool
    residual_scale: float
    emb_scale: float
    logit_scale: float
    logit_softcap: float | None
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    qk_per_head: bool
    qk_full: bool
    scale: float
    softcap: float | None
    layout: str
    windows: tuple[int | None, ...]  # per layer: the sliding window, or None on a "full" layer
    rope_layers: tuple[bool, ...]
    rope: Rope
    rope_sliding: Rope | None
    moe: MoE | None

    @classmethod
    def from_model(cls, m: dict) -> "Arch":
        f = lambda path: _field(m, path)  # noqa: E731
        dims = {k: int(f(k)) for k in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
                                        "head_dim", "vocab_size", "intermediate_size", "max_position_embeddings")}
        n = dims["num_layers"]
        _check_choices(m)
        if dims["num_attention_heads"] % dims["num_kv_heads"]:
            raise ConversionError(f"manifest model.num_attention_heads={dims['num_attention_heads']} is not a "
                                  f"multiple of num_kv_heads={dims['num_kv_heads']}")
        return cls(
            hidden=dims["hidden_size"], n_layers=n, n_heads=dims["num_attention_heads"], n_kv=dims["num_kv_heads"],
            head_dim=dims["head_dim"], vocab=dims["vocab_size"], max_pos=dims["max_position_embeddings"],
            tied=bool(f("tie_word_embeddings")), norm_type=f("norm.type"), eps=float(f("norm.eps")),
            norm_offset=float(f("norm.weight_offset")), norm_bias=bool(f("norm.bias")),
            gated=f("mlp.type") == "gated", act=f("mlp.activation"), mlp_bias=bool(f("mlp.bias")),
            parallel=f("block.residual") == "parallel", shared_norm=bool(f("block.shared_norm")),
            pre_norm=bool(f("block.pre_norm")), post_norm=bool(f("block.post_norm")),
            residual_scale=float(f("block.residual_scale")), emb_scale=float(f("embedding.scale")),
            logit_scale=float(f("logits.scale")), logit_softcap=f("logits.softcap"),
            qkv_bias=bool(f("attention.qkv_bias")), o_bias=bool(f("attention.o_bias")),
            qk_norm=bool(f("attention.qk_norm")), qk_per_head=f("attention.qk_norm_weights") == "per_head",
            qk_full=f("attention.qk_norm_scope") == "full", scale=float(f("attention.scale")),
            softcap=f("attention.softcap"), layout=f("rope.layout"), windows=_windows(m, n),
            rope_layers=tuple(_flags(m, "rope.layers", n)), rope=_rope(m, dims["head_dim"]),
            rope_sliding=_rope(m, dims["head_dim"], sliding=True), moe=_moe(m, n))


_SUPPORTED = {"norm.type": ("rmsnorm", "layernorm"), "mlp.type": ("gated", "plain"),
              "mlp.activation": tuple(nn.ACTIVATIONS), "rope.layout": ("half", "interleaved"),
              "block.residual": ("sequential", "parallel"), "attention.qk_norm_weights": ("shared", "per_head"),
              "attention.qk_norm_scope": ("head", "full")}


def _check_choices(m: dict) -> None:
    for path, choices in _SUPPORTED.items():
        v = _field(m, path)
        if v not in choices:
            raise ConversionError(f"manifest model.{path}={v!r}: expected {' or '.join(map(repr, choices))}")


def _rope(m: dict, head_dim: int, sliding: bool = False) -> Rope | None:
    if sliding:
        obj = _field(m, "rope.sliding")
        if obj is None:
            return None
        params = {"theta": obj["theta"], "rotary_dim": _field(m, "rope.rotary_dim"), "scaling": obj["scaling"]}
        table, factor = "rope_freqs_sliding", obj["attention_factor"]
    else:
        params = {k: _field(m, f"rope.{k}") for k in ("theta", "rotary_dim", "scaling")}
        table, factor = "rope_freqs", _field(m, "rope.attention_factor")
    rotary_dim = params["rotary_dim"]
    if not isinstance(rotary_dim, int) or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConversionError(f"manifest model.rope.rotary_dim={rotary_dim}: expected even and ≤ head_dim={head_dim}")
    scaling = params["scaling"]
    kind = None if scaling is None else scaling.get("type")
    if kind in DYNAMIC_SCALING_TYPES:
        table = None
    elif kind not in spec.STATIC_ROPE_SCALINGS:
        raise ConversionError(f"manifest model.rope.scaling.type={kind!r}: not supported by the reference decoder")
    return Rope(table, params, float(factor))


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


def _flags(m: dict, path: str, n_layers: int) -> list[bool]:
    v = _field(m, path)
    if not isinstance(v, list) or len(v) != n_layers or not all(isinstance(x, bool) for x in v):
        raise ConversionError(f"manifest model.{path}: expected {n_layers} booleans")
    return v


def _moe(m: dict, n_layers: int) -> MoE | None:
    moe = _field(m, "moe")
    if moe is None:
        return None
    if moe.get("scoring") != "softmax":
        raise ConversionError(f"manifest model.moe.scoring={moe.get('scoring')!r}: expected 'softmax'")
    shared = moe.get("shared_expert")
    return MoE(experts=int(moe["num_experts"]), top_k=int(moe["num_experts_per_tok"]),
               norm_topk=bool(moe["norm_topk_prob"]), layers=tuple(_flags(m, "moe.layers", n_layers)),
               shared=shared is not None, shared_gate=bool(shared and shared["gate"]))


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


# ---------------------------------------------------------------- weights, two ways

class _Weights:
    """The decoder's view of the tensors: vectors, matrix products and embedding rows."""

    def __init__(self, provider: WeightProvider, dtype: type, offset: float):
        self.p, self.dtype, self.offset = provider, dtype, offset

    def vec(self, name: str) -> np.ndarray:
        return np.asarray(self.p.get(name), self.dtype)

    def norm_weight(self, name: str) -> np.ndarray:
        """A norm's weight as it multiplies: o + w (addendum: norm.weight_offset)."""
        w = self.vec(name)
        return w if self.offset == 0 else w + self.dtype(self.offset)

    def embed(self, tokens: list[int]) -> np.ndarray:
        return np.concatenate([np.asarray(self.p.rows("token_embd.weight", t, t + 1), self.dtype) for t in tokens])

    def linear(self, name: str, x: np.ndarray, bias: str | None = None) -> np.ndarray:
        """x @ Wᵀ (+ bias) for W [out, in]."""
        y = self._matmul(name, x, 0, self.p.shape(name)[0])
        return y + self.vec(bias) if bias else y

    def expert_linear(self, name: str, expert: int, x: np.ndarray) -> np.ndarray:
        """x @ W[expert]ᵀ for an expert tensor W [E, out, in]."""
        rows = self.p.shape(name)[1]
        return self._matmul(name, x, expert * rows, (expert + 1) * rows)

    def _matmul(self, name: str, x: np.ndarray, start: int, end: int) -> np.ndarray:
        raise NotImplementedError


class _Resident(_Weights):
    """Every tensor loaded once as float32: decoding with a KV cache."""

    def __init__(self, provider: WeightProvider, offset: float):
        super().__init__(provider, np.float32, offset)
        self._cache: dict[str, np.ndarray] = {}

    def vec(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = np.ascontiguousarray(self.p.get(name), dtype=np.float32)
        return self._cache[name]

    def embed(self, tokens: list[int]) -> np.ndarray:
        return self.vec("token_embd.weight")[tokens]

    def _matmul(self, name: str, x: np.ndarray, start: int, end: int) -> np.ndarray:
        w = self.vec(name)
        return x @ (w.reshape(-1, w.shape[-1]) if w.ndim == 3 else w)[start:end].T


class _Streamed(_Weights):
    """Every matrix read once, in row chunks of ~chunk_values values, then dropped: bounded memory."""

    def __init__(self, provider: WeightProvider, dtype: type, offset: float, chunk_values: int):
        super().__init__(provider, dtype, offset)
        self.chunk_values = chunk_values

    def _matmul(self, name: str, x: np.ndarray, start: int, end: int) -> np.ndarray:
        step = max(1, self.chunk_values // x.shape[1])
        y = np.empty((x.shape[0], end - start), self.dtype)
        for a in range(start, end, step):
            b = min(a + step, end)
            y[:, a - start:b - start] = x @ np.asarray(self.p.rows(name, a, b), self.dtype).T
        return y


# ---------------------------------------------------------------- one forward pass

class KVCache:
    """Per layer, the keys and values of every position so far ([kv_heads, capacity, head_dim])."""

    def __init__(self, arch: Arch, dtype: type):
        self.dtype, self.length = dtype, 0
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


def _tables(arch: Arch, w: _Weights, rope: Rope, positions: range) -> list:
    """cos / sin per position: from the archive's table, or computed for this sequence length."""
    if rope.table is not None:
        inv_freq = w.vec(rope.table)
    else:
        inv_freq = np.asarray(runtime_inv_freq(rope.params, head_dim=arch.head_dim, max_position_embeddings=arch.max_pos,
                                               seq_len=positions.stop), w.dtype)
    return [nn.rope_tables(inv_freq, pos, rope.factor) for pos in positions]


def forward(arch: Arch, w: _Weights, tokens: list[int], cache: KVCache) -> np.ndarray:
    """Logits [len(tokens), vocab] for `tokens` at positions cache.length …; the cache grows by them."""
    positions = range(cache.length, cache.length + len(tokens))
    tables = {"global": _tables(arch, w, arch.rope, positions)}
    if arch.rope_sliding is not None:
        tables["sliding"] = _tables(arch, w, arch.rope_sliding, positions)
    x = w.embed(tokens)
    if arch.emb_scale != 1:
        x = x * w.dtype(arch.emb_scale)
    for li in range(arch.n_layers):
        x = _layer(arch, w, li, x, tables, cache)
    cache.length += len(tokens)
    head = "token_embd.weight" if arch.tied else "output.weight"
    logits = w.linear(head, _norm(arch, w, "output_norm", x))
    if arch.logit_scale != 1:
        logits = logits * w.dtype(arch.logit_scale)
    return nn.softcap(logits, arch.logit_softcap)


def _norm(arch: Arch, w: _Weights, name: str, x: np.ndarray, bias: bool = True) -> np.ndarray:
    """Norm `name` (a block norm, output_norm, a post-norm with bias=False) of x."""
    b = w.vec(name + ".bias") if bias and arch.norm_bias else None
    return nn.norm(arch.norm_type, x, w.norm_weight(name + ".weight"), arch.eps, b)


def _scaled(v: np.ndarray, r: float) -> np.ndarray:
    return v if r == 1 else v * v.dtype.type(r)


def _layer(arch: Arch, w: _Weights, li: int, x: np.ndarray, tables: dict, cache: KVCache) -> np.ndarray:
    """One block: sequential or parallel, pre- and post-norms, residual scale (addendum §2)."""
    b, r = f"blk.{li}.", arch.residual_scale
    a_in = _norm(arch, w, b + "attn_norm", x) if arch.pre_norm else x
    a = _attention(arch, w, li, a_in, tables, cache)
    if arch.post_norm:
        a = _norm(arch, w, b + "attn_post_norm", a, bias=False)
    h = x + _scaled(a, r)
    if arch.parallel:  # y = x + r·attn(n₁(x)) + r·mlp(n₂(x))
        m_in = a_in if arch.shared_norm else (_norm(arch, w, b + "ffn_norm", x) if arch.pre_norm else x)
    else:
        m_in = _norm(arch, w, b + "ffn_norm", h) if arch.pre_norm else h
    m = _ffn(arch, w, li, m_in)
    if arch.post_norm:
        m = _norm(arch, w, b + "ffn_post_norm", m, bias=False)
    return h + _scaled(m, r)


def _qk_norm(arch: Arch, w: _Weights, name: str, x: np.ndarray, heads: int) -> np.ndarray:
    """q or k [n, heads·d] normalised per head (shared or per-head weights) or over the full width."""
    weight = w.norm_weight(name)
    n, d = x.shape[0], arch.head_dim
    if arch.qk_full:
        return nn.norm(arch.norm_type, x, weight, arch.eps).reshape(n, heads, d)
    x = x.reshape(n, heads, d)
    return nn.norm(arch.norm_type, x, weight.reshape(heads, d) if arch.qk_per_head else weight, arch.eps)


def _attention(arch: Arch, w: _Weights, li: int, h: np.ndarray, tables: dict, cache: KVCache) -> np.ndarray:
    """Self-attention of positions cache.length … over the cache and themselves; appends their k, v."""
    b, n, hd = f"blk.{li}.", h.shape[0], arch.head_dim
    bias = arch.qkv_bias
    q = w.linear(b + "attn_q.weight", h, b + "attn_q.bias" if bias else None)
    k = w.linear(b + "attn_k.weight", h, b + "attn_k.bias" if bias else None)
    v = w.linear(b + "attn_v.weight", h, b + "attn_v.bias" if bias else None).reshape(n, arch.n_kv, hd)
    if arch.qk_norm:
        q = _qk_norm(arch, w, b + "attn_q_norm.weight", q, arch.n_heads)
        k = _qk_norm(arch, w, b + "attn_k_norm.weight", k, arch.n_kv)
    else:
        q, k = q.reshape(n, arch.n_heads, hd), k.reshape(n, arch.n_kv, hd)
    window = arch.windows[li]
    if arch.rope_layers[li]:
        kind = "sliding" if window is not None and "sliding" in tables else "global"
        q = np.stack([nn.apply_rope(q[i], *tables[kind][i], arch.layout) for i in range(n)])
        k = np.stack([nn.apply_rope(k[i], *tables[kind][i], arch.layout) for i in range(n)])
    cache.append(li, k, v)
    mixed = np.empty((n, arch.n_heads * hd), q.dtype)
    for i in range(n):
        end = cache.length + i + 1
        first = 0 if window is None else max(0, end - window)  # i − w < j ≤ i
        mixed[i] = nn.attend(q[i], cache.k[li][:, first:end], cache.v[li][:, first:end], arch.scale, arch.softcap)
    return w.linear(b + "attn_output.weight", mixed, b + "attn_output.bias" if arch.o_bias else None)


def _ffn(arch: Arch, w: _Weights, li: int, x: np.ndarray) -> np.ndarray:
    if arch.moe is not None and arch.moe.layers[li]:
        return _moe_ffn(arch, w, li, x)
    b, act = f"blk.{li}.", nn.ACTIVATIONS[arch.act]
    bias = (lambda name: b + name) if arch.mlp_bias else (lambda name: None)
    if arch.gated:
        hidden = act(w.linear(b + "ffn_gate.weight", x, bias("ffn_gate.bias"))) * \
            w.linear(b + "ffn_up.weight", x, bias("ffn_up.bias"))
    else:
        hidden = act(w.linear(b + "ffn_up.weight", x, bias("ffn_up.bias")))
    return w.linear(b + "ffn_down.weight", hidden, bias("ffn_down.bias"))


def _moe_ffn(arch: Arch, w: _Weights, li: int, x: np.ndarray) -> np.ndarray:
    """Σ pᵢ · expertᵢ(x) over each token's top-k experts, plus the (gated) shared expert (addendum §3)."""
    b, moe, act = f"blk.{li}.", arch.moe, nn.ACTIVATIONS[arch.act]
    router = w.linear(b + "ffn_gate_inp.weight", x)
    picks = [nn.route(router[t], moe.top_k, moe.norm_topk) for t in range(x.shape[0])]
    out = np.zeros_like(x)
    for e in sorted({int(i) for ids, _ in picks for i in ids}):
        tokens = [t for t, (ids, _) in enumerate(picks) if e in ids]
        weights = np.array([picks[t][1][list(picks[t][0]).index(e)] for t in tokens], x.dtype)[:, None]
        xs = x[tokens]
        hidden = act(w.expert_linear(b + "ffn_gate_exps.weight", e, xs)) * w.expert_linear(b + "ffn_up_exps.weight", e, xs)
        out[tokens] += w.expert_linear(b + "ffn_down_exps.weight", e, hidden) * weights
    if moe.shared:
        hidden = act(w.linear(b + "ffn_gate_shexp.weight", x)) * w.linear(b + "ffn_up_shexp.weight", x)
        shared = w.linear(b + "ffn_down_shexp.weight", hidden)
        if moe.shared_gate:
            shared = shared * nn.sigmoid(w.linear(b + "ffn_gate_inp_shexp.weight", x))
        out = out + shared
    return out


# ---------------------------------------------------------------- the two entry points

class Decoder:
    """Greedy single-sequence decoder over a WeightProvider, with a growing KV cache."""

    def __init__(self, provider: WeightProvider) -> None:
        self.model = provider.model
        self.arch = Arch.from_model(provider.model)
        check_tensors(provider)
        self._w = _Resident(provider, self.arch.norm_offset)
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
        return self.extend([token_id])[0]

    def extend(self, tokens: list[int]) -> np.ndarray:
        """Feed tokens at the next positions in one pass; f32 logits [len(tokens), vocab]."""
        for t in tokens:
            if not 0 <= t < self.vocab:
                raise UsageError(f"token id {t}: outside the vocabulary [0, {self.vocab})")
        return forward(self.arch, self._w, list(tokens), self._cache).astype(np.float32)

    def logits_for(self, tokens: list[int]) -> np.ndarray:
        """Reset, then run `tokens` in one pass; logits [len(tokens), vocab] (row t predicts t + 1).
        One pass, as transformers runs a whole sequence: a sequence-dependent RoPE (dynamic,
        longrope) then uses the same table for every position."""
        self.reset()
        return self.extend(tokens)

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
        seq = list(prompt)
        logits = self.logits_for(seq)[-1]
        for n in range(max_new_tokens):
            tok = int(np.argmax(logits))  # first maximum on ties, like torch.argmax
            yield tok
            if tok in stop or n + 1 == max_new_tokens:
                return
            seq.append(tok)
            logits = self.logits_for(seq)[-1] if self._longrope_switch(len(seq)) else self.step(tok)

    def _longrope_switch(self, length: int) -> bool:
        """Whether a sequence of `length` positions is the first to use longrope's long factors: the
        cached keys, rotated with the short ones, are then recomputed (as transformers' generation
        does: it drops the cache when the sequence first outgrows original_max_position_embeddings)."""
        for rope in (self.arch.rope, self.arch.rope_sliding):
            scaling = rope.params["scaling"] if rope is not None else None
            if scaling is not None and scaling.get("type") == "longrope":
                original = scaling.get("original_max_position_embeddings", self.arch.max_pos)
                if length - 1 <= original < length:
                    return True
        return False


def prefill_logits(provider: WeightProvider, tokens: list[int], chunk_values: int = 1 << 19,
                   dtype: type = np.float32) -> np.ndarray:
    """Logits [len(tokens), vocab] of a short sequence, computed layer by layer.

    The same model as `Decoder` (row t predicts token t + 1), but every weight is read once, in
    row chunks of ~chunk_values values through `provider.rows`, and dropped: memory stays at a
    few chunks whatever the model size. The converter computes its probe this way in float64
    (`dtype`), so that the stored float32 logits do not depend on the host's BLAS kernels."""
    arch = Arch.from_model(provider.model)
    return forward(arch, _Streamed(provider, dtype, arch.norm_offset, chunk_values), list(tokens), KVCache(arch, dtype))
