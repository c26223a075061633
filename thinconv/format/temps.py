"""The temp files the writers make beside their output (``.NAME.*.tmp``): named before it is created,
so that no temp escapes its clean-up, flock()ed while being written, and removed when a killed
earlier run left it behind (the lock tells a live writer's temp from an abandoned one)."""

from __future__ import annotations

import errno
import glob
import os
import secrets
import shutil
import stat
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: temp files are not locked, and none is ever called stale
    fcntl = None


def temp_pattern(out: Path) -> str:
    """The glob of the temp files the writers make for `out` (``.NAME.*.tmp`` in out's folder)."""
    return os.path.join(glob.escape(str(out.parent)), f".{glob.escape(out.name)}.*.tmp")


class TempOutput:
    """The temp file (or folder) a writer fills beside `out`. Its `path` is known before it
    exists, so that a clean-up running at any moment — an exception a signal raises between
    creating it and returning from :meth:`create` included — knows what to remove."""

    def __init__(self, out: Path, suffix: str = ".tmp"):
        self.out, self.suffix = out, suffix
        self.path: Path | None = None

    def _name(self) -> Path:
        return self.out.parent / f".{self.out.name}.{secrets.token_hex(6)}{self.suffix}"

    def create(self) -> int:
        """Create the file (mode 0600), open for writing and flock()ed for as long as the returned
        descriptor (or a dup of it) is open: the proof, for :func:`remove_stale_temps`, that a
        writer is alive. Another name is tried if a cleaner removed this one before the lock."""
        while True:
            self.path = self._name()
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            except FileExistsError:
                self.path = None  # someone else's: never ours to remove
                continue
            if fcntl is None or _lock_and_check(fd, self.path):
                return fd
            os.close(fd)

    def create_folder(self) -> Path:
        """Create it as an empty folder (mode 0700) and return its path."""
        while True:
            self.path = self._name()
            try:
                os.mkdir(self.path, 0o700)
                return self.path
            except FileExistsError:
                self.path = None

    def remove(self) -> None:
        """Remove it (a folder with its contents), if it was created and is still there."""
        if self.path is None:
            return
        if self.path.is_dir() and not self.path.is_symlink():
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)


def _lock_and_check(fd: int, path: Path) -> bool:
    """flock `fd`; False if `path` no longer names it (a cleaner took it before the lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
        return True  # no flock on this filesystem: the cleaner cannot lock it either, so never removes it
    return _still_named(os.fstat(fd), path)


def _still_named(st: os.stat_result, path: str | os.PathLike) -> bool:
    """Whether `path` still names the file `st` describes (not removed, replaced or renamed away)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def remove_stale_temps(out: str | os.PathLike) -> list[Path]:
    """Delete the temp files (``.NAME.*.tmp``) a killed earlier write of `out` left in its folder;
    return them. A temp a live writer still holds (its flock) is left alone, as is anything that
    is not a regular file; without flock (not POSIX) nothing can be proved abandoned, so nothing
    is removed."""
    out = Path(out)
    if fcntl is None:
        return []
    removed = []
    for name in sorted(glob.glob(temp_pattern(out))):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block us
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a running conversion is writing it
            if _still_named(st, name):  # not renamed into place meanwhile
                os.unlink(name)
                removed.append(Path(name))
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed
