"""The manifest's `model` section (spec §2.1 and the vocabulary addendum): every key, its type,
its allowed values and its default, in one table.

The validator (`manifest.py`) walks this table; `modelmeta` writes through `canonical_model`,
which drops optional keys at their defaults (addendum §1: a writer omits defaults, a validator
rejects them); the reference decoder reads through `value`, which supplies them; FORMAT.md lists
the same keys (a test checks it). Adding a key is one row here plus the code that computes it.

Keys that thin-v0.md itself defines are REQUIRED: archives have always written them, so they
stay explicit even where the addendum gives them a default (`norm.type`, `mlp.type`, …).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Key:
    """One `model` key. `path` is relative to `model` ("attention.sliding_window")."""

    path: str
    type: str  # str | int | number | bool | object | layers | layer_flags | token | tokens | scaling
    default: Any = REQUIRED  # REQUIRED, or the value an absent key means (omitted when equal)
    choices: tuple = ()  # allowed strings (str), or entry values (layers)
    minimum: int | None = None  # int: smallest allowed value
    positive: bool = False  # number: > 0
    nullable: bool = False  # null is a value (distinct from absent)
    doc: str = ""

    @property
    def parent(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def optional(self) -> bool:
        return self.default is not REQUIRED


_DIMS = ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
         "vocab_size", "max_position_embeddings")

MODEL_KEYS: tuple[Key, ...] = (
    Key("architecture", "str", doc="recipe family: llama, mistral, qwen2, qwen3, …"),
    Key("source_architecture", "str", doc="the Hugging Face class, e.g. LlamaForCausalLM"),
    *(Key(k, "int", minimum=1, doc="as in the source config") for k in _DIMS),
    Key("tie_word_embeddings", "bool", doc="true: no output.weight; the head is token_embd.weight"),
    Key("norm", "object", doc="every norm of the model (block norms, q/k norms, output_norm)"),
    Key("norm.type", "str", choices=("rmsnorm", "layernorm"),
        doc="rmsnorm: y = x · rsqrt(mean(x²) + eps) · w; layernorm: y = (x − mean(x)) · rsqrt(var(x) + eps) · w "
            "(+ b), var biased"),
    Key("norm.eps", "number", positive=True, doc="added to the mean of squares (the variance)"),
    Key("norm.weight_offset", "number", default=0, doc="o: every norm multiplies by (o + w) instead of w (Gemma: 1)"),
    Key("norm.bias", "bool", default=False,
        doc="every block norm and output_norm has a .bias (layernorm only; q/k and post-norms never do)"),
    Key("mlp", "object", doc="the feed-forward block"),
    Key("mlp.type", "str", choices=("gated", "plain"), doc="gated: down(act(gate(x)) · up(x)); plain: down(act(up(x)))"),
    Key("mlp.activation", "str", choices=("silu", "gelu", "gelu_tanh"),
        doc="silu: x · sigmoid(x); gelu: the erf form; gelu_tanh: the tanh approximation"),
    Key("mlp.bias", "bool", default=False, doc="ffn_up.bias, ffn_down.bias (and ffn_gate.bias when gated) exist"),
    Key("block", "object", default={}, doc="how a layer combines attention, MLP and norms"),
    Key("block.residual", "str", default="sequential", choices=("sequential", "parallel"),
        doc="parallel: y = x + attn(n₁(x)) + mlp(n₂(x))"),
    Key("block.shared_norm", "bool", default=False, doc="parallel only: no ffn_norm; the MLP reads attn_norm's output"),
    Key("block.pre_norm", "bool", default=True,
        doc="false: no attn_norm / ffn_norm; attention and MLP read the residual stream itself"),
    Key("block.post_norm", "bool", default=False,
        doc="attn_post_norm / ffn_post_norm normalise the attention / MLP output before it is added"),
    Key("block.residual_scale", "number", default=1, doc="r: h = x + r · attn(…), y = h + r · mlp(…)"),
    Key("embedding", "object", default={}, doc="the token embedding lookup"),
    Key("embedding.scale", "number", default=1, doc="s: the looked-up row is multiplied by s"),
    Key("logits", "object", default={}, doc="the output head"),
    Key("logits.scale", "number", default=1, doc="s: logits = s · (output_norm(x) · Wᵀ)"),
    Key("logits.softcap", "number", default=None, positive=True, nullable=True,
        doc="c: logits = c · tanh(logits / c), after logits.scale"),
    Key("attention", "object", doc="self-attention (GQA: query head h uses kv head h ÷ (heads / kv_heads))"),
    Key("attention.qkv_bias", "bool", doc="attn_q/k/v.bias exist"),
    Key("attention.o_bias", "bool", doc="attn_output.bias exists"),
    Key("attention.qk_norm", "bool", doc="attn_q_norm / attn_k_norm exist (RMSNorm per head, before RoPE)"),
    Key("attention.sliding_window", "int", minimum=1, nullable=True,
        doc="on a sliding layer, position i attends to j with i − window < j ≤ i"),
    Key("attention.layer_types", "layers", choices=("full", "sliding"),
        doc="\"sliding\" only when sliding_window is an int"),
    Key("attention.scale", "number", positive=True, doc="scores = (q · k) × scale"),
    Key("attention.softcap", "number", default=None, positive=True, nullable=True,
        doc="c: scores = c · tanh(scores / c) after the scale, before the mask"),
    Key("attention.qk_norm_weights", "str", default="shared", choices=("shared", "per_head"),
        doc="per_head: attn_q_norm is [heads × head_dim], attn_k_norm [kv_heads × head_dim], row block h for head h"),
    Key("attention.qk_norm_scope", "str", default="head", choices=("head", "full"),
        doc="full: q_norm / k_norm normalise the whole projection before it is split into heads"),
    Key("rope", "object", doc="rotary position embedding"),
    Key("rope.theta", "number", positive=True, doc="the base"),
    Key("rope.rotary_dim", "int", minimum=2, doc="even, ≤ head_dim: the first rotary_dim dims of each head rotate"),
    Key("rope.layout", "str", choices=("half", "interleaved"),
        doc="half: dim i pairs with i + rotary_dim/2; interleaved: 2i with 2i + 1"),
    Key("rope.scaling", "scaling", doc="null, or the source's parameters with the kind in `type`"),
    Key("rope.attention_factor", "number", positive=True, doc="multiplies cos and sin"),
    Key("rope.layers", "layer_flags", default=True, doc="one per layer; false: no rotary embedding on that layer"),
    Key("rope.sliding", "object", default=None, nullable=True,
        doc="the RoPE of 'sliding' layers (then rope_freqs_sliding follows rope_freqs)"),
    Key("rope.sliding.theta", "number", positive=True, doc="as rope.theta"),
    Key("rope.sliding.scaling", "scaling", doc="as rope.scaling"),
    Key("rope.sliding.attention_factor", "number", positive=True, doc="as rope.attention_factor"),
    Key("special_tokens", "object", doc="token ids in [0, vocab_size)"),
    Key("special_tokens.bos", "token", nullable=True, doc="beginning of sequence"),
    Key("special_tokens.eos", "tokens", doc="every token that ends generation"),
    Key("special_tokens.pad", "token", nullable=True, doc="padding"),
    Key("moe", "object", default=None, nullable=True, doc="mixture of experts: the MLP of sparse layers"),
    Key("moe.num_experts", "int", minimum=1, doc="E"),
    Key("moe.num_experts_per_tok", "int", minimum=1, doc="k ≤ E: experts each token uses"),
    Key("moe.expert_intermediate_size", "int", minimum=1, doc="f: each expert's intermediate size"),
    Key("moe.scoring", "str", choices=("softmax",), doc="router probabilities p = softmax(x · W_gate_inpᵀ)"),
    Key("moe.norm_topk_prob", "bool", doc="the k chosen probabilities are divided by their sum"),
    Key("moe.layers", "layer_flags", doc="one per layer: true = sparse (experts), false = the dense MLP"),
    Key("moe.shared_expert", "object", nullable=True, doc="an always-on gated MLP added to the experts' output"),
    Key("moe.shared_expert.intermediate_size", "int", minimum=1, doc="fs"),
    Key("moe.shared_expert.gate", "bool", doc="its output is scaled by sigmoid(x · W_gate_inp_shexpᵀ)"),
)
BY_PATH: dict[str, Key] = {k.path: k for k in MODEL_KEYS}


def children(parent: str) -> tuple[Key, ...]:
    """The keys directly inside object `parent` ("" for the `model` object itself), in table order."""
    return tuple(k for k in MODEL_KEYS if k.parent == parent)


def value(model: dict, path: str) -> Any:
    """model[a][b]… for "a.b…", the key's default where the model omits it (KeyError for a
    missing required key)."""
    node: Any = model
    parts = path.split(".")
    for i, part in enumerate(parts):
        if node is None and i:  # inside an optional object that is null: nothing is there
            return None
        if not isinstance(node, dict) or part not in node:
            key = BY_PATH[".".join(parts[: i + 1])]
            if not key.optional:
                raise KeyError(f"model.{path}")
            want = BY_PATH[path]
            if not want.optional:  # a required key of an absent optional object
                return None
            if want.type == "layer_flags":  # the default "all true", one per layer
                return [True] * model["num_layers"]
            return want.default
        node = node[part]
    return node


def is_default(key: Key, v: Any) -> bool:
    """Whether `v` is the key's default (so a writer omits it and a validator rejects it)."""
    if not key.optional:
        return False
    d = key.default
    if key.type == "layer_flags":
        return isinstance(v, list) and all(x is True for x in v)
    if isinstance(d, bool) or isinstance(v, bool) or d is None or v is None:
        return type(v) is type(d) and v == d
    return v == d


def canonical_model(model: dict, parent: str = "") -> dict:
    """`model` as a writer stores it: optional keys at their defaults, and optional objects left
    empty, are omitted (one model has one manifest)."""
    out = {}
    for k, v in model.items():
        path = f"{parent}.{k}" if parent else k
        key = BY_PATH.get(path)
        if key is not None and key.type == "object" and isinstance(v, dict):
            v = canonical_model(v, path)
            if key.optional and not v:
                continue
        if key is not None and is_default(key, v):
            continue
        out[k] = v
    return out


_TYPE_NAMES = {"str": "string", "int": "int", "number": "number", "bool": "bool", "object": "object",
               "layers": "list, one per layer", "layer_flags": "list of bools, one per layer", "token": "token id", "tokens": "list of token ids",
               "scaling": "object or null"}


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def markdown_table() -> str:
    """The key table FORMAT.md carries (tests/test_schema.py checks the two agree; print it with
    `python -c "from thinconv.format.schema import markdown_table as t; print(t(), end='')"`)."""
    import json

    rows = ["| key | type | default | values and meaning |", "|---|---|---|---|"]
    for k in MODEL_KEYS:
        kind = _TYPE_NAMES[k.type] + (" or null" if k.nullable else "")
        if k.type == "int" and k.minimum is not None:
            kind += f" ≥ {k.minimum}"
        if k.type == "number" and k.positive:
            kind += " > 0"
        if not k.optional:
            default = "required inside" if any(BY_PATH[a].optional for a in _ancestors(k.path)) else "required"
        elif k.type == "layer_flags":
            default = "all `true`"
        else:
            default = f"`{json.dumps(k.default)}`"
        values = " \\| ".join(f"`{json.dumps(c)}`" for c in k.choices)
        meaning = "; ".join(x for x in (values, k.doc) if x)
        rows.append(f"| `{k.path}` | {kind} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"

