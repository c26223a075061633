"""Converting `org/name` from a pre-populated, offline Hugging Face cache (tests/hubcache.py)."""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from conftest import Thin, assert_one_line_error, run_cli
from hubcache import populate_hub_cache, use_hub_cache
from thinconv.cli import app

REPO = "tiny-org/tiny-llama-sharded"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
runner = CliRunner()


@pytest.fixture(scope="module")
def hub(ckpts, tmp_path_factory):
    """HF_HOME holding the sharded fixture as REPO@COMMIT (refs/main → COMMIT)."""
    home = tmp_path_factory.mktemp("hf_home")
    populate_hub_cache(home, REPO, ckpts["sharded"].path, commit=COMMIT)
    return home


def _env(home) -> dict:
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": None, "HF_TOKEN": None,
            "HUGGINGFACE_HUB_CACHE": None}


@pytest.mark.slow
def test_convert_repo_id_offline(hub, ckpts, tmp_path):
    out = tmp_path / "hub.thin"
    r = run_cli("convert", REPO, out, "--no-probe", env=_env(hub))
    assert r.returncode == 0, r.stderr
    thin = Thin.read(out)
    src = thin.manifest["validation"]["source"]
    assert (src["repo_id"], src["revision"], src["commit"]) == (REPO, "main", COMMIT)
    folder = ckpts["sharded"].path
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2
    files = {f["name"]: f for f in src["files"]}
    assert sorted(files) == sorted(shards + ["config.json", "generation_config.json", "model.safetensors.index.json"])
    for name, f in files.items():
        data = (folder / name).read_bytes()
        assert f["size"] == len(data)
        # LFS files are stored under their sha256; git files (json) under a sha1: no sha256 to report
        assert f["sha256"] == (hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else None), name
    # the same archive as from the local folder, but for where it came from
    local = tmp_path / "local.thin"
    assert run_cli("convert", folder, local, "--no-probe").returncode == 0
    want = Thin.read(local)
    assert thin.pages == want.pages
    for key in ("model", "tensors", "pages", "assets"):
        assert thin.manifest[key] == want.manifest[key]
    assert thin.manifest["validation"]["stats"] == want.manifest["validation"]["stats"]
    r = run_cli("verify", out)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_unknown_revision_is_one_line(hub, tmp_path):
    out = tmp_path / "x.thin"
    r = run_cli("convert", REPO, out, "--revision", "v9-does-not-exist", "--no-probe", env=_env(hub))
    assert r.returncode == 1
    assert_one_line_error(r.stderr, REPO, "v9-does-not-exist")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_revision_by_commit_and_unknown_repo(hub, monkeypatch, tmp_path):
    """In-process (the cache patched into huggingface_hub): an explicit commit, and an absent repo."""
    use_hub_cache(monkeypatch, hub)
    out = tmp_path / "c.thin"
    r = runner.invoke(app, ["convert", REPO, str(out), "--revision", COMMIT, "--no-probe", "--json"])
    assert r.exit_code == 0, r.output
    src = Thin.read(out).manifest["validation"]["source"]
    assert (src["repo_id"], src["revision"], src["commit"]) == (REPO, COMMIT, COMMIT)
    r = runner.invoke(app, ["convert", "tiny-org/not-cached", str(tmp_path / "n.thin"), "--no-probe"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "tiny-org/not-cached", "HF_HUB_OFFLINE")
    assert not (tmp_path / "n.thin").exists()


def test_dry_run_from_the_hub(hub, monkeypatch, tmp_path):
    use_hub_cache(monkeypatch, hub)
    r = runner.invoke(app, ["convert", REPO, str(tmp_path / "d.thin"), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["recipe"] == "llama" and plan["model"]["num_kv_heads"] == 2
    assert not (tmp_path / "d.thin").exists()
