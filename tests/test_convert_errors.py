"""Bad input: each case gives one clear `error:` line naming the file / tensor / field, a non-zero
exit, no traceback — and loses nothing: no output, no temp file, a pre-existing output untouched."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import resource
import shutil
import signal
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import Ckpt, Thin, assert_one_line_error, leftovers, load_safetensors_file, run_cli, \
    write_safetensors
from thinconv.cli import app

runner = CliRunner()
PRECIOUS = b"an archive the user wants to keep"


def _edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))


def _edit_weights(src: Path, fn) -> None:
    tensors = load_safetensors_file(src / "model.safetensors")
    fn(tensors)
    write_safetensors(src / "model.safetensors", tensors)


def _rewrite_header(path: Path, fn) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


# Each case breaks a copy of a checkpoint and names what the one error line must mention.

def case_missing_config(src: Path, marker: Path):
    (src / "config.json").unlink()
    return ["config.json", "missing"]


def case_invalid_config(src: Path, marker: Path):
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,,}')
    return ["config.json", "not valid JSON", "line 1"]


def case_config_field_wrong_type(src: Path, marker: Path):
    _edit_config(src, hidden_size="32")
    return ["config.json", "hidden_size", "positive integer"]


def case_unknown_architecture(src: Path, marker: Path):
    _edit_config(src, architectures=["FancyNetForCausalLM"])
    return ["config.json", "FancyNetForCausalLM", "`thinconv recipes` lists the", "supported",
            "--recipes DIR", "THINCONV_RECIPES"]


class _Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def case_pickle_only(src: Path, marker: Path):
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _Evil(marker)}))
    return ["pytorch_model.bin", "only pickle weights", "never unpickles", "safetensors"]


def case_truncated_safetensors(src: Path, marker: Path):
    p = src / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    return ["model.safetensors", "run past the end of the data section", "truncated"]


def case_header_length_past_end(src: Path, marker: Path):
    p = src / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    return ["model.safetensors", f"header length {len(data) * 2}", "past the end of the file"]


def case_overlapping_offsets(src: Path, marker: Path):
    def overlap(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        b, e = h[names[1]]["data_offsets"]
        h[names[1]]["data_offsets"] = [b - 4, e - 4]

    _rewrite_header(src / "model.safetensors", overlap)
    return ["model.safetensors", "overlap"]


def case_index_names_missing_shard(src: Path, marker: Path):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (src / gone).unlink()
    return ["model.safetensors.index.json", gone, "missing"]


def case_tensor_in_two_shards(src: Path, marker: Path):
    shards = sorted(src.glob("*.safetensors"))
    first, second = load_safetensors_file(shards[0]), load_safetensors_file(shards[1])
    dup = next(iter(first))
    second[dup] = first[dup]
    write_safetensors(shards[1], second)
    return [dup, shards[0].name, shards[1].name, "both"]


def case_unmapped_tensor(src: Path, marker: Path):
    _edit_weights(src, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", np.ones((4, 4), np.float32)))
    return ["model.layers.0.mlp.extra_proj.weight", "not mapped by the recipe"]


def case_missing_tensor(src: Path, marker: Path):
    _edit_weights(src, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    return ["missing", "blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"]


def case_shape_contradicts_config(src: Path, marker: Path):
    _edit_config(src, num_key_value_heads=2)  # the weights have 4 KV heads × 8
    return ["model.layers.0.self_attn.k_proj.weight", "[32, 32]", "[16, 32]", "num_key_value_heads 2"]


def case_tied_but_head_differs(src: Path, marker: Path):
    _edit_config(src, tie_word_embeddings=True)  # lm_head.weight stays, and differs from the embeddings
    return ["tie_word_embeddings", "lm_head.weight", "model.embed_tokens.weight", "differs"]


def case_layer_beyond_config(src: Path, marker: Path):
    _edit_config(src, num_hidden_layers=1)
    return ["model.layers.1.", "num_hidden_layers = 1"]


def case_integer_weights(src: Path, marker: Path):
    _edit_weights(src, lambda t: t.__setitem__("model.norm.weight", np.ones(32, np.int64)))
    return ["model.norm.weight", "I64", "float dtype"]


def case_f16_overflow(src: Path, marker: Path):
    def big(t):
        w = t["model.layers.0.mlp.up_proj.weight"].copy()
        w[3, 5] = 1e6
        t["model.layers.0.mlp.up_proj.weight"] = w

    _edit_weights(src, big)
    return ["blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", "f16 range", "1e+06"], ["--dtype", "f16"]


def case_f64_beyond_f32(src: Path, marker: Path):
    def wide(t):
        for k in t:
            t[k] = t[k].astype(np.float64)
        t["model.layers.1.mlp.down_proj.weight"][2, 3] = -1e300

    _edit_weights(src, wide)
    return ["blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight", "f32 range", "1e+300"]


def case_nan_strict(src: Path, marker: Path):
    def nan(t):
        w = t["model.layers.1.self_attn.v_proj.weight"].copy()
        w[0, 0], w[1, 1], w[2, 2] = np.nan, np.inf, -np.inf
        t["model.layers.1.self_attn.v_proj.weight"] = w

    _edit_weights(src, nan)
    return ["blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight", "1 NaN", "2 Inf", "--strict"], ["--strict"]


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}
SHARDED = {"index_names_missing_shard", "tensor_in_two_shards"}


def _case(name: str, src: Path, marker: Path) -> tuple[list[str], list[str]]:
    got = CASES[name](src, marker)
    return got if isinstance(got[1], list) else (got, [])


@pytest.fixture
def broken(request, ckpts, tmp_path):
    """(source folder, output folder, marker, needles, extra args) for one case."""
    name = request.param
    base = ckpts["sharded" if name in SHARDED else "llama2"]
    src = tmp_path / "src"
    shutil.copytree(base.path, src)
    marker = tmp_path / "unpickled"
    needles, extra = _case(name, src, marker)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    return src, out_dir, marker, needles, extra


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a numpy warning would be a second stderr line
@pytest.mark.parametrize("broken", sorted(CASES), indirect=True)
def test_bad_input(broken):
    src, out_dir, marker, needles, extra = broken
    out = out_dir / "model.thin"
    # (the probe's own handling of an f64 overflow is checked in test_f64_overflow_with_probe)
    for probe in ("--no-probe",) if "f32 range" in needles else ("--probe", "--no-probe"):
        # no output: none is written, no temp file is left
        r = runner.invoke(app, ["convert", str(src), str(out), probe, *extra])
        assert r.exit_code == 1, (r.output, r.exception)
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
        assert_one_line_error(r.stderr, *needles)
        assert leftovers(out_dir) == []
    # a pre-existing output is untouched, even with --force
    out.write_bytes(PRECIOUS)
    r = runner.invoke(app, ["convert", str(src), str(out), "--force", "--no-probe", *extra])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, *needles)
    assert out.read_bytes() == PRECIOUS and leftovers(out_dir) == ["model.thin"]
    assert not marker.exists()  # the pickle was never loaded


@pytest.mark.slow
@pytest.mark.parametrize("name", ["invalid_config", "f16_overflow"])
def test_bad_input_in_a_subprocess_is_one_line(name, llama_copy: Ckpt, tmp_path):
    """The real console script: exit 1, one line on stderr (no numpy warning either), no traceback."""
    needles, extra = _case(name, llama_copy.path, tmp_path / "marker")
    r = run_cli("convert", llama_copy.path, tmp_path / "o.thin", "--no-probe", *extra)
    assert r.returncode == 1
    assert_one_line_error(r.stderr, *needles)
    assert leftovers(tmp_path) == ["src"]


# ---------------------------------------------------------------- what is accepted

def _set_head_to_embeddings(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()


def test_tied_with_identical_head_is_accepted(llama_copy: Ckpt, tmp_path):
    _edit_config(llama_copy.path, tie_word_embeddings=True)
    _edit_weights(llama_copy.path, _set_head_to_embeddings)
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(tmp_path / "t.thin"), "--no-probe"])
    assert r.exit_code == 0, r.output
    thin = Thin.read(tmp_path / "t.thin")
    names = [t["name"] for t in thin.manifest["tensors"]]
    assert "output.weight" not in names and thin.manifest["model"]["tie_word_embeddings"] is True
    assert thin.raw("token_embd.weight") == llama_copy.tensors["model.embed_tokens.weight"].tobytes()
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(tmp_path / "t2.thin"), "--dry-run", "--json"])
    assert "lm_head.weight" in json.loads(r.stdout)["ignored"]


def _poison(t):
    w = t["model.layers.1.self_attn.v_proj.weight"].copy()
    w[0, 0], w[1, 1], w[2, 2] = np.nan, np.inf, -np.inf
    t["model.layers.1.self_attn.v_proj.weight"] = w


@pytest.mark.parametrize("probe", ["--no-probe", "--probe"])
def test_nan_inf_are_counted_and_warned(llama_copy: Ckpt, tmp_path, probe):
    _edit_weights(llama_copy.path, _poison)
    out = tmp_path / "n.thin"
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(out), probe])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "warning: tensor blk.1.attn_v.weight (model.layers.1.self_attn.v_proj.weight) holds 1 NaN and 2 Inf" \
        in r.stderr
    thin = Thin.read(out)
    st = thin.manifest["validation"]["stats"]["blk.1.attn_v.weight"]
    src = llama_copy.tensors["model.layers.1.self_attn.v_proj.weight"].astype(np.float64).copy()
    src[0, 0] = src[1, 1] = src[2, 2] = 0  # poisoned cells, left out below
    finite = np.delete(src.reshape(-1), [0, 33, 66])
    assert st["nan"] == 1 and st["inf"] == 2
    assert st["min"] == finite.min() and st["max"] == finite.max()
    # float32 sums per chunk, merged in float64: good to ~1e-6 of the values' scale
    assert st["mean"] == pytest.approx(finite.mean(), abs=1e-6 * np.abs(finite).mean())
    assert st["std"] == pytest.approx(finite.std(), rel=1e-6)
    assert np.isnan(thin.array("blk.1.attn_v.weight")[0, 0])  # stored as is
    assert "probe" not in thin.manifest["validation"]  # the source's logits are not finite
    if probe == "--probe":
        assert "probe skipped" in r.stderr
    assert thin.manifest["validation"]["stats"]["blk.0.attn_v.weight"]["nan"] == 0
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


@pytest.mark.slow
def test_f64_overflow_with_probe(llama_copy: Ckpt, tmp_path):
    needles, extra = _case("f64_beyond_f32", llama_copy.path, tmp_path / "marker")
    r = run_cli("convert", llama_copy.path, tmp_path / "o.thin", *extra)
    assert r.returncode == 1
    assert_one_line_error(r.stderr, *needles)


def test_f64_source_converts_to_f32(llama_copy: Ckpt, tmp_path):
    def wide(t):
        for k in t:
            t[k] = t[k].astype(np.float64) / 3  # not representable in f32: rounding happens
    _edit_weights(llama_copy.path, wide)
    out = tmp_path / "w.thin"
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(out), "--no-probe"])
    assert r.exit_code == 0, r.output
    thin = Thin.read(out)
    w = llama_copy.tensors["model.layers.0.mlp.up_proj.weight"].astype(np.float64) / 3
    assert thin.tensor_entry("blk.0.ffn_up.weight")["dtype"] == "f32"
    assert np.array_equal(thin.array("blk.0.ffn_up.weight"), w.astype(np.float32))


def test_f16_in_range_converts(ckpts, tmp_path):
    c = ckpts["llama2"]
    out = tmp_path / "h.thin"
    r = runner.invoke(app, ["convert", str(c.path), str(out), "--dtype", "f16", "--no-probe"])
    assert r.exit_code == 0, r.output
    thin = Thin.read(out)
    w = c.tensors["model.layers.0.mlp.up_proj.weight"]
    assert thin.tensor_entry("blk.0.ffn_up.weight")["dtype"] == "f16"
    assert np.array_equal(thin.array("blk.0.ffn_up.weight"), w.astype(np.float16))


def test_bf16_source_beyond_f16_range_is_refused(ckpts, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ckpts["sharded"].path, src)
    shard = sorted(src.glob("*.safetensors"))[0]
    t = load_safetensors_file(shard)
    name = next(k for k, v in t.items() if v.ndim == 2)
    w = t[name].copy()
    w[0, 0] = ml_dtypes.bfloat16(-3e38)
    t[name] = w
    write_safetensors(shard, t)
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o.thin"), "--dtype", "f16", "--no-probe"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, name, "f16 range")
    assert not (tmp_path / "o.thin").exists()


# ---------------------------------------------------------------- the output side

def test_existing_output_needs_force(ckpts, tmp_path):
    out = tmp_path / "o.thin"
    out.write_bytes(PRECIOUS)
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, str(out), "already exists", "--force")
    assert out.read_bytes() == PRECIOUS and leftovers(tmp_path) == ["o.thin"]
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe", "--force"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"THINv0\0\0" and leftovers(tmp_path) == ["o.thin"]


def test_output_is_a_directory(ckpts, tmp_path):
    out = tmp_path / "o.thin"
    out.mkdir()
    (out / "inside").write_bytes(PRECIOUS)
    for force in ([], ["--force"]):
        r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe", *force])
        assert r.exit_code == 1
        assert_one_line_error(r.stderr, str(out))
        assert leftovers(tmp_path) == ["o.thin"] and (out / "inside").read_bytes() == PRECIOUS


def test_output_folder_missing(ckpts, tmp_path):
    out = tmp_path / "no" / "such" / "o.thin"
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, str(out.parent), "does not exist")
    assert leftovers(tmp_path) == []


def _drop_dac_override() -> None:
    """In the child, before exec: remove CAP_DAC_OVERRIDE from the bounding set, so root (as the tests
    run here) obeys permission bits like anyone else (prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE))."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE) failed")


@pytest.mark.slow
def test_output_folder_not_writable(ckpts, tmp_path):
    """chmod 0o500 on the output folder. Root bypasses permission bits through CAP_DAC_OVERRIDE, so the
    CLI runs in a subprocess whose bounding set lacks that capability (see _drop_dac_override)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    os.chmod(out_dir, 0o500)
    try:
        r = run_cli("convert", ckpts["llama2"].path, out_dir / "o.thin", "--no-probe", preexec_fn=_drop_dac_override)
        assert r.returncode == 1, r.stderr
        assert_one_line_error(r.stderr, str(out_dir), "not writable")
        assert leftovers(out_dir) == []
    finally:
        os.chmod(out_dir, 0o700)


@pytest.mark.slow
def test_disk_full_mid_write(ckpts, tmp_path):
    """RLIMIT_FSIZE below the archive size: the write fails part-way; no partial or temp file remains."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ref = tmp_path / "ref.thin"
    assert runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(ref), "--no-probe"]).exit_code == 0
    limit = ref.stat().st_size // 2

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = run_cli("convert", ckpts["llama2"].path, out_dir / "o.thin", "--no-probe", preexec_fn=small_disk,
                env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.returncode != -signal.SIGXFSZ
    assert_one_line_error(r.stderr, str(out_dir / "o.thin"), "disk full", "no partial file")
    assert leftovers(out_dir) == []
