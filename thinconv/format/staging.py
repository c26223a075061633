"""Staging directories: `manifest.json` + `pages/<id>` files, the packer's door for any tool.

`unpack` writes an archive back to that layout; packing it again reproduces the archive byte
for byte (the layout is fully determined by the manifest).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from thinconv.errors import PackError, ThinFormatError
from thinconv.format.manifest import parse_manifest
from thinconv.format.reader import Archive
from thinconv.format.temps import TempOutput
from thinconv.format.writer import FilePage, PackResult, check_output, pack


def page_path(pages_dir: Path, page_id: str) -> Path:
    """Where a page's file lives; ids may hold '/', but never climb out of pages/."""
    parts = page_id.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PackError(f"page id {page_id!r} cannot be used as a file path under pages/")
    return pages_dir.joinpath(*parts)


def pack_staging(staging: str | os.PathLike, out: str | os.PathLike, *, force: bool = False, progress=None) -> PackResult:
    """Pack a staging dir through the gatekeeper (the manifest is canonicalized, pages checked)."""
    root = Path(staging)
    mpath = root / "manifest.json"
    if not root.is_dir():
        raise PackError(f"{root}: not a directory")
    check_output(Path(out), force, [mpath])  # the page files are checked by pack itself
    try:
        data = mpath.read_bytes()
    except OSError as e:
        raise PackError(f"{mpath}: cannot read ({e.strerror or e})") from None
    try:
        manifest = parse_manifest(data, str(mpath))
    except ThinFormatError as e:
        raise PackError(str(e)) from None
    pages_dir = root / "pages"
    sources = {}
    if isinstance(manifest, dict) and isinstance(manifest.get("pages"), list):
        for p in manifest["pages"]:
            pid = p.get("id") if isinstance(p, dict) else None
            if isinstance(pid, str):
                path = page_path(pages_dir, pid)
                if path.is_file():
                    sources[pid] = FilePage(path)
    if pages_dir.is_dir():
        for f in pages_dir.rglob("*"):
            pid = f.relative_to(pages_dir).as_posix()
            if f.is_file() and pid not in sources:
                raise PackError(f"{f}: page file not declared in manifest.json")
    return pack(manifest, sources, out, force=force, progress=progress)


def unpack(archive: Archive, dest: str | os.PathLike, *, force: bool = False) -> int:
    """Write `archive` as a staging dir at `dest` (created; must be absent or empty unless force).

    Written to a temp folder beside `dest` and renamed, so a failure leaves nothing behind.
    Returns the number of page files written."""
    dest = Path(dest)
    if archive.path.resolve().is_relative_to(dest.resolve()):
        raise PackError(f"{dest} holds {archive.path}, the archive being unpacked; unpack it elsewhere")
    if dest.exists():
        if not dest.is_dir():
            raise PackError(f"{dest} exists and is not a directory")
        if any(dest.iterdir()) and not force:
            raise PackError(f"{dest} is not empty (use --force to replace it)")
    parent = dest.parent
    temp, aside = TempOutput(dest), TempOutput(dest, ".old")  # named before they exist: see TempOutput
    old = None
    try:
        try:
            tmp = temp.create_folder()
        except OSError as e:
            raise PackError(f"cannot write in {parent}: {e.strerror or e}") from None
        (tmp / "manifest.json").write_text(json.dumps(archive.manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
        pages_dir = tmp / "pages"
        for rec in archive.pages:
            path = page_path(pages_dir, rec.id)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(archive.page_bytes(rec.id))
        if dest.exists():
            # Move the old folder aside first: until the new one is in place, nothing is lost.
            old = aside.create_folder()
            os.replace(dest, old / "d")
        os.replace(tmp, dest)
        aside.remove()
    except BaseException as e:
        temp.remove()
        if old is not None and (old / "d").exists() and not dest.exists():
            os.replace(old / "d", dest)  # put the previous folder back
        aside.remove()
        if isinstance(e, OSError):
            raise PackError(f"unpacking into {dest} failed ({e.strerror or e}); nothing was left behind") from None
        raise
    return len(archive.pages)
