"""Gemma 1, Gemma 2 and Gemma 3 (text): recipes gemma, gemma2, gemma3, end to end.

Tiny random checkpoints are built with transformers (tests/families.py), every computation-changing
config value set away from its default: (1 + w) norms with random w, a head_dim that is not
hidden / heads, query_pre_attn_scalar ≠ head_dim, soft-caps of 5-10, a sliding window of 4 (< the 16
tokens `check` compares), explicit and default layer types, two RoPEs (linear-scaled global,
low-theta local), and the config spellings transformers rewrites (Gemma 1 "gelu" → tanh GELU; a
Gemma 3 legacy config with rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern).

Every `check --against` here uses hidden_size 64: √64 = 8 is exact in bf16. The archive's
embedding.scale is √hidden_size rounded to the checkpoint's dtype (as a bf16 model runs), while
`check` runs transformers in float32, which uses the unrounded √H; for a hidden size whose root is
not exact in bf16 (H = 80: 8.9375 vs 8.94427) a bf16 archive and the f32 reference differ by that
rounding, so the bf16 comparisons stay on exact roots (the rounding itself is tested on H = 80).

The expected `model` sections are written out by hand from the config values set here; the
lying archives (families.rewrite) each change or drop one key the family sets.
Run with `-s` to print the figures.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import blake3
import numpy as np
import pytest
from typer.testing import CliRunner

import families as F
from thinconv.cli import app
from thinconv.format.reader import open_archive

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
runner = CliRunner()

H, HEADS, KV, FFN = 64, 4, 2, 96
WINDOW = 4
BASE = dict(vocab_size=F.VOCAB, hidden_size=H, intermediate_size=FFN, num_attention_heads=HEADS,
            num_key_value_heads=KV, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
G3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
G3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
           "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
# The same Gemma 3 RoPE and layer types in the Hub's legacy spelling (Gemma3TextConfig folds it in).
G3_LEGACY = dict(rope_parameters=None, layer_types=None, _sliding_window_pattern=None, rope_theta=50000.0,
                 rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                 sliding_window_pattern=3)
FIGURES: list[str] = []


def _config(family: str):
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

    if family == "gemma":  # biases on q, k, v and o; untied; head_dim 24 ≠ 64 / 4
        return GemmaConfig(**BASE, num_hidden_layers=2, head_dim=24, attention_bias=True, tie_word_embeddings=False,
                           rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    if family == "gemma2":  # erf GELU (no rewrite in Gemma 2), layer types that are not the default
        return Gemma2Config(**BASE, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                            attn_logit_softcapping=5.0, final_logit_softcapping=10.0, hidden_activation="gelu",
                            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 2000.0})
    if family == "gemma3":  # attn_logit_softcapping 2.0: Gemma 3 never applies it
        return Gemma3TextConfig(**BASE, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24,
                                sliding_window=WINDOW, layer_types=G3_TYPES, final_logit_softcapping=8.0,
                                attn_logit_softcapping=2.0, rms_norm_eps=1e-5, rope_parameters=copy.deepcopy(G3_ROPE))
    raise KeyError(family)


# Config edits after save_pretrained: the spellings a class rewrites or ignores.
EDITS = {
    # Gemma 1 reads only hidden_act, and runs "gelu" as the tanh approximation
    "gemma": dict(hidden_act="gelu", hidden_activation="silu"),
    # Gemma 2 / 3 read only hidden_activation
    "gemma2": dict(hidden_act="silu"),
    "gemma3": dict(hidden_act="silu"),
}
# case → (family, dtype, extra config edits)
CASES = {
    "gemma-f32": ("gemma", "f32", {}),
    "gemma-bf16": ("gemma", "bf16", {}),
    "gemma2-f32": ("gemma2", "f32", {}),
    "gemma2-bf16": ("gemma2", "bf16", {"layer_types": None}),  # the default: sliding iff (L + 1) % 2
    "gemma3-f32": ("gemma3", "f32", {}),
    "gemma3-bf16": ("gemma3", "bf16", {}),
    "gemma3-legacy": ("gemma3", "f32", G3_LEGACY),
}


# ---------------------------------------------------------------- the expected model sections (by hand)

def _expected(case: str) -> dict:
    special = {"bos": 1, "eos": [2], "pad": 0}
    dims = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_kv_heads": 2,
            "vocab_size": 384, "max_position_embeddings": 128}
    if case.startswith("gemma-"):
        return {**dims, "architecture": "gemma", "source_architecture": "GemmaForCausalLM", "num_layers": 2,
                "head_dim": 24, "tie_word_embeddings": False,
                "norm": {"type": "rmsnorm", "eps": 1e-5, "weight_offset": 1},
                "mlp": {"type": "gated", "activation": "gelu_tanh"},
                "attention": {"qkv_bias": True, "o_bias": True, "qk_norm": False, "sliding_window": None,
                              "layer_types": ["full", "full"], "scale": 24 ** -0.5},
                "rope": {"theta": 1000.0, "rotary_dim": 24, "layout": "half", "scaling": None,
                         "attention_factor": 1.0},
                "embedding": {"scale": 8.0}, "special_tokens": special}
    if case.startswith("gemma2-"):
        types = ["full", "sliding", "sliding"] if case == "gemma2-f32" else ["sliding", "full", "sliding"]
        return {**dims, "architecture": "gemma2", "source_architecture": "Gemma2ForCausalLM", "num_layers": 3,
                "head_dim": 16, "tie_word_embeddings": True,
                "norm": {"type": "rmsnorm", "eps": 1e-5, "weight_offset": 1},
                "mlp": {"type": "gated", "activation": "gelu"},
                "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": 4,
                              "layer_types": types, "scale": 24 ** -0.5, "softcap": 5.0},
                "rope": {"theta": 2000.0, "rotary_dim": 16, "layout": "half", "scaling": None,
                         "attention_factor": 1.0},
                "block": {"post_norm": True}, "embedding": {"scale": 8.0}, "logits": {"softcap": 10.0},
                "special_tokens": special}
    return {**dims, "architecture": "gemma3", "source_architecture": "Gemma3ForCausalLM", "num_layers": 4,
            "head_dim": 16, "tie_word_embeddings": True,
            "norm": {"type": "rmsnorm", "eps": 1e-5, "weight_offset": 1},
            "mlp": {"type": "gated", "activation": "gelu_tanh"},
            "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": True, "sliding_window": 4,
                          "layer_types": ["sliding", "sliding", "full", "sliding"], "scale": 24 ** -0.5},
            "rope": {"theta": 50000.0, "rotary_dim": 16, "layout": "half", "scaling": {"type": "linear", "factor": 2.0},
                     "attention_factor": 1.0, "sliding": {"theta": 500.0, "scaling": None, "attention_factor": 1.0}},
            "block": {"post_norm": True}, "embedding": {"scale": 8.0}, "logits": {"softcap": 8.0},
            "special_tokens": special}


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemma")


@pytest.fixture(scope="module")
def sources(work) -> dict[str, Path]:
    out = {}
    for case, (family, dtype, extra) in CASES.items():
        folder = work / "src" / case
        if case == "gemma3-legacy":  # the gemma3-f32 weights under a legacy config.json
            shutil.copytree(out["gemma3-f32"], folder)
        else:
            F.build(_config(family), folder, dtype=dtype)
        F.edit_config(folder, **{**EDITS[family], **extra})
        out[case] = folder
    return out


def _convert(src: Path, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["convert", str(src), str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def archives(sources, work) -> dict[str, Path]:
    out = {case: _convert(src, work / f"{case}.thin") for case, src in sources.items()}
    out["gemma3-q8_0"] = _convert(sources["gemma3-f32"], work / "gemma3-q8_0.thin", "--dtype", "q8_0")
    return out


def check(*args) -> tuple[int, dict]:
    """`thinconv check … --json` in-process: (exit code, parsed JSON)."""
    r = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def _record(what: str, ref: str, d: dict) -> None:
    FIGURES.append(f"{what:34s} vs {ref:12s} {d['dtype_class']:5s} rel {d['max_rel_diff']:.3g}  "
                   f"abs {d['max_abs_diff']:.3g}  top1 {d['top1_agreement']:.3f}  mean KL {d['mean_kl']:.3g}")


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if FIGURES:
        print("\n" + "\n".join(FIGURES))


def one_line_error(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


# ---------------------------------------------------------------- 1-3: model section, verify, check

@pytest.mark.parametrize("case", list(CASES))
def test_model_section_is_the_hand_written_one(case, archives):
    with open_archive(archives[case]) as a:
        assert a.model == _expected(case)


def test_legacy_gemma3_config_gives_the_same_archive(archives):
    """rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern convert exactly as the
    nested rope_parameters and explicit layer_types: same model, same tensors, same bytes per page."""
    with open_archive(archives["gemma3-f32"]) as a, open_archive(archives["gemma3-legacy"]) as b:
        assert a.model == b.model
        assert a.manifest["tensors"] == b.manifest["tensors"]
        assert [p for p in a.manifest["pages"] if "tensor" in p] == [p for p in b.manifest["pages"] if "tensor" in p]
        names = [t["name"] for t in a.manifest["tensors"]]
    assert names[:2] == ["rope_freqs", "rope_freqs_sliding"]
    assert names.count("blk.0.attn_q_norm.weight") == 1 and "blk.3.attn_k_norm.weight" in names
    assert "output.weight" not in names  # tied


@pytest.mark.parametrize("case", list(CASES) + ["gemma3-q8_0"])
def test_archive_verifies(case, archives):
    r = runner.invoke(app, ["verify", str(archives[case])])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("case", list(CASES))
def test_check_against_transformers_and_probe(case, archives, sources):
    code, d = check(archives[case], "--against", sources[case])
    _record(case, "transformers", d)
    assert code == 0 and d["ok"], d["failures"]
    assert d["dtype_class"] == "exact" and d["top1_agreement"] == 1.0
    assert d["max_rel_diff"] <= 1e-4  # well inside the 1e-3 bound
    assert d["positions"] == 16 > WINDOW  # the window bites
    code, d = check(archives[case])
    _record(case, "probe", d)
    assert code == 0 and d["ok"] and d["reference"] == "probe", d["failures"]
    assert d["dtype_class"] == "exact" and d["max_rel_diff"] <= 1e-5


def test_q8_0_archive(archives, sources):
    with open_archive(archives["gemma3-q8_0"]) as a:
        assert a.model == _expected("gemma3-f32")
        dtypes = {t["name"]: t["dtype"] for t in a.manifest["tensors"]}
    assert dtypes["blk.0.attn_q.weight"] == "q8_0" and dtypes["token_embd.weight"] == "q8_0"
    assert dtypes["blk.0.attn_q_norm.weight"] == "f32" and dtypes["rope_freqs_sliding"] == "f32"
    code, d = check(archives["gemma3-q8_0"], "--against", sources["gemma3-f32"])
    _record("gemma3-q8_0", "transformers", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "q8_0", d["failures"]
    assert 0 < d["mean_kl"] <= 1e-2
    code, d = check(archives["gemma3-q8_0"])
    _record("gemma3-q8_0", "probe", d)
    assert code == 0 and d["ok"] and d["dtype_class"] == "q8_0"


# ---------------------------------------------------------------- 4: run = transformers' greedy

@pytest.mark.parametrize("case", ["gemma-f32", "gemma2-bf16", "gemma3-f32"])
def test_run_matches_transformers_greedy(case, archives, sources):
    prompt = "Once upon a time"
    r = runner.invoke(app, ["run", str(archives[case]), "--prompt", prompt, "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    text = F.hf_greedy(sources[case], prompt, 8)
    assert text and r.stdout == prompt + text + "\n"


# ---------------------------------------------------------------- 5: lying archives fail

def _lie(archive: Path, out: Path, edit) -> Path:
    """families.rewrite, then the derived RoPE tables recomputed from the lying model (so that the lie
    is a valid archive: verify checks them)."""
    from thinconv.format.staging import pack_staging, unpack
    from thinconv.rope import derived_tables

    F.rewrite(archive, out, edit)
    staging = out.with_suffix(".tables")
    with open_archive(out) as a:
        unpack(a, staging, force=True)
    manifest = json.loads((staging / "manifest.json").read_text())
    tables = derived_tables(manifest["model"])
    for page in manifest["pages"]:
        if page.get("tensor") in tables:
            data = np.ascontiguousarray(tables[page["tensor"]], "<f4").tobytes()
            (staging / "pages" / page["id"]).write_bytes(data)
            page["size"], page["checksum"] = len(data), blake3.blake3(data).hexdigest()
    (staging / "manifest.json").write_text(json.dumps(manifest))
    pack_staging(staging, out, force=True)
    shutil.rmtree(staging)
    return out


def _drop(pattern: str):
    return lambda m: F.drop_tensors(m, lambda name: name.endswith(pattern))


def _set(path: str, value, *then):
    """An edit: model.<path> = value (DROP removes the key, and an emptied optional object with it),
    then the edits in `then` (e.g. tensors dropped)."""
    def edit(m):
        *parents, last = path.split(".")
        nodes = [m["model"]]
        for p in parents:
            nodes.append(nodes[-1].setdefault(p, {}))
        if value is DROP:
            del nodes[-1][last]
        else:
            nodes[-1][last] = value
        for holder, p, node in reversed(list(zip(nodes, parents, nodes[1:]))):
            if node == {}:
                del holder[p]
        for t in then:
            t(m)
    return edit


DROP = object()
ALL_FULL = lambda n: _set("attention.layer_types", ["full"] * n, _set("attention.sliding_window", None))  # noqa: E731

LIES = {
    "gemma": [
        ("norm.weight_offset", _set("norm.weight_offset", DROP)),
        ("mlp.activation=silu", _set("mlp.activation", "silu")),
        ("embedding.scale", _set("embedding.scale", DROP)),
        ("attention.qkv_bias", _set("attention.qkv_bias", False, _drop("attn_q.bias"), _drop("attn_k.bias"),
                                    _drop("attn_v.bias"))),
        ("attention.o_bias", _set("attention.o_bias", False, _drop("attn_output.bias"))),
    ],
    "gemma2": [
        ("norm.weight_offset", _set("norm.weight_offset", DROP)),
        ("mlp.activation=silu", _set("mlp.activation", "silu")),
        ("embedding.scale", _set("embedding.scale", DROP)),
        ("attention.scale=head_dim", _set("attention.scale", 0.25)),
        ("attention.softcap", _set("attention.softcap", DROP)),
        ("logits.softcap", _set("logits.softcap", DROP)),
        ("block.post_norm", _set("block.post_norm", DROP, _drop("attn_post_norm.weight"),
                                 _drop("ffn_post_norm.weight"))),
        ("sliding_window=none", ALL_FULL(3)),
        ("sliding_window+1", _set("attention.sliding_window", WINDOW + 1)),
        ("layer_types=default", _set("attention.layer_types", ["sliding", "full", "sliding"])),
    ],
    "gemma3": [
        ("norm.weight_offset", _set("norm.weight_offset", DROP)),
        ("mlp.activation=silu", _set("mlp.activation", "silu")),
        ("embedding.scale", _set("embedding.scale", DROP)),
        ("attention.scale=head_dim", _set("attention.scale", 0.25)),
        ("attention.softcap=2 (config)", _set("attention.softcap", 2.0)),
        ("logits.softcap", _set("logits.softcap", DROP)),
        ("block.post_norm", _set("block.post_norm", DROP, _drop("attn_post_norm.weight"),
                                 _drop("ffn_post_norm.weight"))),
        ("attention.qk_norm", _set("attention.qk_norm", False, _drop("attn_q_norm.weight"),
                                   _drop("attn_k_norm.weight"))),
        ("rope.sliding", _set("rope.sliding", DROP, _drop("rope_freqs_sliding"))),
        ("rope.scaling", _set("rope.scaling", None)),
        ("sliding_window=none", _set("rope.sliding", DROP, _drop("rope_freqs_sliding"), ALL_FULL(4))),
        ("layer_types=pattern 6", _set("attention.layer_types", ["sliding"] * 4)),
    ],
}
LIE_CASES = [(fam, what, edit) for fam, lies in LIES.items() for what, edit in lies]


@pytest.mark.parametrize("family,what,edit", LIE_CASES, ids=[f"{f}-{w}" for f, w, _ in LIE_CASES])
def test_lying_archive_fails(family, what, edit, archives, sources, work):
    case = f"{family}-f32"
    bad = _lie(archives[case], work / f"lie-{family}-{what.replace(' ', '_')}.thin", edit)
    with open_archive(bad) as a, open_archive(archives[case]) as good:
        assert a.model != good.model  # the lie is really there …
    assert runner.invoke(app, ["verify", str(bad)]).exit_code == 0  # … in a valid archive
    code, d = check(bad, "--against", sources[case])
    _record(f"LIE {family} {what}", "transformers", d)
    assert code == 1 and not d["ok"] and d["dtype_class"] == "exact"
    code, d = check(bad)
    _record(f"LIE {family} {what}", "probe", d)
    assert code == 1 and not d["ok"]


def test_erf_vs_tanh_gelu_is_below_the_exact_bound(archives, sources, work):
    """A limit of `check`, stated rather than hidden: Gemma 2 here runs the erf GELU; an archive that
    says "gelu_tanh" instead (what a reader applying Gemma 1's "gelu" rewrite would write) moves the
    logits by ~3e-4 relative, under the exact class's 1e-3 bound, so `check` passes it. The figures
    still show it far above the honest archive's float32 noise."""
    bad = _lie(archives["gemma2-f32"], work / "lie-gemma2-gelu_tanh.thin", _set("mlp.activation", "gelu_tanh"))
    _, honest = check(archives["gemma2-f32"], "--against", sources["gemma2-f32"])
    _, lie = check(bad, "--against", sources["gemma2-f32"])
    _record("LIE gemma2 mlp.activation=gelu_tanh", "transformers", lie)
    assert lie["max_abs_diff"] > 50 * honest["max_abs_diff"]


# ---------------------------------------------------------------- 6: config keys

def _variant(src: Path, work: Path, name: str, **edits) -> Path:
    folder = work / "variants" / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(src, folder)
    F.edit_config(folder, **edits)
    return folder


def _dry_run(folder: Path, *extra: str):
    return runner.invoke(app, ["convert", str(folder), str(folder) + ".thin", "--dry-run", *extra])


def test_unhandled_config_key_is_refused_then_allowed(sources, work):
    """A Gemma 2 key on a Gemma 1 model: transformers' GemmaForCausalLM never caps the logits, so
    the recipe cannot know what the author meant; refused, naming the key, until allowed."""
    src = _variant(sources["gemma-f32"], work, "g1-final-cap", final_logit_softcapping=30.0)
    r = _dry_run(src)
    assert r.exit_code != 0
    line = one_line_error(r)
    assert "'final_logit_softcapping' = 30.0" in line and "--allow-config-key final_logit_softcapping" in line
    out = _convert(src, work / "g1-final-cap.thin", "--allow-config-key", "final_logit_softcapping")
    with open_archive(out) as a:
        assert a.model == _expected("gemma-f32")
    code, d = check(out, "--against", src)
    assert code == 0 and d["ok"]


REFUSED = [  # (case, config edits, the key the one-line refusal names)
    ("gemma-f32", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2-f32", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3-f32", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma-f32", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("gemma3-f32", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("gemma3-f32", {"altup_num_inputs": 4}, "altup_num_inputs"),  # a Gemma 3n key
    # transformers 5 silently ignores a {"type": …} rope_scaling without "rope_type" here
    ("gemma3-legacy", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    # a flat rope_parameters is ignored by Gemma3TextConfig (its nested defaults win)
    ("gemma3-f32", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, "rope_parameters"),
    ("gemma3-f32", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_scaling"),  # both forms at once
]


@pytest.mark.parametrize("case,edits,key", REFUSED, ids=[f"{c}-{k}" for c, _, k in REFUSED])
def test_config_the_recipe_cannot_say_is_refused(case, edits, key, sources, work):
    r = _dry_run(_variant(sources[case], work, f"refused-{case}-{key}", **edits))
    assert r.exit_code != 0
    assert f"'{key}'" in one_line_error(r)


@pytest.mark.parametrize("case", list(CASES))
def test_recipe_check_is_ok(case, sources):
    recipe = CASES[case][0]
    r = runner.invoke(app, ["recipe", "check", recipe, str(sources[case])])
    assert r.exit_code == 0 and "OK" in r.stdout, r.output


# ---------------------------------------------------------------- the config readings, without weights

def _read(recipe: str, config: dict, dtype: str = "f32") -> dict:
    from thinconv.modelmeta import read_model_metadata
    from thinconv.recipe import load_registry

    r = load_registry().get(recipe)
    return read_model_metadata(config, None, architecture=r.name, rules=r.metadata, family=r.family,
                               weights_dtype=dtype)


def _hub_config(arch: str, model_type: str, **extra) -> dict:
    return {"architectures": [arch], "model_type": model_type, "hidden_size": 80, "intermediate_size": 96,
            "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 384, "max_position_embeddings": 128, **extra}


def test_embedding_scale_is_rounded_to_the_checkpoint_dtype():
    """√80 = 8.944272…: a bf16 Gemma runs with 8.9375, an f32 one with float32(√80)."""
    config = _hub_config("GemmaForCausalLM", "gemma")
    assert _read("gemma", config, "bf16")["embedding"]["scale"] == 8.9375
    assert _read("gemma", config, "f32")["embedding"]["scale"] == 8.9442720413208
    assert _read("gemma3", _hub_config("Gemma3ForCausalLM", "gemma3_text"), "bf16")["embedding"]["scale"] == 8.9375


def test_gemma3_defaults_follow_transformers():
    """No layer_types, no RoPE keys: every 6th layer full, thetas 1e6 (global) and 1e4 (local)."""
    model = _read("gemma3", _hub_config("Gemma3ForCausalLM", "gemma3_text"))
    assert model["attention"]["layer_types"] == ["sliding"] * 5 + ["full", "sliding"]
    assert model["attention"]["sliding_window"] == 4096 and "softcap" not in model["attention"]
    assert model["rope"]["theta"] == 1000000.0 and model["rope"]["scaling"] is None
    assert model["rope"]["sliding"] == {"theta": 10000.0, "scaling": None, "attention_factor": 1.0}
    assert model["attention"]["scale"] == 1 / 16 and "logits" not in model  # query_pre_attn_scalar 256


# Gemma 3 RoPE spellings, each compared with what Gemma3TextConfig itself makes of it.
ROPE_FORMS = [
    {},
    {"rope_theta": 20000.0, "rope_local_base_freq": 300.0},
    {"rope_theta": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0}}, "rope_theta": 3000.0,
     "rope_local_base_freq": 90.0},
    {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 3.0, "rope_theta": 70.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 9000.0}}},
    {"rope_scaling": {"rope_type": "linear", "factor": 8.0, "rope_theta": 123.0}, "rope_theta": 5.0},
]


@pytest.mark.parametrize("form", ROPE_FORMS, ids=[",".join(f) or "none" for f in ROPE_FORMS])
def test_gemma3_rope_forms_match_transformers(form):
    from transformers import Gemma3TextConfig

    config = _hub_config("Gemma3ForCausalLM", "gemma3_text", sliding_window_pattern=3, **copy.deepcopy(form))
    model = _read("gemma3", config)
    hf = Gemma3TextConfig(**{k: v for k, v in copy.deepcopy(config).items() if k not in ("architectures", "model_type")})
    assert model["attention"]["layer_types"] == [t.split("_")[0] for t in hf.layer_types]

    def as_thin(p: dict) -> tuple:
        kind = p["rope_type"]
        return float(p["rope_theta"]), None if kind == "default" else {"type": kind, "factor": float(p["factor"])}

    rope, sliding = model["rope"], model["rope"]["sliding"]
    assert (rope["theta"], rope["scaling"]) == as_thin(hf.rope_parameters["full_attention"])
    assert (sliding["theta"], sliding["scaling"]) == as_thin(hf.rope_parameters["sliding_attention"])


def test_gemma3_without_sliding_layers_has_one_rope():
    model = _read("gemma3", _hub_config("Gemma3ForCausalLM", "gemma3_text", layer_types=["full_attention"] * 7,
                                        rope_local_base_freq=10000.0, sliding_window=512))
    assert model["attention"]["layer_types"] == ["full"] * 7 and model["attention"]["sliding_window"] is None
    assert "sliding" not in model["rope"] and model["rope"]["theta"] == 1000000.0


def test_nested_rope_parameters_account_only_for_the_keys_read():
    """Engine fix (modelmeta._rope_per_layer_type): reading the nested RoPE form once copied the whole
    config ({**config, …}), which marked every config.json key as read, so with Gemma 3's nested
    rope_parameters no unknown key was ever refused."""
    from thinconv.errors import ConversionError

    config = _hub_config("Gemma3ForCausalLM", "gemma3_text", rope_parameters=copy.deepcopy(G3_ROPE),
                         layer_types=G3_TYPES + ["sliding_attention"] * 3, altup_num_inputs=4)
    with pytest.raises(ConversionError, match="'altup_num_inputs' = 4: not understood by recipe gemma3"):
        _read("gemma3", config)
    config.pop("altup_num_inputs")
    assert _read("gemma3", config)["rope"]["sliding"]["theta"] == 500.0


# The keys of Hub configs as published (google/gemma-2b, gemma-2-2b, gemma-3-1b-it; transformers 4.x
# spellings), dimensions shrunk: every key is accounted for, and the legacy values read as transformers 5 reads them.
HUB = {
    "gemma": {"architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
              "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh",
              "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 16384,
              "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 8, "num_hidden_layers": 3,
              "num_key_value_heads": 1, "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None,
              "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0",
              "use_cache": True, "vocab_size": 256000},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
               "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
               "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
               "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
               "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 4,
               "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
               "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
               "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
               "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
               "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
               "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
               "num_attention_heads": 4, "num_hidden_layers": 8, "num_key_value_heads": 1, "pad_token_id": 0,
               "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
               "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
               "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True,
               "vocab_size": 262144},
}


def test_hub_configs():
    g1 = _read("gemma", HUB["gemma"], "bf16")
    assert g1["mlp"]["activation"] == "gelu_tanh" and g1["embedding"]["scale"] == 45.25  # √2048 = 45.2548 in bf16
    assert g1["tie_word_embeddings"] is True and g1["attention"]["scale"] == 1 / 16 and g1["rope"]["theta"] == 10000.0
    g2 = _read("gemma2", HUB["gemma2"], "f32")
    assert g2["attention"]["layer_types"] == ["sliding", "full", "sliding", "full"]
    assert (g2["attention"]["softcap"], g2["logits"]["softcap"], g2["embedding"]["scale"]) == (50.0, 30.0, 48.0)
    assert g2["special_tokens"]["eos"] == [1, 107]
    g3 = _read("gemma3", HUB["gemma3"], "bf16")
    assert g3["attention"]["layer_types"] == ["sliding"] * 5 + ["full"] + ["sliding"] * 2
    assert g3["attention"]["sliding_window"] == 512 and "softcap" not in g3["attention"] and "logits" not in g3
    assert g3["rope"]["theta"] == 1000000.0 and g3["rope"]["scaling"] is None
    assert g3["rope"]["sliding"] == {"theta": 10000.0, "scaling": None, "attention_factor": 1.0}
    assert g3["embedding"]["scale"] == 34.0  # √1152 = 33.941 in bf16
    assert g3["attention"]["qk_norm"] is True and g3["norm"]["weight_offset"] == 1
