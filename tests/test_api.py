"""The Python API (issue 15, item 1): `thinconv.open`, `thinconv.convert`, `thinconv.to_torch`, and the
README's "Python API" examples, run as written against examples/tiny-llama."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

import thinconv
from conftest import Thin
from thinconv.cli import app

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
runner = CliRunner()


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("api")
    out = {}
    for dtype in ("auto", "q8_0", "q4_1", "f16"):
        out[dtype] = base / f"tiny-{dtype}.thin"
        thinconv.convert(EXAMPLE, out[dtype], dtype=dtype, probe=False)
    return out


# ---------------------------------------------------------------- the top level

def test_exports_are_complete_and_documented():
    for name in thinconv.__all__:
        obj = getattr(thinconv, name)
        if callable(obj) and not isinstance(obj, type) and name != "__version__":
            assert (obj.__doc__ or "").strip(), name
    for name in ("open", "convert", "to_torch", "Archive", "TensorPage", "ConvertSummary", "ThinError"):
        assert name in thinconv.__all__


def test_convert_is_callable_however_the_module_was_imported():
    """`thinconv.convert` is also the conversion module: importing it (as the CLI and tests do) keeps it callable."""
    import thinconv.convert as module
    from thinconv.convert import convert_source  # noqa: F401

    assert module is thinconv.convert and callable(thinconv.convert) and hasattr(module, "convert_source")
    import inspect

    params = inspect.signature(thinconv.convert).parameters
    assert list(params)[:2] == ["source", "out"] and {"dtype", "keep", "force", "revision"} <= set(params)


def test_import_is_light():
    code = "import sys, thinconv; print(sorted(m for m in ('numpy', 'torch', 'huggingface_hub') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.stdout.strip() == "[]", r.stderr


# ---------------------------------------------------------------- thinconv.convert

def test_convert_returns_what_json_prints(tmp_path):
    summary = thinconv.convert(str(EXAMPLE), tmp_path / "a.thin", dtype="q4_0", keep={"ffn_down*": "q8_0"},
                               probe=False)
    r = runner.invoke(app, ["convert", str(EXAMPLE), str(tmp_path / "b.thin"), "--dtype", "q4_0", "--keep",
                            "ffn_down*=q8_0", "--no-probe", "--json"])
    assert r.exit_code == 0, r.output
    cli = json.loads(r.stdout)
    for d in (summary, cli):
        d.pop("seconds")
        d.pop("path")
    assert summary == cli
    data = (tmp_path / "a.thin").read_bytes()
    assert summary["size"] == len(data) and summary["archive_hash"] == data[56:88].hex()
    assert summary["dtypes"] == {"f32": 6, "q8_0": 3, "q4_0": 12}
    wider = {k["tensor"]: k for k in summary["kept_wider"]}
    assert wider["token_embd.weight"]["reason"] == "the output head is never stored below q8_0"
    assert {n for n, k in wider.items() if k["dtype"] == "f32"} == {
        "rope_freqs", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "blk.1.attn_norm.weight",
        "blk.1.ffn_norm.weight", "output_norm.weight"}
    assert not any(n.endswith("ffn_down.weight") for n in wider)  # asked q8_0 by keep: not wider than asked
    assert summary["quant"]["tensors"] == 15 and summary["quant"]["largest"][0]["tensor"] == summary["quant"]["worst"]


def test_convert_errors_are_thin_errors(tmp_path):
    out = tmp_path / "a.thin"
    out.write_bytes(b"keep")
    with pytest.raises(thinconv.PackError, match="already exists"):
        thinconv.convert(EXAMPLE, out)
    with pytest.raises(thinconv.UsageError, match="--dtype"):
        thinconv.convert(EXAMPLE, tmp_path / "b.thin", dtype="q5_k")
    with pytest.raises(thinconv.CheckpointError):
        thinconv.convert(tmp_path / "nope", tmp_path / "c.thin")
    assert out.read_bytes() == b"keep"


# ---------------------------------------------------------------- thinconv.open

def test_archive_accessors(archives):
    path = archives["q8_0"]
    ref = Thin.read(path)  # an independent reader (tests/conftest.py)
    with thinconv.open(path) as a:
        assert isinstance(a, thinconv.Archive)
        assert a.manifest == ref.manifest and a.model == ref.manifest["model"]
        assert a.tensor_names == [t["name"] for t in ref.manifest["tensors"]]
        assert a.asset_names == [x["name"] for x in ref.manifest["assets"]]
        assert json.loads(a.asset_bytes("config.json")) == json.loads((EXAMPLE / "config.json").read_text())
        raw = a.tensor("blk.0.attn_q.weight")
        assert raw.dtype == np.uint8 and not raw.flags.writeable and raw.tobytes() == ref.raw("blk.0.attn_q.weight")
        norm = a.tensor("blk.0.attn_norm.weight")
        assert norm.dtype == np.float32 and not norm.flags.writeable
        assert a.verify().ok and a.fileno() >= 0


def test_tensor_is_zero_copy(archives):
    with thinconv.open(archives["auto"]) as a:
        t = a.tensor("token_embd.weight")
        assert t.dtype == ml_dtypes.bfloat16
        first = a.tensor_pages("token_embd.weight")[0]
        # the array's memory is the file's mapping at the page's offset, not a copy
        base = np.frombuffer(a._mm, np.uint8)
        assert t.__array_interface__["data"][0] == base.__array_interface__["data"][0] + first.offset


def test_tensor_pages_give_offsets_for_pread(archives):
    path = archives["q4_1"]
    ref = Thin.read(path)
    with thinconv.open(path) as a:
        for name in a.tensor_names:
            pages = a.tensor_pages(name)
            assert [p.id for p in pages] == a.tensor_info(name)["pages"]
            rows = [p.rows for p in pages]
            assert rows[0][0] == 0 and all(x[1] == y[0] for x, y in zip(rows, rows[1:]))
            data = b"".join(os.pread(a.fileno(), p.size, p.offset) for p in pages)
            assert data == ref.raw(name)
            for p in pages:
                assert p.offset % 4096 == 0 and p.offset == ref.offsets[p.id]
                import blake3

                assert blake3.blake3(os.pread(a.fileno(), p.size, p.offset)).hexdigest() == p.checksum


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1", "f16", "auto"])
def test_dequantize_dtypes(archives, dtype):
    with thinconv.open(archives[dtype]) as a:
        for name in ("blk.0.attn_q.weight", "token_embd.weight", "blk.1.ffn_norm.weight"):
            f32 = a.dequantize(name)
            assert f32.dtype == np.float32 and f32.flags.writeable and list(f32.shape) == a.tensor_info(name)["shape"]
            for want, np_type in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16),
                                  ("bf16", ml_dtypes.bfloat16), (np.float32, np.float32)):
                got = a.dequantize(name, dtype=want)
                assert got.dtype == np_type and got.shape == f32.shape
                # each value is the float32 decode rounded to nearest even
                np.testing.assert_array_equal(got, f32.astype(np_type))
            part = a.dequantize(name, (1, 3), dtype="bfloat16")
            np.testing.assert_array_equal(part, f32.reshape(f32.shape[0], -1)[1:3].reshape(part.shape).astype(
                ml_dtypes.bfloat16))
        with pytest.raises(thinconv.ThinFormatError, match="float32, bfloat16, float16"):
            a.dequantize("token_embd.weight", dtype="int8")


def test_bf16_dequantize_of_bf16_is_the_stored_bits(archives):
    with thinconv.open(archives["auto"]) as a:
        stored = a.tensor("blk.0.ffn_up.weight")
        got = a.dequantize("blk.0.ffn_up.weight", dtype="bfloat16")
        assert got.tobytes() == stored.tobytes() and got.flags.writeable


# ---------------------------------------------------------------- torch

def test_to_torch_without_warnings(archives):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on read-only numpy arrays: there must be none
        with thinconv.open(archives["auto"]) as a:
            w = thinconv.to_torch(a, "blk.0.attn_q.weight")
            assert w.dtype == torch.bfloat16 and list(w.shape) == a.tensor_info("blk.0.attn_q.weight")["shape"]
            stored = a.tensor("blk.0.attn_q.weight")
            assert w.view(torch.int16).numpy().tobytes() == stored.tobytes()
            # the documented by-hand call
            by_hand = torch.from_numpy(a.tensor("blk.0.attn_q.weight", private=True).view(np.uint16)).view(torch.bfloat16)
            assert torch.equal(by_hand.float(), torch.from_numpy(a.dequantize("blk.0.attn_q.weight")))
            n = thinconv.to_torch(a, "blk.0.attn_norm.weight")
            assert n.dtype == torch.float32
            e = thinconv.to_torch(a, "token_embd.weight", dtype=torch.float32)
            assert e.dtype == torch.float32 and torch.equal(e, torch.from_numpy(a.dequantize("token_embd.weight")))
            w.mul_(2)  # writable: a private copy-on-write page; the file and the read-only views are untouched
            assert a.tensor("blk.0.attn_q.weight").tobytes() == stored.tobytes()
        with thinconv.open(archives["q8_0"]) as a:
            q = thinconv.to_torch(a, "blk.0.attn_q.weight")
            assert q.dtype == torch.float32
            qb = thinconv.to_torch(a, "blk.0.attn_q.weight", dtype=torch.bfloat16)
            assert qb.dtype == torch.bfloat16 and torch.equal(qb, q.to(torch.bfloat16))
        with thinconv.open(archives["f16"]) as a:
            assert thinconv.to_torch(a, "blk.0.attn_q.weight").dtype == torch.float16
    assert verify_unchanged(archives["auto"])


def verify_unchanged(path: Path) -> bool:
    with thinconv.open(path) as a:
        return a.verify().ok


def test_tensors_outlive_the_archive(archives):
    import torch

    a = thinconv.open(archives["auto"])
    w = thinconv.to_torch(a, "blk.0.attn_q.weight")
    view = a.tensor("blk.0.attn_k.weight")
    a.close()
    assert torch.isfinite(w.float()).all() and np.isfinite(view.astype(np.float32)).all()


# ---------------------------------------------------------------- the README's examples

def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    api = text[text.index("## Python API"):]
    api = api[: api.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", api, re.S)


def test_readme_has_api_examples():
    blocks = readme_python_blocks()
    assert len(blocks) >= 2
    code = "\n".join(blocks)
    for call in ("thinconv.convert(", "thinconv.open(", ".tensor(", ".dequantize(", "dtype=\"bfloat16\"",
                 ".tensor_pages(", ".asset_bytes(", ".verify()", "thinconv.to_torch("):
        assert call in code, call


@pytest.mark.slow
def test_readme_api_examples_run(tmp_path):
    """Each ```python block of the README's API section, in order, in a fresh interpreter, from a folder
    that has examples/ as the repo root has; any warning fails it."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for i, block in enumerate(readme_python_blocks()):
        script = tmp_path / f"block{i}.py"
        script.write_text("import warnings\nwarnings.simplefilter('error')\n" + block)
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=ENV,
                           timeout=300)
        assert r.returncode == 0, f"README block {i} failed:\n{block}\n{r.stderr}"
        assert "Warning" not in r.stderr, r.stderr
