"""End-to-end conversion of the six tiny fixtures (tests/conftest.py): API and CLI, against the
source tensors, the config they were built from, transformers' own RoPE table and spec §2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

import thinconv
from conftest import ASSET_ORDER, KINDS, TOKENIZER_FILES, Ckpt, Thin, expected_names, hf_source_name, \
    interleave_reference
from thinconv.cli import app
from thinconv.convert import ConvertResult, convert_source
from thinconv.format.reader import open_archive
from thinconv.plan import ConvertOptions
from thinconv.recipe import load_registry

runner = CliRunner()
ROPE_ROLES = ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_q_norm.weight",
              "attn_k_norm.weight")


def convert_api(src: Path | str, out: Path, *, recipes=(), force: bool = False, **opts) -> ConvertResult:
    """The library entry point, without the probe unless asked (tests compare the rest)."""
    opts.setdefault("probe", False)
    return convert_source(src, out, options=ConvertOptions(**opts), registry=load_registry(recipes), force=force)


@pytest.fixture(scope="module")
def converted(ckpts, tmp_path_factory) -> dict[str, tuple[Path, Thin]]:
    """Every fixture converted once with the default options (API)."""
    base = tmp_path_factory.mktemp("converted")
    out = {}
    for kind in KINDS:
        path = base / f"{kind}.thin"
        convert_api(ckpts[kind].path, path)
        out[kind] = (path, Thin.read(path))
    return out


@pytest.fixture(scope="module")
def interleaved(ckpts, tmp_path_factory) -> dict[str, Thin]:
    base = tmp_path_factory.mktemp("interleaved")
    out = {}
    for kind in KINDS:
        path = base / f"{kind}.thin"
        r = runner.invoke(app, ["convert", str(ckpts[kind].path), str(path), "--rope-layout", "interleaved",
                                   "--no-probe"])
        assert r.exit_code == 0, r.output
        out[kind] = Thin.read(path)
    return out


# ---------------------------------------------------------------- the default conversion

def test_model_section(ckpt: Ckpt, converted):
    _, thin = converted[ckpt.kind]
    assert thin.manifest["model"] == ckpt.model
    assert thin.manifest["validation"]["converter"]["recipe"] == ckpt.model["architecture"]


def test_tensor_and_page_order_is_decode_order(ckpt: Ckpt, converted):
    _, thin = converted[ckpt.kind]
    m = thin.manifest
    names = [t["name"] for t in m["tensors"]]
    assert names == expected_names(ckpt.model)
    if ckpt.model["tie_word_embeddings"]:
        assert "output.weight" not in names
    for t in m["tensors"]:
        layer = int(t["name"].split(".")[1]) if t["name"].startswith("blk.") else None
        assert t["layer"] == layer
        assert t["role"] == (t["name"].split(".", 2)[2] if layer is not None else t["name"])
        assert t["source"] == ([] if t["name"] == "rope_freqs" else [hf_source_name(t["name"])])
    # pages: the tensors' pages in tensor order, then the assets'; the page table agrees
    want = [p for t in m["tensors"] for p in t["pages"]] + [p for a in m["assets"] for p in a["pages"]]
    assert [p["id"] for p in m["pages"]] == want == list(thin.pages)
    offsets = [thin.offsets[p] for p in want]
    assert offsets == sorted(offsets)


def test_passthrough_is_exact(ckpt: Ckpt, converted):
    """Matrices: the source bytes, untouched. 1-D tensors: exact f32 upcasts of the source values."""
    _, thin = converted[ckpt.kind]
    used = set()
    for t in thin.manifest["tensors"]:
        if t["name"] == "rope_freqs":
            continue
        src = ckpt.tensors[hf_source_name(t["name"])]
        used.add(hf_source_name(t["name"]))
        assert t["shape"] == list(src.shape)
        assert t["quant"] is None
        if src.ndim == 2:
            assert t["dtype"] == ckpt.dtype
            assert thin.raw(t["name"]) == src.tobytes(), t["name"]
        else:
            assert t["dtype"] == "f32"
            got = thin.array(t["name"])
            assert np.array_equal(got, src.astype(np.float32)), t["name"]
    # every source tensor made it in (tied checkpoints have no lm_head.weight at all)
    assert used == set(ckpt.tensors)


def test_hints(converted):
    _, thin = converted["llama2"]
    hints = {t["name"]: t["hints"] for t in thin.manifest["tensors"]}
    assert hints["token_embd.weight"] == {"placement": "host", "access": "gather"}
    assert hints["blk.0.attn_q.weight"] == {"placement": "device", "access": "matmul"}
    assert hints["blk.0.attn_norm.weight"] == {"placement": "device", "access": "elementwise"}


def test_archive_verifies(ckpt: Ckpt, converted):
    path, _ = converted[ckpt.kind]
    r = runner.invoke(app, ["verify", str(path)])
    assert r.exit_code == 0, r.output
    assert "OK" in r.output
    with open_archive(path) as a:  # and the project's reader reads what our own parser reads
        assert a.verify().ok
        assert a.tensor_names == [t["name"] for t in converted[ckpt.kind][1].manifest["tensors"]]


def test_rope_freqs_equal_transformers_inv_freq(ckpt: Ckpt, converted):
    _, thin = converted[ckpt.kind]
    t = thin.tensor_entry("rope_freqs")
    assert t["dtype"] == "f32" and t["shape"] == [ckpt.model["rope"]["rotary_dim"] // 2]
    assert t["source"] == [] and t["layer"] is None
    got = thin.array("rope_freqs").astype(np.float64)
    want = ckpt.inv_freq.astype(np.float64)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-6


def test_llama3_scaling_changed_the_frequencies(ckpts, converted):
    """Guards the fixture: llama3 scaling must actually bend some frequencies, or the check above is void."""
    c = ckpts["llama3"]
    plain = 500000.0 ** (-np.arange(0, 16, 2) / 16)
    got = converted["llama3"][1].array("rope_freqs")
    assert np.isclose(got[0], plain[0]) and not np.allclose(got, plain, rtol=1e-3)
    assert np.allclose(got[-1], plain[-1] / 8, rtol=1e-5)  # low frequencies are divided by the factor
    assert np.allclose(c.inv_freq, got, rtol=1e-6)


def test_validation_section(ckpt: Ckpt, converted):
    _, thin = converted[ckpt.kind]
    v = thin.manifest["validation"]
    assert v["converter"] == {"name": "thinconv", "version": thinconv.__version__,
                              "recipe": ckpt.model["architecture"],
                              "options": {"dtype": "auto", "page_size": 16 << 20, "rope_layout": "half", "keep": [],
                                          "strict": False, "probe": False}}
    src = v["source"]
    assert (src["repo_id"], src["revision"], src["commit"]) == (None, None, None)
    present = sorted(p.name for p in ckpt.path.iterdir()
                     if p.name in ASSET_ORDER or p.suffix == ".safetensors" or p.name.endswith(".index.json"))
    assert [f["name"] for f in src["files"]] == present
    for f in src["files"]:
        assert f["size"] == (ckpt.path / f["name"]).stat().st_size
        assert f["sha256"] is None  # a local folder has no blob hashes, and none is computed
    stats = v["stats"]
    assert set(stats) == {t["name"] for t in thin.manifest["tensors"]} - {"rope_freqs"}
    for name, st in stats.items():
        x = ckpt.tensors[hf_source_name(name)].astype(np.float64)
        assert st["min"] == x.min() and st["max"] == x.max(), name
        # float32 sums per chunk, merged in float64: good to ~1e-6 of the values' scale
        assert math.isclose(st["mean"], x.mean(), abs_tol=1e-6 * np.abs(x).mean()), name
        assert math.isclose(st["std"], x.std(), rel_tol=1e-6), name
        assert st["nan"] == 0 and st["inf"] == 0
    assert "quant" not in v


def test_assets_are_verbatim(ckpt: Ckpt, converted):
    _, thin = converted[ckpt.kind]
    present = [n for n in ASSET_ORDER if (ckpt.path / n).is_file()]
    assert "config.json" in present and "generation_config.json" in present
    for n in TOKENIZER_FILES.get(ckpt.kind, {}):
        assert (n in present) == (n in ASSET_ORDER)
    assets = thin.manifest["assets"]
    assert [a["name"] for a in assets] == present
    for a in assets:
        data = (ckpt.path / a["name"]).read_bytes()
        assert thin.asset(a["name"]) == data
        assert a["size"] == len(data)
        want_type = "application/json" if a["name"].endswith(".json") else \
            "text/plain" if a["name"].endswith(".jinja") else "application/octet-stream"
        assert a["media_type"] == want_type
    assert "special_tokens_map.json" not in [a["name"] for a in assets]


# ---------------------------------------------------------------- CLI, determinism

def test_cli_conversion_equals_api_and_is_deterministic(ckpt: Ckpt, converted, tmp_path):
    api_path, _ = converted[ckpt.kind]
    again = tmp_path / "again.thin"
    convert_api(ckpt.path, again)
    assert again.read_bytes() == api_path.read_bytes()
    cli = tmp_path / "cli.thin"
    r = runner.invoke(app, ["convert", str(ckpt.path), str(cli), "--no-probe"])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output
    assert cli.read_bytes() == api_path.read_bytes()


def test_cli_default_adds_only_the_probe(ckpts, converted, tmp_path):
    """The CLI's default conversion stores validation.probe; everything else is the API's archive."""
    out = tmp_path / "probe.thin"
    r = runner.invoke(app, ["convert", str(ckpts["qwen2"].path), str(out)])
    assert r.exit_code == 0, r.output
    got, want = Thin.read(out), converted["qwen2"][1]
    assert "probe" in got.manifest["validation"] and got.manifest["validation"]["converter"]["options"]["probe"]
    del got.manifest["validation"]["probe"]
    got.manifest["validation"]["converter"]["options"]["probe"] = False
    assert got.manifest == want.manifest and got.pages == want.pages


def test_cli_json_output(ckpts, converted, tmp_path):
    out = tmp_path / "o.thin"
    r = runner.invoke(app, ["convert", str(ckpts["qwen3"].path), str(out), "--json", "--no-probe"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    data = out.read_bytes()
    assert d["path"] == str(out) and d["size"] == len(data) and d["recipe"] == "qwen3"
    assert d["page_count"] == len(converted["qwen3"][1].pages) and d["warnings"] == [] and d["quant"] is None
    assert d["archive_hash"] == data[56:88].hex()


# ---------------------------------------------------------------- --rope-layout interleaved

def test_interleaved_layout(ckpt: Ckpt, interleaved):
    thin = interleaved[ckpt.kind]
    model = dict(ckpt.model, rope=dict(ckpt.model["rope"], layout="interleaved"))
    assert thin.manifest["model"] == model
    hd, rd = ckpt.model["head_dim"], ckpt.model["rope"]["rotary_dim"]
    permuted = 0
    for t in thin.manifest["tensors"]:
        name, role = t["name"], t["role"]
        if name == "rope_freqs":
            continue
        src = ckpt.tensors[hf_source_name(name)]
        got = thin.array(name)
        if role in ROPE_ROLES:
            want = interleave_reference(src, hd, rd)
            assert not np.array_equal(want, src)  # the permutation is not a no-op on random data
            permuted += 1
        else:
            want = src
        assert got.tobytes() == want.astype(got.dtype).tobytes(), name
    att = ckpt.model["attention"]
    assert permuted == ckpt.model["num_layers"] * (2 + 2 * att["qkv_bias"] + 2 * att["qk_norm"])
    # checksums and stats are of the permuted bytes, and the archive verifies
    q = ckpt.tensors[hf_source_name("blk.0.attn_q.weight")].astype(np.float64)
    assert thin.manifest["validation"]["stats"]["blk.0.attn_q.weight"]["mean"] == pytest.approx(
        float(q.mean()), abs=1e-6 * float(np.abs(q).mean()))


def test_interleaved_archive_verifies(ckpts, tmp_path):
    out = tmp_path / "i.thin"
    r = runner.invoke(app, ["convert", str(ckpts["qwen2"].path), str(out), "--rope-layout", "interleaved"])
    assert r.exit_code == 0
    with open_archive(out) as a:
        assert a.verify().ok and a.model["rope"]["layout"] == "interleaved"


def test_interleaved_partial_rotary(llama_copy: Ckpt, tmp_path):
    """rotary_dim < head_dim: only the first rotary_dim rows of each head move."""
    cfg_path = llama_copy.path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["partial_rotary_factor"] = 0.5
    cfg_path.write_text(json.dumps(cfg))
    res = convert_api(llama_copy.path, tmp_path / "p.thin", rope_layout="interleaved")
    assert res.manifest["model"]["rope"]["rotary_dim"] == 4
    thin = Thin.read(tmp_path / "p.thin")
    for name in ("blk.0.attn_q.weight", "blk.1.attn_k.weight"):
        src = llama_copy.tensors[hf_source_name(name)]
        want = interleave_reference(src, 8, 4)
        assert np.array_equal(thin.array(name), want)
        # rows 4..7 of each head stay where they were
        assert np.array_equal(thin.array(name).reshape(-1, 8, 32)[:, 4:], src.reshape(-1, 8, 32)[:, 4:])
    assert thin.manifest["tensors"][0]["shape"] == [2]


# ---------------------------------------------------------------- --page-size

@pytest.mark.parametrize("kind", ["llama2", "sharded"])
def test_small_pages_split_by_whole_rows(ckpts, kind, tmp_path):
    c = ckpts[kind]
    out = tmp_path / "small.thin"
    r = runner.invoke(app, ["convert", str(c.path), str(out), "--page-size", "4KiB", "--no-probe"])
    assert r.exit_code == 0, r.output
    thin = Thin.read(out)
    m = thin.manifest
    assert m["runtime"]["page_size"] == 4096
    pages = {p["id"]: p for p in m["pages"]}
    split, big = 0, 0
    for t in m["tensors"]:
        shape = t["shape"]
        row_bytes = (shape[1] if len(shape) == 2 else 1) * {"f32": 4, "bf16": 2}[t["dtype"]]
        total = shape[0] * row_bytes
        want_pages = math.ceil(total / 4096) if len(shape) == 2 else 1
        assert len(t["pages"]) == want_pages, t["name"]
        split += len(t["pages"]) > 1
        big += total > 4096
        cursor = 0
        for k, pid in enumerate(t["pages"]):
            p = pages[pid]
            assert pid == f"{t['name']}#{k}"
            s, e = p["rows"]
            assert s == cursor and e > s
            assert p["size"] == (e - s) * row_bytes <= max(4096, row_bytes)
            assert len(thin.pages[pid]) == p["size"]
            cursor = e
        assert cursor == shape[0]
        if t["name"] != "rope_freqs":
            src = c.tensors[hf_source_name(t["name"])]
            want = src if src.ndim == 2 else src.astype(np.float32)
            assert thin.raw(t["name"]) == want.tobytes()
    assert split == big >= 2  # at least the embeddings and the head are > 4 KiB
    if kind == "llama2":  # the 10 KiB tokenizer.model splits by bytes too
        tok = next(a for a in m["assets"] if a["name"] == "tokenizer.model")
        assert [pages[p]["size"] for p in tok["pages"]] == [4096, 4096, 10240 - 8192]
        assert thin.asset("tokenizer.model") == (c.path / "tokenizer.model").read_bytes()
    r = runner.invoke(app, ["verify", str(out)])
    assert r.exit_code == 0, r.output
    with open_archive(out) as a:
        for t in m["tensors"]:
            if t["name"] != "rope_freqs":
                assert a.tensor(t["name"]).tobytes() == thin.raw(t["name"])


def test_page_size_below_alignment_is_a_usage_error(ckpts, tmp_path):
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(tmp_path / "x.thin"), "--page-size", "1000"])
    assert r.exit_code == 2
    assert "--page-size" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.thin").exists()


# ---------------------------------------------------------------- dtype conversions keep the values

def test_dtype_f32_upcasts_exactly(ckpts, tmp_path):
    c = ckpts["llama3"]
    res = convert_api(c.path, tmp_path / "f32.thin", dtype="f32")
    thin = Thin.read(res.path)
    for t in thin.manifest["tensors"]:
        assert t["dtype"] == "f32"
        if t["name"] != "rope_freqs":
            assert np.array_equal(thin.array(t["name"]), c.tensors[hf_source_name(t["name"])].astype(np.float32))



# ---------------------------------------------------------------- other RoPE scalings, against transformers

@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_rope_scalings_match_transformers(llama_copy: Ckpt, tmp_path, scaling):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_path = llama_copy.path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **scaling}
    cfg_path.write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_copy.path))
    rotary = hf.model.rotary_emb
    res = convert_api(llama_copy.path, tmp_path / "r.thin")
    thin = Thin.read(res.path)
    rope = thin.manifest["model"]["rope"]
    assert rope["scaling"]["type"] == scaling["rope_type"]
    assert rope["attention_factor"] == pytest.approx(float(rotary.attention_scaling), rel=1e-6)
    names = [t["name"] for t in thin.manifest["tensors"]]
    if scaling["rope_type"] == "dynamic":
        assert "rope_freqs" not in names and names == expected_names(thin.manifest["model"])
        return
    want = rotary.inv_freq.to(torch.float64).numpy()
    got = thin.array("rope_freqs").astype(np.float64)
    assert np.max(np.abs(got - want) / want) <= 1e-6


def test_llama_attention_bias(tmp_path):
    """LlamaConfig.attention_bias puts biases on q, k, v *and* o: attn_output.bias exists."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, attention_bias=True)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_()
    hf.save_pretrained(tmp_path / "src")
    res = convert_api(tmp_path / "src", tmp_path / "b.thin", rope_layout="interleaved")
    thin = Thin.read(res.path)
    att = thin.manifest["model"]["attention"]
    assert att["qkv_bias"] is True and att["o_bias"] is True
    names = [t["name"] for t in thin.manifest["tensors"]]
    assert names == expected_names(thin.manifest["model"]) and "blk.1.attn_output.bias" in names
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert np.array_equal(thin.array("blk.1.attn_output.bias"), sd["model.layers.1.self_attn.o_proj.bias"])
    assert np.array_equal(thin.array("blk.0.attn_v.bias"), sd["model.layers.0.self_attn.v_proj.bias"])
    assert np.array_equal(thin.array("blk.0.attn_k.bias"),
                          interleave_reference(sd["model.layers.0.self_attn.k_proj.bias"], 8, 8))


def test_dtype_bf16_from_f32_rounds_like_ml_dtypes(ckpts, tmp_path):
    c = ckpts["qwen3"]
    res = convert_api(c.path, tmp_path / "b.thin", dtype="bf16")
    thin = Thin.read(res.path)
    for t in thin.manifest["tensors"]:
        src = c.tensors.get(hf_source_name(t["name"])) if t["name"] != "rope_freqs" else None
        if src is None:
            continue
        if src.ndim == 2:
            assert t["dtype"] == "bf16"
            assert thin.raw(t["name"]) == src.astype(ml_dtypes.bfloat16).tobytes()
        else:
            assert t["dtype"] == "f32" and np.array_equal(thin.array(t["name"]), src)
