"""GPT-NeoX (GPTNeoXForCausalLM) and Cohere (CohereForCausalLM): recipes/gpt_neox.toml and
recipes/cohere.toml, end to end against transformers 5.24.

Tiny random checkpoints (tests/families.py) with every computation-changing config value away from
its default and from neutral values:

    neox          parallel residual with two norms, rotary_pct 0.5, theta 5000, erf GELU, eps 1e-3,
                  q/k/v and dense biases (attention_bias default true); f32 and bf16
    neox_legacy   the Hub form: flat rotary_pct 0.75 / rotary_emb_base 2000 (no rope_parameters),
                  decoy top-level rope_theta / partial_rotary_factor / num_key_value_heads (all three
                  ignored by GPT-NeoX), sequential residual, attention_bias false, gelu_new, head saved
                  as lm_head.weight instead of embed_out.weight, old buffers (attention.bias,
                  masked_bias, rotary_emb.inv_freq) to ignore; f32
    cohere        per-head q/k norm, logit_scale 0.37, attention bias, GQA 4/2, eps 1e-3, theta 1000,
                  tied head; f32 and bf16, archived in both RoPE layouts
    cohere_legacy flat rope_theta 3000, decoy partial_rotary_factor, head_dim 32 != 64 / 4, untied,
                  logit_scale 2.5, no q/k norm, no biases; f32

The expected `model` sections are written out by hand from those values. Lying archives (a key
changed or removed, the tensors it governs dropped or supplied, the rope tables recomputed) are
valid archives that both `check --against SRC` and `check` (the probe) must fail. Run with -s to
print the figures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import blake3
import numpy as np
import pytest
from typer.testing import CliRunner

import families
from thinconv.cli import app
from thinconv.format import spec
from thinconv.format.reader import open_archive
from thinconv.format.staging import pack_staging, unpack
from thinconv.mapping import Entry, stacked_shape
from thinconv.rope import derived_tables

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
runner = CliRunner()
V = families.VOCAB
FIGURES: list[str] = []


# ---------------------------------------------------------------- checkpoints

def _neox_config(**over):
    from transformers import GPTNeoXConfig

    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, rotary_pct=0.5, rotary_emb_base=5000, use_parallel_residual=True,
              hidden_act="gelu", layer_norm_eps=1e-3, bos_token_id=1, eos_token_id=2)
    return GPTNeoXConfig(**{**kw, **over})


def _cohere_config(**over):
    from transformers import CohereConfig

    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, logit_scale=0.37, use_qk_norm=True,
              attention_bias=True, layer_norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return CohereConfig(**{**kw, **over})


def _edit_tensors(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _hub_neox_tensors(t: dict) -> None:
    """The head under its in-memory name, and the buffers old GPT-NeoX checkpoints carry (causal
    mask, masked_bias, RoPE table), which transformers ignores on load."""
    import torch

    t["lm_head.weight"] = t.pop("embed_out.weight")
    for layer in range(2):
        t[f"gpt_neox.layers.{layer}.attention.bias"] = torch.tril(torch.ones(64, 64, dtype=torch.bool))[None, None]
        t[f"gpt_neox.layers.{layer}.attention.masked_bias"] = torch.tensor(-1e9)
        t[f"gpt_neox.layers.{layer}.attention.rotary_emb.inv_freq"] = 2000.0 ** -(torch.arange(0, 12, 2) / 12)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("neox_cohere")


@pytest.fixture(scope="module")
def src(work) -> dict[str, Path]:
    d = work / "src"
    out = {}
    for dt in ("f32", "bf16"):
        out[f"neox_{dt}"] = families.build(_neox_config(), d / f"neox_{dt}", dtype=dt)
        out[f"cohere_{dt}"] = families.build(_cohere_config(), d / f"cohere_{dt}", dtype=dt, seed=3)
    legacy = families.build(_neox_config(use_parallel_residual=False, attention_bias=False, hidden_act="gelu_new",
                                         layer_norm_eps=2e-3), d / "neox_legacy", seed=1)
    families.edit_config(legacy, rope_parameters=None, rotary_pct=0.75, rotary_emb_base=2000, rope_theta=500.0,
                         partial_rotary_factor=0.5, num_key_value_heads=2)
    _edit_tensors(legacy, _hub_neox_tensors)
    out["neox_legacy"] = legacy
    legacy = families.build(_cohere_config(head_dim=32, tie_word_embeddings=False, use_qk_norm=False,
                                           attention_bias=False, logit_scale=2.5), d / "cohere_legacy", seed=2)
    families.edit_config(legacy, rope_parameters=None, rope_theta=3000.0, partial_rotary_factor=0.5)
    out["cohere_legacy"] = legacy
    return out


def convert(source: Path, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["convert", str(source), str(out), *map(str, extra)])
    assert r.exit_code == 0, r.output
    return out


def _copy_with(src: Path, folder: Path, **changes) -> Path:
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# name → (source, extra convert arguments)
ARCHIVES = {
    "neox_f32": ("neox_f32", ()), "neox_bf16": ("neox_bf16", ()), "neox_legacy": ("neox_legacy", ()),
    "neox_interleaved": ("neox_f32", ("--rope-layout", "interleaved")),
    "neox_q8_0": ("neox_f32", ("--dtype", "q8_0")),
    "cohere_f32": ("cohere_f32", ()), "cohere_bf16": ("cohere_bf16", ()), "cohere_legacy": ("cohere_legacy", ()),
    "cohere_interleaved": ("cohere_f32", ("--rope-layout", "interleaved")),
    "cohere_bf16_interleaved": ("cohere_bf16", ("--rope-layout", "interleaved")),
}


@pytest.fixture(scope="module")
def archive(src, work):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            source, extra = ARCHIVES[name]
            made[name] = convert(src[source], work / f"{name}.thin", *extra)
        return made[name]

    return get


def check(*args, ok_codes=(0, 1)) -> tuple[int, dict]:
    r = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert r.exit_code in ok_codes, r.output
    return r.exit_code, json.loads(r.stdout)


def _record(name: str, ref: str, d: dict) -> None:
    FIGURES.append(f"{name:34s} vs {ref:12s} class {d['dtype_class']:5s} rel {d['max_rel_diff']:.3g}  "
                   f"abs {d['max_abs_diff']:.3g}  top1 {d['top1_agreement']:.4f}  mean KL {d['mean_kl']:.3g}")


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if FIGURES:
        print("\n" + "\n".join(FIGURES))


# ---------------------------------------------------------------- 1. the model section, by hand

FULL2 = ["full", "full"]
NEOX = {
    "architecture": "gpt_neox", "source_architecture": "GPTNeoXForCausalLM", "hidden_size": 64,
    "intermediate_size": 96, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 4, "head_dim": 16,
    "vocab_size": V, "max_position_embeddings": 64, "tie_word_embeddings": False,
    "norm": {"type": "layernorm", "eps": 1e-3, "bias": True},
    "mlp": {"type": "plain", "activation": "gelu", "bias": True},
    "block": {"residual": "parallel"},
    "attention": {"qkv_bias": True, "o_bias": True, "qk_norm": False, "sliding_window": None, "layer_types": FULL2,
                  "scale": 0.25},
    "rope": {"theta": 5000.0, "rotary_dim": 8, "layout": "half", "scaling": None, "attention_factor": 1.0},
    "special_tokens": {"bos": 1, "eos": [2], "pad": None},
}
NEOX_LEGACY = {  # sequential (block omitted: the default), no attention biases, tanh GELU, 0.75 × 16 rotary dims
    **NEOX, "norm": {"type": "layernorm", "eps": 2e-3, "bias": True},
    "mlp": {"type": "plain", "activation": "gelu_tanh", "bias": True},
    "attention": {**NEOX["attention"], "qkv_bias": False, "o_bias": False},
    "rope": {**NEOX["rope"], "theta": 2000.0, "rotary_dim": 12},
}
del NEOX_LEGACY["block"]
COHERE = {
    "architecture": "cohere", "source_architecture": "CohereForCausalLM", "hidden_size": 64,
    "intermediate_size": 96, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16,
    "vocab_size": V, "max_position_embeddings": 64, "tie_word_embeddings": True,
    "norm": {"type": "layernorm", "eps": 1e-3},
    "mlp": {"type": "gated", "activation": "silu"},
    "block": {"residual": "parallel", "shared_norm": True},
    "logits": {"scale": 0.37},
    "attention": {"qkv_bias": True, "o_bias": True, "qk_norm": True, "qk_norm_weights": "per_head",
                  "sliding_window": None, "layer_types": FULL2, "scale": 0.25},
    "rope": {"theta": 1000.0, "rotary_dim": 16, "layout": "half", "scaling": None, "attention_factor": 1.0},
    "special_tokens": {"bos": 1, "eos": [2], "pad": 0},
}
COHERE_LEGACY = {  # head_dim 32 from config.json; theta from the flat rope_theta; the whole head rotates
    **COHERE, "head_dim": 32, "tie_word_embeddings": False, "logits": {"scale": 2.5},
    "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": None,
                  "layer_types": FULL2, "scale": 32 ** -0.5},
    "rope": {**COHERE["rope"], "theta": 3000.0, "rotary_dim": 32},
}
EXPECTED = {
    "neox_f32": NEOX, "neox_bf16": NEOX, "neox_legacy": NEOX_LEGACY,
    "neox_interleaved": {**NEOX, "rope": {**NEOX["rope"], "layout": "interleaved"}},
    "cohere_f32": COHERE, "cohere_bf16": COHERE, "cohere_legacy": COHERE_LEGACY,
    "cohere_interleaved": {**COHERE, "rope": {**COHERE["rope"], "layout": "interleaved"}},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_model_section(name, archive):
    with open_archive(archive(name)) as a:
        assert a.model == EXPECTED[name]


def test_tensor_sources(archive):
    """The fused per-head QKV is split into per-head slices; the head comes from whichever name the
    checkpoint uses; Cohere's [heads, head_dim] q/k norms are read whole (flattened)."""
    qkv = "gpt_neox.layers.1.attention.query_key_value"
    with open_archive(archive("neox_f32")) as a:
        src = {t["name"]: t["source"] for t in a.manifest["tensors"]}
        assert src["blk.1.attn_q.weight"] == [f"{qkv}.weight[{48 * h}:{48 * h + 16}]" for h in range(4)]
        assert src["blk.1.attn_k.bias"] == [f"{qkv}.bias[{48 * h + 16}:{48 * h + 32}]" for h in range(4)]
        assert src["blk.1.attn_v.weight"] == [f"{qkv}.weight[{48 * h + 32}:{48 * h + 48}]" for h in range(4)]
        assert src["output.weight"] == ["embed_out.weight"]
        assert "blk.0.ffn_gate.weight" not in src and src["blk.0.ffn_norm.bias"] == [
            "gpt_neox.layers.0.post_attention_layernorm.bias"]
    with open_archive(archive("neox_legacy")) as a:
        assert {t["name"]: t["source"] for t in a.manifest["tensors"]}["output.weight"] == ["lm_head.weight"]
        assert not any("masked_bias" in s or "inv_freq" in s or s.endswith("attention.bias")
                       for t in a.manifest["tensors"] for s in t["source"])
    with open_archive(archive("cohere_f32")) as a:
        info = {t["name"]: t for t in a.manifest["tensors"]}
        assert info["blk.0.attn_q_norm.weight"]["shape"] == [64] and info["blk.0.attn_k_norm.weight"]["shape"] == [32]
        assert "blk.0.ffn_norm.weight" not in info and "output.weight" not in info


def test_cohere_layouts_keep_or_deinterleave_the_rows(archive, src):
    """Cohere is natively interleaved: --rope-layout interleaved copies q/k (and their biases and
    per-head norms) as stored; the default half layout de-interleaves each head."""
    from safetensors.numpy import load_file

    st = load_file(src["cohere_f32"] / "model.safetensors")
    q, qb, qn = (st[f"model.layers.0.self_attn.{n}"] for n in ("q_proj.weight", "q_proj.bias", "q_norm.weight"))
    deint = np.concatenate([h * 16 + np.r_[0:16:2, 1:16:2] for h in range(4)])  # half row i ← source row 2i
    with open_archive(archive("cohere_interleaved")) as a:
        assert np.array_equal(a.tensor("blk.0.attn_q.weight"), q)
        assert np.array_equal(a.tensor("blk.0.attn_q.bias"), qb)
        assert np.array_equal(a.tensor("blk.0.attn_q_norm.weight"), qn.reshape(-1))
        assert np.array_equal(a.tensor("blk.0.attn_v.weight"), st["model.layers.0.self_attn.v_proj.weight"])
    with open_archive(archive("cohere_f32")) as a:
        assert np.array_equal(a.tensor("blk.0.attn_q.weight"), q[deint])
        assert np.array_equal(a.tensor("blk.0.attn_q.bias"), qb[deint])
        assert np.array_equal(a.tensor("blk.0.attn_q_norm.weight"), qn.reshape(-1)[deint])
        assert np.array_equal(a.tensor("blk.0.attn_v.weight"), st["model.layers.0.self_attn.v_proj.weight"])


# ---------------------------------------------------------------- 2-3. verify, check against transformers and the probe

PASSING = ["neox_f32", "neox_bf16", "neox_legacy", "neox_interleaved", "cohere_f32", "cohere_bf16", "cohere_legacy",
           "cohere_interleaved", "cohere_bf16_interleaved"]


@pytest.mark.parametrize("name", PASSING + ["neox_q8_0"])
def test_verify(name, archive):
    r = runner.invoke(app, ["verify", str(archive(name))])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("name", PASSING)
def test_check_exact(name, archive, src):
    a = archive(name)
    code, d = check(a, "--against", src[ARCHIVES[name][0]])
    _record(name, "transformers", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "exact" and d["top1_agreement"] == 1.0
    code, d = check(a)
    _record(name, "probe", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "exact"


def test_check_q8_0(archive, src):
    a = archive("neox_q8_0")
    with open_archive(a) as arc:
        assert {t["dtype"] for t in arc.manifest["tensors"] if len(t["shape"]) == 2} == {"q8_0"}
    code, d = check(a, "--against", src["neox_f32"])
    _record("neox_q8_0", "transformers", d)
    assert code == 0 and d["dtype_class"] == "q8_0" and 0 < d["mean_kl"] <= 1e-2
    code, d = check(a)
    _record("neox_q8_0", "probe", d)
    assert code == 0 and d["dtype_class"] == "q8_0"


def test_neox_config_head_dim_changes_only_the_rotated_width(src, work):
    """GPTNeoXAttention ignores a config head_dim, its rotary embedding does not (getattr): with
    head_dim 8 the first int(8 × 0.5) = 4 dims of each 16-dim head rotate, over frequencies of a
    4-dim rotation. transformers runs this without complaint; the recipe says what it computes."""
    folder = work / "src" / "neox_head_dim"
    shutil.copytree(src["neox_f32"], folder)
    families.edit_config(folder, head_dim=8)
    a = convert(folder, work / "neox_head_dim.thin")
    with open_archive(a) as arc:
        assert arc.model["head_dim"] == 16 and arc.model["attention"]["scale"] == 0.25
        assert arc.model["rope"]["rotary_dim"] == 4
    code, d = check(a, "--against", folder)
    _record("neox_head_dim", "transformers", d)
    assert code == 0 and d["dtype_class"] == "exact"


def test_neox_rope_scaling_replaces_the_parameters(src, work):
    """A truthy legacy rope_scaling replaces rope_parameters wholesale; its own rope_theta and
    partial_rotary_factor win over rotary_emb_base / rotary_pct."""
    scaling = {"rope_type": "linear", "factor": 3.0, "rope_theta": 700, "partial_rotary_factor": 0.25}
    folder = _copy_with(src["neox_legacy"], work / "src" / "neox_rope_scaling", rope_scaling=scaling)
    a = convert(folder, work / "neox_rope_scaling.thin")
    with open_archive(a) as arc:
        assert arc.model["rope"] == {"theta": 700.0, "rotary_dim": 4, "layout": "half",
                                     "scaling": {"type": "linear", "factor": 3.0}, "attention_factor": 1.0}
    code, d = check(a, "--against", folder)
    _record("neox_rope_scaling", "transformers", d)
    assert code == 0 and d["dtype_class"] == "exact"


# ---------------------------------------------------------------- 4. run vs transformers' greedy generation

@pytest.mark.parametrize("name", ["neox_f32", "neox_legacy", "cohere_f32", "cohere_legacy"])
def test_run_matches_transformers(name, archive, src):
    prompt = "The river"
    want = families.hf_greedy(src[ARCHIVES[name][0]], prompt, 8)
    r = runner.invoke(app, ["run", str(archive(name)), "--prompt", prompt, "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert want and r.stdout == prompt + want + "\n"


# ---------------------------------------------------------------- 5. lying archives

def tamper(source: Path, dst: Path, edit) -> Path:
    """unpack → edit(manifest, pages_dir, archive) → tensors and pages back in decode order, page
    sizes and checksums recomputed, orphans and stale statistics dropped → pack (validated)."""
    stage = dst.with_suffix(".stage")
    with open_archive(source) as a:
        unpack(a, stage, force=True)
        m = json.loads((stage / "manifest.json").read_text())
        pages = stage / "pages"
        edit(m, pages, a)
    order = {n: i for i, n in enumerate(spec.tensor_names(m["model"]))}
    assert set(order) == {t["name"] for t in m["tensors"]}, "the lie is not a complete archive"
    m["tensors"].sort(key=lambda t: order[t["name"]])
    pos = {t["name"]: i for i, t in enumerate(m["tensors"])}
    m["pages"].sort(key=lambda p: (0, pos[p["tensor"]], int(p["id"].rsplit("#", 1)[1])) if "tensor" in p else (1, 0, 0))
    for section in ("stats", "quant"):
        table = m["validation"].get(section, {})
        for k in [k for k in table if k not in pos]:
            del table[k]
    keep = {p["id"] for p in m["pages"]}
    for f in [f for f in pages.rglob("*") if f.is_file()]:
        if f.relative_to(pages).as_posix() not in keep:
            f.unlink()
    for p in m["pages"]:
        data = (pages / p["id"]).read_bytes()
        p["size"], p["checksum"] = len(data), blake3.blake3(data).hexdigest()
    (stage / "manifest.json").write_text(json.dumps(m))
    pack_staging(stage, dst, force=True)
    shutil.rmtree(stage)
    return dst


def drop(m: dict, pattern: str) -> None:
    gone = {t["name"] for t in m["tensors"] if re.fullmatch(pattern, t["name"])}
    assert gone, pattern
    m["tensors"] = [t for t in m["tensors"] if t["name"] not in gone]
    m["pages"] = [p for p in m["pages"] if p.get("tensor") not in gone]


def put(m: dict, pages: Path, name: str, data: np.ndarray, source: list[str]) -> None:
    """Tensor `name` (replaced if present) holding `data` as f32, one page."""
    m["tensors"] = [t for t in m["tensors"] if t["name"] != name]
    m["pages"] = [p for p in m["pages"] if p.get("tensor") != name]
    m["validation"].get("stats", {}).pop(name, None)
    role, layer = spec.split_name(name)
    data = np.ascontiguousarray(data, "<f4")
    pid = f"{name}#0"
    (pages / pid).write_bytes(data.tobytes())
    hints = {"placement": "device", "access": "elementwise" if data.ndim == 1 else "matmul"}
    m["tensors"].append({"name": name, "role": role, "layer": layer, "source": source, "shape": list(data.shape),
                         "dtype": "f32", "quant": None, "hints": hints, "pages": [pid]})
    m["pages"].append({"id": pid, "tensor": name, "rows": [0, data.shape[0]], "size": 0, "checksum": ""})


def copy_layer_tensors(m, pages, a, src_role: str, dst_role: str, fn=lambda x, layer: x) -> None:
    """blk.L.<dst_role> = fn(blk.L.<src_role>) on every layer (sources kept, for the dtype class)."""
    info = {t["name"]: t for t in a.manifest["tensors"]}
    for layer in range(m["model"]["num_layers"]):
        s = f"blk.{layer}.{src_role}"
        put(m, pages, f"blk.{layer}.{dst_role}", fn(a.dequantize(s), layer), info[s]["source"])


def recompute_rope_freqs(m, pages, a) -> None:
    put(m, pages, "rope_freqs", derived_tables(m["model"])["rope_freqs"], [])


def _set(path: str, value):
    """An edit setting (value not None) or removing (None) model key `path`."""
    def edit(m, pages, a):
        *parents, last = path.split(".")
        node = m["model"]
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            assert last in node, path
            node.pop(last)
        else:
            assert node.get(last) != value, path
            node[last] = value
        if len(parents) == 1 and not node:  # an emptied optional object (block, logits) is omitted too
            del m["model"][parents[0]]
    return edit


def _then(*edits):
    def edit(m, pages, a):
        for e in edits:
            e(m, pages, a)
    return edit


def _drop(pattern: str):
    return lambda m, pages, a: drop(m, pattern)


def _truncate_qk_norms(m, pages, a):
    """Shared q/k norm weights: head 0's row block of the per-head weights."""
    d = m["model"]["head_dim"]
    info = {t["name"]: t for t in a.manifest["tensors"]}
    for t in [t for t in a.manifest["tensors"] if re.fullmatch(r"blk\.\d+\.attn_[qk]_norm\.weight", t["name"])]:
        put(m, pages, t["name"], a.dequantize(t["name"])[:d], info[t["name"]]["source"])


NORM_BIASES = r"(blk\.\d+\.(attn|ffn)_norm|output_norm)\.bias"
LIES = {
    # GPT-NeoX
    "neox norm.type rmsnorm": ("neox_f32", _then(_set("norm.type", "rmsnorm"), _set("norm.bias", None),
                                                 _drop(NORM_BIASES))),
    "neox norm.bias": ("neox_f32", _then(_set("norm.bias", None), _drop(NORM_BIASES))),
    "neox norm.eps": ("neox_f32", _set("norm.eps", 1e-5)),
    "neox mlp.type gated": ("neox_f32", _then(_set("mlp.type", "gated"),
                                              lambda m, p, a: copy_layer_tensors(m, p, a, "ffn_up.weight",
                                                                                 "ffn_gate.weight"),
                                              lambda m, p, a: copy_layer_tensors(m, p, a, "ffn_up.bias",
                                                                                 "ffn_gate.bias"))),
    "neox mlp.activation silu": ("neox_f32", _set("mlp.activation", "silu")),
    "neox mlp.bias": ("neox_f32", _then(_set("mlp.bias", None), _drop(r"blk\.\d+\.ffn_(up|down)\.bias"))),
    "neox block.residual sequential": ("neox_f32", _set("block.residual", None)),
    "neox_legacy block.residual parallel": ("neox_legacy", _set("block.residual", "parallel")),
    "neox attention.qkv_bias": ("neox_f32", _then(_set("attention.qkv_bias", False),
                                                  _drop(r"blk\.\d+\.attn_[qkv]\.bias"))),
    "neox attention.o_bias": ("neox_f32", _then(_set("attention.o_bias", False), _drop(r"blk\.\d+\.attn_output\.bias"))),
    "neox rope.rotary_dim": ("neox_f32", _then(_set("rope.rotary_dim", 16), recompute_rope_freqs)),
    "neox rope.theta": ("neox_f32", _then(_set("rope.theta", 10000.0), recompute_rope_freqs)),
    "neox rope.layout": ("neox_f32", _set("rope.layout", "interleaved")),
    # Cohere
    "cohere norm.type rmsnorm": ("cohere_f32", _set("norm.type", "rmsnorm")),
    "cohere norm.eps": ("cohere_f32", _set("norm.eps", 1e-5)),
    "cohere block.residual sequential": ("cohere_f32", _then(
        _set("block.shared_norm", None), _set("block.residual", None),
        lambda m, p, a: copy_layer_tensors(m, p, a, "attn_norm.weight", "ffn_norm.weight"))),
    "cohere block.shared_norm": ("cohere_f32", _then(  # a second norm: the final norm's weights
        _set("block.shared_norm", None),
        lambda m, p, a: [put(m, p, f"blk.{L}.ffn_norm.weight", a.dequantize("output_norm.weight"),
                             ["model.norm.weight"]) for L in range(2)])),
    "cohere logits.scale": ("cohere_f32", _set("logits.scale", None)),
    "cohere attention.qk_norm": ("cohere_f32", _then(_set("attention.qk_norm_weights", None),
                                                     _set("attention.qk_norm", False),
                                                     _drop(r"blk\.\d+\.attn_[qk]_norm\.weight"))),
    "cohere attention.qk_norm_weights shared": ("cohere_f32", _then(_set("attention.qk_norm_weights", None),
                                                                    _truncate_qk_norms)),
    "cohere attention.qkv_bias": ("cohere_f32", _then(_set("attention.qkv_bias", False),
                                                      _drop(r"blk\.\d+\.attn_[qkv]\.bias"))),
    "cohere attention.o_bias": ("cohere_f32", _then(_set("attention.o_bias", False),
                                                    _drop(r"blk\.\d+\.attn_output\.bias"))),
    "cohere rope.theta": ("cohere_f32", _then(_set("rope.theta", 500000.0), recompute_rope_freqs)),
    "cohere rope.rotary_dim": ("cohere_f32", _then(_set("rope.rotary_dim", 8), recompute_rope_freqs)),
    "cohere rope.layout interleaved": ("cohere_f32", _set("rope.layout", "interleaved")),
    "cohere_interleaved rope.layout half": ("cohere_interleaved", _set("rope.layout", "half")),
    "cohere_legacy tie_word_embeddings": ("cohere_legacy", _then(_set("tie_word_embeddings", True),
                                                                 _drop(r"output\.weight"))),
    "cohere_legacy head_dim/scale": ("cohere_legacy", _set("attention.scale", 0.25)),  # hidden / heads, not head_dim
}


@pytest.mark.parametrize("lie", list(LIES))
def test_lying_archive_fails(lie, archive, src, work):
    base, edit = LIES[lie]
    bad = tamper(archive(base), work / f"lie-{re.sub(r'[^a-z0-9]+', '-', lie)}.thin", edit)
    assert runner.invoke(app, ["verify", str(bad)]).exit_code == 0  # a valid archive: only check can tell
    code, d = check(bad, "--against", src[ARCHIVES[base][0]])
    _record(f"lie: {lie}", "transformers", d)
    assert code == 1 and not d["ok"] and d["failures"] and d["dtype_class"] == "exact"
    code, d = check(bad)
    assert code == 1 and not d["ok"]


# ---------------------------------------------------------------- 6. config keys the recipes do not handle

def _one_line_error(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


# A key of a neighbouring family that would change the computation there; this recipe reads
# nothing of it, so the conversion stops naming it unless the user takes responsibility.
FOREIGN = {"neox_f32": ("logit_scale", 0.5), "cohere_f32": ("rotary_pct", 0.5)}


@pytest.mark.parametrize("family", list(FOREIGN))
def test_unhandled_config_key_is_refused(family, src, work):
    key, value = FOREIGN[family]
    folder = _copy_with(src[family], work / "src" / f"{family}_{key}", **{key: value})
    out = work / f"{family}_{key}.thin"
    line = _one_line_error(runner.invoke(app, ["convert", str(folder), str(out)]))
    assert f"'{key}'" in line and f"--allow-config-key {key}" in line and not out.exists()
    convert(folder, out, "--allow-config-key", key)
    with open_archive(out) as a:
        assert a.manifest["validation"]["converter"]["options"]["allow_config_keys"] == [key]
        assert a.model == EXPECTED[family]


@pytest.mark.parametrize("family", ["neox_f32", "cohere_f32"])
def test_bidirectional_attention_is_refused(family, src, work):
    """`is_causal: false` makes transformers attend bidirectionally; no model key can say that. The
    key accounting counts it as a change, not an "off" value (family.DEFAULT_ON_KEYS): refused unless
    the user takes responsibility."""
    folder = _copy_with(src[family], work / "src" / f"{family}_bidirectional", is_causal=False)
    line = _one_line_error(runner.invoke(app, ["convert", str(folder), str(work / "bidi.thin")]))
    assert "'is_causal'" in line and "--allow-config-key is_causal" in line
    folder = _copy_with(src[family], work / "src" / f"{family}_causal", is_causal=True)
    convert(folder, work / f"{family}_causal.thin")


def test_cohere_null_logit_scale_is_refused(src, work):
    folder = _copy_with(src["cohere_f32"], work / "src" / "cohere_null_scale", logit_scale=None)  # transformers crashes
    assert "'logit_scale'" in _one_line_error(runner.invoke(app, ["convert", str(folder), str(work / "null.thin")]))


# ---------------------------------------------------------------- 7. recipe check

@pytest.mark.parametrize("name", ["neox_f32", "neox_bf16", "neox_legacy", "cohere_f32", "cohere_bf16", "cohere_legacy"])
def test_recipe_check(name, src):
    recipe = "gpt_neox" if name.startswith("neox") else "cohere"
    r = runner.invoke(app, ["recipe", "check", recipe, str(src[name])])
    assert r.exit_code == 0 and "OK" in r.output, r.output


# ---------------------------------------------------------------- engine: 1-D tensors from 2-D sources

def test_stacked_shape_flattens_2d_sources_of_1d_tensors():
    """Cohere's q_norm [heads, head_dim] is the 1-D per-head attn_q_norm [heads × head_dim]: the
    mapping's shape check reads it flattened (row-major), as the row reader does."""
    assert stacked_shape([[4, 16]], [Entry("q_norm")], 1) == [64]
    assert stacked_shape([[4, 16], [32]], [Entry("a"), Entry("b")], 1) == [96]
    assert stacked_shape([[4, 16]], [Entry("w")], 2) == [4, 16]  # a matrix keeps its shape
    assert stacked_shape([[64]], [Entry("b")], 1) == [64]
    assert stacked_shape([[4, 16]], [Entry("q", 0, 2)], 1) == [2, 16]  # slices are rows: never flattened
    assert stacked_shape([[2, 4, 16]], [Entry("x")], 1) == [2, 4, 16]  # only 2-D sources flatten
