"""Granite, SmolLM3 and StableLM (recipes/granite.toml, smollm3.toml, stablelm.toml), end to end.

Tiny random checkpoints are built with transformers (tests/families.py) with every parameter that
changes the computation set to a non-default, non-neutral value: Granite's four multipliers, q/k/v/o
and MLP biases; SmolLM3's NoPE layers and sliding layers that do NOT coincide (layer_types decides the
window, no_rope_layers the RoPE); StableLM's LayerNorms with bias and a large eps (0.1, so that a
misread eps shows), partial RoPE 0.5, q/k/v bias, per-head q/k LayerNorms (`norms.{h}`, the {H}
source pattern), and a second StableLM with the parallel block and ONE shared norm whose config has
no partial_rotary_factor (the 0.25 default). Each is saved in f32 and in bf16.

Per family: the `model` section equals one written out here by hand from the config values; the
archive verifies; `check --against SRC` passes in the exact class (f32 and bf16 sources), a q8_0
archive passes its bounds, `check` passes against the probe; `run` prints what transformers'
greedy generation prints; for every key the recipes set, a lying (but valid) archive fails `check`
both against the source and against the probe; a config key that changes the computation and that
no recipe handles is refused in one line; defaults (absent keys) are read as transformers reads them.
Run with `-s` to print the figures.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import families as F
from thinconv.cli import app
from thinconv.errors import RecipeError
from thinconv.format.reader import open_archive
from thinconv.format.staging import pack_staging, unpack
from thinconv.recipe import load_registry
from thinconv.rope import derived_tables

runner = CliRunner()
PROMPT = "Once upon a time"
WINDOW = 5  # SmolLM3's sliding window: the default check sequence (16 tokens) outlasts it
DTYPES = ("f32", "bf16")
KINDS = ("granite", "smollm3", "stablelm", "stablelm_par")
RECIPE = {"granite": "granite", "smollm3": "smollm3", "stablelm": "stablelm", "stablelm_par": "stablelm"}
COMMON = dict(vocab_size=F.VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=None)


def _config(kind: str):
    from transformers import GraniteConfig, SmolLM3Config, StableLmConfig

    if kind == "granite":
        return GraniteConfig(**COMMON, num_hidden_layers=2, embedding_multiplier=12.0, attention_multiplier=0.03125,
                             residual_multiplier=0.22, logits_scaling=8.0, attention_bias=True, mlp_bias=True,
                             rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if kind == "smollm3":  # RoPE on layers 0 and 3; the window on layers 0 and 1
        return SmolLM3Config(**COMMON, num_hidden_layers=4, no_rope_layers=[1, 0, 0, 1], use_sliding_window=True,
                             sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention",
                                                                 "full_attention", "full_attention"],
                             attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5)
    if kind == "stablelm":
        return StableLmConfig(**COMMON, num_hidden_layers=2, partial_rotary_factor=0.5, qk_layernorm=True,
                              use_qkv_bias=True, use_parallel_residual=False, layer_norm_eps=0.1)
    if kind == "stablelm_par":
        return StableLmConfig(**COMMON, num_hidden_layers=2, qk_layernorm=False, use_qkv_bias=False,
                              use_parallel_residual=True, layer_norm_eps=0.1, hidden_act="gelu")
    raise KeyError(kind)


# ---------------------------------------------------------------- the model sections, by hand

def _base(arch: str, source: str, layers: int) -> dict:
    return {"architecture": arch, "source_architecture": source, "hidden_size": 64, "intermediate_size": 128,
            "num_layers": layers, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 384,
            "max_position_embeddings": 128, "special_tokens": {"bos": 1, "eos": [2], "pad": None}}


EXPECTED = {
    "granite": {
        **_base("granite", "GraniteForCausalLM", 2), "tie_word_embeddings": False,
        "norm": {"type": "rmsnorm", "eps": 1e-5},
        "mlp": {"type": "gated", "activation": "silu", "bias": True},
        "attention": {"qkv_bias": True, "o_bias": True, "qk_norm": False, "sliding_window": None,
                      "layer_types": ["full", "full"], "scale": 0.03125},  # attention_multiplier, not 16^-0.5
        "rope": {"theta": 5000.0, "rotary_dim": 16, "layout": "half", "scaling": None, "attention_factor": 1.0},
        "embedding": {"scale": 12.0}, "block": {"residual_scale": 0.22}, "logits": {"scale": 0.125},  # 1 / 8
    },
    "smollm3": {
        **_base("smollm3", "SmolLM3ForCausalLM", 4), "tie_word_embeddings": True,
        "norm": {"type": "rmsnorm", "eps": 1e-5},
        "mlp": {"type": "gated", "activation": "silu", "bias": True},
        "attention": {"qkv_bias": True, "o_bias": True, "qk_norm": False, "sliding_window": WINDOW,
                      "layer_types": ["sliding", "sliding", "full", "full"], "scale": 0.25},
        "rope": {"theta": 2000000.0, "rotary_dim": 16, "layout": "half", "scaling": None, "attention_factor": 1.0,
                 "layers": [True, False, False, True]},
    },
    "stablelm": {
        **_base("stablelm", "StableLmForCausalLM", 2), "tie_word_embeddings": False,
        "norm": {"type": "layernorm", "eps": 0.1, "bias": True},
        "mlp": {"type": "gated", "activation": "silu"},
        "attention": {"qkv_bias": True, "o_bias": False, "qk_norm": True, "qk_norm_weights": "per_head",
                      "sliding_window": None, "layer_types": ["full", "full"], "scale": 0.25},
        "rope": {"theta": 10000.0, "rotary_dim": 8, "layout": "half", "scaling": None, "attention_factor": 1.0},
    },
    "stablelm_par": {
        **_base("stablelm", "StableLmForCausalLM", 2), "tie_word_embeddings": False,
        "norm": {"type": "layernorm", "eps": 0.1, "bias": True},
        "mlp": {"type": "gated", "activation": "gelu"},
        "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": None,
                      "layer_types": ["full", "full"], "scale": 0.25},
        "rope": {"theta": 10000.0, "rotary_dim": 4, "layout": "half", "scaling": None, "attention_factor": 1.0},
        "block": {"residual": "parallel", "shared_norm": True},
    },
}


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gsnc")


@pytest.fixture(scope="module")
def sources(work) -> dict[tuple[str, str], Path]:
    out = {}
    for kind in KINDS:
        for dt in DTYPES:
            folder = F.build(_config(kind), work / "src" / f"{kind}-{dt}", dtype=dt)
            if kind == "stablelm_par":  # no partial_rotary_factor anywhere: StableLM's default 0.25
                F.edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
            out[kind, dt] = folder
    return out


def convert(src: Path, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["convert", str(src), str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def archive(sources, work):
    """archive(kind, dtype, *options) → path, converted on first use."""
    cache: dict = {}

    def get(kind: str, dt: str, *extra: str) -> Path:
        key = (kind, dt, extra)
        if key not in cache:
            tag = "-".join([kind, dt, *[x.strip("-") for x in extra]])
            cache[key] = convert(sources[kind, dt], work / f"{tag}.thin", *extra)
        return cache[key]

    return get


def check(*args, ok_codes=(0, 1)) -> tuple[int, dict]:
    """`thinconv check … --json` in-process: (exit code, parsed JSON)."""
    r = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert r.exit_code in ok_codes, r.output
    return r.exit_code, json.loads(r.stdout)


def one_line_error(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


FIGURES: list[str] = []


def _record(what: str, ref: str, d: dict) -> None:
    FIGURES.append(f"{what:42s} vs {ref:12s} {d['dtype_class']:6s} rel {d['max_rel_diff']:.3g}  "
                   f"top1 {d['top1_agreement']:.4f}  mean KL {d['mean_kl']:.3g}")


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if FIGURES:
        print("\n" + "\n".join(FIGURES))


def copy_source(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """A copy of a source folder, its config.json without the keys `drop` and with `changes` (None
    is written as null)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config = {**{k: v for k, v in config.items() if k not in drop}, **changes}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# ---------------------------------------------------------------- good archives

@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_model_section(kind, dt, archive):
    with open_archive(archive(kind, dt)) as a:
        assert a.model == EXPECTED[kind]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_archive_verifies_and_recipe_check_is_ok(kind, dt, archive, sources):
    r = runner.invoke(app, ["verify", str(archive(kind, dt))])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["recipe", "check", RECIPE[kind], str(sources[kind, dt]), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] and d["problems"] == [] and d["unmapped"] == [] and d["missing"] == []


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_check_against_transformers_and_probe(kind, dt, archive, sources):
    path = archive(kind, dt)
    code, d = check(path, "--against", sources[kind, dt])
    _record(f"{kind} {dt}", "transformers", d)
    assert code == 0 and d["ok"] and d["failures"] == [], d["failures"]
    assert d["dtype_class"] == "exact" and d["top1_agreement"] == 1.0
    assert d["max_rel_diff"] <= 1e-5  # observed ≈ 1e-6: float32 rounding only
    assert d["positions"] == 16 > WINDOW
    code, d = check(path)
    _record(f"{kind} {dt}", "probe", d)
    assert code == 0 and d["ok"] and d["reference"] == "probe"
    assert d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5


@pytest.mark.parametrize("kind", ["stablelm", "granite"])
def test_q8_0(kind, archive, sources):
    path = archive(kind, "f32", "--dtype", "q8_0")
    code, d = check(path, "--against", sources[kind, "f32"])
    _record(f"{kind} f32 → q8_0", "transformers", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "q8_0", d["failures"]
    assert 0 < d["mean_kl"] <= 1e-2  # > 0: the matrices really are quantized
    code, d = check(path)
    _record(f"{kind} f32 → q8_0", "probe", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "q8_0"


@pytest.mark.parametrize("kind", ["stablelm", "stablelm_par", "granite", "smollm3"])
def test_interleaved_layout(kind, archive, sources):
    """--rope-layout interleaved permutes the q/k rows (and StableLM's per-head q/k norm weights)
    within the partial rotary dims only; on SmolLM3's NoPE layers q and k move alike (q · k unchanged)."""
    path = archive(kind, "bf16", "--rope-layout", "interleaved")
    code, d = check(path, "--against", sources[kind, "bf16"])
    _record(f"{kind} bf16 interleaved", "transformers", d)
    assert code == 0 and d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5, d["failures"]
    with open_archive(path) as a, open_archive(archive(kind, "bf16")) as half:
        assert a.model["rope"]["layout"] == "interleaved"
        if kind == "stablelm":
            hd, rd = 16, 8
            want = half.tensor("blk.0.attn_q_norm.weight").reshape(4, hd).copy()
            rot = want[:, :rd].copy()
            want[:, 0:rd:2], want[:, 1:rd:2] = rot[:, : rd // 2], rot[:, rd // 2:]
            assert np.array_equal(a.tensor("blk.0.attn_q_norm.weight").reshape(4, hd), want)


def _hf_greedy_ids(src: Path, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("kind,dt", [(k, "f32") for k in KINDS] + [("stablelm", "bf16")])
def test_run_matches_transformers_greedy(kind, dt, archive, sources):
    from thinconv.check import ArchiveProvider, archive_tokenizer
    from thinconv.decoder import Decoder

    path, src = archive(kind, dt), sources[kind, dt]
    r = runner.invoke(app, ["run", str(path), "--prompt", PROMPT, "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert r.stdout == PROMPT + F.hf_greedy(src, PROMPT, 8) + "\n"
    # the text of random models is mostly U+FFFD, so compare the token ids too
    with open_archive(path) as a:
        ids = archive_tokenizer(a).encode(PROMPT).ids
        ours = list(Decoder(ArchiveProvider(a)).generate(ids, 8, eos=set()))
    assert ours == _hf_greedy_ids(src, ids, 8)


# ---------------------------------------------------------------- lying archives fail

def lie(archive: Path, out: Path, edit) -> Path:
    """A lying copy: edit(manifest, pages_dir) changes the model (and tensors); rope_freqs is
    recomputed from the edited model.rope, page sizes and checksums are fixed, orphan pages dropped,
    and the result is packed through the validating packer — a valid archive that only `check`
    can tell from the truth."""
    stage = out.with_suffix(".stage")
    with open_archive(archive) as a:
        unpack(a, stage, force=True)
    m = json.loads((stage / "manifest.json").read_text())
    pages = stage / "pages"
    edit(m, pages)
    for name, table in derived_tables(m["model"]).items():
        set_tensor(m, pages, name, table)
    names = {t["name"] for t in m["tensors"]}
    for section in ("stats", "quant"):
        if section in m["validation"]:
            m["validation"][section] = {k: v for k, v in m["validation"][section].items() if k in names}
    keep = {p["id"] for p in m["pages"]}
    for f in [f for f in pages.rglob("*") if f.is_file()]:
        if f.relative_to(pages).as_posix() not in keep:
            f.unlink()
    for p in m["pages"]:
        data = (pages / p["id"]).read_bytes()
        p["size"], p["checksum"] = len(data), blake3.blake3(data).hexdigest()
    (stage / "manifest.json").write_text(json.dumps(m))
    pack_staging(stage, out, force=True)
    shutil.rmtree(stage)
    return out


def drop(m: dict, pattern: str) -> None:
    """Remove every tensor whose name matches the regex, with its pages."""
    F.drop_tensors(m, lambda name: re.fullmatch(pattern, name) is not None)


def set_tensor(m: dict, pages: Path, name: str, values: np.ndarray, template: str | None = None,
               after: str | None = None) -> None:
    """Give 1-D f32 tensor `name` these values (one page); when absent, create it like tensor
    `template` (a 1-D tensor), placed after tensor `after` (decode order)."""
    values = np.ascontiguousarray(values, "<f4")
    pid = f"{name}#0"
    if not any(t["name"] == name for t in m["tensors"]):
        like = next(t for t in m["tensors"] if t["name"] == template)
        i = max(i for i, t in enumerate(m["tensors"]) if t["name"] == after)
        m["tensors"].insert(i + 1, {**like, "name": name, "role": name.split(".", 2)[2], "pages": [pid]})
        page = next(p for p in m["pages"] if p.get("tensor") == template)
        j = max(j for j, p in enumerate(m["pages"]) if p.get("tensor") == after)
        m["pages"].insert(j + 1, {**page, "id": pid, "tensor": name})
    t = next(t for t in m["tensors"] if t["name"] == name)
    t["shape"], t["pages"] = [values.size], [pid]
    m["pages"] = [p for p in m["pages"] if p.get("tensor") != name or p["id"] == pid]
    next(p for p in m["pages"] if p["id"] == pid)["rows"] = [0, values.size]
    (pages / pid).write_bytes(values.tobytes())


def tensor(pages: Path, name: str) -> np.ndarray:
    return np.frombuffer((pages / f"{name}#0").read_bytes(), "<f4")


def _no_embedding_scale(m, pages):
    del m["model"]["embedding"]


def _attention_scale_inverse_sqrt(m, pages):
    m["model"]["attention"]["scale"] = 16 ** -0.5  # the Llama default where attention_multiplier replaces it


def _no_residual_scale(m, pages):
    del m["model"]["block"]


def _logits_multiplied(m, pages):
    m["model"]["logits"]["scale"] = 8.0  # × logits_scaling instead of ÷


def _no_mlp_bias(m, pages):
    del m["model"]["mlp"]["bias"]
    drop(m, r"blk\.\d+\.ffn_(gate|up|down)\.bias")


def _no_qkv_bias(m, pages):
    m["model"]["attention"]["qkv_bias"] = False
    drop(m, r"blk\.\d+\.attn_[qkv]\.bias")


def _no_o_bias(m, pages):
    m["model"]["attention"]["o_bias"] = False
    drop(m, r"blk\.\d+\.attn_output\.bias")


def _rope_everywhere(m, pages):
    del m["model"]["rope"]["layers"]


def _no_window(m, pages):
    m["model"]["attention"]["sliding_window"] = None
    m["model"]["attention"]["layer_types"] = ["full"] * 4


def _window_on_nope_layers(m, pages):
    # what SmolLM3Config would compute without layer_types: the window on the NoPE layers
    m["model"]["attention"]["layer_types"] = ["full", "sliding", "sliding", "full"]


def _llama_theta(m, pages):
    m["model"]["rope"]["theta"] = 10000.0  # rope_freqs follows (lie())


def _rmsnorm(m, pages):
    m["model"]["norm"] = {"type": "rmsnorm", "eps": 0.1}
    drop(m, r".*norm\.bias")


def _no_norm_bias(m, pages):
    del m["model"]["norm"]["bias"]
    drop(m, r".*norm\.bias")


def _default_eps(m, pages):
    m["model"]["norm"]["eps"] = 1e-5


def _full_rotary(m, pages):
    m["model"]["rope"]["rotary_dim"] = 16  # partial_rotary_factor ignored


def _quarter_rotary(m, pages):
    m["model"]["rope"]["rotary_dim"] = 4  # the 0.25 default where the config says 0.5


def _shared_qk_norm(m, pages):
    del m["model"]["attention"]["qk_norm_weights"]  # "shared": head 0's weights for every head
    for t in [t["name"] for t in m["tensors"] if re.fullmatch(r"blk\.\d+\.attn_[qk]_norm\.weight", t["name"])]:
        set_tensor(m, pages, t, tensor(pages, t)[:16])


def _no_qk_norm(m, pages):
    m["model"]["attention"]["qk_norm"] = False
    del m["model"]["attention"]["qk_norm_weights"]
    drop(m, r"blk\.\d+\.attn_[qk]_norm\.weight")


def _parallel_shared(m, pages):
    m["model"]["block"] = {"residual": "parallel", "shared_norm": True}
    drop(m, r"blk\.\d+\.ffn_norm\.(weight|bias)")


def _sequential(m, pages):
    """Sequential, the MLP's norm a copy of attn_norm (the only norm the checkpoint has)."""
    del m["model"]["block"]
    for layer in range(2):
        b = f"blk.{layer}."
        set_tensor(m, pages, b + "ffn_norm.weight", tensor(pages, b + "attn_norm.weight"), b + "attn_norm.weight",
                   after=b + "attn_output.weight")
        set_tensor(m, pages, b + "ffn_norm.bias", tensor(pages, b + "attn_norm.bias"), b + "attn_norm.bias",
                   after=b + "ffn_norm.weight")


def _parallel_own_norm(m, pages):
    """Parallel but not shared: the MLP reads its own norm (an identity affine: w = 1, b = 0)."""
    del m["model"]["block"]["shared_norm"]
    for layer in range(2):
        b = f"blk.{layer}."
        set_tensor(m, pages, b + "ffn_norm.weight", np.ones(64), b + "attn_norm.weight", after=b + "attn_output.weight")
        set_tensor(m, pages, b + "ffn_norm.bias", np.zeros(64), b + "attn_norm.bias", after=b + "ffn_norm.weight")


LIES = [
    ("granite", "embedding.scale", _no_embedding_scale),
    ("granite", "attention.scale", _attention_scale_inverse_sqrt),
    ("granite", "block.residual_scale", _no_residual_scale),
    ("granite", "logits.scale", _logits_multiplied),
    ("granite", "mlp.bias", _no_mlp_bias),
    ("granite", "attention.qkv_bias", _no_qkv_bias),
    ("granite", "attention.o_bias", _no_o_bias),
    ("smollm3", "rope.layers", _rope_everywhere),
    ("smollm3", "attention.sliding_window", _no_window),
    ("smollm3", "attention.layer_types", _window_on_nope_layers),
    ("smollm3", "rope.theta", _llama_theta),
    ("smollm3", "mlp.bias", _no_mlp_bias),
    ("smollm3", "attention.o_bias", _no_o_bias),
    ("stablelm", "norm.type", _rmsnorm),
    ("stablelm", "norm.bias", _no_norm_bias),
    ("stablelm", "norm.eps", _default_eps),
    ("stablelm", "rope.rotary_dim=16", _full_rotary),
    ("stablelm", "rope.rotary_dim=4", _quarter_rotary),
    ("stablelm", "attention.qk_norm_weights", _shared_qk_norm),
    ("stablelm", "attention.qk_norm", _no_qk_norm),
    ("stablelm", "attention.qkv_bias", _no_qkv_bias),
    ("stablelm", "block.residual", _parallel_shared),
    ("stablelm_par", "block.residual", _sequential),
    ("stablelm_par", "block.shared_norm", _parallel_own_norm),
    ("stablelm_par", "rope.rotary_dim", _full_rotary),
]


@pytest.mark.parametrize("kind,key,edit", LIES, ids=[f"{k}-{key}" for k, key, _ in LIES])
def test_lying_archive_fails(kind, key, edit, archive, sources, work):
    bad = lie(archive(kind, "bf16"), work / f"lie-{kind}-{key}.thin", edit)
    assert runner.invoke(app, ["verify", str(bad)]).exit_code == 0  # a valid archive: only check can tell
    code, d = check(bad, "--against", sources[kind, "bf16"])
    _record(f"LIE {kind} {key}", "transformers", d)
    assert code == 1 and not d["ok"] and d["failures"]
    assert d["dtype_class"] == "exact" and d["max_rel_diff"] > 1e-2  # far outside the bound, not marginal
    code, d = check(bad)
    _record(f"LIE {kind} {key}", "probe", d)
    assert code == 1 and not d["ok"]


# ---------------------------------------------------------------- config accounting and refusals

@pytest.mark.parametrize("kind,value", [("granite", False), ("granite", None), ("smollm3", False), ("stablelm", False)])
def test_unhandled_config_key_is_refused(kind, value, sources, tmp_path):
    """is_causal false (or null: transformers reads `getattr(config, "is_causal", True)`) makes every
    one of these families bidirectional; no recipe handles it (thinconv.family.DEFAULT_ON_KEYS: for
    this key an "off" value is not off)."""
    src = copy_source(sources[kind, "f32"], tmp_path / "src", is_causal=value)
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "x.thin")])
    assert r.exit_code != 0
    line = one_line_error(r)
    assert "'is_causal'" in line and "--allow-config-key is_causal" in line
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "x.thin"), "--allow-config-key", "is_causal",
                            "--no-probe"])
    assert r.exit_code == 0, r.output


REFUSALS = [
    # StableLM's attention uses hidden / heads whatever head_dim says (its RoPE would read head_dim)
    ("stablelm", {"head_dim": 32}, "'head_dim'"),
    # a no_rope_layers shorter than the layers: transformers fails with an IndexError
    ("smollm3", {"no_rope_layers": [1, 0, 1]}, "'no_rope_layers'"),
    ("smollm3", {"no_rope_layers": [1, 0, 2, 1]}, "'no_rope_layers'"),
    # sliding layers without a window (transformers fails too)
    ("smollm3", {"sliding_window": None}, "sliding_window is null"),
    # a partial factor with a scaled RoPE: transformers' table no longer fits the head
    ("granite", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0,
                                     "partial_rotary_factor": 0.5}}, "'rope_parameters'"),
]


@pytest.mark.parametrize("kind,changes,needle", REFUSALS, ids=[f"{k}-{next(iter(c))}" for k, c, _ in REFUSALS])
def test_config_the_recipe_cannot_say_is_refused(kind, changes, needle, sources, tmp_path):
    src = copy_source(sources[kind, "f32"], tmp_path / "src", **changes)
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "x.thin")])
    assert r.exit_code != 0
    assert needle in one_line_error(r)


# ---------------------------------------------------------------- defaults, as transformers reads them

DEFAULTS = [
    # Granite: attention_multiplier absent means 1.0 (not head_dim^-0.5); the other multipliers 1
    ("granite", ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"), {},
     lambda m: (m["attention"]["scale"], "embedding" in m, "block" in m, "logits" in m) == (1.0, False, False, False)),
    # Granite: partial_rotary_factor is ignored by the default RoPE
    ("granite", (), {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}},
     lambda m: m["rope"]["rotary_dim"] == 16),
    # SmolLM3: no rope keys → theta 2e6; no no_rope_layers → every 2nd layer NoPE; no layer_types →
    # sliding where NoPE (use_sliding_window and sliding_window set)
    ("smollm3", ("rope_parameters", "no_rope_layers", "layer_types"), {"no_rope_layer_interval": 2},
     lambda m: (m["rope"]["theta"], m["rope"]["layers"], m["attention"]["layer_types"])
     == (2000000.0, [True, False, True, False], ["full", "sliding", "full", "sliding"])),
    # SmolLM3: explicit layer_types decide even with use_sliding_window false
    ("smollm3", (), {"use_sliding_window": False, "rope_parameters": {"rope_type": "default", "rope_theta": 7000.0}},
     lambda m: (m["rope"]["theta"], m["attention"]["layer_types"], m["attention"]["sliding_window"])
     == (7000.0, ["sliding", "sliding", "full", "full"], WINDOW)),
    # SmolLM3 as the Hub has it (transformers 4.x keys): flat rope_theta, null rope_scaling, the inert
    # max_window_layers and pretraining_tp, and an interval that an explicit no_rope_layers overrides
    ("smollm3", ("rope_parameters", "dtype"), {"rope_theta": 5000000.0, "rope_scaling": None, "max_window_layers": 28,
                                               "pretraining_tp": 2, "torch_dtype": "bfloat16", "no_rope_layer_interval": 2},
     lambda m: (m["rope"]["theta"], m["rope"]["layers"]) == (5000000.0, [True, False, False, True])),
    # StableLM: legacy flat keys (no rope_parameters)
    ("stablelm", ("rope_parameters",), {"rope_theta": 3000.0, "partial_rotary_factor": 0.75},
     lambda m: (m["rope"]["theta"], m["rope"]["rotary_dim"]) == (3000.0, 12)),
    # StableLM: no factor anywhere → 0.25
    ("stablelm", ("rope_parameters",), {}, lambda m: (m["rope"]["theta"], m["rope"]["rotary_dim"]) == (10000.0, 4)),
]


@pytest.mark.parametrize("kind,drop,changes,expect", DEFAULTS, ids=[f"{k}-{i}" for i, (k, *_) in enumerate(DEFAULTS)])
def test_defaults_match_transformers(kind, drop, changes, expect, sources, tmp_path):
    """The config edited (keys removed, legacy forms), converted, read as expected, and still
    computing what transformers computes from the same edited config."""
    src = copy_source(sources[kind, "f32"], tmp_path / "src", drop, **changes)
    out = convert(src, tmp_path / "x.thin")
    with open_archive(out) as a:
        assert expect(a.model), a.model
    code, d = check(out, "--against", src)
    _record(f"default {kind} -{sorted(drop)} +{sorted(changes)}"[:42], "transformers", d)
    assert code == 0 and d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5, d["failures"]


def _read(recipe: str, config: dict) -> dict:
    from thinconv.modelmeta import read_model

    r = load_registry().get(recipe)
    return read_model(config, None, architecture=r.name, rules=r.metadata, family=r.family, weights_dtype="f32")[0]


def test_num_key_value_heads_defaults():
    """Absent num_key_value_heads: SmolLM3Config says 4 and StableLmConfig 32 (not one per head);
    SmolLM3's null means one per head."""
    base = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 32, "num_hidden_layers": 2,
            "max_position_embeddings": 128, "vocab_size": 384}
    assert _read("smollm3", {**base, "architectures": ["SmolLM3ForCausalLM"]})["num_kv_heads"] == 4
    assert _read("smollm3", {**base, "architectures": ["SmolLM3ForCausalLM"],
                             "num_key_value_heads": None})["num_kv_heads"] == 32
    m = _read("stablelm", {**base, "architectures": ["StableLmForCausalLM"]})
    assert m["num_kv_heads"] == 32 and m["norm"] == {"type": "layernorm", "eps": 1e-5, "bias": True}
    assert m["rope"]["rotary_dim"] == 4 and m["rope"]["theta"] == 10000.0  # 16 × 0.25
    m = _read("smollm3", {**base, "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 6})
    assert m["tie_word_embeddings"] is True and m["rope"]["theta"] == 2000000.0
    assert m["rope"]["layers"] == [True, True, True, False, True, True]  # no_rope_layer_interval 4
    assert "layers" not in _read("smollm3", {**base, "architectures": ["SmolLM3ForCausalLM"]})["rope"]  # all RoPE
    m = _read("granite", {**base, "architectures": ["GraniteForCausalLM"]})
    assert m["attention"]["scale"] == 1.0 and m["num_kv_heads"] == 32


# ---------------------------------------------------------------- the {H} source pattern (engine)

def test_head_pattern_expands_per_role():
    """{H}: the query heads for query-side roles, the key/value heads for key/value-side roles."""
    r = load_registry().get("stablelm")
    model = {"num_attention_heads": 4, "num_kv_heads": 2}
    assert r.sources_for("blk.1.attn_q_norm.weight", model) == [
        f"model.layers.1.self_attn.q_layernorm.norms.{h}.weight" for h in range(4)]
    assert r.sources_for("blk.1.attn_k_norm.weight", model) == [
        f"model.layers.1.self_attn.k_layernorm.norms.{h}.weight" for h in range(2)]
    assert r.match_source("model.layers.3.self_attn.k_layernorm.norms.11.weight") == ["blk.3.attn_k_norm.weight"]
    assert r.match_source("model.layers.3.self_attn.k_layernorm.norms.01.weight") == []


@pytest.mark.parametrize("body,needle", [
    ('"blk.{L}.ffn_up.weight" = "m.{L}.up.{H}.weight"', "{H} (once) stands for the heads"),
    ('"blk.{L}.attn_q.weight" = "m.{L}.q.{H}.{H}.weight"', "{H} (once) stands for the heads"),
    ('"blk.{L}.attn_q.weight" = { source = "m.{L}.q.{H}.weight", rows = "[[0, 4]]" }', "without {E} or {H}"),
])
def test_head_pattern_misuse_is_a_recipe_error(body, needle, tmp_path):
    (tmp_path / "bad.toml").write_text(f'name = "bad"\nextends = "llama"\narchitectures = ["BadForCausalLM"]\n'
                                       f'[tensors]\n{body}\n')
    with pytest.raises(RecipeError, match=re.escape(needle)):
        load_registry([tmp_path])


def test_head_tensors_missing_or_extra_are_reported(sources, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = copy_source(sources["stablelm", "f32"], tmp_path / "src")
    t = load_file(src / "model.safetensors")
    del t["model.layers.1.self_attn.q_layernorm.norms.3.weight"]
    t["model.layers.0.self_attn.k_layernorm.norms.2.weight"] = np.ones(16, np.float32)  # only 2 kv heads
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    r = runner.invoke(app, ["recipe", "check", "stablelm", str(src), "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["missing"] == ["blk.1.attn_q_norm.weight (from model.layers.1.self_attn.q_layernorm.norms.3.weight)"]
    assert any("model.layers.0.self_attn.k_layernorm.norms.2.weight" in p for p in d["problems"])


# ---------------------------------------------------------------- semantics of a quantized archive

@pytest.mark.parametrize("dt", DTYPES)
def test_q8_0_semantics_expose_what_quantization_noise_hides(dt, archive, sources, work):
    """Issue 14, case 2: a SmolLM3 archive that ignores its NoPE layers (model.rope.layers removed:
    RoPE everywhere) differs from its source by little more than q8_0 noise. check --against now also
    runs transformers on the archive's own dequantized weights and holds the reference decoder to
    the exact bound there: the honest q8_0 archive passes both comparisons, the lie fails semantics."""
    src = sources["smollm3", dt]
    honest = archive("smollm3", dt, "--dtype", "q8_0")
    code, d = check(honest, "--against", src)
    _record(f"smollm3 {dt} → q8_0 fidelity", "transformers", d)
    _record(f"smollm3 {dt} → q8_0 semantics", "transformers", {**d["semantics"], "dtype_class": "exact"})
    assert code == 0 and d["ok"] and d["dtype_class"] == "q8_0" and 0 < d["mean_kl"] <= 1e-2
    assert d["semantics"]["ok"] and d["semantics"]["max_rel_diff"] <= 1e-4
    bad = lie(honest, work / f"lie-smollm3-{dt}-q8_0-rope.layers.thin", _rope_everywhere)
    assert runner.invoke(app, ["verify", str(bad)]).exit_code == 0
    code, d = check(bad, "--against", src)
    _record(f"LIE smollm3 {dt} q8_0 rope.layers fidelity", "transformers", d)
    _record(f"LIE smollm3 {dt} q8_0 rope.layers semantics", "transformers", {**d["semantics"], "dtype_class": "exact"})
    assert code == 1 and not d["ok"]
    # fidelity alone passes it (mean KL ≈ 0.007 ≤ 0.01): the noise hides the error …
    assert d["mean_kl"] <= 1e-2 and not any(f.startswith("mean_kl") for f in d["failures"])
    sem = d["semantics"]  # … semantics does not
    assert not sem["ok"] and sem["max_rel_diff"] > 1e-2  # far outside the exact bound, not marginal
    assert any(f.startswith("semantics: max_rel_diff") for f in d["failures"])
    r = runner.invoke(app, ["check", str(bad), "--against", str(src)])
    assert r.exit_code == 1 and "semantics (" in r.stdout and "FAIL semantics: max_rel_diff" in r.stderr
