"""Phi-3 and OLMo 2 (recipes/phi3.toml, olmo2.toml), end to end.

Tiny random checkpoints are built with transformers (tests/families.py), every parameter that
changes the computation set to a non-default, non-neutral value:

* `phi3`: longrope (short and long factors far apart) with partial RoPE 0.5, a sliding window of 5
  on every layer, rms_norm_eps 0.05, rope_theta 5000. The top-level original_max_position_embeddings
  is 6 (f32) / 12 (bf16) while the nested one says 999: transformers uses the top-level value. So the
  f32 probe (8 tokens) runs the long factors, the bf16 probe the short ones; `check` (16 tokens) runs
  the long ones, `check --steps 6` the short ones.
* `phi3b`: an explicit head_dim 8 (≠ hidden / heads = 16), partial RoPE 0.5 (rotary_dim 4), default
  RoPE (theta 20000), a tied head (Phi-4-mini style), erf GELU, no window.
* `olmo2`: q/k/v/o biases, post-norms only, full-width q/k norms, rms_norm_eps 0.05, rope_theta 3000.

Per family: the `model` section equals one written out here by hand; the archive verifies; `check
--against SRC` passes in the exact class (f32 and bf16 sources) and against the probe; a q8_0
archive passes its bounds; `run` prints what transformers' greedy generation prints (for longrope
also when the generation crosses original_max_position_embeddings); for every key the recipes set, a
lying (but valid) archive fails `check` against the source and against the probe; the fused
qkv / gate_up split is checked (a wrong boundary is refused, a swapped split fails `check`);
config keys are accounted for; defaults and legacy forms are read as transformers reads them.
Run with `-s` to print the figures.
"""

from __future__ import annotations

import json
import math
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
from thinconv.format.reader import open_archive
from thinconv.format.staging import pack_staging, unpack
from thinconv.recipe import load_registry
from thinconv.rope import derived_tables

runner = CliRunner()
PROMPT = "Once upon a time"  # 13 tokens with the example tokenizer: past both original maxima
DTYPES = ("f32", "bf16")
KINDS = ("phi3", "phi3b", "olmo2")
RECIPE = {"phi3": "phi3", "phi3b": "phi3", "olmo2": "olmo2"}
BUILT = {"phi3": DTYPES, "phi3b": ("f32",), "olmo2": DTYPES}
CASES = [(k, dt) for k in KINDS for dt in BUILT[k]]
WINDOW = 5
ORIGINAL = {"f32": 6, "bf16": 12}  # Phi-3 original_max_position_embeddings (top level)
SHORT = [1.0, 1.3, 1.9, 2.6]  # rotary_dim / 2 = 4 factors each
LONG = [1.5, 3.0, 6.0, 11.0]
EPS = 0.05  # large, so that a misread eps shows
COMMON = dict(vocab_size=F.VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(kind: str, dt: str):
    from transformers import Olmo2Config, Phi3Config

    if kind == "phi3":
        return Phi3Config(**COMMON, num_hidden_layers=2, max_position_embeddings=64,
                          original_max_position_embeddings=ORIGINAL[dt], partial_rotary_factor=0.5,
                          sliding_window=WINDOW, rms_norm_eps=EPS,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": SHORT,
                                           "long_factor": LONG})
    if kind == "phi3b":
        return Phi3Config(**COMMON, num_hidden_layers=2, max_position_embeddings=64, head_dim=8,
                          partial_rotary_factor=0.5, tie_word_embeddings=True, hidden_act="gelu", rms_norm_eps=EPS,
                          rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    if kind == "olmo2":
        return Olmo2Config(**COMMON, num_hidden_layers=2, max_position_embeddings=128, attention_bias=True,
                           rms_norm_eps=EPS, rope_parameters={"rope_type": "default", "rope_theta": 3000.0})
    raise KeyError(kind)


# ---------------------------------------------------------------- the model sections, by hand

def _base(arch: str, source: str, head_dim: int, max_pos: int, tied: bool) -> dict:
    return {"architecture": arch, "source_architecture": source, "hidden_size": 64, "intermediate_size": 96,
            "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": head_dim, "vocab_size": 384,
            "max_position_embeddings": max_pos, "tie_word_embeddings": tied, "norm": {"type": "rmsnorm", "eps": EPS},
            "special_tokens": {"bos": 1, "eos": [2], "pad": 0}}


def _phi3_expected(dt: str) -> dict:
    original = ORIGINAL[dt]
    factor = 64 / original  # max_position_embeddings / original (no factor in the config)
    return {
        **_base("phi3", "Phi3ForCausalLM", 16, 64, False),
        "mlp": {"type": "gated", "activation": "silu"},
        "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": WINDOW,
                      "layer_types": ["sliding", "sliding"], "scale": 0.25},
        "rope": {"theta": 5000.0, "rotary_dim": 8, "layout": "half",
                 "scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                             "original_max_position_embeddings": original, "factor": factor},
                 "attention_factor": math.sqrt(1 + math.log(factor) / math.log(original))},
    }


EXPECTED = {
    ("phi3", "f32"): _phi3_expected("f32"),
    ("phi3", "bf16"): _phi3_expected("bf16"),
    ("phi3b", "f32"): {
        **_base("phi3", "Phi3ForCausalLM", 8, 64, True),
        "mlp": {"type": "gated", "activation": "gelu"},
        "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": None,
                      "layer_types": ["full", "full"], "scale": 8 ** -0.5},
        "rope": {"theta": 20000.0, "rotary_dim": 4, "layout": "half", "scaling": None, "attention_factor": 1.0},
    },
}
for _dt in DTYPES:
    EXPECTED["olmo2", _dt] = {
        **_base("olmo2", "Olmo2ForCausalLM", 16, 128, False),
        "mlp": {"type": "gated", "activation": "silu"},
        "block": {"pre_norm": False, "post_norm": True},
        "attention": {"qkv_bias": True, "o_bias": True, "qk_norm": True, "qk_norm_scope": "full",
                      "sliding_window": None, "layer_types": ["full", "full"], "scale": 0.25},
        "rope": {"theta": 3000.0, "rotary_dim": 16, "layout": "half", "scaling": None, "attention_factor": 1.0},
    }


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("phi3olmo2")


@pytest.fixture(scope="module")
def sources(work) -> dict[tuple[str, str], Path]:
    out = {}
    for kind, dt in CASES:
        folder = F.build(_config(kind, dt), work / "src" / f"{kind}-{dt}", dtype=dt)
        if kind == "phi3":  # the nested value is overridden by the top-level one (transformers' Phi-3 rule)
            config = json.loads((folder / "config.json").read_text())
            assert config["original_max_position_embeddings"] == ORIGINAL[dt]
            config["rope_parameters"]["original_max_position_embeddings"] = 999
            (folder / "config.json").write_text(json.dumps(config, indent=2))
        out[kind, dt] = folder
    return out


def convert(src: Path, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["convert", str(src), str(out), *extra])
    assert r.exit_code == 0, r.output
    assert "probe skipped" not in r.stderr
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
    FIGURES.append(f"{what:44s} vs {ref:12s} {d['dtype_class']:6s} n {d['positions']:2d}  rel {d['max_rel_diff']:.3g}  "
                   f"top1 {d['top1_agreement']:.4f}  mean KL {d['mean_kl']:.3g}")


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if FIGURES:
        print("\n" + "\n".join(FIGURES))


def copy_source(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of a source folder with config.json edited (None removes a key)."""
    shutil.copytree(src, dst)
    F.edit_config(dst, **config_changes)
    return dst


# ---------------------------------------------------------------- good archives

@pytest.mark.parametrize("kind,dt", CASES)
def test_model_section(kind, dt, archive):
    with open_archive(archive(kind, dt)) as a:
        assert a.model == EXPECTED[kind, dt]


@pytest.mark.parametrize("kind,dt", CASES)
def test_archive_verifies_and_recipe_check_is_ok(kind, dt, archive, sources):
    r = runner.invoke(app, ["verify", str(archive(kind, dt))])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["recipe", "check", RECIPE[kind], str(sources[kind, dt]), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] and d["problems"] == [] and d["unmapped"] == [] and d["missing"] == []


def test_fused_tensors_are_split_as_transformers_splits_them(archive, sources):
    """qkv_proj rows: q (heads × head_dim), then k, then v (kv_heads × head_dim each); gate_up_proj:
    gate, then up — with phi3b's head_dim 8 (not hidden / heads)."""
    from safetensors.numpy import load_file

    for kind, (q, kv) in (("phi3", (64, 32)), ("phi3b", (32, 16))):
        src = load_file(sources[kind, "f32"] / "model.safetensors")
        with open_archive(archive(kind, "f32")) as a:
            for layer in range(2):
                qkv = src[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
                gate_up = src[f"model.layers.{layer}.mlp.gate_up_proj.weight"]
                assert qkv.shape == (q + 2 * kv, 64) and gate_up.shape == (192, 64)
                b = f"blk.{layer}."
                assert np.array_equal(a.tensor(b + "attn_q.weight"), qkv[:q])
                assert np.array_equal(a.tensor(b + "attn_k.weight"), qkv[q:q + kv])
                assert np.array_equal(a.tensor(b + "attn_v.weight"), qkv[q + kv:])
                assert np.array_equal(a.tensor(b + "ffn_gate.weight"), gate_up[:96])
                assert np.array_equal(a.tensor(b + "ffn_up.weight"), gate_up[96:])
            names = {t["name"]: t["source"] for t in a.manifest["tensors"]}
            assert names["blk.0.attn_k.weight"] == [f"model.layers.0.self_attn.qkv_proj.weight[{q}:{q + kv}]"]
            assert names["blk.1.ffn_up.weight"] == ["model.layers.1.mlp.gate_up_proj.weight[96:192]"]


@pytest.mark.parametrize("kind,dt", CASES)
def test_check_against_transformers_and_probe(kind, dt, archive, sources):
    path = archive(kind, dt)
    code, d = check(path, "--against", sources[kind, dt])
    _record(f"{kind} {dt}", "transformers", d)
    assert code == 0 and d["ok"] and d["failures"] == [], d["failures"]
    assert d["dtype_class"] == "exact" and d["top1_agreement"] == 1.0
    assert d["max_rel_diff"] <= 1e-5  # observed ≈ 1e-6: float32 rounding only
    # 16, or past the longrope switch (original_max_position_embeddings + 8) where that is later
    assert d["positions"] == max(16, _expected_switch(kind, dt) + 8)
    code, d = check(path)
    _record(f"{kind} {dt}", "probe", d)
    assert code == 0 and d["ok"] and d["reference"] == "probe" and d["positions"] == 8
    assert d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5


def _expected_switch(kind: str, dt: str) -> int:
    return ORIGINAL[dt] if kind == "phi3" else 0


@pytest.mark.parametrize("dt", DTYPES)
def test_longrope_both_regimes(dt, archive, sources):
    """Short factors up to original_max_position_embeddings tokens, long ones past it — as transformers
    decides per forward pass (seq_len > original); the probe's prefix is compared on its own pass."""
    path, src = archive("phi3", dt), sources["phi3", dt]
    original = ORIGINAL[dt]
    for steps in (original, original + 1, 24):
        code, d = check(path, "--against", src, "--steps", steps)
        _record(f"phi3 {dt} --steps {steps}", "transformers", d)
        assert code == 0 and d["positions"] == steps and d["max_rel_diff"] <= 1e-5, d["failures"]
    code, d = check(path, "--steps", 5)  # the probe's first 5 positions, of its 8-token pass
    assert code == 0 and d["positions"] == 5 and d["max_rel_diff"] <= 1e-5, d["failures"]
    with open_archive(path) as a:  # the probe ran the regime this test says it does
        assert len(a.manifest["validation"]["probe"]["tokens"]) == 8
    # the two regimes really differ: the first `original` positions change when the pass is longer
    short = F.hf_logits(src, _default_tokens(path)[:original])
    long = F.hf_logits(src, _default_tokens(path)[:original + 1])[:original]
    assert np.abs(short - long).max() > 0.1


def test_sliced_sources_keep_the_exact_class_without_a_probe(archive, sources):
    """`check --against` reads each tensor's source dtype through its NAME[a:b] slices: an f32
    archive of an f32 source is judged exact even with no probe to fall back on (engine: check.py)."""
    path = archive("phi3", "f32", "--no-probe")
    with open_archive(path) as a:
        assert "probe" not in a.manifest["validation"]
    code, d = check(path, "--against", sources["phi3", "f32"])
    assert code == 0 and d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5


def test_streamed_prefill_computes_longrope(archive):
    """The layer-by-layer engine (big models) computes a sequence-dependent RoPE too (engine: check.py
    no longer demands a static rope_freqs table), and agrees with the token-by-token one."""
    from thinconv.check import archive_logits

    with open_archive(archive("phi3", "f32")) as a:
        tokens = _default_tokens(a.path)[:16]
        decoded, how = archive_logits(a, tokens)
        streamed, how2 = archive_logits(a, tokens, memory_budget=0)
    assert (how, how2) == ("decode", "prefill")
    assert np.abs(decoded - streamed).max() <= 1e-5 * np.abs(decoded).max()


def _default_tokens(path: Path) -> list[int]:
    from thinconv.probe import default_tokens

    with open_archive(path) as a:
        return default_tokens(a.model, 24)


def test_q8_0(archive, sources):
    path = archive("phi3", "f32", "--dtype", "q8_0")
    with open_archive(path) as a:
        assert a.tensor_info("blk.0.attn_k.weight")["dtype"] == "q8_0"
        assert a.tensor_info("blk.1.ffn_up.weight")["dtype"] == "q8_0"
    code, d = check(path, "--against", sources["phi3", "f32"])
    _record("phi3 f32 → q8_0", "transformers", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "q8_0", d["failures"]
    assert 0 < d["mean_kl"] <= 1e-2  # > 0: the matrices really are quantized
    code, d = check(path)
    _record("phi3 f32 → q8_0", "probe", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "q8_0"


@pytest.mark.parametrize("kind", ["phi3", "phi3b", "olmo2"])
def test_interleaved_layout(kind, archive, sources):
    """--rope-layout interleaved permutes the partial rotary rows of each head (Phi-3's slices of the
    fused qkv_proj; OLMo 2's q/k biases and full-width q/k norm weights too)."""
    path = archive(kind, "f32", "--rope-layout", "interleaved")
    code, d = check(path, "--against", sources[kind, "f32"])
    _record(f"{kind} f32 interleaved", "transformers", d)
    assert code == 0 and d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5, d["failures"]
    code, d = check(path)
    assert code == 0 and d["max_rel_diff"] <= 1e-5, d["failures"]
    with open_archive(path) as a, open_archive(archive(kind, "f32")) as half:
        assert a.model["rope"]["layout"] == "interleaved"
        hd, rd = a.model["head_dim"], a.model["rope"]["rotary_dim"]
        name = "blk.0.attn_q_norm.weight" if kind == "olmo2" else "blk.0.attn_k.weight"
        want = half.tensor(name).reshape(-1, hd, *half.tensor(name).shape[1:]).copy()
        rot = want[:, :rd].copy()
        want[:, 0:rd:2], want[:, 1:rd:2] = rot[:, : rd // 2], rot[:, rd // 2:]
        assert np.array_equal(a.tensor(name), want.reshape(half.tensor(name).shape))


def _hf_greedy_ids(src: Path, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


RUNS = [(k, dt, PROMPT) for k, dt in CASES] + [
    # longrope: generation crosses original_max_position_embeddings (3 + 8 > 6; 9 + 8 > 12), where
    # transformers recomputes the cache with the long factors
    ("phi3", "f32", "The river"), ("phi3", "bf16", "Once upon"),
]


@pytest.mark.parametrize("kind,dt,prompt", RUNS)
def test_run_matches_transformers_greedy(kind, dt, prompt, archive, sources):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from thinconv.check import ArchiveProvider, archive_tokenizer
    from thinconv.decoder import Decoder

    path, src = archive(kind, dt), sources[kind, dt]
    # transformers' greedy continuation, as families.hf_greedy computes it (one model load for text and ids)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                             eos_token_id=None, pad_token_id=0)
    hf_ids = out[0, ids.shape[1]:].tolist()
    r = runner.invoke(app, ["run", str(path), "--prompt", prompt, "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert r.stdout == prompt + tok.decode(hf_ids, skip_special_tokens=True) + "\n"
    # the text of random models is mostly U+FFFD, so compare the token ids too
    with open_archive(path) as a:
        prompt_ids = archive_tokenizer(a).encode(prompt).ids
        assert prompt_ids == ids[0].tolist()
        ours = list(Decoder(ArchiveProvider(a)).generate(prompt_ids, 8, eos=set()))
    assert ours == hf_ids
    if kind == "phi3" and prompt != PROMPT:
        assert len(prompt_ids) <= ORIGINAL[dt] < len(prompt_ids) + 7  # the generation does cross the switch


def test_longrope_generation_recomputes_at_the_switch(archive, sources):
    """Without the recompute (keys cached with the short factors kept), the continuation differs from
    transformers' — so the recompute is what makes `run` agree."""
    from thinconv.check import ArchiveProvider
    from thinconv.decoder import Decoder

    prompt = [1, 200, 17]
    with open_archive(archive("phi3", "f32")) as a:
        dec = Decoder(ArchiveProvider(a))
        ours = list(dec.generate(prompt, 10, eos=set()))
        stale, seq = [], list(prompt)
        logits = dec.logits_for(seq)[-1]
        for _ in range(10):
            stale.append(int(np.argmax(logits)))
            logits = dec.step(stale[-1])
    hf = _hf_greedy_ids(sources["phi3", "f32"], prompt, 10)
    assert ours == hf
    assert stale[:4] == hf[:4] and stale != hf  # identical up to the switch (length 7), then not


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


def _scaling(**changes):
    def edit(m, pages):
        m["model"]["rope"]["scaling"].update(changes)
    return edit


def _no_longrope_factor(m, pages):
    m["model"]["rope"]["attention_factor"] = 1.0


def _full_rotary(m, pages):
    m["model"]["rope"]["rotary_dim"] = m["model"]["head_dim"]  # partial_rotary_factor ignored


def _no_window(m, pages):
    m["model"]["attention"]["sliding_window"] = None
    m["model"]["attention"]["layer_types"] = ["full", "full"]


def _window_one_wider(m, pages):
    m["model"]["attention"]["sliding_window"] = WINDOW + 1  # i − w ≤ j: one key too many


def _default_eps(m, pages):
    m["model"]["norm"]["eps"] = 1e-5


def _scale_from_hidden(m, pages):
    m["model"]["attention"]["scale"] = 0.25  # (hidden / heads)^-0.5 where head_dim is 8


def _silu(m, pages):
    m["model"]["mlp"]["activation"] = "silu"


def _gate_up_swapped(m, pages):
    """The gate and up halves of gate_up_proj exchanged (a tensor lie: no model key says the split)."""
    for layer in range(2):
        g, u = pages / f"blk.{layer}.ffn_gate.weight#0", pages / f"blk.{layer}.ffn_up.weight#0"
        gb, ub = g.read_bytes(), u.read_bytes()
        g.write_bytes(ub), u.write_bytes(gb)


def _pre_norms(m, pages):
    """Pre-norms (of weight 1) in front of attention and MLP, as Llama has."""
    del m["model"]["block"]["pre_norm"]
    for layer in range(2):
        b = f"blk.{layer}."
        first = "token_embd.weight" if layer == 0 else f"blk.{layer - 1}.ffn_post_norm.weight"
        set_tensor(m, pages, b + "attn_norm.weight", np.ones(64), b + "attn_post_norm.weight", after=first)
        set_tensor(m, pages, b + "ffn_norm.weight", np.ones(64), b + "attn_post_norm.weight",
                   after=b + "attn_post_norm.weight")


def _no_post_norms(m, pages):
    del m["model"]["block"]["post_norm"]
    drop(m, r"blk\.\d+\.(attn|ffn)_post_norm\.weight")


def _qk_norm_per_head(m, pages):
    """The same [heads × head_dim] weights, but each head normalised on its own (Cohere / StableLM)."""
    del m["model"]["attention"]["qk_norm_scope"]
    m["model"]["attention"]["qk_norm_weights"] = "per_head"


def _qk_norm_per_head_shared(m, pages):
    """q/k normalised per head with head 0's weights (Qwen3-style shared [head_dim] weights)."""
    del m["model"]["attention"]["qk_norm_scope"]
    for t in [t["name"] for t in m["tensors"] if re.fullmatch(r"blk\.\d+\.attn_[qk]_norm\.weight", t["name"])]:
        set_tensor(m, pages, t, np.frombuffer((pages / f"{t}#0").read_bytes(), "<f4")[:16])


def _no_qk_norm(m, pages):
    m["model"]["attention"]["qk_norm"] = False
    del m["model"]["attention"]["qk_norm_scope"]
    drop(m, r"blk\.\d+\.attn_[qk]_norm\.weight")


def _no_qkv_bias(m, pages):
    m["model"]["attention"]["qkv_bias"] = False
    drop(m, r"blk\.\d+\.attn_[qkv]\.bias")


def _no_o_bias(m, pages):
    m["model"]["attention"]["o_bias"] = False
    drop(m, r"blk\.\d+\.attn_output\.bias")


def _other_theta(m, pages):
    m["model"]["rope"]["theta"] = 100.0  # rope_freqs follows (lie())


# (kind, dtype, what, edit, extra check arguments against the source)
LIES = [
    # longrope: the f32 archives run the long factors (16 tokens; probe 8 > 6), the bf16 probe the short ones
    ("phi3", "f32", "rope.scaling.long_factor", _scaling(long_factor=SHORT), ()),
    ("phi3", "bf16", "rope.scaling.short_factor", _scaling(short_factor=LONG), ("--steps", "12")),
    ("phi3", "f32", "rope.scaling.original_max", _scaling(original_max_position_embeddings=16), ()),
    ("phi3", "bf16", "rope.scaling.original_max", _scaling(original_max_position_embeddings=6), ("--steps", "12")),
    ("phi3", "f32", "rope.attention_factor", _no_longrope_factor, ()),
    ("phi3", "bf16", "rope.attention_factor", _no_longrope_factor, ()),
    ("phi3", "f32", "attention.sliding_window=null", _no_window, ()),
    ("phi3", "f32", "attention.sliding_window+1", _window_one_wider, ()),
    ("phi3", "f32", "norm.eps", _default_eps, ()),
    ("phi3", "f32", "tensors:gate_up_swapped", _gate_up_swapped, ()),
    ("phi3b", "f32", "rope.rotary_dim", _full_rotary, ()),
    ("phi3b", "f32", "attention.scale", _scale_from_hidden, ()),
    ("phi3b", "f32", "mlp.activation", _silu, ()),
    ("phi3b", "f32", "rope.theta", _other_theta, ()),
    ("olmo2", "bf16", "block.pre_norm", _pre_norms, ()),
    ("olmo2", "bf16", "block.post_norm", _no_post_norms, ()),
    ("olmo2", "bf16", "attention.qk_norm_scope", _qk_norm_per_head, ()),
    ("olmo2", "bf16", "attention.qk_norm_scope(shared)", _qk_norm_per_head_shared, ()),
    ("olmo2", "bf16", "attention.qk_norm", _no_qk_norm, ()),
    ("olmo2", "bf16", "attention.qkv_bias", _no_qkv_bias, ()),
    ("olmo2", "bf16", "attention.o_bias", _no_o_bias, ()),
    ("olmo2", "bf16", "norm.eps", _default_eps, ()),
    ("olmo2", "bf16", "rope.theta", _other_theta, ()),
]


@pytest.mark.parametrize("kind,dt,key,edit,extra", LIES, ids=[f"{k}-{dt}-{key}" for k, dt, key, _, _ in LIES])
def test_lying_archive_fails(kind, dt, key, edit, extra, archive, sources, work):
    bad = lie(archive(kind, dt), work / f"lie-{kind}-{dt}-{key}.thin", edit)
    assert runner.invoke(app, ["verify", str(bad)]).exit_code == 0  # a valid archive: only check can tell
    code, d = check(bad, "--against", sources[kind, dt], *extra)
    _record(f"LIE {kind} {dt} {key}", "transformers", d)
    assert code == 1 and not d["ok"] and d["failures"]
    # named as a difference of the model section, or far outside the bound (a lie in the tensors)
    assert d["dtype_class"] == "exact" and (d["model_differences"] or d["max_rel_diff"] > 1e-2)
    code, d = check(bad)
    _record(f"LIE {kind} {dt} {key}", "probe", d)
    assert code == 1 and not d["ok"] and d["max_rel_diff"] > 5e-3  # ≥ 5 × the exact bound (8 positions)


def test_the_probe_sees_one_longrope_regime(archive, sources, work):
    """A probe is one pass: the f32 probe (8 tokens > 6) cannot see the short factors, so a lie about
    them passes it — and fails against the source on a short sequence. (The bf16 probe, 8 ≤ 12, is the
    one that catches it: test_lying_archive_fails.)"""
    bad = lie(archive("phi3", "f32"), work / "lie-phi3-f32-short.thin", _scaling(short_factor=LONG))
    code, d = check(bad)
    assert code == 0 and d["max_rel_diff"] <= 1e-5
    code, d = check(bad, "--against", sources["phi3", "f32"], "--steps", "6")
    _record("LIE phi3 f32 rope.scaling.short_factor", "transformers", d)
    assert code == 1 and d["max_rel_diff"] > 1e-2


# ---------------------------------------------------------------- the fused split in user recipes

def _user_recipe(folder: Path, name: str, tensors: str) -> Path:
    folder.mkdir(parents=True)
    (folder / f"{name}.toml").write_text(f'name = "{name}"\nextends = "phi3"\narchitectures = ["Phi3ForCausalLM"]\n'
                                         f'[tensors]\n{tensors}\n')
    return folder


QKV = "model.layers.{L}.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.{L}.mlp.gate_up_proj.weight"


@pytest.mark.parametrize("body,needle", [
    # v starts one row early: every shape still agrees, but row 95 of qkv_proj is read twice
    (f'"blk.{{L}}.attn_v.weight" = {{ source = "{QKV}", rows = "[[(num_attention_heads + num_kv_heads) * head_dim - 1, '
     f'(num_attention_heads + 2 * num_kv_heads) * head_dim - 1]]" }}', "rows [95, 96) are read twice"),
    # k one row short: a wrong shape, and row 95 read by nobody
    (f'"blk.{{L}}.attn_k.weight" = {{ source = "{QKV}", rows = "[[num_attention_heads * head_dim, '
     f'(num_attention_heads + num_kv_heads) * head_dim - 1]]" }}', "blk.0.attn_k.weight"),
    # the up half taken from the first intermediate_size - 1 rows
    (f'"blk.{{L}}.ffn_up.weight" = {{ source = "{GATE_UP}", rows = "[[intermediate_size + 1, 2 * intermediate_size]]" }}',
     "blk.0.ffn_up.weight"),
], ids=["overlap", "short-k", "short-up"])
def test_wrong_slice_boundary_is_refused(body, needle, sources, tmp_path):
    recipes = _user_recipe(tmp_path / "recipes", "phi3bad", body)
    src = sources["phi3", "f32"]
    r = runner.invoke(app, ["recipe", "check", str(recipes / "phi3bad.toml"), str(src), "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert not d["ok"] and any(needle in p for p in d["problems"] + d["missing"]), d
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "x.thin"), "--recipes", str(recipes)])
    assert r.exit_code == 1
    assert needle in one_line_error(r)
    assert not (tmp_path / "x.thin").exists()


def test_swapped_split_converts_but_fails_check(sources, tmp_path):
    """gate and up exchanged in a user recipe: the slices tile gate_up_proj, so the mapping cannot
    tell; `check --against` does. (The probe cannot: it runs the recipe's own reading of the source.)"""
    body = (f'"blk.{{L}}.ffn_gate.weight" = {{ source = "{GATE_UP}", rows = "[[intermediate_size, 2 * intermediate_size]]" }}\n'
            f'"blk.{{L}}.ffn_up.weight" = {{ source = "{GATE_UP}", rows = "[[0, intermediate_size]]" }}')
    recipes = _user_recipe(tmp_path / "recipes", "phi3swap", body)
    src = sources["phi3", "f32"]
    r = runner.invoke(app, ["recipe", "check", str(recipes / "phi3swap.toml"), str(src)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "swap.thin"
    r = runner.invoke(app, ["convert", str(src), str(out), "--recipes", str(recipes)])
    assert r.exit_code == 0, r.output
    code, d = check(out, "--against", src, "--recipes", recipes)  # the model section comes from the same recipe
    _record("user recipe phi3 gate/up swapped", "transformers", d)
    assert code == 1 and d["max_rel_diff"] > 1e-2
    code, d = check(out)
    assert code == 0


# ---------------------------------------------------------------- config accounting and refusals

@pytest.mark.parametrize("kind,key,value", [
    # transformers applies these masks when it generates with a static (compilable) cache
    # (masking_utils.create_masks_for_generate); no recipe here says them
    ("olmo2", "sliding_window", 4),
    ("phi3b", "attention_chunk_size", 4),
    ("phi3", "attention_chunk_size", 4),
])
def test_unhandled_config_key_is_refused(kind, key, value, sources, tmp_path):
    src = copy_source(sources[kind, BUILT[kind][0]], tmp_path / "src", **{key: value})
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "x.thin")])
    assert r.exit_code == 1
    line = one_line_error(r)
    assert f"'{key}' = {value}" in line and f"--allow-config-key {key}" in line
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "x.thin"), "--allow-config-key", key])
    assert r.exit_code == 0, r.output


REFUSALS = [
    # Phi3Config accepts the default RoPE and longrope only (transformers refuses to load this too)
    ("phi3b", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0,
                                   "partial_rotary_factor": 0.5}}, "'rope_parameters'"),
    # longrope factors must cover rotary_dim / 2 = 4 (refused before any tensor is read: --no-probe too)
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": SHORT[:2],
                                  "long_factor": LONG[:2], "partial_rotary_factor": 0.5}}, "'rope_parameters'"),
    # OLMo 2: a scaled RoPE reads partial_rotary_factor, and transformers then fails (the table no
    # longer fits the head it rotates whole)
    ("olmo2", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3000.0,
                                   "partial_rotary_factor": 0.5}}, "'rope_parameters'"),
]


@pytest.mark.parametrize("kind,changes,needle", REFUSALS, ids=["phi3-linear", "phi3-factor-length", "olmo2-partial"])
def test_config_the_recipe_cannot_say_is_refused(kind, changes, needle, sources, tmp_path):
    src = copy_source(sources[kind, BUILT[kind][0]], tmp_path / "src", **changes)
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "x.thin"), "--no-probe"])
    assert r.exit_code == 1
    assert needle in one_line_error(r)
    assert not (tmp_path / "x.thin").exists()


# ---------------------------------------------------------------- defaults, as transformers reads them

_LEGACY = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}
DEFAULTS = [
    # no top-level original_max_position_embeddings: Phi3Config's own 4096 overrides the nested 16, so
    # factor 64 / 4096 < 1 and attention factor 1, and 20 tokens run the SHORT factors
    ("phi3", dict(original_max_position_embeddings=None,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": SHORT,
                                   "long_factor": LONG, "original_max_position_embeddings": 16,
                                   "partial_rotary_factor": 0.5}),
     lambda m: (m["rope"]["scaling"]["original_max_position_embeddings"], m["rope"]["scaling"]["factor"],
                m["rope"]["attention_factor"]) == (4096, 64 / 4096, 1.0)),
    # … with an explicit factor and attention factor: both kept
    ("phi3", dict(original_max_position_embeddings=None,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": SHORT,
                                   "long_factor": LONG, "original_max_position_embeddings": 16, "factor": 4.0,
                                   "attention_factor": 1.3, "partial_rotary_factor": 0.5}),
     lambda m: m["rope"]["scaling"] == {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                        "original_max_position_embeddings": 4096, "factor": 4.0,
                                        "attention_factor": 1.3} and m["rope"]["attention_factor"] == 1.3),
    # the top-level value with an explicit factor: factor 2 → sqrt(1 + ln 2 / ln 6)
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": SHORT,
                                   "long_factor": LONG, "factor": 2.0, "partial_rotary_factor": 0.5}),
     lambda m: (m["rope"]["scaling"]["factor"], m["rope"]["attention_factor"])
     == (2.0, math.sqrt(1 + math.log(2.0) / math.log(6)))),
    # legacy: rope_scaling {"type": "longrope"} with a top-level rope_theta, no rope_parameters
    ("phi3", dict(rope_parameters=None, rope_theta=5000.0, rope_scaling=_LEGACY),
     lambda m: m["rope"] == _phi3_expected("f32")["rope"]),
    # no rms_norm_eps: 1e-5; no sliding_window: none (not Mistral's 4096); no partial factor: the whole head
    ("phi3b", dict(rms_norm_eps=None, sliding_window=None, partial_rotary_factor=None,
                   rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
     lambda m: (m["norm"]["eps"], m["attention"]["sliding_window"], m["rope"]["rotary_dim"]) == (1e-5, None, 8)),
    # a window set: every layer slides (Phi-3-mini-4k: 2047)
    ("phi3b", dict(sliding_window=3), lambda m: (m["attention"]["sliding_window"], m["attention"]["layer_types"])
     == (3, ["sliding", "sliding"])),
    # attention_bias and mlp_bias mean nothing to Phi-3 (no biases anywhere)
    ("phi3b", dict(attention_bias=True, mlp_bias=True),
     lambda m: (m["attention"]["qkv_bias"], m["attention"]["o_bias"], "bias" in m["mlp"]) == (False, False, False)),
    # OLMo 2's default RoPE ignores partial_rotary_factor; no rms_norm_eps: 1e-5
    ("olmo2", dict(rms_norm_eps=None, rope_parameters={"rope_type": "default", "rope_theta": 3000.0,
                                                        "partial_rotary_factor": 0.5}),
     lambda m: (m["rope"]["rotary_dim"], m["norm"]["eps"]) == (16, 1e-5)),
    # a scaled RoPE, and legacy flat keys
    ("olmo2", dict(rope_parameters=None, rope_theta=3000.0, rope_scaling={"type": "linear", "factor": 2.0}),
     lambda m: (m["rope"]["theta"], m["rope"]["rotary_dim"], m["rope"]["scaling"])
     == (3000.0, 16, {"type": "linear", "factor": 2.0})),
]


@pytest.mark.parametrize("kind,changes,expect", DEFAULTS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(DEFAULTS)])
def test_defaults_match_transformers(kind, changes, expect, sources, tmp_path):
    """The config edited (keys removed or legacy forms), converted, read as expected, and still
    computing what transformers computes from the same edited config (20 tokens: past the window and
    any longrope switch)."""
    src = copy_source(sources[kind, BUILT[kind][0]], tmp_path / "src", **changes)
    for key, value in changes.items():
        assert (key in json.loads((src / "config.json").read_text())) == (value is not None)
    out = convert(src, tmp_path / "x.thin")
    with open_archive(out) as a:
        assert expect(a.model), a.model
    code, d = check(out, "--against", src, "--steps", "20")
    _record(f"default {kind} {sorted(changes)}", "transformers", d)
    assert code == 0 and d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5, d["failures"]
    code, d = check(out)
    assert code == 0 and d["max_rel_diff"] <= 1e-5, d["failures"]


def test_recipes_are_listed():
    reg = load_registry()
    assert reg.for_architecture(["Phi3ForCausalLM"]).name == "phi3"
    assert reg.for_architecture(["Olmo2ForCausalLM"]).name == "olmo2"
    assert reg.get("phi3").chain == ("phi3", "llama") and reg.get("olmo2").chain == ("olmo2", "llama")


# ---------------------------------------------------------------- engine: expressions returning objects

def test_expression_returning_a_model_object_gives_its_data():
    """A model name that holds an object (`rope.scaling`) is a namespace for dotted access; as an
    expression's value (or inside a list) it is a copy of the object itself."""
    from thinconv import expr

    names = {"rope": {"scaling": {"type": "longrope", "factor": 2.0}}, "n": 2}
    funcs = expr.BASE_FUNCTIONS
    value = expr.evaluate(expr.parse("rope.scaling if n else None", "t"), names, funcs, "t")
    assert value == {"type": "longrope", "factor": 2.0} and type(value) is dict
    assert value is not names["rope"]["scaling"]
    value = expr.evaluate(expr.parse("[rope.scaling, rope.scaling.factor]", "t"), names, funcs, "t")
    assert value == [{"type": "longrope", "factor": 2.0}, 2.0] and type(value[0]) is dict
