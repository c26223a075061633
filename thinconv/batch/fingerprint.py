"""Done or not: whether an existing archive is the one a job would write (its fingerprint: source
identity, options, recipe, thinconv version), and whether it still verifies."""

from __future__ import annotations

import re
from pathlib import Path

import thinconv
from thinconv.batch.jobs import Job
from thinconv.checkpoint.source import CONFIG_NAME, hub_download, open_checkpoint
from thinconv.errors import ThinError
from thinconv.format import spec
from thinconv.format.reader import open_archive


def job_fingerprint(job: Job, commit: str | None = None) -> dict:
    """What an archive must record to count as this job's output."""
    source = {"repo_id": job.source, "commit": commit} if job.hub else {"folder": job.source}
    return {"source": source, "options": job.options.record(), "version": thinconv.__version__, "recipe": job.recipe}


def archive_mismatch(job: Job, commit: str | None = None) -> str | None:
    """None when `job.out` holds the archive `job` would write — same thinconv version, recipe
    (when the job names one), options and source identity (hub: repo and resolved `commit`; local:
    file names and sizes, config.json, and no source file newer than the archive); else why not.
    Checks the manifest only, not the page checksums (see :func:`verify_archive`)."""
    want = job_fingerprint(job, commit)
    if not job.out.exists():
        return "no archive yet"
    try:
        with open(job.out, "rb") as f:
            magic = f.read(len(spec.MAGIC))
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    if magic != spec.MAGIC:
        raise ThinError(f"{job.out} exists and is not a .thin archive; move it away (batch replaces only archives)")
    try:
        with open_archive(job.out) as a:
            manifest = a.manifest
            archived_config = a.asset_bytes("config.json") if any(x["name"] == "config.json" for x in manifest["assets"]) else None
    except ThinError as e:
        return f"unreadable archive ({e})"
    validation = manifest.get("validation", {})
    conv, src = validation.get("converter") or {}, validation.get("source") or {}
    if conv.get("version") != want["version"]:
        return f"made by thinconv {conv.get('version')}, this is {want['version']}"
    if job.recipe is not None and conv.get("recipe") != job.recipe:
        return f"recipe {conv.get('recipe')!r} ≠ {job.recipe!r}"
    have_opts = conv.get("options")
    if isinstance(have_opts, dict) and "recipe_files" in have_opts:  # a user recipe's files: not a job option
        have_opts = {k: v for k, v in have_opts.items() if k != "recipe_files"}
    if have_opts != want["options"]:
        if not isinstance(have_opts, dict):
            return "the archive records no conversion options"
        diff = [k for k in want["options"] if have_opts.get(k) != want["options"][k]]
        return "options differ: " + ", ".join(f"{k} {have_opts.get(k)!r} → {want['options'][k]!r}" for k in diff)
    if job.hub:
        if src.get("repo_id") != job.source or src.get("commit") != commit:
            return f"source was {src.get('repo_id')}@{src.get('commit')}, now {job.source}@{commit}"
        return None
    if src.get("repo_id") is not None:
        return f"source was the hub repo {src.get('repo_id')}, now a local folder"
    return _local_mismatch(job, src, archived_config)


def _local_mismatch(job: Job, src: dict, archived_config: bytes | None) -> str | None:
    try:
        with open_checkpoint(job.source) as ckpt:
            files = ckpt.files
    except ThinError as e:
        return f"source cannot be opened ({e})"
    have = [(f.get("name"), f.get("size")) for f in src.get("files", [])]
    now = [(f.name, f.size) for f in files]
    if sorted(have) != sorted(now):
        return "source files differ (names or sizes)"
    config = Path(job.source) / "config.json"
    try:
        if archived_config is not None and config.read_bytes() != archived_config:
            return "source config.json differs"
        made = job.out.stat().st_mtime
        newer = [f.name for f in files if f.path.stat().st_mtime > made]
    except OSError as e:
        return f"cannot read the source ({e.strerror or e})"
    if newer:
        return f"source file {newer[0]} is newer than the archive"
    return None


def verify_archive(path: Path, progress=None) -> str | None:
    """None when every checksum of the archive verifies; else the first failure. `progress`
    (start(phase, total) / advance(n), like the converter's) follows the bytes checked."""
    try:
        with open_archive(path) as a:
            if progress is not None:
                progress.start("verifying", sum(p.size for p in a.pages))
            report = a.verify(progress=progress.advance if progress is not None else None)
    except ThinError as e:
        return str(e)
    return None if report.ok else f"{report.failures[0]}" + (f" (+{len(report.failures) - 1} more)"
                                                              if len(report.failures) > 1 else "")


def resolve_commit(repo_id: str, revision: str | None, token: str | None = None) -> str:
    """The commit a hub branch / tag / commit names, through the HF cache (only config.json is
    fetched; offline, the cache's refs answer)."""
    if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    return hub_download(repo_id, revision or "main", token, [CONFIG_NAME]).name


def download_source(repo_id: str, commit: str, token: str | None = None) -> None:
    """Fetch everything a conversion of repo_id@commit reads into the HF cache (configs, index,
    tokenizer files, the shards the index names), as a conversion would."""
    with open_checkpoint(repo_id, revision=commit, token=token):
        pass
