"""Mixture-of-experts families (issue 12): Mixtral, Qwen2-MoE (sigmoid-gated shared expert) and
Qwen3-MoE, in both checkpoint layouts — the per-expert tensors the Hub and save_pretrained have,
and the fused ones save_pretrained(..., save_original_format=False) writes (gate_up_proj
[E, 2f, hidden] gate first, down_proj [E, hidden, f]).

Per family, tiny random checkpoints (tests/families.py) in f32 and bf16, both layouts; every
config value that changes the computation is set away from its default (windows shorter than the
check sequence, RoPE base 5000, decoder_sparse_step 2 with mlp_only_layers, top-2 of 6-8 experts,
norm_topk_prob, attention biases, head_dim ≠ hidden / heads, a tied head). Windows are shorter
than the probe's 8 tokens, so that dropping one fails `check` against the probe too. The "hub" variant
rewrites config.json the way Hub files spell it (num_experts instead of num_local_experts, a
top-level rope_theta, torch_dtype, no layer_types, the default-valued keys left out) so that the
recipes' defaults are exercised. The expected `model` sections are written out by hand; the
source-side oracles (stacked experts, gguf quantization, the quantization error figures) are
computed with numpy and gguf-py, never with thinconv.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import blake3
import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import (Thin, assert_convert_refused, assert_one_line_error, leftovers, load_safetensors_folder,
                      write_safetensors)
from families import VOCAB, build, drop_tensors, edit_config, hf_greedy
from thinconv.cli import app

runner = CliRunner()
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
VARIANTS = ("f32", "f32_fused", "bf16", "bf16_fused")  # bf16: per-expert tensors, Hub-style config.json
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}
EXPERT_ROLES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
MEASURED: dict[str, float] = {}  # figures the report quotes (printed at the end with -s)
FAILURES: dict[str, str] = {}  # why each lying archive failed `check`


# ---------------------------------------------------------------- the checkpoints

ROPE_5000 = {"rope_type": "default", "rope_theta": 5000.0}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def _config(family: str, hub: bool):
    """The transformers config of a family's checkpoint (`hub`: the variant whose config.json is
    then rewritten Hub-style, built with the values that spelling implies)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "mixtral":
        return MixtralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=32, num_local_experts=6,
                             num_experts_per_tok=2, tie_word_embeddings=True,
                             sliding_window=None if hub else 6,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6} if hub else ROPE_5000)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**COMMON, intermediate_size=128, num_hidden_layers=6, num_experts=6, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=96, decoder_sparse_step=2,
                              mlp_only_layers=[3], use_sliding_window=True, sliding_window=4, max_window_layers=6 if hub else 3,
                              rope_parameters=ROPE_5000, qkv_bias=hub, norm_topk_prob=not hub)
    return Qwen3MoeConfig(**COMMON, intermediate_size=128, num_hidden_layers=6, head_dim=32, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=2, mlp_only_layers=[1],
                          use_sliding_window=True, sliding_window=5, rope_parameters=ROPE_5000,
                          attention_bias=not hub, norm_topk_prob=not hub)


def _hub_style(family: str, folder: Path) -> None:
    """config.json as the Hub spells it: legacy keys, defaults left out."""
    common = dict(dtype=None, torch_dtype="bfloat16")
    if family == "mixtral":  # → no window, RoPE base 1e6 (MixtralConfig's defaults); num_experts alias
        edit_config(folder, sliding_window=None, rope_parameters=None, num_local_experts=None, num_experts=6,
                    **common)
    elif family == "qwen2_moe":  # → qkv_bias true, norm_topk_prob false, layer_types by the max_window_layers rule
        # (max_window_layers 6 = num_hidden_layers: the even layers below it slide)
        edit_config(folder, qkv_bias=None, norm_topk_prob=None, layer_types=None, rope_parameters=None,
                    rope_theta=5000.0, **common)
    else:  # → num_experts alias, no biases, no renormalisation; max_window_layers ignored
        edit_config(folder, num_local_experts=None, num_experts=8, attention_bias=None, norm_topk_prob=None,
                    rope_parameters=None, rope_theta=5000.0, max_window_layers=2, **common)


def _model(**kw) -> dict:
    """A `model` section (spec §2.1 + addendum §3), every value given by the caller."""
    return {
        "architecture": kw["arch"], "source_architecture": kw["src"], "hidden_size": 64,
        "intermediate_size": kw["inter"], "num_layers": kw["layers"], "num_attention_heads": 4, "num_kv_heads": 2,
        "head_dim": kw["head_dim"], "vocab_size": VOCAB, "max_position_embeddings": 256,
        "tie_word_embeddings": kw["tied"], "norm": {"type": "rmsnorm", "eps": 1e-5},
        "mlp": {"type": "gated", "activation": "silu"},
        "attention": {"qkv_bias": kw["qkv_bias"], "o_bias": kw["o_bias"], "qk_norm": kw["qk_norm"],
                      "sliding_window": kw["window"], "layer_types": kw["types"], "scale": kw["head_dim"] ** -0.5},
        "rope": {"theta": kw["theta"], "rotary_dim": kw["head_dim"], "layout": "half", "scaling": None,
                 "attention_factor": 1.0},
        "special_tokens": {"bos": 1, "eos": [2], "pad": None},
        "moe": kw["moe"],
    }


S, F, T, N = "sliding", "full", True, False
EXPECTED = {
    ("mixtral", False): _model(
        arch="mixtral", src="MixtralForCausalLM", inter=96, layers=2, head_dim=32, tied=True, qkv_bias=False,
        o_bias=False, qk_norm=False, window=6, types=[S, S], theta=5000.0,
        moe={"num_experts": 6, "num_experts_per_tok": 2, "expert_intermediate_size": 96, "scoring": "softmax",
             "norm_topk_prob": True, "layers": [T, T], "shared_expert": None}),
    ("mixtral", True): _model(
        arch="mixtral", src="MixtralForCausalLM", inter=96, layers=2, head_dim=32, tied=True, qkv_bias=False,
        o_bias=False, qk_norm=False, window=None, types=[F, F], theta=1e6,
        moe={"num_experts": 6, "num_experts_per_tok": 2, "expert_intermediate_size": 96, "scoring": "softmax",
             "norm_topk_prob": True, "layers": [T, T], "shared_expert": None}),
    ("qwen2_moe", False): _model(
        arch="qwen2_moe", src="Qwen2MoeForCausalLM", inter=128, layers=6, head_dim=16, tied=False, qkv_bias=False,
        o_bias=False, qk_norm=False, window=4, types=[S, F, S, F, F, F], theta=5000.0,
        moe={"num_experts": 6, "num_experts_per_tok": 2, "expert_intermediate_size": 32, "scoring": "softmax",
             "norm_topk_prob": True, "layers": [N, T, N, N, N, T],
             "shared_expert": {"intermediate_size": 96, "gate": True}}),
    ("qwen2_moe", True): _model(
        arch="qwen2_moe", src="Qwen2MoeForCausalLM", inter=128, layers=6, head_dim=16, tied=False, qkv_bias=True,
        o_bias=False, qk_norm=False, window=4, types=[S, F, S, F, S, F], theta=5000.0,
        moe={"num_experts": 6, "num_experts_per_tok": 2, "expert_intermediate_size": 32, "scoring": "softmax",
             "norm_topk_prob": False, "layers": [N, T, N, N, N, T],
             "shared_expert": {"intermediate_size": 96, "gate": True}}),
    ("qwen3_moe", False): _model(
        arch="qwen3_moe", src="Qwen3MoeForCausalLM", inter=128, layers=6, head_dim=32, tied=False, qkv_bias=True,
        o_bias=True, qk_norm=True, window=5, types=[S] * 6, theta=5000.0,
        moe={"num_experts": 8, "num_experts_per_tok": 2, "expert_intermediate_size": 64, "scoring": "softmax",
             "norm_topk_prob": True, "layers": [N, N, N, T, N, T], "shared_expert": None}),
    ("qwen3_moe", True): _model(
        arch="qwen3_moe", src="Qwen3MoeForCausalLM", inter=128, layers=6, head_dim=32, tied=False, qkv_bias=False,
        o_bias=False, qk_norm=True, window=5, types=[S] * 6, theta=5000.0,
        moe={"num_experts": 8, "num_experts_per_tok": 2, "expert_intermediate_size": 64, "scoring": "softmax",
             "norm_topk_prob": False, "layers": [N, N, N, T, N, T], "shared_expert": None}),
}
SPARSE = {f: [i for i, s in enumerate(EXPECTED[f, False]["moe"]["layers"]) if s] for f in FAMILIES}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module", autouse=True)
def _same_source_same_logits():
    """`check --against SRC` runs SRC under transformers; this module checks many archives
    (quantized, lying) against the same few sources and tokens, so each source's logits are
    computed once and reused — the same values, without reloading the model for every check."""
    import thinconv.check

    original = thinconv.check.transformers_logits
    cache: dict = {}

    def cached(source_root, tokens, vocab=None, **kwargs):
        if kwargs:  # the archive's own weights in a temporary folder (semantics): nothing to reuse
            return original(source_root, tokens, vocab, **kwargs)
        key = (str(source_root), tuple(tokens), vocab)
        if key not in cache:
            cache[key] = original(source_root, tokens, vocab)
        return cache[key].copy()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(thinconv.check, "transformers_logits", cached)
        yield


@pytest.fixture(scope="module")
def sources(work) -> dict[tuple[str, str], Path]:
    """(family, variant) → checkpoint folder, built once."""
    out = {}
    for family in FAMILIES:
        for variant in VARIANTS:
            hub = variant == "bf16"
            folder = work / "src" / f"{family}-{variant}"
            save = {"save_original_format": False} if variant.endswith("fused") else {}
            build(_config(family, hub), folder, dtype=variant.split("_")[0], save_kwargs=save)
            if hub:
                _hub_style(family, folder)
            out[family, variant] = folder
    return out


def convert(src: Path, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["convert", str(src), str(out), "--force", *extra])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def archive(sources, work):
    """archive(family, variant, *options) → path, converted on first use."""
    cache: dict[tuple, Path] = {}

    def get(family: str, variant: str, *extra: str) -> Path:
        key = (family, variant, *extra)
        if key not in cache:
            tag = "".join(c if c.isalnum() else "_" for c in "-".join(extra))
            cache[key] = convert(sources[family, variant], work / f"{family}-{variant}-{tag}.thin", *extra)
        return cache[key]

    return get


def check(*args) -> tuple[int, dict]:
    """`thinconv check … --json` in-process: (exit code, parsed JSON)."""
    r = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def source_tensors(folder: Path) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in load_safetensors_folder(folder).items()}


def expert_source(family: str, fused: bool, tensors: dict, layer: int, role: str) -> np.ndarray:
    """The [E, rows, cols] tensor a canonical expert role holds, stacked / sliced with numpy from the
    source names written out here (not the recipe): Mixtral w1 = gate, w3 = up, w2 = down; the fused
    gate_up_proj holds gate in its first f rows of dim 1, up in the rest."""
    if fused:
        p = f"model.layers.{layer}.mlp."
        if role == "ffn_gate_inp.weight":
            return tensors[p + "gate.weight"]
        if role == "ffn_down_exps.weight":
            return tensors[p + "experts.down_proj"]
        gate_up = tensors[p + "experts.gate_up_proj"]
        f = gate_up.shape[1] // 2
        return gate_up[:, :f] if role == "ffn_gate_exps.weight" else gate_up[:, f:]
    if family == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        names = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
    else:
        p = f"model.layers.{layer}.mlp."
        names = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}
    if role == "ffn_gate_inp.weight":
        return tensors[p + "gate.weight"]
    n = EXPECTED[family, False]["moe"]["num_experts"]
    return np.stack([tensors[f"{p}experts.{e}.{names[role]}.weight"] for e in range(n)])


# ---------------------------------------------------------------- model section, verify, recipe check

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_model_section_is_the_hand_written_one(archive, sources, family, variant):
    path = archive(family, variant)
    thin = Thin.read(path)
    assert thin.manifest["model"] == EXPECTED[family, variant == "bf16"]
    assert thin.manifest["validation"]["converter"]["recipe"] == family
    assert runner.invoke(app, ["verify", str(path)]).exit_code == 0
    r = runner.invoke(app, ["recipe", "check", family, str(sources[family, variant]), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] and d["problems"] == [] and d["unmapped"] == [] and d["missing"] == []
    # matrices keep the source dtype (auto); the routers are f32 like the norms
    dtype = variant.split("_")[0]
    for t in thin.manifest["tensors"]:
        want = "f32" if len(t["shape"]) == 1 or t["role"].startswith("ffn_gate_inp") else dtype
        assert t["dtype"] == want, t["name"]


# ---------------------------------------------------------------- check --against, probe, run

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_check_against_transformers_exact(archive, sources, family, variant):
    path = archive(family, variant)
    code, res = check(path, "--against", sources[family, variant])
    assert code == 0 and res["ok"], res["failures"]
    assert res["dtype_class"] == "exact" and res["reference"] == "transformers"
    window = EXPECTED[family, variant == "bf16"]["attention"]["sliding_window"]
    assert res["positions"] == (max(16, window + 8) if window else 16)  # the window is exercised
    MEASURED[f"{family} {variant} max_rel_diff"] = res["max_rel_diff"]
    code, res = check(path)  # against the probe
    assert code == 0 and res["ok"] and res["reference"] == "probe", res["failures"]


@pytest.mark.parametrize("variant", ["f32", "f32_fused"])  # experts per tensor, and fused (export re-fuses them)
@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_within_bounds(archive, sources, family, variant):
    path = archive(family, variant, "--dtype", "q8_0")
    thin = Thin.read(path)
    for t in thin.manifest["tensors"]:
        if t["role"] in EXPERT_ROLES:
            assert t["dtype"] == "q8_0", t["name"]
        if t["role"].startswith("ffn_gate_inp"):
            assert t["dtype"] == "f32", t["name"]  # routers are never quantized
    code, res = check(path, "--against", sources[family, variant])
    assert code == 0 and res["dtype_class"] == "q8_0", res["failures"]
    MEASURED[f"{family} {variant} q8_0 mean_kl"] = res["mean_kl"]
    MEASURED[f"{family} {variant} q8_0 top1"] = res["top1_agreement"]
    # semantics: transformers on the archive's own dequantized experts agrees to the exact bound
    sem = res["semantics"]
    assert sem["ok"] and sem["top1_agreement"] == 1.0 and sem["max_rel_diff"] <= 1e-4, sem["failures"]
    MEASURED[f"{family} {variant} q8_0 semantics max_rel_diff"] = sem["max_rel_diff"]
    code, res = check(path)
    assert code == 0, res["failures"]


@pytest.mark.parametrize("family", FAMILIES)
def test_run_matches_transformers_greedy(archive, sources, family):
    prompt = "Once upon a time"
    r = runner.invoke(app, ["run", str(archive(family, "f32")), "--prompt", prompt, "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    want = hf_greedy(sources[family, "f32"], prompt, 8)
    assert want.strip()
    assert r.stdout == prompt + want + "\n"


# ---------------------------------------------------------------- experts: bytes, pages, quantization

PAGE_SIZE = 5000  # no power of two: whole-row pages of this size do not divide an expert's rows


@pytest.mark.parametrize("variant", ["f32", "f32_fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_pages_never_straddle(archive, sources, family, variant):
    """With ~5 KB pages every expert spans several pages, and no page holds rows of two experts
    (addendum §4: ⌊a / rows⌋ = ⌊(b − 1) / rows⌋); the stacked bytes equal the source's."""
    path = archive(family, variant, "--page-size", str(PAGE_SIZE))
    thin = Thin.read(path)
    assert runner.invoke(app, ["verify", str(path)]).exit_code == 0
    pages = {p["id"]: p for p in thin.manifest["pages"]}
    tensors = source_tensors(sources[family, variant])
    n_experts = EXPECTED[family, False]["moe"]["num_experts"]
    checked = 0
    for t in thin.manifest["tensors"]:
        if t["role"] not in EXPERT_ROLES:
            continue
        experts, rows, cols = t["shape"]
        assert experts == n_experts
        page_rows = PAGE_SIZE // (cols * 4)
        assert rows % page_rows, "pages cut without regard to experts would straddle them"
        spans = [pages[pid]["rows"] for pid in t["pages"]]
        assert len(spans) == experts * math.ceil(rows / page_rows), (t["name"], spans)
        assert spans[0][0] == 0 and spans[-1][1] == experts * rows
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for a, b in spans:
            assert a // rows == (b - 1) // rows, (t["name"], a, b, rows)
            assert b - a <= page_rows
        want = expert_source(family, variant.endswith("fused"), tensors, t["layer"], t["role"])
        assert np.array_equal(thin.array(t["name"]), want), t["name"]
        checked += 1
    assert checked == 3 * len(SPARSE[family])


def test_validator_refuses_a_page_that_straddles_experts(archive):
    """A hand-made manifest whose pages cross expert boundaries is refused, page by page."""
    from thinconv.format.manifest import validate_manifest

    thin = Thin.read(archive("mixtral", "f32"))
    m = json.loads(json.dumps(thin.manifest))
    assert not validate_manifest(m).lines()
    name = "blk.0.ffn_down_exps.weight"
    t = next(t for t in m["tensors"] if t["name"] == name)
    assert t["shape"] == [6, 64, 96]
    # re-cut the tensor into 24-row pages with no regard to experts (64 rows each)
    cuts = list(range(0, 6 * 64 + 1, 24))
    cut_pages = [{"id": f"{name}#{k}", "tensor": name, "rows": [a, b], "size": (b - a) * 96 * 4,
                  "checksum": "0" * 64} for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    first = next(i for i, p in enumerate(m["pages"]) if p.get("tensor") == name)
    m["pages"] = m["pages"][:first] + cut_pages + [p for p in m["pages"][first:] if p.get("tensor") != name]
    t["pages"] = [p["id"] for p in cut_pages]
    lines = validate_manifest(m).lines()
    straddling = [(a, b) for a, b in zip(cuts, cuts[1:]) if a // 64 != (b - 1) // 64]
    assert len(straddling) == 4 and len(lines) == 4, lines
    assert all("straddles experts" in ln and "a page never holds rows of two experts" in ln for ln in lines)
    assert any("[48, 72] straddles experts 0 and 1 (64 rows each)" in ln for ln in lines), lines


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("family,variant", [("mixtral", "f32"), ("qwen2_moe", "bf16_fused"), ("qwen3_moe", "f32_fused"),
                                            ("qwen3_moe", "bf16")])
def test_quantized_expert_bytes_equal_gguf(archive, sources, family, variant, scheme):
    """Expert tensors quantize along cols as [E·rows, cols] matrices: the bytes equal gguf-py's
    reference quantizer (bit-exact with ggml) run on the stacked source; routers stay f32."""
    thin = Thin.read(archive(family, variant, "--dtype", scheme))
    tensors = source_tensors(sources[family, variant])
    fused = variant.endswith("fused")
    for layer in SPARSE[family]:
        for role in EXPERT_ROLES:
            t = thin.tensor_entry(f"blk.{layer}.{role}")
            assert t["dtype"] == scheme and t["quant"]["source_dtype"] == variant.split("_")[0]
            src = expert_source(family, fused, tensors, layer, role)
            want = gguf.quants.quantize(src.reshape(-1, src.shape[-1]), QTYPE[scheme])
            assert thin.raw(t["name"]) == want.tobytes(), t["name"]
        router = thin.tensor_entry(f"blk.{layer}.ffn_gate_inp.weight")
        assert router["dtype"] == "f32" and router["quant"] is None
        assert np.array_equal(thin.array(router["name"]), expert_source(family, fused, tensors, layer,
                                                                         "ffn_gate_inp.weight"))


def test_keep_globs_match_expert_roles_and_the_error_report(archive, sources):
    """--dtype q4_0 --keep 'ffn_down_exps*=q8_0': down experts q8_0, the other experts q4_0, the
    shared expert q4_0, its gate and the routers f32; validation.quant per expert tensor equals
    the error of the dequantized bytes, computed here with gguf-py."""
    family, variant = "qwen2_moe", "f32"
    thin = Thin.read(archive(family, variant, "--dtype", "q4_0", "--keep", "ffn_down_exps*=q8_0"))
    tensors = source_tensors(sources[family, variant])
    dt = {t["name"]: t["dtype"] for t in thin.manifest["tensors"]}
    quant = thin.manifest["validation"]["quant"]
    for layer in SPARSE[family]:
        b = f"blk.{layer}."
        assert dt[b + "ffn_down_exps.weight"] == "q8_0"
        assert dt[b + "ffn_gate_exps.weight"] == dt[b + "ffn_up_exps.weight"] == "q4_0"
        assert dt[b + "ffn_gate_shexp.weight"] == dt[b + "ffn_down_shexp.weight"] == "q4_0"
        assert dt[b + "ffn_gate_inp.weight"] == dt[b + "ffn_gate_inp_shexp.weight"] == "f32"
        assert b + "ffn_gate_inp.weight" not in quant
        for role in EXPERT_ROLES:
            name = b + role
            src = expert_source(family, False, tensors, layer, role)
            src = src.reshape(-1, src.shape[-1])
            raw = np.frombuffer(thin.raw(name), np.uint8).reshape(src.shape[0], -1)
            deq = gguf.quants.dequantize(raw, QTYPE[dt[name]]).astype(np.float64)
            err = deq - src.astype(np.float64)
            rmse = math.sqrt(float(np.mean(err ** 2)))
            rms = math.sqrt(float(np.mean(src.astype(np.float64) ** 2)))
            got = quant[name]
            assert got["rmse"] == pytest.approx(rmse, rel=1e-5), name
            assert got["max_abs_err"] == pytest.approx(float(np.abs(err).max()), rel=1e-6), name
            assert got["rel_rmse"] == pytest.approx(rmse / rms, rel=1e-5), name
            assert 0 < got["rel_rmse"] < (0.01 if dt[name] == "q8_0" else 0.2)
    path = archive(family, variant, "--dtype", "q4_0", "--keep", "ffn_down_exps*=q8_0")
    assert runner.invoke(app, ["inspect", str(path)]).exit_code == 0
    code, res = check(path, "--against", sources[family, variant])
    assert code == 0 and res["dtype_class"] == "q4", res


def test_check_class_counts_expert_tensors(archive, sources):
    """A bf16 source whose expert tensors alone are cast to f16 is a lossy ("float") archive: the
    dtype class looks at [E, rows, cols] tensors too."""
    path = archive("mixtral", "bf16_fused", "--keep", "ffn_*_exps*=f16")
    thin = Thin.read(path)
    assert {t["dtype"] for t in thin.manifest["tensors"] if t["role"] in EXPERT_ROLES} == {"f16"}
    assert {t["dtype"] for t in thin.manifest["tensors"] if len(t["shape"]) == 2 and
            not t["role"].startswith("ffn_gate_inp")} == {"bf16"}
    code, res = check(path, "--against", sources["mixtral", "bf16_fused"])
    assert res["dtype_class"] == "float" and code == 0, res


# ---------------------------------------------------------------- lying archives

def lie(src: Path, out: Path, edit, add: dict[str, np.ndarray] | None = None) -> Path:
    """A lying copy of an archive: the manifest through `edit(manifest)` (which may drop tensors),
    plus f32 matrices `add` (one page, or one per expert), the RoPE tables recomputed for the
    edited model, repacked through the validating packer in decode order — so the lie is a valid
    archive (`verify` passes)."""
    from thinconv.format import open_archive, spec
    from thinconv.format.staging import pack_staging, page_path, unpack
    from thinconv.rope import derived_tables

    staging = out.with_suffix(".staging")
    with open_archive(src) as a:
        unpack(a, staging, force=True)
    m = json.loads((staging / "manifest.json").read_text())
    edit(m)

    def write_page(pid: str, data: bytes) -> dict:
        path = page_path(staging / "pages", pid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return {"size": len(data), "checksum": blake3.blake3(data).hexdigest()}

    for name, arr in (add or {}).items():
        arr = np.ascontiguousarray(arr, dtype="<f4")
        role, layer = spec.split_name(name)
        per = arr.shape[1] if arr.ndim == 3 else arr.shape[0]  # rows of a page: one expert, or the matrix
        pieces = arr.reshape(-1, arr.shape[-1])
        ids = [f"{name}#{k}" for k in range(pieces.shape[0] // per)]
        for k, pid in enumerate(ids):
            m["pages"].append({"id": pid, "tensor": name, "rows": [k * per, (k + 1) * per],
                               **write_page(pid, pieces[k * per:(k + 1) * per].tobytes())})
        m["tensors"].append({"name": name, "role": role, "layer": layer, "source": [], "shape": list(arr.shape),
                             "dtype": "f32", "quant": None, "pages": ids,
                             "hints": {"placement": "device", "access": "matmul"}})
    for name, table in derived_tables(m["model"]).items():  # rope_freqs follows rope.theta
        page = next(p for p in m["pages"] if p.get("tensor") == name)
        page.update(write_page(page["id"], np.ascontiguousarray(table, dtype="<f4").tobytes()))
    order = {n: i for i, n in enumerate(spec.tensor_names(m["model"]))}
    m["tensors"].sort(key=lambda t: order.get(t["name"], -1))
    by_id = {p["id"]: p for p in m["pages"]}
    m["pages"] = [by_id[pid] for t in m["tensors"] for pid in t["pages"]] + [p for p in m["pages"] if "asset" in p]
    keep = {p["id"] for p in m["pages"]}
    for f in (staging / "pages").rglob("*"):
        if f.is_file() and f.relative_to(staging / "pages").as_posix() not in keep:
            f.unlink()
    (staging / "manifest.json").write_text(json.dumps(m))
    pack_staging(staging, out, force=True)
    shutil.rmtree(staging)
    return out


def _set(path: str, value):
    def edit(m):
        node = m["model"]
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return edit


def _drop(pred, *edits):
    def edit(m):
        for e in edits:
            e(m)
        drop_tensors(m, pred)
    return edit


def _moe_layer_lie(family: str, thin: Thin):
    """moe.layers changed, with the tensors it governs swapped so the archive stays valid: Mixtral's
    layer 1 becomes a dense MLP (expert 0's weights as ffn_gate/up/down); a Qwen family's first dense
    layer after a sparse one becomes sparse (that sparse layer's expert tensors copied)."""
    layers = list(EXPECTED[family, False]["moe"]["layers"])
    if family == "mixtral":
        target = 1
        add = {f"blk.1.ffn_{r}.weight": thin.array(f"blk.1.ffn_{r}_exps.weight")[0] for r in ("gate", "up", "down")}
        gone = {f"blk.1.{r}" for r in ("ffn_gate_inp.weight", *EXPERT_ROLES)}
    else:
        donor = SPARSE[family][0]
        target = next(i for i in range(donor + 1, len(layers)) if not layers[i])
        roles = ["ffn_gate_inp.weight", *EXPERT_ROLES]
        if family == "qwen2_moe":
            roles += ["ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]
        add = {f"blk.{target}.{r}": thin.array(f"blk.{donor}.{r}") for r in roles}
        gone = {f"blk.{target}.ffn_{r}.weight" for r in ("gate", "up", "down")}
    layers[target] = not layers[target]
    return _drop(lambda n: n in gone, _set("moe.layers", layers)), add


def _lies(family: str) -> dict:
    """name → (variant, edit or (edit, add) builder): each a key the family's recipe sets."""
    qwen2 = family == "qwen2_moe"
    out = {
        "moe.num_experts_per_tok": ("f32", _set("moe.num_experts_per_tok", 3)),
        "moe.norm_topk_prob": ("f32", _set("moe.norm_topk_prob", False)),
        "moe.layers": ("f32", "moe_layers"),
        "attention.sliding_window": ("f32", lambda m: (_set("attention.sliding_window", None)(m),
                                                       _set("attention.layer_types", [F] * m["model"]["num_layers"])(m))),
        "rope.theta": ("f32", _set("rope.theta", 10000.0)),
    }
    if family == "mixtral":
        out["rope.theta (hub default 1e6)"] = ("bf16", _set("rope.theta", 10000.0))
    if qwen2:
        out["attention.layer_types"] = ("f32", _set("attention.layer_types", [S, F, F, F, F, F]))
        out["moe.shared_expert.gate"] = ("f32", _drop(lambda n: n.endswith("ffn_gate_inp_shexp.weight"),
                                                      _set("moe.shared_expert.gate", False)))
        out["moe.shared_expert"] = ("f32", _drop(lambda n: "_shexp." in n, _set("moe.shared_expert", None)))
        out["attention.qkv_bias (hub default true)"] = ("bf16", _drop(lambda n: n.endswith(("_q.bias", "_k.bias", "_v.bias")),
                                                                        _set("attention.qkv_bias", False)))
        out["moe.norm_topk_prob (hub default false)"] = ("bf16", _set("moe.norm_topk_prob", True))
    if family == "qwen3_moe":
        out["attention.qk_norm"] = ("f32", _drop(lambda n: "_norm.weight" in n and ("attn_q_" in n or "attn_k_" in n),
                                                 _set("attention.qk_norm", False)))
        out["attention.o_bias"] = ("f32", _drop(lambda n: n.endswith("attn_output.bias"), _set("attention.o_bias", False)))
        out["attention.qkv_bias"] = ("f32", _drop(lambda n: n.endswith(("_q.bias", "_k.bias", "_v.bias")),
                                                  _set("attention.qkv_bias", False)))
    return out


LIES = [(f, name) for f in FAMILIES for name in _lies(f)]


@pytest.mark.parametrize("family,lie_name", LIES, ids=[f"{f}:{n}" for f, n in LIES])
def test_lying_archive_fails_check(archive, sources, work, family, lie_name):
    variant, edit = _lies(family)[lie_name]
    src = archive(family, variant)
    add = None
    if edit == "moe_layers":
        edit, add = _moe_layer_lie(family, Thin.read(src))
    out = work / f"lie-{family}-{''.join(c if c.isalnum() else '_' for c in lie_name)}.thin"
    lie(src, out, edit, add)
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0  # a valid archive: only check can tell
    assert Thin.read(out).manifest["model"] != Thin.read(src).manifest["model"]
    code, res = check(out, "--against", sources[family, variant])
    assert code == 1 and res["failures"], res
    FAILURES[f"lie {family} {lie_name} vs transformers"] = "; ".join(res["failures"])
    code, res = check(out)
    assert code == 1 and res["failures"], res
    FAILURES[f"lie {family} {lie_name} vs probe"] = "; ".join(res["failures"])


# ---------------------------------------------------------------- config keys

@pytest.mark.parametrize("family,key,value", [
    ("mixtral", "routed_scaling_factor", 2.5),  # DeepSeek-style routing scale: Mixtral has none
    ("qwen2_moe", "scoring_func", "sigmoid"),
    ("qwen3_moe", "shared_expert_intermediate_size", 64),  # Qwen2-MoE's shared expert: Qwen3-MoE has none
])
def test_unknown_config_key_is_refused(sources, work, family, key, value):
    src = work / f"cfgkey-{family}"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(sources[family, "f32"], src)
    edit_config(src, **{key: value})
    out_dir = work / f"cfgkey-out-{family}"
    out_dir.mkdir(exist_ok=True)
    r = runner.invoke(app, ["convert", str(src), str(out_dir / "x.thin")])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, repr(key), f"--allow-config-key {key}")
    assert leftovers(out_dir) == []
    r = runner.invoke(app, ["convert", str(src), str(out_dir / "x.thin"), "--allow-config-key", key])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("family", FAMILIES)
def test_keys_that_do_not_change_inference_are_understood(sources, work, family):
    """Router training settings (and a true output_router_logits) do not stop a conversion."""
    src = work / f"train-{family}"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(sources[family, "f32"], src)
    extra = {"router_aux_loss_coef": 0.02, "output_router_logits": True}
    if family == "mixtral":
        extra["router_jitter_noise"] = 0.1
    edit_config(src, **extra)
    out = convert(src, work / f"train-{family}.thin")
    assert Thin.read(out).manifest["model"] == EXPECTED[family, False]


# ---------------------------------------------------------------- bad input

def _tensor_edit(name: str, fn):
    def edit(t):
        t[name] = fn(t[name])
    return edit


def _pop(name: str):
    return lambda t: t.pop(name)


L1 = "model.layers.1."
L3 = "model.layers.3."
BAD = {
    # case: (family, variant, tensor edit, config edits, needles of the one error line)
    "expert missing": ("mixtral", "f32", _pop(L1 + "block_sparse_moe.experts.3.w1.weight"), {},
                       ("missing", "blk.1.ffn_gate_exps.weight", "experts.3.w1.weight")),
    "expert missing (qwen)": ("qwen3_moe", "f32", _pop(L3 + "mlp.experts.7.down_proj.weight"), {},
                              ("missing", "blk.3.ffn_down_exps.weight", "experts.7.down_proj.weight")),
    "experts of unequal shape": ("qwen2_moe", "f32", _tensor_edit(L1 + "mlp.experts.2.gate_proj.weight", lambda a: a[:24]),
                                 {}, ("experts of unequal shape", "experts.2.gate_proj.weight is [24, 64]",
                                      "the other 5 are [32, 64]")),
    "experts of unequal cols": ("mixtral", "f32", _tensor_edit(L1 + "block_sparse_moe.experts.0.w2.weight",
                                                               lambda a: a[:, :64]), {},
                                ("experts of unequal shape", "experts.0.w2.weight is [64, 64]", "are [64, 96]")),
    "num_experts below the tensors": ("qwen2_moe", "f32", None, {"num_experts": 5},
                                      ("experts beyond the 5", "experts.5.", "[6, 64]", "[5, 64]")),
    "num_local_experts above the tensors": ("qwen3_moe", "f32", None, {"num_local_experts": 9},
                                            ("missing", "experts.8", "[8, 64]", "[9, 64]")),
    "num_experts vs fused tensors": ("mixtral", "f32_fused", None, {"num_local_experts": 5},
                                     ("mlp.experts.gate_up_proj[0:96]", "[6, 96, 64]", "[5, 96, 64]")),
    "num_experts and num_local_experts disagree": ("qwen3_moe", "bf16", None, {"num_local_experts": 6},
                                                   ("'num_experts'", "num_local_experts")),
    "num_experts_per_tok above the experts": ("qwen3_moe", "f32", None, {"num_experts_per_tok": 9},
                                              ("num_experts_per_tok", "9 exceeds num_experts 8")),
    "num_experts_per_tok zero": ("mixtral", "f32", None, {"num_experts_per_tok": 0}, ("num_experts_per_tok",)),
    "router of the wrong width": ("qwen2_moe", "f32", _tensor_edit(L1 + "mlp.gate.weight", lambda a: a[:, :60]), {},
                                  ("mlp.gate.weight", "blk.1.ffn_gate_inp.weight", "[6, 60]", "[6, 64]")),
    "router of the wrong height (fused)": ("qwen3_moe", "f32_fused",
                                           _tensor_edit(L3 + "mlp.gate.weight", lambda a: a[:7]), {},
                                           ("mlp.gate.weight", "[7, 64]", "[8, 64]")),
    "shared expert gate of the wrong shape": ("qwen2_moe", "f32", _tensor_edit(L1 + "mlp.shared_expert_gate.weight",
                                                                               lambda a: np.concatenate([a, a])), {},
                                              ("shared_expert_gate.weight", "[2, 64]", "[1, 64]")),
    "fused gate_up_proj too narrow": ("qwen2_moe", "f32_fused",
                                      _tensor_edit(L1 + "mlp.experts.gate_up_proj", lambda a: a[:, :60]), {},
                                      ("blk.1.ffn_up_exps.weight", "gate_up_proj[32:64] is outside its shape [6, 60, 64]")),
    "decoder_sparse_step zero": ("qwen2_moe", "f32", None, {"decoder_sparse_step": 0}, ("decoder_sparse_step",)),
    "a dense layer's MLP missing": ("qwen3_moe", "f32", _pop("model.layers.1.mlp.down_proj.weight"), {},
                                    ("missing", "blk.1.ffn_down.weight")),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_clear_line(sources, work, case):
    family, variant, tensor_edit, cfg, needles = BAD[case]
    tag = "".join(c if c.isalnum() else "_" for c in case)
    src = work / "bad" / tag
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(sources[family, variant], src)
    if tensor_edit is not None:
        tensors = load_safetensors_folder(src)
        tensor_edit(tensors)
        for f in src.glob("*.safetensors"):
            f.unlink()
        write_safetensors(src / "model.safetensors", tensors)
    if cfg:
        edit_config(src, **cfg)
    assert_convert_refused(src, work / "bad-out" / tag, *needles)


def test_report_measured_figures():
    """Not a check: prints what the other tests measured (run with -s)."""
    for k, v in sorted(MEASURED.items()):
        print(f"MEASURED {k}: {v:.3g}")
    for k, v in sorted(FAILURES.items()):
        print(f"FAILED AS IT SHOULD {k}: {v}")
