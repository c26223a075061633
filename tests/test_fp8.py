"""Block-scaled FP8 sources (issue 12): `quantization_config.quant_method = "fp8"`, e4m3 weights with
`<name>_scale_inv` F32 block scales of weight_block_size, made here by our own numpy + ml_dtypes
quantizer from a tiny random Qwen2-MoE (a dense layer, experts, a shared expert) whose matrix sizes
are NOT multiples of the 32×32 block, so partial edge blocks exist everywhere. Embeddings, norms, the
head and the routers stay unquantized (bf16), as in real FP8 checkpoints.

The oracle is numpy's block dequantization, w8.astype(f32) * repeat(scale) cropped — the semantics
llama.cpp implements (transformers 5.24 infers the block from the scale grid and is wrong for
partial edge blocks, /work/notes/moe_fp8.md §11.4, so it is compared against only on a second
checkpoint whose sizes are multiples of the block).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import Thin, assert_convert_refused, load_safetensors_folder, write_safetensors
from families import VOCAB, build, edit_config
from thinconv.cli import app

runner = CliRunner()
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(FP8).max)  # 448
BLOCK = (32, 32)
QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


# ---------------------------------------------------------------- our own FP8 quantizer

def quantize_blocks(w: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [R, C] → (w8 float8_e4m3fn [R, C], scale f32 [⌈R/br⌉, ⌈C/bc⌉]) with w ≈ w8 · scale per block:
    scale = amax / 448, w8 = clip(w / scale, ±448) (ml_dtypes gives NaN beyond the range: clip first)."""
    br, bc = block
    rows, cols = w.shape
    scale = np.ones((math.ceil(rows / br), math.ceil(cols / bc)), np.float32)
    w8 = np.zeros((rows, cols), FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].astype(np.float32)
            amax = float(np.abs(blk).max())
            s = np.float32(amax / FP8_MAX) if amax > 0 else np.float32(1.0)
            scale[i, j] = s
            w8[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = np.clip(blk / s, -FP8_MAX, FP8_MAX).astype(FP8)
    return w8, scale


def dequantize_blocks(w8: np.ndarray, scale: np.ndarray, block=BLOCK) -> np.ndarray:
    """Per-block dequantization, partial edge blocks included: repeat the scales, crop, multiply (f32)."""
    rows, cols = w8.shape
    return w8.astype(np.float32) * np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:rows, :cols]


def quantized(name: str, arr: np.ndarray) -> bool:
    """Which tensors a real FP8 checkpoint quantizes: the linear layers, not embeddings, norms, head, routers."""
    return arr.ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name and \
        not name.startswith("lm_head") and "norm" not in name and \
        not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))


def make_fp8(src: Path, dst: Path, block=BLOCK, scale_block=None) -> dict[str, np.ndarray]:
    """An FP8 copy of the f32 checkpoint `src` at `dst`; returns name → the dequantized f32 weights
    (numpy's block dequantization for FP8 tensors, the bf16 values for the others).
    `scale_block`: quantize with another block than config.json names (a wrong scale grid)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    out, deq = {}, {}
    for name, arr in load_safetensors_folder(src).items():
        arr = arr.astype(np.float32)
        if quantized(name, arr):
            w8, scale = quantize_blocks(arr, scale_block or block)
            out[name], out[name + "_scale_inv"] = w8, scale
            deq[name] = dequantize_blocks(w8, scale, scale_block or block)
        else:
            out[name] = arr.astype(ml_dtypes.bfloat16)
            deq[name] = out[name].astype(np.float32)
    write_safetensors(dst / "model.safetensors", out, {"format": "pt"})
    edit_config(dst, quantization_config={**QCONFIG, "weight_block_size": list(block)}, dtype="bfloat16")
    return deq


def qwen2_moe_config(hidden: int, inter: int, moe: int, shared: int, heads: int = 4):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=moe, shared_expert_intermediate_size=shared, mlp_only_layers=[0],
                          norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, bos_token_id=1,
                          eos_token_id=2)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def edge(work) -> tuple[Path, dict[str, np.ndarray]]:
    """FP8 Qwen2-MoE: hidden 80 (head_dim 20), dense 72, experts 48, shared expert 40 — every matrix
    has a partial 32×32 block on at least one edge."""
    f32 = build(qwen2_moe_config(hidden=80, inter=72, moe=48, shared=40), work / "f32")
    deq = make_fp8(f32, work / "fp8")
    return work / "fp8", deq


@pytest.fixture(scope="module")
def divisible(work) -> tuple[Path, dict[str, np.ndarray]]:
    """FP8 Qwen2-MoE whose every size is a multiple of the 32×32 block (hidden 64, dense 96,
    experts 32, shared expert 64): what transformers dequantizes right, and q8_0 can quantize."""
    f32 = build(qwen2_moe_config(hidden=64, inter=96, moe=32, shared=64), work / "div-f32")
    deq = make_fp8(f32, work / "div-fp8")
    return work / "div-fp8", deq


def convert(src: Path, out: Path, *extra: str) -> Thin:
    r = runner.invoke(app, ["convert", str(src), str(out), "--force", *extra])
    assert r.exit_code == 0, r.output
    return Thin.read(out)


SPARSE_ROLES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
ROLE_SOURCE = {  # canonical role → source name in layer L (written out, not the recipe)
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}


def expected_f32(deq: dict[str, np.ndarray], name: str) -> np.ndarray:
    """The f32 values a canonical tensor must hold: numpy's dequantization, experts stacked."""
    if name == "token_embd.weight":
        return deq["model.embed_tokens.weight"]
    if name == "output.weight":
        return deq["lm_head.weight"]
    layer, role = int(name.split(".")[1]), name.split(".", 2)[2]
    if role in SPARSE_ROLES:
        return np.stack([deq[f"model.layers.{layer}.mlp.experts.{e}.{SPARSE_ROLES[role]}.weight"] for e in range(4)])
    return deq[f"model.layers.{layer}.{ROLE_SOURCE[role]}"]


# ---------------------------------------------------------------- round trip, bit for bit

def test_f32_archive_equals_numpy_block_dequantization(edge, work):
    src, deq = edge
    thin = convert(src, work / "f32.thin", "--dtype", "f32")
    assert runner.invoke(app, ["verify", str(work / "f32.thin")]).exit_code == 0
    partial = 0
    for t in thin.manifest["tensors"]:
        if len(t["shape"]) == 1:
            continue
        assert t["dtype"] == "f32" and t["quant"] is None, t["name"]
        want = expected_f32(deq, t["name"])
        got = thin.array(t["name"])
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), t["name"]
        partial += any(d % 32 for d in t["shape"][-2:])
        assert not any(s.endswith("_scale_inv") for s in t["source"]), t["source"]
    assert partial >= 10  # edge blocks in q/k/v/o, dense, expert and shared-expert matrices
    # the source's quantization is recorded with its provenance
    assert thin.manifest["validation"]["source"]["quantization"] == QCONFIG


def test_auto_means_bf16_for_an_fp8_source(edge, work):
    src, deq = edge
    thin = convert(src, work / "auto.thin")
    for t in thin.manifest["tensors"]:
        if len(t["shape"]) == 1:
            continue
        router = t["role"].startswith("ffn_gate_inp")
        assert t["dtype"] == ("f32" if router else "bf16"), t["name"]
        want = expected_f32(deq, t["name"])
        if not router:  # f32 dequantization rounded once to bf16 (nearest even), as transformers loads it
            want = want.astype(ml_dtypes.bfloat16)
        assert np.array_equal(thin.array(t["name"]).view(np.uint8), want.view(np.uint8)), t["name"]
    assert thin.manifest["validation"]["source"]["quantization"]["quant_method"] == "fp8"
    r = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "200"})
    assert "bf16 for an fp8 source" in " ".join(r.stdout.split())


@pytest.mark.parametrize("dtype", ["f32", "auto"])
def test_check_against_the_probe(edge, work, dtype):
    src, _ = edge
    out = work / f"probe-{dtype}.thin"
    convert(src, out, "--dtype", dtype)
    r = runner.invoke(app, ["check", str(out), "--json"])
    res = json.loads(r.stdout)
    assert r.exit_code == 0 and res["ok"], res
    assert res["max_rel_diff"] < (1e-5 if dtype == "f32" else 5e-2)


def test_q8_0_quantizes_the_dequantized_weights(divisible, work):
    """--dtype q8_0: the quantizer's input is the f32 dequantization (quant.source_dtype f32); the
    bytes equal gguf-py's reference quantizer on numpy's dequantization."""
    src, deq = divisible
    thin = convert(src, work / "q8.thin", "--dtype", "q8_0")
    n = 0
    for t in thin.manifest["tensors"]:
        if t["dtype"] != "q8_0":
            continue
        want = expected_f32(deq, t["name"])
        want = gguf.quants.quantize(want.reshape(-1, want.shape[-1]), gguf.GGMLQuantizationType.Q8_0)
        assert thin.raw(t["name"]) == want.tobytes(), t["name"]
        # fp8 weights reach the quantizer as w8 · scale in f32; embeddings and head are bf16 in the source
        assert t["quant"]["source_dtype"] == ("bf16" if t["layer"] is None else "f32"), t["name"]
        n += 1
    assert n == 2 + 2 * 4 + 3 + 3 + 3  # embeddings, head; q/k/v/o ×2 layers; dense MLP; experts; shared expert


def test_scales_are_consumed_not_unmapped(edge):
    from thinconv.checkpoint import open_checkpoint
    from thinconv.mapping import map_checkpoint
    from thinconv.recipe import load_registry

    src, _ = edge
    with open_checkpoint(str(src)) as ck:
        report = map_checkpoint(ck, load_registry().get("qwen2_moe"))
        scales = sorted(n for n in ck.tensors if n.endswith("_scale_inv"))
    assert report.problems == [] and report.unmapped == []
    assert scales and sorted(report.consumed) == scales
    assert report.fp8 is not None and report.fp8.block == BLOCK


# ---------------------------------------------------------------- transformers, on block-divisible sizes

def _check_against_fp8(archive: Path, src: Path) -> tuple[int, dict]:
    """`thinconv check ARCHIVE --against SRC --json` on an FP8 source: (exit code, the JSON).
    transformers needs `accelerate` to load FP8; its CPU path only dequantizes and never uses it,
    so the availability check is patched."""
    import transformers.quantizers.quantizer_finegrained_fp8 as q

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(q, "is_accelerate_available", lambda: True)
        r = runner.invoke(app, ["check", str(archive), "--against", str(src), "--json"])
    return r.exit_code, json.loads(r.stdout)


def test_check_against_transformers_on_block_divisible_sizes(divisible, work):
    """With every size a multiple of the 32×32 block, transformers' own FP8 dequantization is right:
    `check --against` the FP8 source passes (transformers needs `accelerate` to load FP8; its CPU
    path only dequantizes and never uses it, so the availability check is patched here)."""
    src, _ = divisible
    out = work / "div.thin"
    convert(src, out, "--dtype", "f32")
    code, res = _check_against_fp8(out, src)
    assert code == 0 and res["ok"] and res["reference"] == "transformers", res
    assert res["max_rel_diff"] < 1e-4
    print(f"MEASURED fp8 (block-divisible) vs transformers: max_rel_diff {res['max_rel_diff']:.3g}")


# ---------------------------------------------------------------- refusals

def _variant(edge, work: Path, tag: str) -> Path:
    src, _ = edge
    dst = work / "bad" / tag
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def _refused(src: Path, work: Path, tag: str, *needles: str) -> None:
    assert_convert_refused(src, work / "bad-out" / tag, *needles)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "compressed-tensors"])
def test_other_quant_methods_are_refused(edge, work, method):
    src = _variant(edge, work, method)
    edit_config(src, quantization_config={"quant_method": method, "bits": 4})
    _refused(src, work, method, f"quant_method '{method}' is not supported")


def test_fp8_without_its_scales(edge, work):
    src = _variant(edge, work, "noscale")
    tensors = _load_raw(src)
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"]
    write_safetensors(src / "model.safetensors", tensors, {"format": "pt"})
    _refused(src, work, "noscale", "experts.2.up_proj.weight", "is fp8 but", "_scale_inv", "missing")


def test_scales_of_the_wrong_block_grid(edge, work):
    """Scales made with 16×16 blocks while config.json says 32×32: one line naming the tensor and the grid."""
    src = work / "bad" / "grid"
    make_fp8(work / "f32", src, scale_block=(16, 16))
    edit_config(src, quantization_config=QCONFIG)
    # 26 scale tensors are wrong: the line names the first three and counts the rest
    _refused(src, work, "grid", "q_proj.weight_scale_inv is F32 [5, 5], expected F32 [3, 3] (blocks of 32×32",
             "… and 23 more tensor(s) like these")


def test_weight_block_size_malformed(edge, work):
    src = _variant(edge, work, "blocksize")
    edit_config(src, quantization_config={**QCONFIG, "weight_block_size": [32]})
    _refused(src, work, "blocksize", "weight_block_size")


def _load_raw(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the hand-written file, float8 included (safetensors' numpy loader has no fp8)."""
    data = (folder / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    types = {"F8_E4M3": FP8, "BF16": ml_dtypes.bfloat16, "F32": np.float32}
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], types[h["dtype"]]).reshape(h["shape"])
    return out


def test_semantics_of_a_lossy_archive_of_an_fp8_source(divisible, work):
    """A q8_0 archive of an FP8 source, against it: semantics loads the source's config without its
    quantization_config (the archive's weights are plain floats) and agrees to the exact bound."""
    src, _ = divisible
    out = work / "div-q8_0.thin"
    convert(src, out, "--dtype", "q8_0")
    code, res = _check_against_fp8(out, src)
    assert code == 0 and res["ok"] and res["dtype_class"] == "q8_0", res
    sem = res["semantics"]
    assert sem["ok"] and sem["top1_agreement"] == 1.0 and sem["max_rel_diff"] < 1e-4
    print(f"MEASURED fp8 → q8_0: semantics max_rel_diff {sem['max_rel_diff']:.3g}, fidelity mean KL "
          f"{res['mean_kl']:.3g}")
