"""`thinconv check` that cannot be fooled (issue 14): the archive's `model` section is compared
with the one its source's config implies before any decoding; the decoded sequence is long enough
for every window; the exactness class comes from what the converter recorded it did; transformers'
own failures are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from families import VOCAB, build, rewrite
from hubcache import populate_hub_cache, use_hub_cache
from thinconv.cli import app
from thinconv.format import open_archive

runner = CliRunner()
WINDOW = 32  # longer than the 16 positions check used to decode, and than the 8 the probe stores


def check(*args) -> tuple[int, dict]:
    r = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def _convert(src: Path, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["convert", str(src), str(out), "--force", *extra])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trust")


@pytest.fixture(scope="module")
def mistral(work) -> tuple[Path, Path]:
    """A Mistral checkpoint with sliding_window 32 and its archive."""
    from transformers import MistralConfig

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    src = build(cfg, work / "mistral", dtype="bf16", seed=3)
    return src, _convert(src, work / "mistral.thin")


def _no_window(m: dict) -> None:
    att = m["model"]["attention"]
    assert att["sliding_window"] == WINDOW
    att["sliding_window"], att["layer_types"] = None, ["full"] * m["model"]["num_layers"]


def test_a_removed_window_fails_check_against_the_source(mistral, work):
    """Case 1: the lie used to pass (16 positions never reach a 32-token window, nothing compared the
    manifest with the config). Now the model section is compared first, and the sequence covers the
    window."""
    src, archive = mistral
    code, d = check(archive, "--against", src)
    assert code == 0 and d["model_compared"] and not d["model_differences"]
    assert d["positions"] == WINDOW + 8  # long enough for the window to act
    lie = rewrite(archive, work / "no-window.thin", _no_window)
    code, d = check(lie, "--against", src)
    assert code == 1 and not d["ok"]
    assert "model.attention.sliding_window: archive null, source 32" in d["model_differences"]
    assert any("model section differs" in f for f in d["failures"])
    assert d["positions"] == WINDOW + 8  # the source's window sizes the test, whatever the archive claims
    assert d["max_rel_diff"] > 1e-2  # and the logits differ past the window, too
    r = runner.invoke(app, ["check", str(lie), "--against", str(src)])
    assert r.exit_code == 1 and "sliding_window: archive null, source 32" in r.stderr


def test_without_against_a_hub_source_in_the_cache_is_compared(mistral, work, monkeypatch):
    """The probe covers 8 positions, too few for a 32-token window; the archive's recorded hub source,
    found in the local cache, still exposes the lie (no network, no --against)."""
    src, _ = mistral
    home = work / "hf"
    populate_hub_cache(home, "org/mistral-w32", src, commit="a" * 40)
    use_hub_cache(monkeypatch, home)
    archive = _convert("org/mistral-w32", work / "hub-mistral.thin")
    code, d = check(archive)
    assert code == 0 and d["model_compared"] and d["reference"] == "probe"
    lie = rewrite(archive, work / "hub-no-window.thin", _no_window)
    code, d = check(lie)
    assert code == 1 and "model.attention.sliding_window: archive null, source 32" in d["model_differences"]


def test_a_local_source_without_against_says_what_it_could_not_compare(mistral, work):
    _, archive = mistral
    lie = rewrite(archive, work / "local-no-window.thin", _no_window)
    code, d = check(lie)  # the probe's 8 positions cannot tell; the check says so rather than claim more
    assert not d["model_compared"]
    assert any("not compared with the source" in n for n in d["notes"])
    assert any("probe covers 8 positions" in n for n in d["notes"]) is False  # the lie claims no window
    code, d = check(archive)
    assert any("probe covers 8 positions" in n for n in d["notes"])  # the true archive's window is longer


def test_a_window_longer_than_the_cap_is_reported_not_silently_skipped(work, monkeypatch):
    import thinconv.check as check_mod
    from transformers import MistralConfig

    monkeypatch.setattr(check_mod, "CHECK_CAP", 24)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                        max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    src = build(cfg, work / "mistral-cap", seed=4)
    code, d = check(_convert(src, work / "cap.thin"), "--against", src)
    assert code == 0 and d["positions"] == 24
    assert any("sliding window 32" in n and "not exercised" in n for n in d["notes"])


def test_recorded_lossy_values_set_the_class(mistral, work):
    """Case 3: the class comes from what the converter recorded (validation.lossy), not from dtype
    equality: a bf16 → f16 cast is recorded and judged by the float bounds."""
    src, archive = mistral
    with open_archive(archive) as a:
        assert "lossy" not in a.manifest["validation"]  # bf16 → bf16: exact copies
    f16 = _convert(src, work / "mistral-f16.thin", "--dtype", "f16")
    with open_archive(f16) as a:
        lossy = a.manifest["validation"]["lossy"]
        assert lossy["blk.0.attn_q.weight"] == "cast bf16 → f16" and "blk.0.attn_norm.weight" not in lossy
    code, d = check(f16, "--against", src)
    assert code == 0 and d["dtype_class"] == "float"


TRANSFORMS = '''
import numpy as np
from thinconv.transforms import register_transform


@register_transform("fold_and_unfold")
def fold_and_unfold(rows, *, name, start, end, model):
    """The same weights, re-rounded to bf16 through a scale of 3 (what folding a multiplier does)."""
    import ml_dtypes
    return (rows.astype(np.float32) * 3).astype(ml_dtypes.bfloat16).astype(np.float32) / 3
'''


def test_transformed_weights_are_judged_as_rounded_not_exact(mistral, work):
    """Case 3: a recipe transform re-rounds bf16 weights; the archive is right but not bit-exact, so it
    must be judged by the float bounds (it used to fail the exact bound)."""
    src, _ = mistral
    folder = work / "user-recipes"
    folder.mkdir(exist_ok=True)
    (folder / "transforms.py").write_text(TRANSFORMS)
    (folder / "mistral_fold.toml").write_text('name = "mistral_fold"\nextends = "mistral"\n'
                                              'architectures = ["MistralForCausalLM"]\n'
                                              '[transforms]\n"ffn_*.weight" = "fold_and_unfold"\n')
    out = _convert(src, work / "fold.thin", "--recipes", str(folder), "--dtype", "bf16")
    with open_archive(out) as a:
        assert a.manifest["validation"]["lossy"]["blk.1.ffn_up.weight"] == "transform fold_and_unfold"
        w = a.dequantize("blk.1.ffn_up.weight")
    assert w.dtype == np.float32
    code, d = check(out, "--against", src, "--recipes", folder)
    assert code == 0 and d["dtype_class"] == "float", d
    assert d["max_rel_diff"] > 1e-6  # really rounded: an exact bound would be a coin toss
    # transformers cannot be given values a transform changed: the check says it judged fidelity alone
    assert d["semantics"] is None
    assert any("semantics not compared" in n and "fold_and_unfold" in n for n in d["notes"]), d["notes"]


def test_a_transforms_file_is_loaded_only_from_named_folders(work):
    folder = work / "evil"
    folder.mkdir()
    marker = work / "ran"
    (folder / "transforms.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    r = runner.invoke(app, ["recipes"])
    assert r.exit_code == 0 and not marker.exists()
    r = runner.invoke(app, ["recipes", "--recipes", str(folder)])
    assert r.exit_code == 0 and marker.exists()
    (folder / "transforms.py").write_text("raise RuntimeError('boom')\n")
    r = runner.invoke(app, ["recipes", "--recipes", str(work / "evil2")])
    assert r.exit_code == 1


def test_transformers_failures_are_one_line(mistral, work, monkeypatch):
    """Case 5: anything transformers raises while loading or running the source is one line, exit 1."""
    import transformers

    src, archive = mistral

    def broken(*args, **kwargs):
        raise ValueError("sliding_window must be set for sliding layers\n  (a long transformers traceback)")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    r = runner.invoke(app, ["check", str(archive), "--against", str(src)])
    assert r.exit_code == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "transformers cannot load this checkpoint (ValueError: sliding_window must be set" \
        in lines[0] and "Traceback" not in r.output


@pytest.fixture(scope="module")
def yarn(work) -> tuple[Path, Path]:
    """A Llama checkpoint with YaRN RoPE (attention factor 0.1·ln 4 + 1 ≈ 1.139) and its archive."""
    from transformers import LlamaConfig

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_parameters=rope, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    src = build(cfg, work / "yarn", seed=5)
    return src, _convert(src, work / "yarn.thin")


def test_a_lie_on_the_yarn_attention_factor_fails(yarn, work):
    """rope.attention_factor multiplies cos and sin (both paths of the decoder read it: tests/test_decoder.py::
    test_yarn_attention_factor_matters_in_both_paths); an archive claiming 1 fails against the source
    (named, and in the logits) and against its probe."""
    src, archive = yarn
    with open_archive(archive) as a:
        factor = a.model["rope"]["attention_factor"]
    assert factor == pytest.approx(0.1 * np.log(4.0) + 1)
    code, d = check(archive, "--against", src)
    assert code == 0 and d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5

    def unit_factor(m: dict) -> None:
        m["model"]["rope"]["attention_factor"] = 1.0

    lie = rewrite(archive, work / "yarn-factor-1.thin", unit_factor)
    code, d = check(lie, "--against", src)
    assert code == 1 and f"model.rope.attention_factor: archive 1.0, source {factor!r}" in d["model_differences"]
    assert d["max_rel_diff"] > 1e-2
    code, d = check(lie)
    assert code == 1 and d["max_rel_diff"] > 1e-2


def _bound(x: float) -> tuple[str, str]:
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}", f"{x:g}"


def test_help_and_format_say_what_check_proves_and_what_not():
    """check --help and FORMAT.md's last section state the bounds and the cap the code applies, and
    what check does not prove."""
    from thinconv.check import CHECK_CAP, THRESHOLDS

    r = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0
    help_text = " ".join(r.stdout.split())
    section = (Path(__file__).resolve().parents[1] / "FORMAT.md").read_text(encoding="utf-8").split("\n## ")[-1]
    assert section.startswith("5. What `thinconv check` proves")
    section = " ".join(section.split())
    for text in (help_text, section):
        assert "not prove" in text and "semantics" in text and "fidelity" in text and str(CHECK_CAP) in text
        for limits in THRESHOLDS.values():
            for value in limits.values():
                if value != 1.0:  # top-1 agreement: "100 %"
                    assert any(f"≤ {b}" in text for b in _bound(value)), (value, text[:200])
        assert "top-1 100 %" in text


def _one_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


def test_torch_failures_while_running_are_one_line(mistral, work, monkeypatch):
    """Case 5, at run time: an exception from the model's forward is one line naming the source."""
    from transformers import MistralForCausalLM

    src, archive = mistral

    def broken(self, *args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x64 and 32x64)\n  deep in torch")

    monkeypatch.setattr(MistralForCausalLM, "forward", broken)
    line = _one_line(runner.invoke(app, ["check", str(archive), "--against", str(src)]))
    assert f"{src}: transformers cannot run this checkpoint (RuntimeError: mat1 and mat2 shapes" in line


def test_failures_on_the_archive_weights_are_one_line(mistral, work, monkeypatch):
    """Semantics loads the source's config with the archive's weights: a failure there names both."""
    import transformers

    src, _ = mistral
    q8 = _convert(src, work / "mistral-q8_0.thin", "--dtype", "q8_0")
    original = transformers.AutoModelForCausalLM.from_pretrained

    def picky(path, *args, **kwargs):
        if "thinconv-check-" in str(path):
            raise KeyError("model.layers.0.mlp.up_proj.weight\n  (a long transformers traceback)")
        return original(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", picky)
    line = _one_line(runner.invoke(app, ["check", str(q8), "--against", str(src)]))
    assert f"{src} (config) with mistral-q8_0.thin's weights: transformers cannot load this checkpoint (KeyError" \
        in line


def test_every_rope_scaling_the_converter_accepts_is_decoded():
    """Case 4: every RoPE scaling a source may have (the types the converter reads) is one the
    reference decoder computes — statically or per sequence length (dynamic, longrope) — so every
    archive has a probe and can be checked; none needs a conversion-time warning."""
    from thinconv import modelmeta
    from thinconv.format import spec
    from thinconv.rope import DYNAMIC_SCALING_TYPES

    accepted = {None if t == "default" else t for t in modelmeta._ROPE_KEYS}
    assert {"dynamic", "longrope", "yarn", "llama3", "linear", None} <= accepted
    assert accepted <= set(spec.STATIC_ROPE_SCALINGS) | DYNAMIC_SCALING_TYPES
