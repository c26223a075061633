"""Test utility: build a real Hugging Face hub cache on disk, offline.

Layout (as huggingface_hub's file_download.py writes it)::

    <hf_home>/hub/models--org--name/
        blobs/<sha256 for LFS files | git blob sha1 otherwise>
        refs/main                                  # the commit hash, no newline
        snapshots/<commit>/<file> -> ../../blobs/<hash>
        trees/<commit>.json                        # huggingface_hub ≥ 1.x tree listing cache
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

# Suffixes the Hub's default .gitattributes stores in LFS (blob named by sha256).
LFS_SUFFIXES = {".safetensors", ".bin", ".model", ".pt", ".pth", ".ckpt", ".gguf"}


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file, which the cache uses to name non-LFS blobs."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def populate_hub_cache(hf_home: Path, repo_id: str, folder: Path, commit: str = "0" * 40) -> Path:
    """Copy every file of ``folder`` into the hub cache under ``hf_home`` as ``repo_id``@``commit``.

    ``refs/main`` points at ``commit``. Returns the snapshot folder.
    """
    repo_dir = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo_dir / "blobs", repo_dir / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    tree: dict[str, dict] = {}
    for src in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        rel = src.relative_to(folder).as_posix()
        data = src.read_bytes()
        sha1 = git_blob_sha1(data)
        entry: dict = {"size": len(data), "blob_id": sha1}
        if src.suffix in LFS_SUFFIXES:
            blob_name = hashlib.sha256(data).hexdigest()
            entry.update(lfs_sha256=blob_name, lfs_size=len(data))
        else:
            blob_name = sha1
        shutil.copyfile(src, blobs / blob_name)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        # Relative link, like huggingface_hub's _create_symlink: up to the repo folder, then blobs/.
        up = "../" * (rel.count("/") + 2)
        link.symlink_to(f"{up}blobs/{blob_name}")
        tree[rel] = entry
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "trees").mkdir(exist_ok=True)
    (repo_dir / "trees" / f"{commit}.json").write_text(
        json.dumps({"format_version": 1, "files": tree}, indent=1))
    return snapshot


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, hf_home: Path, *, offline: bool = True) -> None:
    """Point the (already imported) huggingface_hub at ``hf_home`` for one test, offline.

    huggingface_hub reads HF_HOME / HF_HUB_OFFLINE into ``huggingface_hub.constants`` at import
    time, so setting the environment alone is too late: patch the constants as well.
    """
    from huggingface_hub import constants

    hub = str(Path(hf_home) / "hub")
    for name, value in {"HF_HOME": str(hf_home), "HF_HUB_CACHE": hub,
                        "HF_HUB_OFFLINE": "1" if offline else "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", os.path.join(str(hf_home), "token"))
