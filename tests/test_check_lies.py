"""A lie on every `model` key (issue 14): for each key of the schema (thinconv/format/schema.py), on
archives that set it (a Mistral with a window, a YaRN Llama, Gemma 3 with its sliding-layer RoPE,
Qwen2-MoE with a shared expert), the key alone is given another value and the archive repacked
through the validating packer, its derived RoPE tables recomputed. Each lie is either

* refused by the packer — the key is bound to the tensors (a shape, or which tensors exist), so no
  valid archive can say it alone (the family tests lie about the key and the tensors together), or
* a valid archive that `check --against SRC` fails, naming the key — and that `check` against the
  probe fails too, except where the probe cannot tell (PROBE_BLIND, each with the reason).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import blake3
import numpy as np
import pytest
from typer.testing import CliRunner

from families import VOCAB, build
from thinconv.cli import app
from thinconv.errors import ThinError
from thinconv.format import open_archive, schema
from thinconv.format.staging import pack_staging, unpack
from thinconv.rope import derived_tables

runner = CliRunner()
LEAVES = [k.path for k in schema.MODEL_KEYS if k.type != "object"]
NO_OTHER_VALUE = {"moe.scoring": "one choice (softmax)"}

# Keys that fix tensor shapes or which tensors exist: the packer refuses a lie on them alone. The
# family tests lie about such a key and its tensors together (e.g. qkv_bias false and the biases
# dropped: test_family_granite_smollm3_stablelm.py, test_family_phi3_olmo2.py, test_family_moe.py, …).
TENSOR_BOUND = {
    "hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
    "tie_word_embeddings", "norm.bias", "mlp.type", "mlp.bias", "block.shared_norm", "block.pre_norm",
    "block.post_norm", "attention.qkv_bias", "attention.o_bias", "attention.qk_norm", "attention.qk_norm_weights",
    "attention.qk_norm_scope", "moe.num_experts", "moe.expert_intermediate_size", "moe.layers",
    "moe.shared_expert.intermediate_size", "moe.shared_expert.gate"}
BASES = ("mistral", "yarn", "gemma3", "qwen2_moe")
# (base, key) lies that the probe (8 positions of one pass) cannot show; check --against names them.
PROBE_BLIND = {
    **{(b, k): "not computed with" for b in BASES
       for k in ("architecture", "source_architecture", "special_tokens.bos", "special_tokens.eos",
                 "special_tokens.pad")},
    **{(b, "max_position_embeddings"): "no RoPE table of these bases reads it" for b in BASES},
    ("mistral", "attention.sliding_window"): "window 12 → 13 acts from position 13, past the probe's 8",
    ("mistral", "attention.layer_types"): "a layer without its 12-token window differs from position 12 on",
}


def _lie_value(path: str, value):
    """Another valid value for model.<path> (valid for the schema; the packer may still refuse it)."""
    key = schema.BY_PATH[path]
    if path == "architecture":
        return "llama" if value != "llama" else "mistral"
    if path == "source_architecture":
        return "LlamaForCausalLM" if value != "LlamaForCausalLM" else "MistralForCausalLM"
    if key.choices and key.type == "str":
        return next(c for c in key.choices if c != value)
    if key.type == "bool":
        return not value
    if key.type == "layers":
        other = {"full": "sliding", "sliding": "full"}
        return [other[value[0]], *value[1:]]
    if key.type == "layer_flags":
        return [not value[0], *value[1:]]
    if key.type == "scaling":
        return {"type": "linear", "factor": 2.0} if value is None else {**value, "factor": value["factor"] * 2}
    if key.type == "token":
        return 3 if value is None else (value + 3) % VOCAB
    if key.type == "tokens":
        return [(value[0] + 3) % VOCAB]
    if path == "rope.rotary_dim":
        return value - 2
    if path == "attention.sliding_window":
        return 3 if value is None else value + 1
    if path == "moe.num_experts_per_tok":
        return value + 1
    if key.type == "int":
        return value * 2
    if path == "norm.eps":
        return value * 1000  # 1e-5 × 1.5 hides below the exact bound; 1e-2 does not
    if key.type == "number":
        return 2.0 if value is None else (1.0 if value == 0 else value * 1.5)
    raise AssertionError(path)


def _lie(archive: Path, out: Path, path: str, value) -> Path:
    """`archive` with model.<path> = value (intermediate objects created), the derived tables
    recomputed, packed by the validating packer (ThinError when it refuses)."""
    stage = out.with_suffix(".stage")
    with open_archive(archive) as a:
        unpack(a, stage, force=True)
    try:
        m = json.loads((stage / "manifest.json").read_text())
        *parents, last = path.split(".")
        node = m["model"]
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        for name, table in derived_tables(m["model"]).items():
            t = next((t for t in m["tensors"] if t["name"] == name), None)
            if t is None:
                continue
            data = np.ascontiguousarray(table, "<f4").tobytes()
            t["shape"] = [table.size]
            page = next(p for p in m["pages"] if p.get("tensor") == name)
            (stage / "pages" / page["id"]).write_bytes(data)
            page.update(size=len(data), checksum=blake3.blake3(data).hexdigest(), rows=[0, table.size])
        (stage / "manifest.json").write_text(json.dumps(m))
        pack_staging(stage, out, force=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def _configs() -> dict:
    from test_family_gemma import _config as gemma_config
    from test_family_moe import _config as moe_config
    from transformers import LlamaConfig, MistralConfig

    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
                 eos_token_id=1)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    return {"mistral": MistralConfig(**small, sliding_window=12),
            "yarn": LlamaConfig(**small, rope_parameters=yarn),
            "gemma3": gemma_config("gemma3"),
            "qwen2_moe": moe_config("qwen2_moe", False)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    work = tmp_path_factory.mktemp("lies")
    out = {}
    for name, cfg in _configs().items():
        src = build(cfg, work / name, seed=7)
        archive = work / f"{name}.thin"
        r = runner.invoke(app, ["convert", str(src), str(archive)])
        assert r.exit_code == 0, r.output
        out[name] = (src, archive)
    return out


@pytest.fixture(scope="module", autouse=True)
def _source_logits_once():
    """Every lie of a base is checked against the same source: its transformers logits are computed
    once per token sequence."""
    import thinconv.check

    original = thinconv.check.transformers_logits
    cache: dict = {}

    def cached(source_root, tokens, vocab=None, **kwargs):
        key = (str(source_root), tuple(tokens), vocab, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = original(source_root, tokens, vocab, **kwargs)
        return cache[key].copy()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(thinconv.check, "transformers_logits", cached)
        yield


def _check(*args) -> tuple[int, dict]:
    r = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def _tried_on(path: str, models: dict[str, dict]) -> list[str]:
    """The bases to lie on about `path`: those that set it (not its default), else the first that has it."""
    have = []
    for base in BASES:
        model = models[base]
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        try:
            if parent and schema.value(model, parent) is None:
                continue  # inside an object this base does not have (rope.sliding, moe, …)
            schema.value(model, path)
        except KeyError:
            continue
        have.append(base)
    key = schema.BY_PATH[path]
    setting = [b for b in have if key.optional and not schema.is_default(key, schema.value(models[b], path))]
    return list(dict.fromkeys(have[:1] + setting + [b for b in ALSO.get(path, ()) if b in have]))


# Required keys are lied about on the first base; these also where their value is special.
ALSO = {"rope.scaling": ("yarn",), "rope.attention_factor": ("yarn",), "attention.sliding_window": ("qwen2_moe",),
        "attention.layer_types": ("qwen2_moe", "gemma3")}


def test_a_lie_on_every_model_key_is_refused_or_fails_check(bases, tmp_path):
    models = {}
    for base, (_, archive) in bases.items():
        with open_archive(archive) as a:
            models[base] = a.model
    outcomes: dict[tuple[str, str], str] = {}
    for path in LEAVES:
        if path in NO_OTHER_VALUE:
            continue
        for base in _tried_on(path, models):
            src, archive = bases[base]
            value = schema.value(models[base], path)
            out = tmp_path / f"{base}-{path}.thin"
            try:
                _lie(archive, out, path, _lie_value(path, value))
            except ThinError:
                outcomes[base, path] = "refused"
                continue
            code, d = _check(out, "--against", src)
            named = [x.split(":")[0] for x in d["model_differences"]]  # the key, or the new object holding it
            assert code == 1 and any(f"model.{path}.".startswith(k + ".") or k.startswith(f"model.{path}.")
                                     for k in named), (base, path, d["model_differences"])
            code, d = _check(out)
            outcomes[base, path] = "caught" if code == 1 else "probe-blind"
    print("\n" + "\n".join(f"{b:10s} {p:40s} {o}" for (b, p), o in sorted(outcomes.items())))
    assert {p for _, p in outcomes} | set(NO_OTHER_VALUE) == set(LEAVES)  # every key was lied about
    # refused: only keys bound to the tensors (and layer types claiming a window the model lacks)
    refused = {(b, p) for (b, p), o in outcomes.items() if o == "refused"}
    assert {p for _, p in refused} - TENSOR_BOUND <= {"attention.layer_types"}, refused
    assert all(models[b]["attention"]["sliding_window"] is None for b, p in refused if p == "attention.layer_types")
    assert TENSOR_BOUND <= set(LEAVES)
    # the probe catches every valid lie but those it cannot see, each with its reason above
    blind = {k for k, o in outcomes.items() if o == "probe-blind"}
    assert blind == {k for k in PROBE_BLIND if k in outcomes}, blind ^ set(PROBE_BLIND)
