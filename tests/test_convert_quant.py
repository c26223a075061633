"""Quantization at conversion (--dtype q8_0/q4_0/q4_1, --keep, recipe [keep]): archive bytes vs
gguf-py's reference quantizers, the dtype policy, validation.quant, reader.dequantize, the CLI
summaries and usage errors. Sources are the session fixtures of conftest.py, an f16 re-save of
one of them, and a Llama with hidden_size 48 (matrices whose cols are not a multiple of 32)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import Ckpt, Thin, assert_one_line_error, hf_source_name, interleave_reference, leftovers, \
    load_safetensors_folder, write_safetensors
from thinconv.checkpoint import open_checkpoint
from thinconv.cli import app
from thinconv.convert import ConvertResult, convert
from thinconv.errors import ThinFormatError
from thinconv.format.reader import open_archive
from thinconv.plan import ConvertOptions, plan_conversion
from thinconv.recipe import load_registry

runner = CliRunner()
SCHEMES = ("q8_0", "q4_0", "q4_1")
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # spec §3, spelled out
# permuted for the interleaved layout (spec §2.1): the matrices, and their biases and q/k norms
PERMUTED = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias", "attn_q_norm.weight",
            "attn_k_norm.weight")
NP = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype(ml_dtypes.bfloat16)}
F16_REL = 2.0 ** -10  # generous bound on f16's relative rounding error of d and m (exact: 2**-11)


# ---------------------------------------------------------------- sources and conversions

def convert_api(src: Path, out: Path, *, recipes=(), recipe: str | None = None, **opts) -> ConvertResult:
    registry = load_registry(recipes)
    with open_checkpoint(str(src)) as ck:
        r = registry.get(recipe) if recipe else registry.for_architecture(ck.config["architectures"])
        return convert(ck, plan_conversion(ck, r, ConvertOptions(**opts)), out)


def _resave_f16(c: Ckpt, dst: Path) -> Ckpt:
    """`c` with every weight re-saved as f16 (values chosen by the fixture fit f16's range)."""
    shutil.copytree(c.path, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    tensors = {k: v.astype(np.float16) for k, v in c.tensors.items()}
    write_safetensors(dst / "model.safetensors", tensors)
    return Ckpt(c.kind, dst, "f16", c.model, tensors, c.inv_freq)


@pytest.fixture(scope="module")
def sources(ckpts, tmp_path_factory) -> dict[str, Ckpt]:
    """One checkpoint per source dtype: bf16 Llama-3 (tied, GQA), f32 Llama-2 (untied), f16 Qwen3
    (q/k norm, head_dim 16 ≠ hidden/heads)."""
    f16 = _resave_f16(ckpts["qwen3"], tmp_path_factory.mktemp("f16") / "qwen3")
    return {"bf16": ckpts["llama3"], "f32": ckpts["llama2"], "f16": f16}


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> Ckpt:
    """A tied bf16 Llama with hidden_size 48: token_embd, attn_q/k/v, ffn_gate/up have 48 cols;
    attn_output (4 heads × 16) and ffn_down (intermediate 64) have 64."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("odd") / "llama48"
    hf.to(torch.bfloat16).save_pretrained(folder)
    return Ckpt("odd", folder, "bf16", {}, load_safetensors_folder(folder), np.zeros(0, np.float32))


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """archive(ckpt, dtype, **options) → (path, Thin, ConvertResult), each conversion done once."""
    base = tmp_path_factory.mktemp("qarchives")
    cache: dict = {}

    def get(ck: Ckpt, dtype: str, **opts):
        key = (str(ck.path), dtype, tuple(sorted(opts.items())))
        if key not in cache:
            path = base / f"{len(cache)}.thin"
            result = convert_api(ck.path, path, dtype=dtype, **opts)
            cache[key] = (path, Thin.read(path), result)
        return cache[key]

    return get


def source_f32(ck: Ckpt, name: str, model: dict, layout: str = "half") -> np.ndarray:
    """The quantizer input of spec §3: the source upcast exactly to f32, permuted for interleaved."""
    a = ck.tensors[hf_source_name(name)].astype(np.float32)
    if layout == "interleaved" and name.split(".", 2)[-1] in PERMUTED:
        a = interleave_reference(a, model["head_dim"], model["rope"]["rotary_dim"])
    return a


def expected_dtype(model: dict, name: str, shape: list[int], scheme: str) -> str:
    """The issue's policy for recipes where every matrix is quantizable (llama, qwen3)."""
    if len(shape) == 1:
        return "f32"
    head = "token_embd.weight" if model["tie_word_embeddings"] else "output.weight"
    return "q8_0" if name == head and scheme in ("q4_0", "q4_1") else scheme


def quant_obj(dtype: str, source_dtype: str) -> dict:
    return {"scheme": dtype, "block_size": 32, "block_bytes": BLOCK_BYTES[dtype], "source_dtype": source_dtype}


def dtypes_of(thin: Thin) -> dict[str, str]:
    return {t["name"]: t["dtype"] for t in thin.manifest["tensors"]}


def assert_exact(ck: Ckpt, thin: Thin, name: str, layout: str = "half") -> None:
    """Tensor `name` of the archive holds exactly what its dtype says the source becomes."""
    t = thin.tensor_entry(name)
    src = source_f32(ck, name, thin.manifest["model"], layout)
    if t["dtype"] in QTYPE:
        assert t["quant"] == quant_obj(t["dtype"], ck.dtype), name
        want = gguf.quants.quantize(src, QTYPE[t["dtype"]])
    else:
        assert t["quant"] is None, name
        want = src.astype(NP[t["dtype"]])
    assert thin.raw(name) == want.tobytes(), f"{name} ({t['dtype']}) differs from the reference"


# ---------------------------------------------------------------- bytes equal ggml's reference quantizers

@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("src", ["bf16", "f16", "f32"])
def test_bytes_equal_gguf_reference(sources, archive, src, scheme):
    ck = sources[src]
    _, thin, _ = archive(ck, scheme)
    model = thin.manifest["model"]
    quantized = 0
    for t in thin.manifest["tensors"]:
        assert t["dtype"] == expected_dtype(model, t["name"], t["shape"], scheme), t["name"]
        if t["name"] == "rope_freqs":
            assert t["quant"] is None
            continue
        assert_exact(ck, thin, t["name"])
        quantized += t["dtype"] in QTYPE
    assert quantized == sum(len(t["shape"]) == 2 for t in thin.manifest["tensors"])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("src", ["bf16", "f16"])
def test_interleaved_quantizes_the_permuted_source(sources, archive, src, scheme):
    ck = sources[src]
    _, thin, _ = archive(ck, scheme, rope_layout="interleaved")
    _, half, _ = archive(ck, scheme)
    assert thin.manifest["model"]["rope"]["layout"] == "interleaved"
    for t in thin.manifest["tensors"]:
        if t["name"] != "rope_freqs":
            assert_exact(ck, thin, t["name"], "interleaved")
    # the permutation really moved quantized rows (else this test proves nothing)
    assert thin.raw("blk.0.attn_q.weight") != half.raw("blk.0.attn_q.weight")
    assert thin.raw("blk.1.attn_k.weight") != half.raw("blk.1.attn_k.weight")
    # same blocks, other row order: the same error figures
    for name, q in half.manifest["validation"]["quant"].items():
        assert thin.manifest["validation"]["quant"][name]["rel_rmse"] == pytest.approx(q["rel_rmse"], rel=1e-5)


def _edge_rows(rng: np.random.Generator) -> np.ndarray:
    """One 32-value block per row, each a corner of the reference quantizers."""
    def normal():
        return rng.standard_normal(32)
    rows = [np.zeros(32), -np.zeros(32), np.full(32, 0.7), np.full(32, -0.7), np.arange(32) - 15.5,
            (np.arange(32) - 16) * (127 / 16), normal() * 1e-39, normal() * 1e-6]
    one = np.zeros(32)
    one[5] = 0.3
    rows.append(one)
    for a, b in ((2.0, -2.0), (-2.0, 2.0), (6e4, -6e4)):  # q4_0: ties of magnitude, either sign first
        r = normal()
        r[3], r[9] = a, b
        rows.append(r)
    r = normal()
    r[::2] = 0.0
    r[1] = -0.0
    rows.append(r)
    return np.array(rows)


def _c_zero_block(scheme: str, block: np.ndarray) -> bytes:
    """ggml's C on a block of (signed) zeros, where gguf-py's numpy choices differ (quant.py's
    docstring): q4_0 keeps max = +0.0, so d = +0.0 / -8 = -0.0 and every q = trunc(8.5) = 8;
    q4_1 keeps the first value as min and max, so m = x[0] (its sign included) and d = +0.0."""
    if scheme == "q8_0":
        return bytes(34)
    if scheme == "q4_0":
        return b"\x00\x80" + b"\x88" * 16
    return bytes(2) + np.float16(block[0]).tobytes() + bytes(16)


@pytest.mark.parametrize("src", ["f32", "f16"])
def test_edge_blocks_equal_the_reference(llama_copy, tmp_path, src):
    """Zeros (signed), constants, ties, f32/f16 subnormals (f32's flush to ±0 in f16), values near
    f16's limit, in a converted tensor: bytes equal gguf-py's, except that blocks of zeros follow
    ggml's C where gguf-py departs from it."""
    name, hf = "blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"
    tensors = dict(llama_copy.tensors)
    w = tensors[hf].copy()  # [64, 32]: one block per row
    edge = _edge_rows(np.random.default_rng(7))
    w[:len(edge)] = edge
    tensors[hf] = w
    tensors = {k: v.astype(NP[src]) for k, v in tensors.items()}
    write_safetensors(llama_copy.path / "model.safetensors", tensors)
    x = tensors[hf].astype(np.float32)
    assert np.signbit(x[1]).all() and not np.signbit(x[0]).any()
    for scheme in SCHEMES:
        out = tmp_path / f"{scheme}.thin"
        convert_api(llama_copy.path, out, dtype=scheme)
        got = np.frombuffer(Thin.read(out).raw(name), np.uint8).reshape(64, BLOCK_BYTES[scheme])
        with np.errstate(all="ignore"):  # gguf-py's 1/d overflows on the subnormal blocks
            want = gguf.quants.quantize(x, QTYPE[scheme])
        zero = [i for i in range(64) if not x[i].any()]
        assert zero[:2] == [0, 1] and (src == "f32" or 6 in zero)
        for i in zero:
            want[i] = np.frombuffer(_c_zero_block(scheme, x[i]), np.uint8)
        assert np.array_equal(got, want), [i for i in range(64) if not np.array_equal(got[i], want[i])]


# ---------------------------------------------------------------- which tensor gets which dtype

@pytest.mark.parametrize("scheme", ["q4_0", "q4_1"])
def test_four_bit_head_defaults_to_q8_0(sources, archive, scheme):
    _, untied, _ = archive(sources["f32"], scheme)  # Llama-2: output.weight is the head
    d = dtypes_of(untied)
    assert d["output.weight"] == "q8_0" and d["token_embd.weight"] == scheme and d["blk.0.ffn_up.weight"] == scheme
    _, tied, _ = archive(sources["bf16"], scheme)  # Llama-3: token_embd.weight is the head
    d = dtypes_of(tied)
    assert "output.weight" not in d and d["token_embd.weight"] == "q8_0" and d["blk.1.attn_v.weight"] == scheme
    assert tied.tensor_entry("token_embd.weight")["quant"] == quant_obj("q8_0", "bf16")


def test_one_d_tensors_stay_f32(sources, archive):
    ck = sources["bf16"]
    # '*' reaches the 1-D roles too: they stay f32 whatever a glob asks
    _, thin, _ = archive(ck, "q4_0", keep=(("*", "q4_1"), ("attn_*", "q8_0")))
    one_d = [t for t in thin.manifest["tensors"] if len(t["shape"]) == 1]
    assert {t["name"] for t in one_d} >= {"rope_freqs", "output_norm.weight", "blk.0.attn_norm.weight"}
    for t in one_d:
        assert (t["dtype"], t["quant"], len(t["pages"])) == ("f32", None, 1), t["name"]
        assert t["name"] not in thin.manifest["validation"]["quant"]
        if t["name"] != "rope_freqs":
            assert_exact(ck, thin, t["name"])
    assert dtypes_of(thin)["blk.0.attn_q.weight"] == "q8_0"


def test_keep_naming_only_1d_roles_is_a_usage_error():
    from thinconv.errors import UsageError
    from thinconv.plan import ConvertOptions

    with pytest.raises(UsageError, match=r"matches only 1-D roles, which are always f32"):
        ConvertOptions(dtype="q4_0", keep=(("*norm*", "q4_1"),))


def _recipe_dir(tmp_path: Path, name: str, body: str) -> Path:
    d = tmp_path / f"recipes-{name}"
    d.mkdir()
    (d / f"{name}.toml").write_text(f'name = "{name}"\nextends = "llama"\n{body}')
    return d


def test_only_the_recipes_quantizable_roles_are_quantized(sources, tmp_path):
    ck = sources["f32"]
    recipes = _recipe_dir(tmp_path, "narrow", 'quantizable = ["ffn_up.weight", "ffn_gate.weight"]\n')
    out = tmp_path / "n.thin"
    convert_api(ck.path, out, recipes=(recipes,), recipe="narrow", dtype="q4_0")
    thin = Thin.read(out)
    for t in thin.manifest["tensors"]:
        role = t["name"].split(".", 2)[-1] if t["name"].startswith("blk.") else t["name"]
        want = "q4_0" if role in ("ffn_up.weight", "ffn_gate.weight") else "f32"
        assert t["dtype"] == want, t["name"]  # the head too: not quantizable, so no q8_0 default
        if t["name"] != "rope_freqs":
            assert_exact(ck, thin, t["name"])
    assert set(thin.manifest["validation"]["quant"]) == {f"blk.{i}.{r}" for i in (0, 1)
                                                         for r in ("ffn_up.weight", "ffn_gate.weight")}
    # an explicit --keep still reaches a role the recipe leaves alone
    out2 = tmp_path / "n2.thin"
    convert_api(ck.path, out2, recipes=(recipes,), recipe="narrow", dtype="q4_0", keep=(("attn_v*", "q8_0"),))
    thin2 = Thin.read(out2)
    assert dtypes_of(thin2)["blk.0.attn_v.weight"] == "q8_0"
    assert_exact(ck, thin2, "blk.0.attn_v.weight")


def test_cols_not_a_multiple_of_32_keep_the_source_dtype(odd, archive):
    _, thin, result = archive(odd, "q4_0", keep=(("ffn_up*", "q4_1"),))
    odd_cols = {t["name"] for t in thin.manifest["tensors"] if len(t["shape"]) == 2 and t["shape"][1] % 32}
    assert odd_cols == {"token_embd.weight"} | {f"blk.0.{r}.weight" for r in
                                               ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")}
    quant = thin.manifest["validation"]["quant"]
    requested = {"token_embd.weight": "q8_0", "blk.0.ffn_up.weight": "q4_1"}  # tied head; --keep
    for name in odd_cols:
        t = thin.tensor_entry(name)
        assert (t["dtype"], t["quant"]) == ("bf16", None), name
        assert thin.raw(name) == odd.tensors[hf_source_name(name)].tobytes()  # the source, untouched
        q = quant[name]
        assert q["rel_rmse"] is None and q["rmse"] is None and q["max_abs_err"] is None
        note = q["note"]
        assert "48" in note and "multiple of 32" in note and "bf16" in note, note
        assert requested.get(name, "q4_0") in note, note
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_down.weight"):
        assert dtypes_of(thin)[name] == "q4_0"
        assert_exact(odd, thin, name)
        assert quant[name]["rel_rmse"] > 0
    assert result.quant_overall["tensors"] == 2
    # nothing requested a block type: nothing to explain
    _, f16, _ = archive(odd, "f16")
    assert dtypes_of(f16)["token_embd.weight"] == "f16"
    assert not f16.manifest["validation"].get("quant")


def test_keep_overrides(sources, archive):
    ck = sources["f32"]
    _, thin, _ = archive(ck, "q4_0", keep=(("ffn_down*", "q8_0"),))
    d = dtypes_of(thin)
    assert (d["blk.0.ffn_down.weight"], d["blk.1.ffn_down.weight"], d["blk.0.ffn_up.weight"]) == ("q8_0", "q8_0", "q4_0")
    assert_exact(ck, thin, "blk.1.ffn_down.weight")

    _, thin, _ = archive(ck, "q8_0", keep=(("attn_*", "bf16"),))
    d = dtypes_of(thin)
    for r in ("attn_q", "attn_k", "attn_v", "attn_output"):
        assert d[f"blk.0.{r}.weight"] == "bf16"
        assert_exact(ck, thin, f"blk.0.{r}.weight")
    assert d["blk.0.attn_norm.weight"] == "f32" and d["blk.0.ffn_gate.weight"] == "q8_0"
    assert "blk.0.attn_q.weight" not in thin.manifest["validation"]["quant"]

    # the later --keep wins, in either order
    _, a, _ = archive(ck, "q4_1", keep=(("ffn_*", "q8_0"), ("ffn_up*", "f16")))
    _, b, _ = archive(ck, "q4_1", keep=(("ffn_up*", "f16"), ("ffn_*", "q8_0")))
    assert (dtypes_of(a)["blk.0.ffn_up.weight"], dtypes_of(a)["blk.0.ffn_gate.weight"]) == ("f16", "q8_0")
    assert (dtypes_of(b)["blk.0.ffn_up.weight"], dtypes_of(b)["blk.0.ffn_gate.weight"]) == ("q8_0", "q8_0")
    assert_exact(ck, a, "blk.0.ffn_up.weight")
    assert_exact(ck, b, "blk.0.ffn_up.weight")

    # --keep beats the q8_0 default of the head
    _, thin, _ = archive(ck, "q4_0", keep=(("output.weight", "q4_1"),))
    assert dtypes_of(thin)["output.weight"] == "q4_1"
    assert_exact(ck, thin, "output.weight")
    _, thin, _ = archive(sources["bf16"], "q4_1", keep=(("token_embd*", "q4_0"),))
    assert dtypes_of(thin)["token_embd.weight"] == "q4_0"
    assert_exact(sources["bf16"], thin, "token_embd.weight")


def test_keep_on_the_command_line_in_order(sources, tmp_path):
    out = tmp_path / "k.thin"
    r = runner.invoke(app, ["convert", str(sources["f32"].path), str(out), "--no-probe", "--dtype", "q4_0",
                            "--keep", "ffn_*=q8_0", "--keep", "ffn_down*=bf16", "--keep", "output*=q4_0"])
    assert r.exit_code == 0, r.output
    d = dtypes_of(Thin.read(out))
    assert (d["blk.0.ffn_gate.weight"], d["blk.0.ffn_down.weight"], d["output.weight"], d["blk.0.attn_q.weight"]) \
        == ("q8_0", "bf16", "q4_0", "q4_0")


def test_recipe_keep_defaults(sources, tmp_path):
    ck = sources["f32"]
    recipes = _recipe_dir(tmp_path, "llamakeep", '[keep]\n"ffn_down.weight" = "q8_0"\n"attn_v.weight" = "f16"\n')
    out = tmp_path / "r.thin"
    r = runner.invoke(app, ["convert", str(ck.path), str(out), "--no-probe", "--dtype", "q4_0",
                            "--recipes", str(recipes)])
    assert r.exit_code == 0, r.output
    thin = Thin.read(out)
    assert thin.manifest["validation"]["converter"]["recipe"] == "llamakeep"  # picked by architecture
    d = dtypes_of(thin)
    assert (d["blk.0.ffn_down.weight"], d["blk.1.attn_v.weight"], d["blk.0.ffn_up.weight"], d["output.weight"]) \
        == ("q8_0", "f16", "q4_0", "q8_0")
    for name in ("blk.0.ffn_down.weight", "blk.1.attn_v.weight", "blk.0.ffn_up.weight"):
        assert_exact(ck, thin, name)
    # the user's --keep beats the recipe's default
    out2 = tmp_path / "r2.thin"
    convert_api(ck.path, out2, recipes=(recipes,), dtype="q4_0", keep=(("ffn_down*", "q4_1"),))
    assert dtypes_of(Thin.read(out2))["blk.0.ffn_down.weight"] == "q4_1"
    # a float conversion stays unquantized: the recipe's block-type default refines quantization only
    for dtype in ("auto", "bf16"):
        out3 = tmp_path / f"r3-{dtype}.thin"
        convert_api(ck.path, out3, recipes=(recipes,), dtype=dtype)
        thin = Thin.read(out3)
        natural = "f32" if dtype == "auto" else dtype
        d = dtypes_of(thin)
        assert {v for n, v in d.items() if "attn_v" not in n} <= {natural, "f32"}
        assert d["blk.0.attn_v.weight"] == d["blk.1.attn_v.weight"] == "f16"  # float defaults still apply
        assert not thin.manifest["validation"].get("quant")


def test_keep_to_a_float_dtype_casts_through_f32(sources, archive):
    """Tensors kept in floats within a quantized conversion: f16 → bf16 and bf16 → f16 round like
    the exact route through f32."""
    _, thin, _ = archive(sources["f16"], "q8_0", keep=(("attn_*", "bf16"),))
    assert dtypes_of(thin)["blk.0.attn_q.weight"] == "bf16"
    for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up"):
        assert_exact(sources["f16"], thin, f"blk.1.{r}.weight")
    _, thin, _ = archive(sources["bf16"], "q4_0", keep=(("ffn_*", "f16"),))
    assert dtypes_of(thin)["blk.0.ffn_gate.weight"] == "f16"
    for r in ("ffn_gate", "ffn_up", "ffn_down", "attn_q"):
        assert_exact(sources["bf16"], thin, f"blk.0.{r}.weight")


@pytest.mark.parametrize("src, dst", [("bf16", "f16"), ("f16", "bf16")])
def test_direct_float_casts_equal_the_route_through_f32(src, dst):
    """Every one of the 65,536 bit patterns: numpy/ml_dtypes' direct cast == upcast to f32, then round."""
    x = np.arange(1 << 16, dtype=np.uint16).view(NP[src])
    with np.errstate(over="ignore", invalid="ignore"):
        direct, route = x.astype(NP[dst]), x.astype(np.float32).astype(NP[dst])
    nan = np.isnan(route.astype(np.float32))
    assert np.array_equal(np.isnan(direct.astype(np.float32)), nan)
    assert np.array_equal(direct.view(np.uint16)[~nan], route.view(np.uint16)[~nan])


def test_f64_source_is_quantized_from_its_f32_rounding(llama_copy, tmp_path):
    wide = {k: v.astype(np.float64) / 3 for k, v in llama_copy.tensors.items()}  # not exact in f32
    write_safetensors(llama_copy.path / "model.safetensors", wide)
    out = tmp_path / "w.thin"
    convert_api(llama_copy.path, out, dtype="q8_0")
    thin = Thin.read(out)
    t = thin.tensor_entry("blk.0.ffn_up.weight")
    assert (t["dtype"], t["quant"]) == ("q8_0", quant_obj("q8_0", "f32"))
    src = wide["model.layers.0.mlp.up_proj.weight"].astype(np.float32)
    assert thin.raw(t["name"]) == gguf.quants.quantize(src, QTYPE["q8_0"]).tobytes()


@pytest.mark.parametrize("value, needles", [
    (float("nan"), ["NaN or Inf", "q4_0"]),
    (1e7, ["too large for q4_0", "--keep 'ffn_up.weight=bf16'"]),  # the f16 block scale d overflows
])
def test_values_a_block_type_cannot_hold_are_refused(llama_copy, tmp_path, value, needles):
    t = dict(llama_copy.tensors)
    w = t["model.layers.1.mlp.up_proj.weight"].copy()
    w[3, 7] = value
    t["model.layers.1.mlp.up_proj.weight"] = w
    write_safetensors(llama_copy.path / "model.safetensors", t)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(out_dir / "o.thin"), "--no-probe", "--dtype", "q4_0"])
    assert r.exit_code == 1, r.output
    assert_one_line_error(r.stderr, "blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight", *needles)
    assert leftovers(out_dir) == []
    # the way out the message suggests
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(out_dir / "o.thin"), "--no-probe", "--dtype", "q4_0",
                            "--keep", "ffn_up.weight=bf16"])
    assert r.exit_code == 0, r.output
    assert dtypes_of(Thin.read(out_dir / "o.thin"))["blk.1.ffn_up.weight"] == "bf16"


# ---------------------------------------------------------------- validation.quant and the error bound

@pytest.mark.parametrize("scheme", SCHEMES)
def test_validation_quant_matches_a_direct_computation(sources, archive, scheme):
    for src in ("bf16", "f16"):
        ck = sources[src]
        path, thin, _ = archive(ck, scheme, page_size=4096)  # several pages per tensor: merged figures
        quant = thin.manifest["validation"]["quant"]
        names = [t["name"] for t in thin.manifest["tensors"] if t["dtype"] in QTYPE]
        assert sorted(quant) == sorted(names)
        with open_archive(path) as a:
            for name in names:
                t = thin.tensor_entry(name)
                deq = a.dequantize(name)
                assert deq.dtype == np.float32 and list(deq.shape) == t["shape"]
                # the reader decodes like gguf-py
                assert np.array_equal(deq, gguf.quants.dequantize(a.tensor_bytes(name), QTYPE[t["dtype"]]))
                x = source_f32(ck, name, thin.manifest["model"]).astype(np.float64)
                err = deq.astype(np.float64) - x
                rmse = math.sqrt(np.mean(err * err))
                want = {"rmse": rmse, "max_abs_err": float(np.abs(err).max()),
                        "rel_rmse": rmse / math.sqrt(np.mean(x * x))}
                assert set(quant[name]) == set(want), name
                for k, v in want.items():
                    assert quant[name][k] == pytest.approx(v, rel=1e-6), (name, k)


def _blocks(thin: Thin, name: str) -> tuple[str, np.ndarray]:
    t = thin.tensor_entry(name)
    return t["dtype"], np.frombuffer(thin.raw(name), np.uint8).reshape(-1, BLOCK_BYTES[t["dtype"]])


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float64)  # q[j], q[j + 16]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_per_element_error_bound(sources, archive, scheme):
    """q8_0: |x − x̂| ≤ d/2; q4_0: ≤ |d| (|d|/2 except where q = 15, the clamp of the extreme
    opposite to the one that set d); q4_1: ≤ d/2 — each plus the f16 rounding of d (and m), with d
    and m read from the archive's own blocks."""
    ratios = []
    for src in ("bf16", "f32"):
        ck = sources[src]
        _, thin, _ = archive(ck, scheme)
        for t in thin.manifest["tensors"]:
            if t["dtype"] != scheme:
                continue
            dtype, b = _blocks(thin, t["name"])
            x = source_f32(ck, t["name"], thin.manifest["model"]).reshape(-1, 32).astype(np.float64)
            d = np.abs(b[:, 0:2].view(np.float16).astype(np.float64))
            if dtype == "q8_0":
                q = b[:, 2:].view(np.int8).astype(np.float64)
                xh = b[:, 0:2].view(np.float16).astype(np.float64) * q
                bound, slack = 0.5 * d, np.abs(q) * d * F16_REL
            elif dtype == "q4_0":
                q = _nibbles(b[:, 2:]) - 8
                xh = b[:, 0:2].view(np.float16).astype(np.float64) * q
                bound, slack = np.where(q == 7, 1.0, 0.5) * d, np.abs(q) * d * F16_REL
            else:
                m = b[:, 2:4].view(np.float16).astype(np.float64)
                q = _nibbles(b[:, 4:])
                xh = b[:, 0:2].view(np.float16).astype(np.float64) * q + m
                bound, slack = 0.5 * d, (q * d + np.abs(m)) * F16_REL
            e = np.abs(x - xh)
            assert (e <= bound + slack + 1e-12).all(), (t["name"], float((e / (bound + slack)).max()))
            ratios.append(float((e / np.maximum(bound, 1e-30)).max()))
    # the bound is tight: some element comes close to it (a looser quantizer would fail above)
    assert 0.9 < max(ratios) < 1.1, ratios


# ---------------------------------------------------------------- reading back

def test_dequantize_rows_and_multi_page_tensors(sources, archive):
    ck = sources["bf16"]
    small, thin, _ = archive(ck, "q4_1", page_size=4096)
    _, big, _ = archive(ck, "q4_1")
    name = "blk.0.ffn_down.weight"  # [64, 128] q4_1: 80 B rows, 51 per 4 KiB page
    t = thin.tensor_entry(name)
    assert len(t["pages"]) == 2 and len(thin.tensor_entry("token_embd.weight")["pages"]) > 2
    for n in (name, "token_embd.weight", "blk.1.attn_q.weight"):
        assert thin.raw(n) == big.raw(n)  # page boundaries change nothing
    with open_archive(small) as a:
        assert a.verify().ok
        full = a.dequantize(name)
        for rows in ((0, 64), (0, 1), (50, 52), (51, 51), (10, 60), (63, 64), (64, 64)):
            part = a.dequantize(name, rows=rows)
            assert part.dtype == np.float32 and np.array_equal(part, full[rows[0]:rows[1]]), rows
        embd = a.dequantize("token_embd.weight")  # q8_0 (tied head), several pages
        assert np.array_equal(embd, gguf.quants.dequantize(
            gguf.quants.quantize(source_f32(ck, "token_embd.weight", a.model), QTYPE["q8_0"]), QTYPE["q8_0"]))
        assert np.array_equal(a.dequantize("token_embd.weight", rows=(100, 200)), embd[100:200])
        # float tensors decode too
        assert np.array_equal(a.dequantize("output_norm.weight", rows=(3, 9)),
                              ck.tensors["model.norm.weight"][3:9].astype(np.float32))
        for bad in ((0, 65), (5, 4), (-1, 3)):
            with pytest.raises(ThinFormatError, match="rows"):
                a.dequantize(name, rows=bad)


def test_quantized_conversion_is_deterministic(sources, tmp_path):
    ck = sources["f16"]
    paths = [tmp_path / "a.thin", tmp_path / "b.thin"]
    for p in paths:
        convert_api(ck.path, p, dtype="q4_1", page_size=4096, rope_layout="interleaved",
                    keep=(("ffn_down*", "q8_0"), ("attn_v*", "q4_0")))
    assert paths[0].read_bytes() == paths[1].read_bytes()


# ---------------------------------------------------------------- CLI: summaries and inspect

def _overall(manifest: dict) -> tuple[int, float, str]:
    """Parameter-weighted mean rel_rmse over the quantized tensors (as ConvertResult.quant_overall)."""
    q = {n: v["rel_rmse"] for n, v in manifest["validation"]["quant"].items() if v["rel_rmse"] is not None}
    size = {t["name"]: math.prod(t["shape"]) for t in manifest["tensors"]}
    return len(q), sum(v * size[n] for n, v in q.items()) / sum(size[n] for n in q), max(q, key=q.get)


def test_convert_summary_and_json(sources, odd, tmp_path):
    for ck in (sources["bf16"], odd):  # odd: notes (no figures) must not disturb the summary
        out = tmp_path / f"{ck.kind}.thin"
        r = runner.invoke(app, ["convert", str(ck.path), str(out), "--no-probe", "--dtype", "q4_0"])
        assert r.exit_code == 0, r.output
        n, overall, worst = _overall(Thin.read(out).manifest)
        assert f"quantization: {n} tensors, overall rel_rmse {overall:.4g} (worst: {worst})" in r.stdout
        r = runner.invoke(app, ["convert", str(ck.path), str(out), "--no-probe", "--dtype", "q4_0", "--force",
                                "--json"])
        assert r.exit_code == 0, r.output
        q = json.loads(r.stdout)["quant"]
        assert (q["tensors"], q["worst"]) == (n, worst) and q["rel_rmse"] == pytest.approx(overall, rel=1e-12)
    r = runner.invoke(app, ["convert", str(sources["bf16"].path), str(tmp_path / "plain.thin"), "--no-probe",
                            "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["quant"] is None
    r = runner.invoke(app, ["convert", str(sources["bf16"].path), str(tmp_path / "plain2.thin"), "--no-probe"])
    assert r.exit_code == 0 and "quantization" not in r.stdout


def test_inspect_shows_the_worst_tensors(sources, odd, archive):
    for ck in (sources["f32"], odd):
        path, thin, _ = archive(ck, "q4_1")
        quant = thin.manifest["validation"]["quant"]
        ranked = sorted((n for n, v in quant.items() if v["rel_rmse"] is not None), key=lambda n: -quant[n]["rel_rmse"])
        r = runner.invoke(app, ["inspect", str(path), "--json"])
        assert r.exit_code == 0, r.output
        worst = json.loads(r.stdout)["quant"]["largest"]  # one name, `quant`, for the summary in every command
        assert [w["tensor"] for w in worst] == ranked[:5] and len(worst) == min(5, len(ranked))
        assert [w["rel_rmse"] for w in worst] == sorted((w["rel_rmse"] for w in worst), reverse=True)
        for w in worst:
            assert {k: w[k] for k in ("rmse", "max_abs_err", "rel_rmse")} == \
                {k: quant[w["tensor"]][k] for k in ("rmse", "max_abs_err", "rel_rmse")}
        r = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        text = r.stdout
        assert "largest quantization error" in text
        table = text[text.index("largest quantization error"):]
        assert ranked[0] in table and f"{quant[ranked[0]]['rel_rmse']:.4g}" in table
    path, plain, _ = archive(sources["f32"], "auto")
    assert not plain.manifest["validation"].get("quant")
    r = runner.invoke(app, ["inspect", str(path)])
    assert r.exit_code == 0 and "largest quantization error" not in r.stdout


# ---------------------------------------------------------------- usage errors

@pytest.mark.parametrize("args, needles", [
    (["--dtype", "q5_0"], ["q5_0", "auto", "bf16", "f16", "f32", "q8_0", "q4_0", "q4_1"]),
    (["--keep", "nonsense"], ["nonsense", "ROLE_GLOB=DTYPE"]),
    (["--keep", "ffn_down*=q9"], ["q9", "bf16", "f16", "f32", "q8_0", "q4_0", "q4_1"]),
    (["--keep", "zzz*=q8_0"], ["zzz*", "matches no role", "ffn_down.weight", "token_embd.weight"]),
])
def test_usage_errors(sources, tmp_path, args, needles):
    r = runner.invoke(app, ["convert", str(sources["f32"].path), str(tmp_path / "o.thin"), *args])
    assert r.exit_code == 2, (args, r.output)
    assert_one_line_error(r.stderr, *needles)
    assert leftovers(tmp_path) == []
