"""`thinconv export`: back to a Hugging Face folder (tensors under their source names, fused and
per-expert sources re-assembled, RoPE rows un-permuted; transformers gives the source's logits
bit for bit) and to GGUF (compared with llama.cpp's own converter, fetched from PyPI)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import Ckpt, assert_one_line_error, load_safetensors_folder, write_safetensors
from families import EXAMPLE, build, hf_logits
from thinconv.checkpoint import open_checkpoint
from thinconv.cli import app
from thinconv.convert import convert, convert_source
from thinconv.errors import ExportError
from thinconv.export import export_gguf, export_safetensors
from thinconv.plan import ConvertOptions, plan_conversion
from thinconv.recipe import load_registry
from thinconv.transforms import register_transform

runner = CliRunner()
TOKENS = [0, 17, 42, 99, 7, 250, 3, 64, 128, 5]


def _convert(src: Path, out: Path, recipes: Path | None = None, **opts) -> Path:
    if recipes is None:
        return convert_source(src, out, options=ConvertOptions(**opts)).path
    reg = load_registry([recipes])
    with open_checkpoint(src) as ck:
        plan = plan_conversion(ck, reg.for_architecture(ck.config["architectures"]), ConvertOptions(**opts))
        return convert(ck, plan, out).path


def _same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


# ---------------------------------------------------------------- safetensors

@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_float_export_gives_back_the_source_tensors(ckpt: Ckpt, layout, tmp_path):
    """Every kind of checkpoint (bf16 / f32, tied, biases, q/k norms, sharded): same names, dtypes
    (1-D tensors back in bf16 for a bf16 source), shapes and bytes; config and tokenizer files verbatim."""
    thin = _convert(ckpt.path, tmp_path / "m.thin", rope_layout=layout)
    res = export_safetensors(thin, tmp_path / "hf")
    _same_tensors(load_safetensors_folder(tmp_path / "hf"), ckpt.tensors)
    assert res.dtype == ckpt.dtype
    assert (tmp_path / "hf" / "config.json").read_bytes() == (ckpt.path / "config.json").read_bytes()
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (ckpt.path / name).is_file():
            assert (tmp_path / "hf" / name).read_bytes() == (ckpt.path / name).read_bytes(), name
    assert not (tmp_path / "hf" / "special_tokens_map.json").exists()  # not an asset of the archive
    with open(tmp_path / "hf" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}


@pytest.mark.parametrize("kind,layout", [("llama3", "half"), ("llama3", "interleaved"), ("qwen2", "interleaved"),
                                         ("qwen3", "half")])
def test_transformers_logits_equal_the_source_exactly(ckpts, kind, layout, tmp_path):
    """transformers (f32, eager) on the exported folder gives the source's logits bit for bit."""
    c = ckpts[kind]
    thin = _convert(c.path, tmp_path / "m.thin", rope_layout=layout)
    export_safetensors(thin, tmp_path / "hf")
    tokens = [t % c.model["vocab_size"] for t in TOKENS]
    want, got = hf_logits(c.path, tokens), hf_logits(tmp_path / "hf", tokens)
    assert want.dtype == got.dtype == np.float32
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


def test_dtype_choices_and_quantized_archives(ckpts, tmp_path):
    """q8_0 is dequantized (auto: f32, exact; bf16 on request); --dtype casts float archives."""
    c = ckpts["llama3"]
    q8 = _convert(c.path, tmp_path / "q8.thin", dtype="q8_0")
    res = export_safetensors(q8, tmp_path / "auto")
    got = load_safetensors_folder(tmp_path / "auto")
    assert res.dtype == "f32" and {a.dtype for a in got.values()} == {np.dtype(np.float32)}
    import thinconv

    with thinconv.open(q8) as a:
        assert np.array_equal(got["model.layers.0.self_attn.v_proj.weight"], a.dequantize("blk.0.attn_v.weight"))
        assert np.array_equal(got["model.norm.weight"], a.tensor("output_norm.weight"))
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["dtype"] == "float32"
    export_safetensors(q8, tmp_path / "bf16", dtype="bf16")
    got = load_safetensors_folder(tmp_path / "bf16")
    assert {a.dtype for a in got.values()} == {np.dtype(ml_dtypes.bfloat16)}
    # a float archive cast to f32: exact widening of the bf16 source
    export_safetensors(_convert(c.path, tmp_path / "bf.thin"), tmp_path / "f32", dtype="f32")
    got = load_safetensors_folder(tmp_path / "f32")
    for name, src in c.tensors.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name], src.astype(np.float32)), name
    # transformers loads a dequantized folder too
    logits = hf_logits(tmp_path / "auto", TOKENS)
    assert np.isfinite(logits).all()


def test_sharded_output_with_index(ckpts, tmp_path):
    c = ckpts["sharded"]
    thin = _convert(c.path, tmp_path / "m.thin")
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "hf"), "--max-shard-size", "10KB", "--json"])
    assert r.exit_code == 0, r.output
    files = json.loads(r.stdout)["files"]
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(c.tensors) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in c.tensors.values())
    _same_tensors(load_safetensors_folder(tmp_path / "hf"), c.tensors)
    assert np.array_equal(hf_logits(tmp_path / "hf", TOKENS[:5]), hf_logits(c.path, TOKENS[:5]))


FUSED_RECIPE = '''
name = "fusedllama"
extends = "llama"
architectures = ["FusedLlamaForCausalLM"]
[tensors]
"blk.{L}.attn_q.weight" = { source = "model.layers.{L}.self_attn.qkv_proj.weight", rows = "[[0, num_attention_heads * head_dim]]" }
"blk.{L}.attn_k.weight" = { source = "model.layers.{L}.self_attn.qkv_proj.weight", rows = "[[num_attention_heads * head_dim, (num_attention_heads + num_kv_heads) * head_dim]]" }
"blk.{L}.attn_v.weight" = { source = "model.layers.{L}.self_attn.qkv_proj.weight", rows = "[[(num_attention_heads + num_kv_heads) * head_dim, (num_attention_heads + 2 * num_kv_heads) * head_dim]]" }
"blk.{L}.ffn_gate.weight" = { source = "model.layers.{L}.mlp.gate_up_proj.weight", rows = "[[0, intermediate_size]]" }
"blk.{L}.ffn_up.weight" = { source = "model.layers.{L}.mlp.gate_up_proj.weight", rows = "[[intermediate_size, 2 * intermediate_size]]" }
'''


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_fused_sources_are_reassembled(llama_copy: Ckpt, layout, tmp_path):
    """Phi-3-style qkv_proj and gate_up_proj (NAME[a:b] slices) come back whole, with q and k rows
    back in the source's layout."""
    t = dict(llama_copy.tensors)
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.qkv_proj.weight"] = np.concatenate([t.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        t[p + "mlp.gate_up_proj.weight"] = np.concatenate([t.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    (llama_copy.path / "model.safetensors").unlink()
    write_safetensors(llama_copy.path / "model.safetensors", t)
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["architectures"] = ["FusedLlamaForCausalLM"]
    (llama_copy.path / "config.json").write_text(json.dumps(cfg))
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "fused.toml").write_text(FUSED_RECIPE)
    thin = _convert(llama_copy.path, tmp_path / "f.thin", recipes, rope_layout=layout, page_size=4096)
    with pytest.raises(ExportError, match="converted with recipe 'fusedllama', which is not available here"):
        export_safetensors(thin, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    export_safetensors(thin, tmp_path / "hf", recipes=(recipes,))
    _same_tensors(load_safetensors_folder(tmp_path / "hf"), t)


def _mixtral(folder: Path, fused: bool) -> dict[str, np.ndarray]:
    """A tiny Mixtral, per-expert (as save_pretrained writes it) or fused as transformers holds it."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=384, max_position_embeddings=128, num_local_experts=4,
                        num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None)
    build(cfg, folder, dtype="bf16")
    t = load_safetensors_folder(folder)
    if fused:
        for layer in range(2):
            p = f"model.layers.{layer}."
            e = [[t.pop(p + f"block_sparse_moe.experts.{x}.{w}.weight") for x in range(4)] for w in ("w1", "w2", "w3")]
            t[p + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(e[0], e[2])])
            t[p + "mlp.experts.down_proj"] = np.stack(e[1])
            t[p + "mlp.gate.weight"] = t.pop(p + "block_sparse_moe.gate.weight")
        (folder / "model.safetensors").unlink()
        write_safetensors(folder / "model.safetensors", t)
    return t


@pytest.mark.parametrize("fused", [False, True])
def test_expert_tensors_split_back(fused, tmp_path):
    """Mixtral: per-expert sources come back one tensor per expert; fused 3-D gate_up_proj (sliced
    on dim 1) and down_proj come back whole; transformers' logits equal the source's."""
    src = tmp_path / "mixtral"
    t = _mixtral(src, fused)
    thin = _convert(src, tmp_path / "m.thin", rope_layout="interleaved")
    export_safetensors(thin, tmp_path / "hf")
    _same_tensors(load_safetensors_folder(tmp_path / "hf"), t)
    if not fused:  # transformers reads the Hub layout (the fused one is its in-memory layout)
        want, got = hf_logits(src, TOKENS), hf_logits(tmp_path / "hf", TOKENS)
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


def test_refusals_are_one_line(ckpts, tmp_path):
    c = ckpts["llama2"]
    thin = _convert(c.path, tmp_path / "m.thin")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "busy")])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "busy is not empty", "--force")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x"
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "busy"), "--force"])
    assert r.exit_code == 0 and not (tmp_path / "busy" / "keep.txt").exists()
    assert (tmp_path / "busy" / "model.safetensors").is_file()
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "x"), "--dtype", "q8_0"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "--dtype 'q8_0'", "auto, bf16, f16, f32")
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "x"), "--to", "onnx"])
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--to 'onnx'")
    r = runner.invoke(app, ["export", str(tmp_path / "missing.thin"), str(tmp_path / "x")])
    assert_one_line_error(r.stderr, "missing.thin", "cannot open")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "m.thin"]  # no temp folder left


@register_transform("test_export_negate")
def _negate(rows, *, name, start, end, model):
    return -rows.astype(np.float32)


def test_what_cannot_be_given_back_is_refused(llama_copy: Ckpt, tmp_path):
    """A recipe transform changed the values; whole sources concatenated into one tensor have sizes
    the archive does not record: both refused in one line, before anything is written."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "neg.toml").write_text('name = "neg"\nextends = "llama"\narchitectures = ["LlamaForCausalLM"]\n'
                                      '[transforms]\n"ffn_up.weight" = "test_export_negate"\n')
    thin = _convert(llama_copy.path, tmp_path / "neg.thin", recipes)
    with pytest.raises(ExportError, match="blk.0.ffn_up.weight was changed by transform 'test_export_negate'"):
        export_safetensors(thin, tmp_path / "hf", recipes=(recipes,))
    (recipes / "neg.toml").unlink()
    t = dict(llama_copy.tensors)
    for layer in range(2):
        k = t.pop(f"model.layers.{layer}.self_attn.k_proj.weight")
        t[f"model.layers.{layer}.self_attn.k_a.weight"], t[f"model.layers.{layer}.self_attn.k_b.weight"] = k[:5], k[5:]
    (llama_copy.path / "model.safetensors").unlink()
    write_safetensors(llama_copy.path / "model.safetensors", t)
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["architectures"] = ["SplitForCausalLM"]
    (llama_copy.path / "config.json").write_text(json.dumps(cfg))
    (recipes / "split.toml").write_text('name = "split"\nextends = "llama"\narchitectures = ["SplitForCausalLM"]\n'
                                        '[tensors]\n"blk.{L}.attn_k.weight" = ["model.layers.{L}.self_attn.k_a.weight", '
                                        '"model.layers.{L}.self_attn.k_b.weight"]\n')
    thin = _convert(llama_copy.path, tmp_path / "split.thin", recipes)
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "hf"), "--recipes", str(recipes)])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "blk.0.attn_k.weight", "k_a.weight", "concatenated whole", "cannot be split back")
    assert not (tmp_path / "hf").exists()


def test_gguf_without_the_gguf_package(ckpts, tmp_path, monkeypatch):
    thin = _convert(ckpts["llama3"].path, tmp_path / "m.thin")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf → ImportError
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "m.gguf"), "--to", "gguf"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "GGUF export needs the gguf package", "thinconv[gguf]")


def test_a_failed_write_leaves_nothing(ckpts, tmp_path, monkeypatch):
    """A failure mid-export (here: a broken tensor read) removes the temp folder; the old output stays."""
    c = ckpts["llama3"]
    thin = _convert(c.path, tmp_path / "m.thin")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("old")
    from thinconv.export import common

    def boom(self, a, b, dtype):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common.TensorRows, "floats", boom)
    with pytest.raises(ExportError, match="disk full"):
        export_safetensors(thin, tmp_path / "hf", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.thin"]
    assert (tmp_path / "hf" / "old.txt").read_text() == "old"


# ---------------------------------------------------------------- GGUF

def _gguf_dump(path: Path) -> tuple[dict, list]:
    """(metadata key → (types, value)) in file order, and [(name, type, shape, bytes)] of every tensor."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(path)
    kv = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = f.types
        if t[0] == GGUFValueType.ARRAY:
            val = [bytes(f.parts[i]) if t[1] == GGUFValueType.STRING else f.parts[i].tolist()[0] for i in f.data]
        elif t[0] == GGUFValueType.STRING:
            val = bytes(f.parts[f.data[0]])
        else:
            val = f.parts[f.data[0]].tolist()[0]
        kv[name] = ([x.name for x in t], val)
    tensors = [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), bytes(np.asarray(t.data).view(np.uint8)))
               for t in r.tensors]
    return kv, tensors


def _example(tmp_path: Path, name: str = "tiny-llama") -> Path:
    dst = tmp_path / name
    shutil.copytree(EXAMPLE, dst)
    return dst


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_0"])
def test_gguf_reads_back(dtype, tmp_path):
    """GGUFReader reads the file: llama.cpp's names, shapes (reversed), types; q8_0 / q4_0 blocks are
    the archive's bytes with attn_q / attn_k rows interleaved; rope_freqs holds llama3 divisors."""
    import thinconv
    from thinconv.rows import rope_row_permutation

    src = _example(tmp_path)
    thin = _convert(src, tmp_path / "tiny-llama.thin", dtype=dtype)
    res = export_gguf(thin, tmp_path / "m.gguf", tokenizer_pre="gpt-2")
    kv, tensors = _gguf_dump(tmp_path / "m.gguf")
    by_name = {t[0]: t for t in tensors}
    assert kv["general.architecture"][1] == b"llama" and kv["general.name"][1] == b"Tiny Llama"
    assert kv["tokenizer.ggml.model"][1] == b"gpt2" and kv["tokenizer.ggml.pre"][1] == b"gpt-2"
    assert len(kv["tokenizer.ggml.tokens"][1]) == 384
    assert kv["llama.block_count"][1] == 2 and kv["llama.rope.freq_base"][1] == 500000.0
    assert res.dtype == {"bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}[dtype]
    assert tensors[0][0] == "rope_freqs.weight"
    assert np.frombuffer(by_name["rope_freqs.weight"][3], np.float32)[0] == 1.0  # a divisor, not a frequency
    with thinconv.open(thin) as a:
        assert len(tensors) == len(a.tensor_names)
        for name in a.tensor_names:
            if name == "rope_freqs":
                continue
            info = a.tensor_info(name)
            g = by_name[name]
            assert g[2] == tuple(reversed(info["shape"]))
            assert g[1] == info["dtype"].upper()
            raw = np.asarray(a.tensor_bytes(name))
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                raw = raw[rope_row_permutation(raw.shape[0], 16, 16)]
            assert g[3] == raw.tobytes(), name


def test_gguf_refuses_other_families_in_one_line(tmp_path):
    src = tmp_path / "mixtral"
    _mixtral(src, fused=False)
    thin = _convert(src, tmp_path / "m.thin")
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "m.gguf"), "--to", "gguf"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "mixtral (MixtralForCausalLM) cannot be exported to GGUF yet",
                          "Llama, Mistral, Qwen2, Qwen3")
    thin = _convert(_example(tmp_path), tmp_path / "t.thin")
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "m.gguf"), "--to", "gguf"])
    assert_one_line_error(r.stderr, "does not know this BPE pre-tokenizer", "--tokenizer-pre")
    r = runner.invoke(app, ["export", str(thin), str(tmp_path / "m.gguf"), "--to", "gguf", "--dtype", "bf16"])
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--dtype applies to --to safetensors only")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.thin", "mixtral", "t.thin", "tiny-llama"]


# -- against llama.cpp's convert_hf_to_gguf.py

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e57098 (the converter thinconv.export.to_gguf follows)
_CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
_WRAPPER = '''
import os, runpy, sys
from pathlib import Path
LLAMA_CPP = Path(os.environ["LLAMA_CPP"])
sys.path.insert(0, str(LLAMA_CPP / "gguf-py")); sys.path.insert(0, str(LLAMA_CPP))
import gguf, conversion.base as base
assert Path(gguf.__file__).resolve().is_relative_to(LLAMA_CPP.resolve())  # the vendored gguf-py
_orig, _pre = base.TextModel.get_vocab_base_pre, os.environ.get("GGUF_TOKENIZER_PRE")
def _patched(self, tokenizer):  # a tiny tokenizer's hash is unknown: use the name given (a known hash wins)
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        if not _pre:
            raise
        return _pre
base.TextModel.get_vocab_base_pre = _patched
sys.argv = [str(LLAMA_CPP / "convert_hf_to_gguf.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _cache_dir() -> Path:
    root = os.environ.get("THINCONV_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "thinconv-tests")
    return Path(root)


@pytest.fixture(scope="session")
def llama_cpp_converter() -> tuple[Path, Path]:
    """(vendor/llama.cpp folder with convert_hf_to_gguf.py, a --target folder with sentencepiece),
    fetched once with pip from the llama-cpp-python sdist and kept in ~/.cache/thinconv-tests
    ($THINCONV_TEST_CACHE): later runs reuse the 2 MB of converter files kept from the 77 MB sdist."""
    cache = _cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    llama_cpp, deps = cache / "llama.cpp", cache / "pydeps"
    if not (llama_cpp / "convert_hf_to_gguf.py").is_file():
        dl = cache / "dl"
        dl.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(dl)],
                           capture_output=True, text=True, timeout=900)
        sdists = list(dl.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode or not sdists:
            pytest.skip(f"cannot download llama-cpp-python {LLAMA_CPP_PYTHON} with pip (no network?): "
                        f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        tmp = cache / "llama.cpp.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdists[0]) as tar:
            for m in tar.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rel and m.isfile() and (rel in _CONVERTER_FILES or rel.startswith(_CONVERTER_FILES)):
                    target = tmp / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(m).read())
        os.replace(tmp, llama_cpp)
        shutil.rmtree(dl, ignore_errors=True)
    if not (deps / "sentencepiece").is_dir():
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps),
                            "sentencepiece>=0.1.98,<0.3.0"], capture_output=True, text=True, timeout=600)
        if r.returncode:
            shutil.rmtree(deps, ignore_errors=True)
            pytest.skip(f"cannot install sentencepiece for the converter (no network?): "
                        f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    for module in ("torch", "transformers", "yaml"):
        pytest.importorskip(module, reason=f"llama.cpp's converter needs {module}")
    return llama_cpp, deps


def _run_converter(converter: tuple[Path, Path], model: Path, outtype: str, out: Path) -> None:
    llama_cpp, deps = converter
    wrapper = out.parent / "run_convert.py"
    wrapper.write_text(_WRAPPER)
    env = {**os.environ, "LLAMA_CPP": str(llama_cpp), "PYTHONPATH": str(deps), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "GGUF_TOKENIZER_PRE": "gpt-2"}
    r = subprocess.run([sys.executable, str(wrapper), str(model), "--outtype", outtype, "--outfile", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _tiny_qwen3(folder: Path) -> Path:
    """Qwen3 with the example tokenizer: q/k norms, head_dim 32 ≠ 64 / 4, tied, bf16."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=384, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    return build(cfg, folder, dtype="bf16")


def _tiny_llama_spm(folder: Path, deps: Path, monkeypatch) -> Path:
    """The example Llama with a SentencePiece tokenizer.model (trained here) instead of tokenizer.json."""
    monkeypatch.syspath_prepend(str(deps))
    import sentencepiece

    _example(folder.parent, folder.name)
    (folder / "tokenizer.json").unlink()
    words = "the quick brown fox jumps over a lazy dog while llamas export tokens".split()
    rng = np.random.default_rng(0)
    text = folder.parent / "corpus.txt"
    text.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(2000)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "tokenizer"), vocab_size=384,
                                             model_type="bpe", byte_fallback=True, minloglevel=2)
    (folder / "tokenizer.vocab").unlink()
    special = {str(i): {"content": c, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])}
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "added_tokens_decoder": special}))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("family,dtype", [("llama", "q8_0"), ("llama", "bf16"), ("qwen3", "q8_0"),
                                          ("llama-spm", "q8_0")])
def test_gguf_equals_llama_cpp_converter(llama_cpp_converter, family, dtype, tmp_path, monkeypatch):
    """A tiny checkpoint through llama.cpp's own convert_hf_to_gguf.py and through thinconv (from a
    half and an interleaved archive): the same metadata (keys, order, types, values), the same
    tensors (names, order, types, shapes, bytes) — the same file, byte for byte. The tiny Llama has
    llama3 RoPE (rope_freqs), a tied head and a byte-level BPE tokenizer (the `gpt2` tokenizer
    model); llama-spm the same weights with a SentencePiece tokenizer.model (the `llama` one);
    Qwen3 has q/k norms, a head_dim of its own and no Q/K permutation."""
    (tmp_path / "src").mkdir()
    if family == "llama":
        src = _example(tmp_path / "src")
    elif family == "llama-spm":
        src = _tiny_llama_spm(tmp_path / "src" / "tiny-llama-spm", llama_cpp_converter[1], monkeypatch)
    else:
        src = _tiny_qwen3(tmp_path / "src" / "tiny-qwen3")
    want = tmp_path / "llama.cpp.gguf"
    _run_converter(llama_cpp_converter, src, dtype, want)
    kv_a, t_a = _gguf_dump(want)
    for layout in ("half", "interleaved"):
        (tmp_path / layout).mkdir()
        thin = _convert(src, tmp_path / layout / f"{src.name}.thin", dtype=dtype, rope_layout=layout)
        got = tmp_path / f"thinconv-{layout}.gguf"
        r = runner.invoke(app, ["export", str(thin), str(got), "--to", "gguf", "--tokenizer-pre", "gpt-2"])
        assert r.exit_code == 0, r.output
        kv_b, t_b = _gguf_dump(got)
        assert list(kv_a) == list(kv_b)
        for key in kv_a:
            assert kv_a[key] == kv_b[key], key
        assert [t[:3] for t in t_a] == [t[:3] for t in t_b]
        for a, b in zip(t_a, t_b):
            assert a[3] == b[3], f"{a[0]}: bytes differ"
        assert hashlib.sha256(got.read_bytes()).digest() == hashlib.sha256(want.read_bytes()).digest()
