"""open_checkpoint: local folders (single file, sharded, broken), pickle refusal, hub cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hubcache import populate_hub_cache, use_hub_cache
from thinconv.checkpoint import HUB_ALLOW_PATTERNS, open_checkpoint
from thinconv.errors import CheckpointError

INDEX = "model.safetensors.index.json"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ASSETS = {
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": b'{"model_max_length": 64}',
    "tokenizer.model": b"\x0a\x05fake sentencepiece",
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "special_tokens_map.json": b"{}",  # neither read nor copied by thinconv
}


def _one_line(error: pytest.ExceptionInfo[CheckpointError]) -> str:
    text = str(error.value)
    assert "\n" not in text and text
    return text


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny Llama saved twice: one model.safetensors, and 20 KB shards with an index."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    llama = LlamaForCausalLM(cfg)
    base = tmp_path_factory.mktemp("ckpt")
    single, sharded = base / "single", base / "sharded"
    llama.save_pretrained(single)
    llama.save_pretrained(sharded, max_shard_size="20KB")
    for folder in (single, sharded):
        for name, data in ASSETS.items():
            (folder / name).write_bytes(data)
    state = {k: v.detach().numpy() for k, v in llama.state_dict().items()}
    return SimpleNamespace(single=single, sharded=sharded, state=state)


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _expect(src: str | Path, pattern: str, **kwargs: object) -> str:
    with pytest.raises(CheckpointError, match=pattern) as info:
        open_checkpoint(src, **kwargs)
    return _one_line(info)


# ------------------------------------------------------------------------------ local folders

def test_single_file_checkpoint(model: SimpleNamespace) -> None:
    with open_checkpoint(model.single) as ckpt:
        assert ckpt.root == model.single and ckpt.repo_id is ckpt.revision is ckpt.commit is None
        assert ckpt.config == json.loads((model.single / "config.json").read_text())
        assert ckpt.config["model_type"] == "llama"
        assert ckpt.generation_config is not None
        assert set(ckpt.tensors) == set(model.state)
        for name, expected in model.state.items():
            np.testing.assert_array_equal(ckpt.array(name), expected)
        assert [f.name for f in ckpt.files] == [
            "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
        assert [f.name for f in ckpt.asset_files()] == [
            "config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
            "tokenizer_config.json", "chat_template.jinja"]
        prov = ckpt.provenance()
        assert prov["repo_id"] is prov["revision"] is prov["commit"] is None
        for entry in prov["files"]:
            assert entry["sha256"] is None  # plain files: never hashed
            assert entry["size"] == (model.single / entry["name"]).stat().st_size
        with pytest.raises(CheckpointError, match="no tensor 'ghost'"):
            ckpt.array("ghost")
    with pytest.raises(CheckpointError, match="closed"):  # close() closed the shard
        ckpt.array("lm_head.weight")


def test_sharded_checkpoint(model: SimpleNamespace) -> None:
    index = json.loads((model.sharded / INDEX).read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 3
    with open_checkpoint(model.sharded) as ckpt:
        assert set(ckpt.tensors) == set(model.state)
        for name, entry in ckpt.tensors.items():
            assert entry.path.name == index[name]
            np.testing.assert_array_equal(ckpt.array(name), model.state[name])
        names = [f.name for f in ckpt.files]
        assert names == sorted(names) and INDEX in names and set(shards) <= set(names)
        assert "special_tokens_map.json" not in names


def test_no_index_reads_every_root_safetensors(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(model.single / "config.json", folder)
    state = load_file(model.single / "model.safetensors")
    names = sorted(state)
    save_file({k: state[k] for k in names[:5]}, folder / "b.safetensors")
    save_file({k: state[k] for k in names[5:]}, folder / "a.safetensors")
    with open_checkpoint(folder) as ckpt:
        assert set(ckpt.tensors) == set(names)
        assert [f.name for f in ckpt.files] == ["a.safetensors", "b.safetensors", "config.json"]
        assert ckpt.generation_config is None
    save_file({names[0]: state[names[0]]}, folder / "c.safetensors")
    _expect(folder, rf"tensor '{names[0]}' is in both b\.safetensors and c\.safetensors")


def test_model_safetensors_wins_without_index(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.single, tmp_path / "ckpt")
    save_file({"other.weight": torch.zeros(2)}, folder / "consolidated.safetensors")
    with open_checkpoint(folder) as ckpt:
        assert "other.weight" not in ckpt.tensors
        assert "consolidated.safetensors" not in [f.name for f in ckpt.files]


def _edit_index(folder: Path, edit) -> None:  # noqa: ANN001 - a callable on the weight_map
    index = json.loads((folder / INDEX).read_text())
    edit(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


def test_index_names_missing_shard(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.sharded, tmp_path / "ckpt")
    (folder / "model-00003-of-00007.safetensors").unlink()
    _expect(folder, r"model\.safetensors\.index\.json names shard model-00003-of-00007\.safetensors,"
                    r" which is missing")


def test_tensor_in_two_shards(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.sharded, tmp_path / "ckpt")
    one, two = folder / "model-00001-of-00007.safetensors", folder / "model-00002-of-00007.safetensors"
    extra = load_file(two)
    extra.update(load_file(one))
    save_file(extra, two)
    name = next(iter(load_file(one)))
    _expect(folder, rf"tensor '{name}' is in both {one.name} and {two.name}")


def test_tensor_not_where_index_says(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.sharded, tmp_path / "ckpt")
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    # Move a tensor whose shard keeps other tensors, so every shard is still named.
    name, actual = next((t, s) for t, s in weight_map.items()
                        if list(weight_map.values()).count(s) > 1)
    claimed = next(s for s in sorted(set(weight_map.values())) if s != actual)
    _edit_index(folder, lambda wm: wm.update({name: claimed}))
    _expect(folder, rf"tensor '{name}': model\.safetensors\.index\.json says shard {claimed},"
                    rf" found in {actual}")


def test_index_tensor_missing_everywhere(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.sharded, tmp_path / "ckpt")
    _edit_index(folder, lambda wm: wm.update({"ghost": "model-00001-of-00007.safetensors"}))
    _expect(folder, r"tensor 'ghost': .* says shard model-00001-of-00007\.safetensors,"
                    r" not found in model-00001-of-00007\.safetensors")


def test_shard_tensor_absent_from_index(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.sharded, tmp_path / "ckpt")
    _edit_index(folder, lambda wm: wm.pop("model.norm.weight"))
    _expect(folder, r"shard model-\d+-of-00007\.safetensors holds tensor 'model\.norm\.weight',"
                    r" which model\.safetensors\.index\.json does not list")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/x.safetensors",
                                   "pytorch_model.bin"])
def test_index_shard_must_be_a_local_safetensors_name(tmp_path: Path, model: SimpleNamespace,
                                                      shard: str) -> None:
    folder = _copy(model.sharded, tmp_path / "ckpt")
    _edit_index(folder, lambda wm: wm.update({"lm_head.weight": shard}))
    _expect(folder, rf"names shard '{shard}', expected a \.safetensors file name")


def test_broken_shard_names_checkpoint_and_file(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.single, tmp_path / "ckpt")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-4])
    text = _expect(folder, r"run past the end of the data section")
    assert text.startswith(f"{folder}/model.safetensors: tensor ")


def test_pickle_only_folder_is_refused(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(model.single / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"")  # never loaded: it is not even a valid pickle
    text = _expect(folder, r"only pickle weights \(pytorch_model\.bin\)")
    assert "never unpickles" in text and "arbitrary code" in text
    assert "safe_serialization=True" in text


def test_no_weights(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(model.single / "config.json", folder)
    _expect(folder, r"no weights found")


@pytest.mark.parametrize(("content", "pattern"), [
    (None, r"config\.json is missing"),
    (b"{not json", r"config\.json: not valid JSON"),
    (b"[1, 2]", r"config\.json: is a JSON list, expected an object"),
    (b"\xff\xfe", r"config\.json: not valid UTF-8"),
])
def test_bad_config(tmp_path: Path, model: SimpleNamespace, content: bytes | None,
                    pattern: str) -> None:
    folder = _copy(model.single, tmp_path / "ckpt")
    if content is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_bytes(content)
    assert _expect(folder, pattern).startswith(str(folder))


def test_bad_generation_config(tmp_path: Path, model: SimpleNamespace) -> None:
    folder = _copy(model.single, tmp_path / "ckpt")
    (folder / "generation_config.json").write_text('"text"')
    _expect(folder, r"generation_config\.json: is a JSON str, expected an object")


def test_bad_sources(tmp_path: Path, model: SimpleNamespace) -> None:
    _expect(model.single / "config.json", r"is a file, expected a checkpoint folder")
    _expect(str(tmp_path / "absent"), r"absent: no such folder, and not a hub repo id")
    _expect("./not/a/repo/id", r"no such folder, and not a hub repo id")
    _expect(model.single, r"revision 'main' applies only to hub repo ids", revision="main")


# ------------------------------------------------------------------------------ hub cache

@pytest.fixture
def hub_repo(tmp_path: Path, model: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Path:
    """org/tiny at COMMIT in an offline cache; its source folder also has an unindexed file."""
    source = _copy(model.sharded, tmp_path / "source")
    save_file({"other.weight": torch.zeros(2)}, source / "consolidated.safetensors")
    hf_home = tmp_path / "hf_home"
    populate_hub_cache(hf_home, "org/tiny", source, commit=COMMIT)
    use_hub_cache(monkeypatch, hf_home)
    return source


def test_hub_repo_from_offline_cache(hub_repo: Path, model: SimpleNamespace,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[list[str]] = []
    real = huggingface_hub.snapshot_download

    def spy(*args: object, **kwargs: object) -> str:
        calls.append(list(kwargs["allow_patterns"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    with open_checkpoint("org/tiny") as ckpt:
        assert (ckpt.repo_id, ckpt.revision, ckpt.commit) == ("org/tiny", "main", COMMIT)
        assert ckpt.root.name == COMMIT and ckpt.root.parent.name == "snapshots"
        for name, expected in model.state.items():
            np.testing.assert_array_equal(ckpt.array(name), expected)
        prov = ckpt.provenance()
    assert (prov["repo_id"], prov["revision"], prov["commit"]) == ("org/tiny", "main", COMMIT)
    by_name = {f["name"]: f for f in prov["files"]}
    assert "consolidated.safetensors" not in by_name
    for name, entry in by_name.items():
        data = (hub_repo / name).read_bytes()
        assert entry["size"] == len(data)
        lfs = name.endswith((".safetensors", ".model"))  # blob named by sha256 in the cache
        assert entry["sha256"] == (hashlib.sha256(data).hexdigest() if lfs else None), name
    # Metadata first, then exactly the indexed shards (never the unindexed consolidated file).
    shards = sorted(n for n in by_name if n.endswith(".safetensors"))
    assert calls == [[p for p in HUB_ALLOW_PATTERNS if p != "*.safetensors"], shards]


def test_hub_revision_as_commit_hash(hub_repo: Path) -> None:
    with open_checkpoint("org/tiny", revision=COMMIT) as ckpt:
        assert ckpt.commit == COMMIT and ckpt.revision == COMMIT


def test_hub_repo_not_cached(hub_repo: Path) -> None:
    text = _expect("org/absent", r"^org/absent@main: not in the local cache")
    assert "HF_HUB_OFFLINE=1" in text


def test_mistyped_local_path_says_so(hub_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`examples/typo` looks like a repo id; when `examples/` is a local folder the message says both."""
    (tmp_path / "examples").mkdir()
    monkeypatch.chdir(tmp_path)
    text = _expect("examples/typo", r"^examples/typo: no such local folder \(in examples/\); read as a hub repo id: "
                                    r"examples/typo@main: not in the local cache")
    assert "HF_HUB_OFFLINE=1" in text


def test_hub_revision_not_cached(hub_repo: Path) -> None:
    _expect("org/tiny", r"^org/tiny@v2: not \(completely\) in the local cache .* and HF_HUB_OFFLINE=1",
            revision="v2")


def test_hub_incomplete_snapshot(hub_repo: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / "hf_home/hub/models--org--tiny/snapshots" / COMMIT
    (snapshot / "tokenizer.json").unlink()  # known missing from the cached tree listing
    _expect("org/tiny", r"^org/tiny@main: the cached snapshot is incomplete")


def test_hub_missing_shard_in_cache(hub_repo: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / "hf_home/hub/models--org--tiny/snapshots" / COMMIT
    (snapshot / "model-00002-of-00007.safetensors").unlink()
    _expect("org/tiny", rf"^org/tiny@{COMMIT}: not \(completely\) in the local cache .*"
                        r" and HF_HUB_OFFLINE=1$")


def _fake_response(status: int) -> SimpleNamespace:
    return SimpleNamespace(status_code=status, headers={}, request=None)


@pytest.mark.parametrize(("error", "pattern"), [
    ("GatedRepoError", r"^org/tiny: gated repository; accept its terms"),
    ("RepositoryNotFoundError", r"^org/tiny: repository not found on the Hub"),
    ("RevisionNotFoundError", r"^org/tiny: revision 'main' not found on the Hub"),
    ("HfHubHTTPError", r"^org/tiny: authentication failed \(401\)"),
])
def test_hub_errors_become_one_line(monkeypatch: pytest.MonkeyPatch, error: str,
                                    pattern: str) -> None:
    import huggingface_hub
    from huggingface_hub import errors

    def fail(*args: object, **kwargs: object) -> str:
        raise getattr(errors, error)("401 Client Error.\n\nDetails", response=_fake_response(401))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    _expect("org/tiny", pattern)


@pytest.mark.slow
def test_hub_env_is_honoured_in_a_fresh_process(hub_repo: Path, tmp_path: Path) -> None:
    """No patching: HF_HOME and HF_HUB_OFFLINE read by huggingface_hub at import time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    code = ("from thinconv.checkpoint import open_checkpoint\n"
            "with open_checkpoint('org/tiny') as c: print(c.commit, len(c.tensors))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == [COMMIT, "21"]
