"""`thinconv check`, `thinconv run` and the conversion-time probe, end to end.

Fixtures are built here (module scope): four tiny bf16 checkpoints made with transformers (random
init, then every parameter re-drawn: norm weights 1 ± 0.2, biases 0.5·randn, so that a dropped
bias or norm changes the logits), converted through the CLI (passthrough, `--rope-layout
interleaved`, `--dtype q8_0`, and a few more on one family). Broken archives are made by unpack →
edit → pack, keeping the manifest valid so that only `check` can catch them. `run` is compared
with transformers' greedy `generate` on examples/tiny-llama, which recites its training text.
Run with `-s` to print the figures (max rel diff, top-1, KL) of every comparison.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from thinconv.check import (THRESHOLDS, CheckResult, PositionResult, compare_logits, compare_probe, judge,
                            parse_tokens)
from hfnames import canonical_name
from thinconv.cli import app
from thinconv.decoder import Decoder, DictProvider
from thinconv.errors import UsageError
from thinconv.format.reader import open_archive
from thinconv.format.staging import pack_staging, unpack
from thinconv.rope import rope_inv_freq

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = ROOT / "examples" / "tiny-llama"
FAMILIES = ("llama3", "mistral", "qwen2", "qwen3")
WINDOW = 4  # Mistral's sliding window; the default check sequence must be longer
VARIANTS = {"bf16": [], "interleaved": ["--rope-layout", "interleaved"], "q8_0": ["--dtype", "q8_0"],
            "noprobe": ["--no-probe"], "f16": ["--dtype", "f16"], "f32": ["--dtype", "f32"], "q4_0": ["--dtype", "q4_0"]}
JSON_KEYS = {"dtype_class", "reference", "engine", "positions", "max_abs_diff", "max_rel_diff", "top1_agreement", "mean_kl",
             "max_kl", "ok", "thresholds", "failures", "per_position", "model_compared", "model_differences", "notes",
             "semantics"}
runner = CliRunner()


# ---------------------------------------------------------------- fixtures

def _config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama3":  # llama3 scaling with a short original context, so the scaling changes frequencies
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return LlamaConfig(hidden_size=64, intermediate_size=128, vocab_size=256, max_position_embeddings=512,
                           rope_parameters=rope, tie_word_embeddings=True, **common)
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    if kind == "mistral":
        return MistralConfig(hidden_size=32, intermediate_size=64, vocab_size=128, max_position_embeddings=256,
                             sliding_window=WINDOW, rope_parameters=default_rope, tie_word_embeddings=False, **common)
    if kind == "qwen2":  # q/k/v bias
        return Qwen2Config(hidden_size=32, intermediate_size=64, vocab_size=256, max_position_embeddings=128,
                           rope_parameters=default_rope, tie_word_embeddings=True, **common)
    if kind == "qwen3":  # q/k norm; head_dim 16 != hidden 32 / 4 heads
        return Qwen3Config(hidden_size=32, intermediate_size=64, head_dim=16, vocab_size=128,
                           max_position_embeddings=128, rope_parameters=default_rope, tie_word_embeddings=False,
                           **common)
    raise KeyError(kind)


def _build_checkpoint(kind: str, folder: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(_config(kind))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # tied weights appear once
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif p.ndim == 1:  # RMSNorm weights (q/k norms included)
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.3 * noise)  # logits of a few units: sharp enough for stable top-1, not saturated
            else:
                p.copy_(noise * (1.5 / math.sqrt(p.shape[1])))
    hf.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("check")


@pytest.fixture(scope="module")
def sources(work) -> dict[str, Path]:
    return {k: _build_checkpoint(k, work / "src" / k) for k in FAMILIES}


def _convert(src: Path, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["convert", str(src), str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def archive(sources, work):
    """archive(kind, variant) → path, converted on first use."""
    cache: dict[tuple[str, str], Path] = {}

    def get(kind: str, variant: str) -> Path:
        if (kind, variant) not in cache:
            cache[kind, variant] = _convert(sources[kind], work / f"{kind}-{variant}.thin", *VARIANTS[variant])
        return cache[kind, variant]

    return get


@pytest.fixture(scope="module")
def tiny_llama(work) -> Path:
    return _convert(TINY_LLAMA, work / "tiny-llama.thin")


def check(*args, ok_codes=(0, 1)) -> tuple[int, dict]:
    """`thinconv check … --json` in-process; (exit code, parsed JSON)."""
    r = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert r.exit_code in ok_codes, r.output
    return r.exit_code, json.loads(r.stdout)


def one_line_error(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


FIGURES: list[str] = []


def _record(kind: str, variant: str, ref: str, d: dict) -> None:
    FIGURES.append(f"{kind:8s} {variant:12s} vs {ref:12s} rel {d['max_rel_diff']:.3g}  abs {d['max_abs_diff']:.3g}  "
                   f"top1 {d['top1_agreement']:.4f}  mean KL {d['mean_kl']:.3g}  max KL {d['max_kl']:.3g}")
    if d.get("semantics"):
        _record(kind, variant, "semantics", d["semantics"])


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if FIGURES:
        print("\n" + "\n".join(FIGURES))


# ---------------------------------------------------------------- good archives pass

@pytest.mark.parametrize("variant", ["bf16", "interleaved", "q8_0"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_check_against_transformers_passes(kind, variant, archive, sources):
    code, d = check(archive(kind, variant), "--against", sources[kind])
    _record(kind, variant, "transformers", d)
    assert code == 0 and d["ok"] and d["failures"] == [], d["failures"]
    assert d["reference"] == "transformers"
    assert d["positions"] == 16 > WINDOW  # the default sequence outlasts the sliding window
    if variant == "q8_0":
        assert d["dtype_class"] == "q8_0"
        assert d["thresholds"] == THRESHOLDS["q8_0"]
        assert 0 < d["mean_kl"] <= THRESHOLDS["q8_0"]["mean_kl"]  # > 0: the weights really are quantized
        # semantics: the archive's own weights under transformers — float32 rounding only
        sem = d["semantics"]
        assert sem["ok"] and sem["thresholds"] == THRESHOLDS["exact"] and sem["positions"] == d["positions"]
        assert sem["top1_agreement"] == 1.0 and sem["max_rel_diff"] <= 1e-4
    else:  # bf16 source, bf16 archive: bit-identical weights, so only float32 rounding differs
        assert d["dtype_class"] == "exact" and d["semantics"] is None
        assert d["top1_agreement"] == 1.0
        assert d["max_rel_diff"] <= 1e-4  # well inside the 1e-3 bound (observed ≈ 1e-6)


@pytest.mark.parametrize("variant", ["bf16", "interleaved", "q8_0"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_check_against_probe_passes(kind, variant, archive):
    code, d = check(archive(kind, variant))
    _record(kind, variant, "probe", d)
    assert code == 0 and d["ok"], d["failures"]
    assert d["reference"] == "probe" and d["positions"] == 8
    if variant != "q8_0":
        assert d["dtype_class"] == "exact" and d["top1_agreement"] == 1.0 and d["max_rel_diff"] <= 1e-5
    else:
        assert d["dtype_class"] == "q8_0" and d["mean_kl"] > 0


@pytest.mark.parametrize("variant,cls", [("f16", "float"), ("f32", "exact")])
def test_float_classes(variant, cls, archive, sources):
    """bf16 → f16 is a lossy float cast (looser bounds); bf16 → f32 is exact."""
    code, d = check(archive("llama3", variant), "--against", sources["llama3"])
    _record("llama3", variant, "transformers", d)
    assert code == 0 and d["dtype_class"] == cls and d["thresholds"] == THRESHOLDS[cls]
    if cls == "float":  # a cast is lossy: its semantics are compared on its own (f16) weights
        assert d["semantics"]["ok"] and d["semantics"]["max_rel_diff"] <= 1e-4
    else:
        assert d["semantics"] is None
    code, d = check(archive("llama3", variant))
    assert code == 0 and d["dtype_class"] == cls


def test_q4_is_reported_only_unless_strict(archive, sources):
    a, src = archive("qwen2", "q4_0"), sources["qwen2"]
    r = runner.invoke(app, ["check", str(a), "--against", str(src)])
    assert r.exit_code == 0 and "reported only" in r.stdout, r.output
    code, d = check(a, "--against", src)
    _record("qwen2", "q4_0", "transformers", d)
    assert code == 0 and d["dtype_class"] == "q4" and d["thresholds"] == {} and d["mean_kl"] > 0
    # far from the source (fidelity), yet exactly what its own weights compute (semantics)
    assert d["semantics"]["ok"] and d["semantics"]["top1_agreement"] == 1.0 and d["semantics"]["max_rel_diff"] <= 1e-4
    code, d = check(a, "--against", src, "--strict")
    assert d["thresholds"] == THRESHOLDS["q4"] and code == (0 if d["mean_kl"] <= THRESHOLDS["q4"]["mean_kl"] else 1)


# ---------------------------------------------------------------- broken archives fail

def tamper(src: Path, dst: Path, edit) -> Path:
    """unpack → edit(manifest, pages_dir) → fix page sizes/checksums, drop orphans → pack."""
    stage = dst.with_suffix(".stage")
    with open_archive(src) as a:
        unpack(a, stage)
    m = json.loads((stage / "manifest.json").read_text())
    pages = stage / "pages"
    edit(m, pages)
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
    pack_staging(stage, dst)
    return dst


def _wrong_layout(m, pages):
    assert m["model"]["rope"]["layout"] == "half"
    m["model"]["rope"]["layout"] = "interleaved"  # claimed, but q/k rows are not permuted


def _wrong_theta(m, pages):
    rope = m["model"]["rope"]
    rope["theta"] = rope["theta"] / 100
    # The decoder (and a runtime) use the rope_freqs tensor, so the wrong theta must reach it.
    freqs = rope_inv_freq(rope, head_dim=m["model"]["head_dim"],
                          max_position_embeddings=m["model"]["max_position_embeddings"])
    old = np.frombuffer((pages / "rope_freqs#0").read_bytes(), "<f4")
    assert old.shape == freqs.shape and not np.allclose(old, freqs)
    (pages / "rope_freqs#0").write_bytes(np.ascontiguousarray(freqs, "<f4").tobytes())


def _no_window(m, pages):
    att = m["model"]["attention"]
    assert att["sliding_window"] == WINDOW
    att["sliding_window"] = None
    att["layer_types"] = ["full"] * m["model"]["num_layers"]


def _window_plus_one(m, pages):
    m["model"]["attention"]["sliding_window"] = WINDOW + 1  # off by one: i − w < j ≤ i must be exact


def _no_bias(m, pages):
    assert m["model"]["attention"]["qkv_bias"]
    m["model"]["attention"]["qkv_bias"] = False
    gone = {t["name"] for t in m["tensors"] if re.fullmatch(r"blk\.\d+\.attn_[qkv]\.bias", t["name"])}
    assert len(gone) == 6
    m["tensors"] = [t for t in m["tensors"] if t["name"] not in gone]
    m["pages"] = [p for p in m["pages"] if p.get("tensor") not in gone]


BROKEN = [("layout", k, _wrong_layout) for k in FAMILIES] + [
    ("theta", "llama3", _wrong_theta), ("theta", "qwen2", _wrong_theta),
    ("window", "mistral", _no_window), ("window+1", "mistral", _window_plus_one), ("bias", "qwen2", _no_bias)]


@pytest.mark.parametrize("what,kind,edit", BROKEN, ids=[f"{w}-{k}" for w, k, _ in BROKEN])
def test_broken_archive_fails(what, kind, edit, archive, sources, work):
    bad = tamper(archive(kind, "bf16"), work / f"bad-{what}-{kind}.thin", edit)
    assert runner.invoke(app, ["verify", str(bad)]).exit_code == 0  # structurally valid: only check can tell
    code, d = check(bad, "--against", sources[kind])
    _record(kind, f"bad-{what}", "transformers", d)
    assert code == 1 and not d["ok"] and d["failures"]
    assert d["dtype_class"] == "exact" and d["max_rel_diff"] > 1e-2  # far outside the bound, not marginal
    code, d = check(bad)  # the stored probe (from the source weights) catches it too
    assert code == 1 and not d["ok"]


def test_failing_check_text_output(archive, sources, work):
    bad = tamper(archive("qwen2", "bf16"), work / "bad-text.thin", _no_bias)
    r = runner.invoke(app, ["check", str(bad), "--against", str(sources["qwen2"])])
    assert r.exit_code == 1
    assert "FAIL" in r.stderr and "exact bound" in r.stderr
    assert "overall:" in r.stdout and "PASS" not in r.output
    r = runner.invoke(app, ["check", str(archive("qwen2", "bf16")), "--against", str(sources["qwen2"])])
    assert r.exit_code == 0 and "PASS" in r.stdout and "top-1 100.0 %" in r.stdout


# ---------------------------------------------------------------- the probe



def _hf_model(src: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()


def _source_decoder(hf, model: dict) -> Decoder:
    """The reference decoder on the source weights, mapped here by hand (rope_freqs from transformers)."""
    tensors = {"rope_freqs": hf.model.rotary_emb.inv_freq.float().numpy()}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and model["tie_word_embeddings"]:
            continue
        tensors[canonical_name(name)] = t.float().numpy()
    return Decoder(DictProvider({**model, "rope": {**model["rope"], "layout": "half"}}, tensors))


@pytest.mark.parametrize("kind", FAMILIES)
def test_probe_content(kind, archive, sources):
    with open_archive(archive(kind, "bf16")) as a:
        model, probe = a.model, a.manifest["validation"]["probe"]
    tokens = probe["tokens"]
    assert probe["top_k"] == 8 and len(tokens) == 8 and len(probe["positions"]) == 8
    assert tokens[0] == model["special_tokens"]["bos"] and all(0 <= t < model["vocab_size"] for t in tokens)
    assert len(set(tokens)) > 4  # spread out, not one repeated id
    hf = _hf_model(sources[kind])
    ours = _source_decoder(hf, model).logits_for(tokens)
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].numpy()
    for i, pos in enumerate(probe["positions"]):
        ids, logits = np.array(pos["ids"]), np.array(pos["logits"])
        assert len(ids) == len(logits) == 8 and len(set(ids.tolist())) == 8
        assert np.all(np.diff(logits) <= 0)  # best first
        assert ids.tolist() == np.argsort(-ours[i], kind="stable")[:8].tolist()
        np.testing.assert_allclose(logits, ours[i][ids], rtol=0, atol=1e-5 * np.abs(ours[i]).max())
        np.testing.assert_allclose(logits, theirs[i][ids], rtol=0, atol=1e-4 * np.abs(theirs[i]).max())


@pytest.mark.parametrize("kind", FAMILIES)
def test_probe_comes_from_the_source_weights(kind, archive):
    """Interleaved and q8_0 archives store the same probe as the passthrough one: it is computed from
    the source weights in HF layout, not from what was written."""
    def probe(variant):
        with open_archive(archive(kind, variant)) as a:
            return a.manifest["validation"]["probe"]

    base = probe("bf16")
    for variant in ("interleaved", "q8_0"):
        other = probe(variant)
        assert other["tokens"] == base["tokens"] and other["top_k"] == base["top_k"]
        for p, q in zip(base["positions"], other["positions"]):
            assert p["ids"] == q["ids"]
            np.testing.assert_allclose(p["logits"], q["logits"], rtol=1e-6)


def test_no_probe_flag(archive):
    with open_archive(archive("qwen3", "noprobe")) as a:
        assert "probe" not in a.manifest["validation"]
    with open_archive(archive("qwen3", "bf16")) as a:
        assert "probe" in a.manifest["validation"]


def test_check_without_probe_or_against_is_one_line_error(archive):
    r = runner.invoke(app, ["check", str(archive("qwen3", "noprobe"))])
    assert r.exit_code == 2
    line = one_line_error(r)
    assert "validation.probe" in line and "--against" in line and "qwen3-noprobe.thin" in line


# ---------------------------------------------------------------- options and errors

def test_json_fields(archive, sources):
    code, d = check(archive("mistral", "bf16"), "--against", sources["mistral"])
    assert set(d) == JSON_KEYS
    per = d["per_position"]
    assert len(per) == d["positions"] and [p["position"] for p in per] == list(range(d["positions"]))
    assert all(set(p) == {"position", "max_abs", "max_rel", "top1_match", "kl"} for p in per)
    assert d["max_abs_diff"] == max(p["max_abs"] for p in per)
    assert d["max_rel_diff"] == max(p["max_rel"] for p in per)
    assert d["top1_agreement"] == sum(p["top1_match"] for p in per) / len(per)
    assert math.isclose(d["mean_kl"], sum(p["kl"] for p in per) / len(per)) and d["max_kl"] == max(p["kl"] for p in per)
    assert d["thresholds"] == THRESHOLDS["exact"]
    assert d["engine"] == "decode"  # a tiny model decodes token by token


@pytest.mark.slow
def test_tokens_and_steps(archive, sources):
    a, src = archive("qwen2", "bf16"), sources["qwen2"]
    code, d = check(a, "--against", src, "--tokens", "5, 17,200,3,3,9")
    assert code == 0 and d["positions"] == 6
    code, d = check(a, "--against", src, "--tokens", "5,17,200,3,3,9", "--steps", "2")
    assert code == 0 and d["positions"] == 2
    code, d = check(a, "--against", src, "--steps", "5")
    assert code == 0 and d["positions"] == 5


@pytest.mark.parametrize("args", [["--tokens", "1,x,3"], ["--tokens", ""], ["--tokens", "1.5"], ["--tokens", "-1"],
                                  ["--tokens", "256"], ["--tokens", "1", "--prompt", "hi"], ["--steps", "0"]],
                         ids=["letter", "empty", "float", "negative", "beyond-vocab", "both", "steps0"])
def test_usage_errors_exit_2(args, archive, sources):
    r = runner.invoke(app, ["check", str(archive("qwen2", "bf16")), "--against", str(sources["qwen2"]), *args])
    assert r.exit_code == 2, r.output
    one_line_error(r)


def test_default_tokens_outlast_the_window():
    from thinconv.probe import default_tokens

    model = {"attention": {"sliding_window": 100}, "max_position_embeddings": 4096, "vocab_size": 50,
             "special_tokens": {"bos": 7}}
    toks = default_tokens(model)
    assert len(toks) > 100 and toks[0] == 7 and all(0 <= t < 50 for t in toks) and len(set(toks)) > 10
    assert len(default_tokens({**model, "attention": {"sliding_window": None}})) >= 16


def test_parse_tokens():
    assert parse_tokens("1, 2,3", 10) == [1, 2, 3]
    for bad in ("a", "", "10", "-1", "1;2"):
        with pytest.raises(UsageError):
            parse_tokens(bad, 10)


def test_prompt_without_tokenizer_is_one_line_error(archive, sources):
    a = archive("llama3", "bf16")
    for args in (["check", str(a), "--against", str(sources["llama3"]), "--prompt", "hello"],
                 ["run", str(a), "--prompt", "hello"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        line = one_line_error(r)
        assert "tokenizer.json" in line and "llama3-bf16.thin" in line


def test_prompt_uses_embedded_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    prompt = "The river ran slowly"
    want = AutoTokenizer.from_pretrained(TINY_LLAMA)(prompt).input_ids
    code, d = check(tiny_llama, "--against", TINY_LLAMA, "--prompt", prompt)
    assert code == 0 and d["positions"] == len(want) and d["top1_agreement"] == 1.0


def test_tokens_must_match_probe_without_against(archive):
    r = runner.invoke(app, ["check", str(archive("qwen2", "bf16")), "--tokens", "1,2,3"])
    assert r.exit_code == 2
    assert "probe" in one_line_error(r)


def _without_torch(*argv: str) -> subprocess.CompletedProcess:
    code = ("import sys; sys.modules['torch'] = None; from thinconv.cli import main; "
            f"sys.argv = ['thinconv', *{list(map(str, argv))!r}]; main()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.slow
def test_missing_torch(archive, sources):
    a = archive("qwen3", "bf16")
    r = _without_torch("check", a, "--against", sources["qwen3"])
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs torch and transformers: pip install" in lines[0], r.stderr
    r = _without_torch("check", a)  # the probe comparison needs numpy only
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout


def test_missing_torch_message_names_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from thinconv.check import transformers_logits\n"
            "try:\n    transformers_logits('.', [1])\nexcept Exception as e:\n    print(type(e).__name__, e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("UsageError ") and "pip install 'thinconv[check]'" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_missing_torch_cli_names_the_extra(archive, sources):
    r = _without_torch("check", archive("qwen3", "bf16"), "--against", sources["qwen3"])
    assert "pip install 'thinconv[check]'" in r.stderr, r.stderr


def test_against_another_model(archive, sources):
    r = runner.invoke(app, ["check", str(archive("qwen2", "bf16")), "--against", str(sources["qwen3"])])
    assert r.exit_code == 1
    line = one_line_error(r)  # the archive's recipe does not even handle the other source's architecture
    assert "Qwen3ForCausalLM is not handled by recipe 'qwen2'" in line
    r = runner.invoke(app, ["check", str(archive("qwen3", "bf16")), "--against", str(sources["mistral"])])
    assert r.exit_code == 1 and "MistralForCausalLM is not handled by recipe 'qwen3'" in one_line_error(r)


@pytest.mark.parametrize("scaling", ["dynamic", "longrope"])
def test_sequence_dependent_rope_has_a_probe_and_checks(work, scaling):
    """Dynamic and longrope RoPE (tables that depend on the sequence length) are decoded by the
    reference decoder: the converter stores a probe, and check passes against it and against
    transformers on a sequence past the switch point (max_position_embeddings 16 / original 16)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if scaling == "dynamic":
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
                          rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    else:
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [2.0, 3.0, 5.0, 8.0], "original_max_position_embeddings": 16}
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, rope_parameters=rope)
    torch.manual_seed(0)
    src = work / "src" / scaling
    AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    out = work / f"{scaling}.thin"
    r = runner.invoke(app, ["convert", str(src), str(out)])
    assert r.exit_code == 0, r.output
    assert "probe skipped" not in r.output
    with open_archive(out) as a:
        assert a.manifest["validation"]["probe"]["tokens"] and "rope_freqs" not in a.tensor_names
    code, d = check(out)
    assert code == 0 and d["ok"], d
    code, d = check(out, "--against", src)
    assert code == 0 and d["ok"] and d["positions"] == 24, d  # 16 + 8: past the switch, where the scaling acts


# ---------------------------------------------------------------- archives with a tokenizer of our own

def _add_tokenizer(tk):
    data = tk.to_str().encode()

    def edit(m, pages):
        (pages / "tokenizer.json#0").write_bytes(data)
        m["pages"].append({"id": "tokenizer.json#0", "asset": "tokenizer.json", "size": 0, "checksum": ""})
        m["assets"].append({"name": "tokenizer.json", "media_type": "application/json", "size": len(data),
                            "pages": ["tokenizer.json#0"]})
    return edit


@pytest.fixture(scope="module")
def metaspace(archive, work):
    """The qwen2 archive with a SentencePiece-style (Metaspace) word tokenizer: ▁w0 … ▁w255."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"\u2581w{i}": i for i in range(256)}, unk_token="\u2581w0"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return tamper(archive("qwen2", "bf16"), work / "qwen2-metaspace.thin", _add_tokenizer(tk)), tk


def test_prompt_with_embedded_tokenizer(metaspace, sources):
    path, tk = metaspace
    code, d = check(path, "--against", sources["qwen2"], "--prompt", "w5 w17 w200 w3")
    assert code == 0 and d["positions"] == 4
    for args in (["check", str(path), "--against", str(sources["qwen2"]), "--prompt", ""],
                 ["run", str(path), "--prompt", ""]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        one_line_error(r)


def _greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from thinconv.check import ArchiveProvider

    with open_archive(path) as a:
        return list(Decoder(ArchiveProvider(a)).generate(ids, n))


def test_run_keeps_the_space_before_the_first_new_token(metaspace):
    path, tk = metaspace
    prompt = "w5 w17"
    ids = tk.encode(prompt).ids
    gen = _greedy(path, ids, 6)
    r = runner.invoke(app, ["run", str(path), "--prompt", prompt, "--max-new-tokens", "6"])
    assert r.exit_code == 0, r.output
    assert r.stdout == tk.decode(ids + gen) + "\n"


def test_run_streams_characters_split_across_tokens(archive, work):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    src = archive("qwen2", "bf16")
    # A prompt whose first two new tokens differ from each other and from the prompt.
    ids, gen = next((ids, gen) for ids in ([5, 17], [9, 40], [100, 3], [60, 61], [7, 8], [200, 201])
                    if len(gen := _greedy(src, ids, 6)) >= 2 and len({*ids, gen[0], gen[1]}) == 4)
    # Byte-level pieces: the first two new tokens are the two bytes of "é" (C3 A9 → "Ã", "©").
    vocab = {f"t{i}": i for i in range(256)}
    vocab.pop(f"t{gen[0]}"), vocab.pop(f"t{gen[1]}")
    vocab.update({"\u00c3": gen[0], "\u00a9": gen[1]})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.WhitespaceSplit(), decoders.ByteLevel()
    assert tk.decode(gen[:1]) == "\ufffd" and tk.decode(gen[:2]) == "\u00e9"
    path = tamper(src, work / "qwen2-bytes.thin", _add_tokenizer(tk))
    prompt = f"t{ids[0]} t{ids[1]}"
    assert tk.encode(prompt).ids == ids
    r = runner.invoke(app, ["run", str(path), "--prompt", prompt, "--max-new-tokens", "6"])
    assert r.exit_code == 0, r.output
    assert r.stdout == prompt + tk.decode(gen) + "\n"


# ---------------------------------------------------------------- comparison arithmetic

def test_compare_logits_figures():
    ref = np.array([[0.0, 1.0, 2.0, -4.0], [3.0, 0.0, 0.0, 0.0]], np.float32)
    same = compare_logits(ref, ref.copy())
    assert all(p.max_abs == 0 and p.max_rel == 0 and p.kl == 0 and p.top1_match for p in same)
    test = ref.copy()
    test[0, 1] = 2.5  # top-1 flips to index 1; |Δ| = 1.5, rel = 1.5 / 4
    test[1] += 7.0  # a constant shift: same distribution, KL 0, but |Δ| = 7
    r = compare_logits(ref, test)
    assert r[0].max_abs == pytest.approx(1.5) and r[0].max_rel == pytest.approx(1.5 / 4) and not r[0].top1_match
    p, q = np.exp(ref[0].astype(np.float64)), np.exp(test[0].astype(np.float64))
    p, q = p / p.sum(), q / q.sum()
    assert r[0].kl == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-9)  # KL(source ‖ archive)
    assert r[1].kl == pytest.approx(0, abs=1e-12) and r[1].top1_match and r[1].max_rel == pytest.approx(7 / 3)


def test_compare_probe_uses_top_ids():
    probe = {"positions": [{"ids": [2, 1], "logits": [2.0, 1.0]}]}
    full = np.array([[9.0, 1.0, 2.0, -3.0]], np.float32)  # index 0 is not in the probe but wins
    (r,) = compare_probe(probe, full)
    assert r.max_abs == 0 and r.kl == pytest.approx(0, abs=1e-12) and not r.top1_match


@pytest.mark.parametrize("cls,pos,ok", [
    ("exact", PositionResult(0, 0.1, 2e-3, True, 0.0), False),
    ("exact", PositionResult(0, 0.0, 0.0, False, 0.0), False),
    ("exact", PositionResult(0, 0.0, 5e-4, True, 0.0), True),
    ("q8_0", PositionResult(0, 9.0, 0.9, False, 5e-3), True),
    ("q8_0", PositionResult(0, 0.0, 0.0, True, 2e-2), False),
    ("q4", PositionResult(0, 9.0, 0.9, False, 5.0), True),  # report only
])
def test_judge(cls, pos, ok):
    assert judge(CheckResult(cls, "probe", [pos])).ok is ok
    if cls == "q4":
        assert not judge(CheckResult(cls, "probe", [pos]), strict_q4=True).ok


# ---------------------------------------------------------------- run

def test_run_matches_transformers_generate(tiny_llama):
    from transformers import AutoTokenizer

    from thinconv.check import ArchiveProvider

    tok = AutoTokenizer.from_pretrained(TINY_LLAMA)
    hf = _hf_model(TINY_LLAMA)
    prompt = "The"
    ids = tok(prompt).input_ids
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40)[0].tolist()[len(ids):]
    assert len(gen) == 40  # recites its training text, no early eos
    with open_archive(tiny_llama) as a:
        ours = list(Decoder(ArchiveProvider(a)).generate(ids, 40))
    assert ours == gen
    r = runner.invoke(app, ["run", str(tiny_llama), "--prompt", prompt, "--max-new-tokens", "40"])
    assert r.exit_code == 0, r.output
    assert r.stdout == prompt + tok.decode(gen, skip_special_tokens=True) + "\n"
    assert r.stdout.rstrip("\n") == tok.decode(ids + gen, skip_special_tokens=True)


@pytest.mark.slow
def test_run_console_script(tiny_llama):
    exe = Path(sys.executable).parent / "thinconv"
    r = subprocess.run([str(exe), "run", str(tiny_llama), "--prompt", "The river", "--max-new-tokens", "12"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The river ran slowly") and r.stderr == ""


def test_big_archives_are_checked_layer_by_layer_with_the_same_logits(archive):
    """Past the memory budget, check switches to the weight-streaming prefill: same numbers."""
    from thinconv.check import archive_logits
    from thinconv.format import open_archive

    with open_archive(archive("llama3", "q8_0")) as a:
        tokens = a.manifest["validation"]["probe"]["tokens"]
        decoded, how = archive_logits(a, tokens)
        streamed, how_big = archive_logits(a, tokens, memory_budget=0)
    assert (how, how_big) == ("decode", "prefill")
    assert np.abs(decoded - streamed).max() <= 1e-5 * np.abs(decoded).max()
