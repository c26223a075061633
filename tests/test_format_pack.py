"""Round trips through pack / open / unpack, and every packer refusal leaving nothing behind."""

from __future__ import annotations

import copy
import mmap
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3
import ml_dtypes
import numpy as np
import pytest

from factory import make_archive_inputs, tiny_model
from thinconv.errors import PackError, ThinFormatError
from thinconv.format import BufferPage, FilePage, LazyPage, open_archive, pack, spec
from thinconv.format.staging import pack_staging, unpack

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

BIG = tiny_model(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=512, num_layers=2, attention={"qkv_bias": True, "o_bias": False, "qk_norm": True,
                                                          "sliding_window": 8, "layer_types": ["sliding", "full"],
                                                          "scale": 0.25},
                 rope={"theta": 1e6, "rotary_dim": 16, "layout": "half", "scaling": None, "attention_factor": 1.0})


def _root_mmap(arr: np.ndarray):
    obj = arr
    while isinstance(obj, (np.ndarray, memoryview)):
        obj = obj.base if isinstance(obj, np.ndarray) else obj.obj
    return obj


# -- round trips -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("model,page_size", [(tiny_model(), 64), (tiny_model(tie_word_embeddings=True), 4096),
                                             (BIG, 4096), (BIG, 10_000)])
def test_tensors_round_trip(tmp_path, dtype, model, page_size):
    manifest, sources, arrays = make_archive_inputs(model, dtype=dtype, page_size=page_size)
    pack(manifest, sources, tmp_path / "a.thin")
    with open_archive(tmp_path / "a.thin") as a:
        assert a.tensor_names == spec.tensor_names(model) == list(arrays)
        for name, want in arrays.items():
            got = a.tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name  # bit-exact, NaN-safe
            assert not got.flags.writeable
            deq = a.dequantize(name)
            assert deq.dtype == np.float32
            np.testing.assert_array_equal(deq, want.astype(np.float32))
        assert a.verify().ok


def test_multi_page_tensor_is_zero_copy(tmp_path):
    manifest, sources, arrays = make_archive_inputs(BIG, dtype="bf16", page_size=4096)
    pack(manifest, sources, tmp_path / "a.thin")
    with open_archive(tmp_path / "a.thin") as a:
        info = a.tensor_info("token_embd.weight")
        assert len(info["pages"]) == 16  # 512 rows × 128 bytes in 4096-byte pages
        recs = [a.page(p) for p in info["pages"]]
        assert all(b.offset == r.offset + r.size for r, b in zip(recs, recs[1:])), "pages must be back to back"
        t = a.tensor("token_embd.weight")
        assert t.dtype == ml_dtypes.bfloat16 and t.shape == (512, 64)
        root = _root_mmap(t)
        assert isinstance(root, mmap.mmap)
        whole = np.frombuffer(root, np.uint8)
        assert np.shares_memory(t, whole)
        assert t.__array_interface__["data"][0] == whole.__array_interface__["data"][0] + recs[0].offset
        assert t.tobytes() == arrays["token_embd.weight"].tobytes()
        # 1-D tensors are one page: also views
        assert np.shares_memory(a.tensor("output_norm.weight"), whole)


def test_split_pages_are_copied_correctly(tmp_path):
    manifest, sources, arrays = make_archive_inputs(tiny_model(), dtype="f32", page_size=64)
    pack(manifest, sources, tmp_path / "a.thin")
    with open_archive(tmp_path / "a.thin") as a:
        recs = [a.page(p) for p in a.tensor_info("token_embd.weight")["pages"]]
        assert len(recs) == 6 and recs[1].offset > recs[0].offset + recs[0].size  # padded apart
        t = a.tensor("token_embd.weight")
        assert not isinstance(_root_mmap(t), mmap.mmap) and not t.flags.writeable
        np.testing.assert_array_equal(t, arrays["token_embd.weight"])
        np.testing.assert_array_equal(a.dequantize("token_embd.weight", rows=(3, 9)), arrays["token_embd.weight"][3:9])
        assert a.dequantize("token_embd.weight", rows=(5, 5)).shape == (0, 8)
        for bad in ((0, 13), (-1, 2), (4, 3)):
            with pytest.raises(ThinFormatError, match=r"rows .* are outside \[0, 12\) of 'token_embd.weight'"):
                a.dequantize("token_embd.weight", rows=bad)


def test_page_and_asset_bytes(tmp_path):
    cfg = b'{"architectures": ["LlamaForCausalLM"], "pad": "' + b"x" * 9000 + b'"}'
    tok = bytes(range(256)) * 20
    manifest, sources, _ = make_archive_inputs(dtype="f16", page_size=4096,
                                               assets={"config.json": cfg, "tokenizer.json": tok,
                                                       "chat_template.jinja": b"{{ x }}"})
    pack(manifest, sources, tmp_path / "a.thin")
    with open_archive(tmp_path / "a.thin") as a:
        for pid, data in sources.items():
            view = a.page_bytes(pid)
            assert isinstance(view, memoryview) and view.readonly and bytes(view) == bytes(data)
        assert len(a.manifest["assets"][0]["pages"]) == 3
        assert a.asset_bytes("config.json") == cfg
        assert a.asset_bytes("tokenizer.json") == tok
        assert a.asset_bytes("chat_template.jinja") == b"{{ x }}"
        with pytest.raises(ThinFormatError, match="no asset named 'tokenizer.model'"):
            a.asset_bytes("tokenizer.model")
        with pytest.raises(ThinFormatError, match="no page with id 'nope#0'"):
            a.page_bytes("nope#0")
        with pytest.raises(ThinFormatError, match="no tensor named 'nope'"):
            a.tensor("nope")


def test_views_outlive_close(tmp_path):
    manifest, sources, arrays = make_archive_inputs(BIG, dtype="bf16", page_size=4096)
    pack(manifest, sources, tmp_path / "a.thin")
    a = open_archive(tmp_path / "a.thin")
    t = a.tensor("token_embd.weight")
    a.close()
    assert t.tobytes() == arrays["token_embd.weight"].tobytes()


def test_unpack_pack_same_bytes(tmp_path):
    manifest, sources, _ = make_archive_inputs(BIG, dtype="bf16", page_size=4096,
                                               assets={"config.json": b"{}", "tokenizer.json": b"[]" * 3000})
    manifest["runtime"] = {"page_size": 4096, "note": "héllo"}
    manifest["validation"] = {"converter": {"name": "thinconv", "version": "0", "recipe": "llama"}}
    first = tmp_path / "a.thin"
    pack(manifest, sources, first)
    with open_archive(first) as a:
        n = unpack(a, tmp_path / "staged")
    assert n == len(manifest["pages"])
    assert (tmp_path / "staged" / "pages" / "token_embd.weight#15").read_bytes() == sources["token_embd.weight#15"]
    pack_staging(tmp_path / "staged", tmp_path / "b.thin")
    assert (tmp_path / "b.thin").read_bytes() == first.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.thin", "b.thin", "staged"]


def test_unpack_refusals(tmp_path):
    manifest, sources, _ = make_archive_inputs()
    pack(manifest, sources, tmp_path / "a.thin")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    with open_archive(tmp_path / "a.thin") as a:
        with pytest.raises(PackError, match="is not empty"):
            unpack(a, tmp_path / "full")
        assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
        with pytest.raises(PackError, match="exists and is not a directory"):
            unpack(a, tmp_path / "file")
        unpack(a, tmp_path / "full", force=True)
        assert not (tmp_path / "full" / "keep.txt").exists()
        unpack(a, tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.thin", "empty", "file", "full"]


def test_pack_staging_refusals(tmp_path):
    manifest, sources, _ = make_archive_inputs()
    pack(manifest, sources, tmp_path / "a.thin")
    with open_archive(tmp_path / "a.thin") as a:
        unpack(a, tmp_path / "s")
    stray = tmp_path / "s" / "pages" / "stray#0"
    stray.write_bytes(b"x")
    with pytest.raises(PackError, match=r"stray#0: page file not declared in manifest.json"):
        pack_staging(tmp_path / "s", tmp_path / "o.thin")
    stray.unlink()
    missing = tmp_path / "s" / "pages" / "output.weight#0"
    data = missing.read_bytes()
    missing.unlink()
    with pytest.raises(PackError, match=r"page 'output.weight#0': no source given"):
        pack_staging(tmp_path / "s", tmp_path / "o.thin")
    missing.write_bytes(data)
    (tmp_path / "s" / "manifest.json").write_bytes(b'{"format": "thin", "format": "thin"}')
    with pytest.raises(PackError, match="duplicate key 'format'"):
        pack_staging(tmp_path / "s", tmp_path / "o.thin")
    with pytest.raises(PackError, match="not a directory"):
        pack_staging(tmp_path / "nope", tmp_path / "o.thin")
    assert not (tmp_path / "o.thin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.thin", "s"]


# -- packer refusals -----------------------------------------------------------------------------------

def _inputs():
    return make_archive_inputs(dtype="f32", page_size=64)


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _refused(tmp_path: Path, manifest, sources, match: str, exc=PackError):
    """The packer must refuse: with no prior output (none created), with a prior output and force
    (untouched), and without force (untouched); no temp file is ever left in the folder."""
    out = tmp_path / "out.thin"
    before = _listing(tmp_path)
    with pytest.raises(exc, match=match):
        pack(copy.deepcopy(manifest), sources, out)
    assert _listing(tmp_path) == before
    out.write_bytes(b"previous archive")
    before = _listing(tmp_path)
    for force in (True, False):
        # without force, "already exists" may come first
        with pytest.raises(exc if force else (exc, PackError), match=match if force else None):
            pack(copy.deepcopy(manifest), sources, out, force=force)
        assert _listing(tmp_path) == before
    out.unlink()


def test_missing_source(tmp_path):
    m, s, _ = _inputs()
    del s["blk.0.ffn_up.weight#3"]
    _refused(tmp_path, m, s, r"page 'blk.0.ffn_up.weight#3': no source given")


def test_wrong_size(tmp_path):
    m, s, _ = _inputs()
    s["token_embd.weight#2"] += b"\0"
    _refused(tmp_path, m, s, r"page 'token_embd.weight#2': source holds 65 bytes, manifest declares 64")


def test_wrong_checksum_detected_while_streaming(tmp_path):
    m, s, _ = _inputs()
    produced = []
    pid = "blk.0.ffn_down.weight#1"
    bad = bytes(len(s[pid]))
    for k in s:
        data = bad if k == pid else s[k]
        s[k] = LazyPage(len(data), lambda k=k, data=data: produced.append(k) or [data])
    want = blake3.blake3(bad).hexdigest()
    _refused(tmp_path, m, s, rf"page '{pid}': blake3 {want} does not match the declared checksum")
    assert produced.count(pid) == 2 and produced.index(pid) > 10  # pages before it were already streamed


def test_extra_source(tmp_path):
    m, s, _ = _inputs()
    s["zzz#0"] = b"x"
    s["aaa#0"] = b"y"
    _refused(tmp_path, m, s, r"page source 'aaa#0' is not declared in the manifest \(and 1 more\)")


def test_invalid_manifest_lists_all_errors(tmp_path):
    m, s, _ = _inputs()
    m["alignment"] = 512
    m["tensors"][1]["dtype"] = "f8"
    m["pages"][0]["size"] = 0
    _refused(tmp_path, m, s, r"manifest is invalid \(3 errors\): alignment: .*; tensors\[1\]\.dtype: .*; "
                             r"pages\[0\]\.size: ")


@pytest.mark.parametrize("chunks,match", [
    (lambda d: [d, b"!"], "produced more than the declared"),
    (lambda d: [d[:-1]], r"produced \d+ bytes, manifest declares"),
    (lambda d: [], r"produced 0 bytes"),
    (lambda d: [np.frombuffer(d, np.uint8)[::2]], "not contiguous bytes"),
])
def test_lazy_source_misbehaves(tmp_path, chunks, match):
    m, s, _ = _inputs()
    pid = "blk.0.attn_v.weight#0"
    s[pid] = LazyPage(len(s[pid]), lambda d=s[pid]: chunks(d))
    _refused(tmp_path, m, s, rf"page '{pid}': .*{match}")


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt(), MemoryError()])
def test_source_raises_mid_stream(tmp_path, exc):
    m, s, _ = _inputs()
    pid = "output.weight#3"
    data = s[pid]

    def produce():
        yield data[:10]
        raise exc

    s[pid] = LazyPage(len(data), produce)
    _refused(tmp_path, m, s, None, exc=type(exc))


def test_unreadable_file_source(tmp_path):
    m, s, _ = _inputs()
    s["output_norm.weight#0"] = FilePage(tmp_path / "gone.bin")
    _refused(tmp_path, m, s, r"page 'output_norm.weight#0': cannot read its source")


def test_bad_buffer_source(tmp_path):
    m, s, _ = _inputs()
    arr = np.frombuffer(s["output_norm.weight#0"] * 2, np.uint8)[::2]
    s["output_norm.weight#0"] = BufferPage(arr)
    _refused(tmp_path, m, s, r"page 'output_norm.weight#0': source is not a usable buffer")


@pytest.mark.parametrize("value,match", [(float("nan"), "Out of range float"), ("\ud800", "surrogates"),
                                         (object(), "not JSON serializable")])
def test_unencodable_manifest(tmp_path, value, match):
    """validate_manifest does not look inside runtime; the encoder is the last line of defence."""
    m, s, _ = _inputs()
    m["runtime"] = {"x": value}
    _refused(tmp_path, m, s, rf"manifest cannot be encoded as canonical JSON \(.*{match}")


def test_manifest_too_large(tmp_path, monkeypatch):
    m, s, _ = _inputs()
    n = len(spec.canonical_json(m))
    monkeypatch.setattr(spec, "MAX_MANIFEST_LEN", n - 1)
    _refused(tmp_path, m, s, rf"manifest is {n} bytes; THIN v0 allows at most {n - 1}")
    monkeypatch.setattr(spec, "MAX_MANIFEST_LEN", n)
    pack(m, s, tmp_path / "ok.thin")


def test_output_folder_problems(tmp_path):
    m, s, _ = _inputs()
    (tmp_path / "d.thin").mkdir()
    with pytest.raises(PackError, match="is a directory"):
        pack(m, s, tmp_path / "d.thin", force=True)
    with pytest.raises(PackError, match="already exists"):
        pack(m, s, tmp_path / "d.thin")
    with pytest.raises(PackError, match="output folder .*missing does not exist"):  # as convert says it
        pack(m, s, tmp_path / "missing" / "x.thin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.thin"]


def test_force_replaces_and_result(tmp_path):
    m, s, _ = _inputs()
    out = tmp_path / "out.thin"
    out.write_bytes(b"old")
    ticks = []
    result = pack(m, s, out, force=True, progress=ticks.append)
    data = out.read_bytes()
    assert data[:8] == b"THINv0\0\0" and result.size == len(data) and result.path == out
    assert result.page_count == len(m["pages"]) and result.archive_hash == data[56:88].hex()
    assert sum(ticks) == sum(p["size"] for p in m["pages"])
    assert oct(out.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.thin"]


DISK_FULL = textwrap.dedent("""
    import resource, signal, sys
    sys.path[:0] = [{tests!r}, {root!r}]
    from factory import make_archive_inputs
    from thinconv.errors import PackError
    from thinconv.format import pack
    m, s, _ = make_archive_inputs(page_size=1 << 20, assets={{"config.json": b"{{}}", "tokenizer.json": bytes(3 << 20)}})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        pack(m, s, sys.argv[1])
    except PackError as e:
        print(e)
        sys.exit(3)
""")


def test_disk_full(tmp_path):
    out = tmp_path / "out" / "big.thin"
    out.parent.mkdir()
    proc = subprocess.run([sys.executable, "-c", DISK_FULL.format(tests=str(TESTS), root=str(ROOT)), str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == f"writing {out} failed (disk full); no partial file was left"
    assert list(out.parent.iterdir()) == []
