"""Where a checkpoint comes from: a local folder or a Hugging Face Hub repo (via its cache).

Only SafeTensors weights are read. Pickle-based weights (``*.bin``, ``*.pt``…) are refused,
never loaded: unpickling can run arbitrary code.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType

import numpy as np

from thinconv.checkpoint.safetensors import SafetensorsFile, TensorEntry, open_safetensors
from thinconv import strictjson
from thinconv.errors import CheckpointError, clipped

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_WEIGHTS_NAME = "model.safetensors"
# Source files copied verbatim into the archive, in spec §2.3 order.
ASSET_NAMES = (CONFIG_NAME, GENERATION_CONFIG_NAME, "tokenizer.json", "tokenizer.model",
               "tokenizer_config.json", "chat_template.jinja")
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")

# Everything but the weights: fetched first, so the index can name exactly which shards to fetch
# (repos such as Mistral's also ship a multi-GB consolidated.safetensors we must not download).
_HUB_META_PATTERNS = [*ASSET_NAMES, INDEX_NAME]
HUB_ALLOW_PATTERNS: list[str] = [*_HUB_META_PATTERNS, "*.safetensors"]

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_REPO_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class SourceFile:
    """A source file thinconv read or copied."""

    name: str  # relative to the checkpoint root, posix
    path: Path
    size: int
    sha256: str | None  # from the hub cache blob name; never computed (files can be huge)


@dataclass
class Checkpoint:
    """An opened checkpoint: parsed configs and memory-mapped SafeTensors shards."""

    root: Path
    repo_id: str | None
    revision: str | None
    commit: str | None
    config: dict
    generation_config: dict | None
    files: list[SourceFile]
    tensors: dict[str, TensorEntry]
    _shards: list[SafetensorsFile] = field(default_factory=list, repr=False)
    _owner: dict[str, SafetensorsFile] = field(default_factory=dict, repr=False)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of tensor ``name`` (see :meth:`SafetensorsFile.array`)."""
        shard = self._owner.get(name)
        if shard is None:
            raise CheckpointError(f"{self.root}: no tensor {name!r} in the checkpoint")
        return shard.array(name)

    def release(self, name: str, start: int, end: int) -> None:
        """Drop bytes [start, end) of tensor ``name`` from resident memory (see SafetensorsFile.release)."""
        shard = self._owner.get(name)
        if shard is not None:
            shard.release(name, start, end)

    def asset_files(self) -> list[SourceFile]:
        """The files copied verbatim into the archive, in spec order, among those present."""
        by_name = {f.name: f for f in self.files}
        return [by_name[n] for n in ASSET_NAMES if n in by_name]

    def provenance(self) -> dict:
        """The manifest's ``validation.source`` section (spec §2.4)."""
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
        }

    def close(self) -> None:
        """Close every shard."""
        for shard in self._shards:
            shard.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def open_checkpoint(src: str | Path, *, revision: str | None = None,
                    token: str | None = None, commit: str | None = None, local_only: bool = False) -> Checkpoint:
    """Open a local checkpoint folder or a hub repo id (``org/name``, via the HF cache).

    An existing folder wins over a repo id of the same spelling; a :class:`Path` is never a repo id.
    Hub downloads fetch configs, index and tokenizer files first, then only the shards the index
    names (all root ``*.safetensors`` without an index), both from the same resolved commit.
    ``commit`` pins a hub source to a commit resolved earlier (e.g. by a batch run) while the
    archive still records ``revision`` as asked. ``local_only`` reads a hub source from the cache
    alone (never the network).
    """
    path = Path(src).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"{src}: is a local folder; revision {revision!r} applies only"
                                  " to hub repo ids")
        root, label, repo_id, commit = path, str(path), None, None
        base = root.resolve()  # every file read must lie inside the folder
        _check_files(root, [*ASSET_NAMES, INDEX_NAME], label, base)
        index = _read_index(root, label)
    elif isinstance(src, str) and not path.exists() and looks_like_repo_id(src):
        repo_id, label = src, src
        revision = revision or "main"
        try:
            root = hub_download(repo_id, commit or revision, token, _HUB_META_PATTERNS, local_only)
        except CheckpointError as error:
            if path.parent.is_dir():  # `examples/typo`: most likely a mistyped local path
                raise CheckpointError(f"{src}: no such local folder (in {path.parent}/); read as a hub repo "
                                      f"id: {error}") from None
            raise
        commit = root.name
        base = root.parent.parent.resolve()  # the repo's cache folder: snapshot links point into its blobs/
        _check_files(root, [*ASSET_NAMES, INDEX_NAME], label, base)
        index = _read_index(root, label)
        shard_patterns = sorted(set(index.values())) if index is not None else ["*.safetensors"]
        # Pin the commit so both downloads come from the same snapshot.
        hub_download(repo_id, commit, token, shard_patterns, local_only)
    elif path.exists():
        raise CheckpointError(f"{src}: is a file, expected a checkpoint folder or a hub repo id"
                              " (org/name)")
    else:
        raise CheckpointError(f"{src}: no such folder, and not a hub repo id (org/name)")

    config = _read_json_object(root, CONFIG_NAME, label, required=True)
    generation_config = _read_json_object(root, GENERATION_CONFIG_NAME, label, required=False)
    shard_names = _shard_names(root, label, index, hub=repo_id is not None)
    _check_files(root, shard_names, label, base)

    with ExitStack() as stack:
        shards = []
        for name in shard_names:
            try:
                shard = open_safetensors(root / name)
            except CheckpointError as error:
                raise CheckpointError(f"{label}/{error}") from None
            stack.callback(shard.close)
            shards.append(shard)
        owner = _assign_tensors(shards, index, label)
        stack.pop_all()  # success: the Checkpoint now owns the shards

    names = [n for n in ASSET_NAMES if (root / n).is_file()] + shard_names
    names += [INDEX_NAME] if index is not None else []
    files = sorted((_source_file(root, n) for n in names), key=lambda f: f.name)
    tensors = {name: shard.entries[name] for name, shard in owner.items()}
    return Checkpoint(root=root, repo_id=repo_id, revision=revision if repo_id else None,
                      commit=commit, config=config, generation_config=generation_config,
                      files=files, tensors=tensors, _shards=shards, _owner=owner)


def _check_files(root: Path, names: list[str], label: str, base: Path) -> None:
    """Each of `names` that exists in `root` must be a regular file, and a symlink must resolve
    inside `base` (the source folder, or a hub repo's cache folder): a checkpoint must not make
    thinconv read (and embed) /etc/shadow, a device or a FIFO."""
    for name in names:
        path = root / name
        if not os.path.lexists(path):
            continue
        target = path.resolve()
        if not target.is_relative_to(base):
            raise CheckpointError(f"{label}/{name}: links outside the checkpoint (to {target}); source files must "
                                  f"lie inside {base}")
        try:
            mode = os.stat(target).st_mode
        except OSError as error:
            raise CheckpointError(f"{label}/{name}: cannot read ({error.strerror or error})") from None
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{label}/{name}: is not a regular file (a {_kind(mode)}); source files must be "
                                  f"regular files")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def looks_like_repo_id(src: str) -> bool:
    """Whether `src` is spelled like a Hugging Face repo id (``org/name``)."""
    if not _REPO_ID_RE.fullmatch(src):
        return False
    # huggingface_hub is imported only for hub sources: it costs ~0.2 s of start-up.
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(src)
    except HFValidationError:
        return False
    return True


def hub_download(repo_id: str, revision: str, token: str | None, patterns: list[str],
                 local_only: bool = False) -> Path:
    """Download the files of `repo_id` at `revision` matching `patterns` into the HF cache and
    return the snapshot folder (``snapshot_download``: honours HF_HOME, HF_TOKEN, HF_HUB_OFFLINE).
    Every failure is a one-line :class:`CheckpointError`."""
    # lazy, as in looks_like_repo_id: local conversions never pay for huggingface_hub
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # Added in huggingface_hub 1.x; older versions return partial snapshots silently.
    incomplete = tuple(filter(None, [getattr(errors, "IncompleteSnapshotError", None)]))
    where = f"{repo_id}@{revision}"
    cache = constants.HF_HUB_CACHE
    # Without HF_HUB_OFFLINE, a missing file would be fetched with five retries (~23 s of
    # back-off) when there is no network: one quick probe decides instead, and an unreachable
    # Hub means working from the cache alone.
    unreachable = None if constants.HF_HUB_OFFLINE or local_only else _hub_unreachable()
    try:
        folder = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns,
                                   local_files_only=local_only or unreachable is not None)
    except incomplete:
        hint = "" if constants.HF_HUB_OFFLINE else f" ({unreachable})" if unreachable else ""
        offline = "" if constants.HF_HUB_OFFLINE else " (HF_HUB_OFFLINE=1 skips the network check when offline)"
        raise CheckpointError(f"{where}: the cached snapshot is incomplete and the Hub cannot be reached{hint};"
                              f" download it again with network access{offline}") from None
    except LocalEntryNotFoundError:
        # The repo folder exists when an earlier download was partial or for another revision.
        partly = (Path(cache) / ("models--" + repo_id.replace("/", "--"))).is_dir()
        state = "not (completely) in the local cache" if partly else "not in the local cache"
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(f"{where}: {state} ({cache}) and HF_HUB_OFFLINE=1") from None
        reason = f" ({unreachable})" if unreachable else ""
        raise CheckpointError(f"{where}: cannot reach the Hub{reason} and {state} ({cache}); check the network"
                              " (working offline? set HF_HUB_OFFLINE=1 to use the cache without trying the Hub)"
                              ) from None
    except GatedRepoError:
        raise CheckpointError(f"{repo_id}: gated repository; accept its terms on huggingface.co and"
                              " pass a token with access (HF_TOKEN or --token)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: repository not found on the Hub (if it is private, pass"
                              " a token with access: HF_TOKEN or --token)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo_id}: revision {revision!r} not found on the Hub") from None
    except DisabledRepoError:
        raise CheckpointError(f"{repo_id}: repository is disabled on the Hub") from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status == 401:
            raise CheckpointError(f"{repo_id}: authentication failed (401); check HF_TOKEN or"
                                  " --token") from None
        raise CheckpointError(f"{where}: Hub request failed: {_first_line(error)}") from None
    except (OSError, ValueError) as error:  # network/disk failures, missing token, bad revision
        raise CheckpointError(f"{where}: download failed: {_first_line(error)}") from None
    if unreachable and patterns is not _HUB_META_PATTERNS:  # the last download of open_checkpoint
        _note_cache_only(repo_id, unreachable)
    return Path(folder)


# endpoint → (when probed, why unreachable or None): one probe per process and minute, so that the
# second download of a conversion (the shards) does not try again.
_HUB_PROBES: dict[str, tuple[float, str | None]] = {}
_PROBE_TTL = 60.0
_NOTED: set[str] = set()  # endpoints whose unreachability was already reported


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be reached (one HEAD request, no retries, HF_HUB_ETAG_TIMEOUT), or None."""
    import time

    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = constants.ENDPOINT
    seen = _HUB_PROBES.get(endpoint)
    if seen is not None and time.monotonic() - seen[0] < _PROBE_TTL:
        return seen[1]
    reason = None
    try:
        get_session().head(endpoint, timeout=constants.HF_HUB_ETAG_TIMEOUT)  # any HTTP answer: reachable
    except Exception as error:  # noqa: BLE001 - httpx / requests network errors alike
        reason = _first_line(error)
    _HUB_PROBES[endpoint] = (time.monotonic(), reason)
    return reason


def _note_cache_only(where: str, reason: str) -> None:
    """One line (once per process) when a checkpoint was served from the cache because the Hub is unreachable."""
    import logging

    from huggingface_hub import constants

    if constants.ENDPOINT not in _NOTED:
        _NOTED.add(constants.ENDPOINT)
        logging.getLogger("thinconv").warning(f"cannot reach the Hub ({reason}): {where} comes from the local "
                                              "cache (set HF_HUB_OFFLINE=1 to skip the network check)")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _read_json_object(root: Path, name: str, label: str, *, required: bool) -> dict | None:
    path = root / name
    if not path.is_file():
        if required:
            raise CheckpointError(f"{label}: {name} is missing")
        return None
    try:
        value = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicates,
                           parse_constant=_no_constant, **strictjson.HOOKS)
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{label}/{name}: not valid UTF-8 (byte {error.start})") from None
    except ValueError as error:
        raise CheckpointError(f"{label}/{name}: not valid JSON ({_clip(error)})") from None
    except RecursionError:
        raise CheckpointError(f"{label}/{name}: not valid JSON (nested too deeply)") from None
    except OSError as error:
        raise CheckpointError(f"{label}/{name}: cannot read ({error.strerror or error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{label}/{name}: is a JSON {type(value).__name__}, expected an object")
    return value


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:  # json would silently keep the last one: which is meant?
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _clip(error: BaseException, limit: int = 160) -> str:
    return clipped(str(error), limit)


def _read_index(root: Path, label: str) -> dict[str, str] | None:
    """The index's weight_map (tensor → shard file name), or None without an index."""

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:  # json would silently keep the last: which shard is right?
                raise CheckpointError(f"{label}/{INDEX_NAME}: duplicate key {key!r}")
            out[key] = value
        return out

    path = root / INDEX_NAME
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=no_duplicates,
                           parse_constant=_no_constant, **strictjson.HOOKS)
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{label}/{INDEX_NAME}: not valid JSON ({_clip(error)})") from None
    except RecursionError:
        raise CheckpointError(f"{label}/{INDEX_NAME}: not valid JSON (nested too deeply)") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{label}/{INDEX_NAME}: expected an object with a \"weight_map\""
                              " object of tensor name → shard file name")
    if not weight_map:
        raise CheckpointError(f"{label}/{INDEX_NAME}: weight_map lists no tensors")
    for shard in sorted(set(weight_map.values())):
        # Shards live next to the index; a path here could escape the checkpoint folder.
        if PurePosixPath(shard).name != shard or "\\" in shard or not shard.endswith(".safetensors"):
            raise CheckpointError(f"{label}/{INDEX_NAME}: names shard {shard!r}, expected a"
                                  " .safetensors file name in the checkpoint folder")
    return weight_map


def _shard_names(root: Path, label: str, index: dict[str, str] | None, *, hub: bool) -> list[str]:
    """The shard files to open, checked to exist."""
    if index is not None:
        names = sorted(set(index.values()))
        for name in names:
            if not (root / name).is_file():
                raise CheckpointError(f"{label}: {INDEX_NAME} names shard {name}, which is missing")
        return names
    if (root / SINGLE_WEIGHTS_NAME).is_file():
        return [SINGLE_WEIGHTS_NAME]
    names = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    if names:
        return names
    pickles = sorted(p.name for p in root.iterdir()
                     if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in PICKLE_PATTERNS))
    if pickles or hub:
        found = f"only pickle weights ({', '.join(pickles)})" if pickles else "no *.safetensors weights"
        raise CheckpointError(
            f"{label}: {found}; thinconv reads only safetensors and never unpickles (loading pickle"
            " can run arbitrary code). Convert to safetensors first in a trusted environment, e.g."
            " transformers save_pretrained(..., safe_serialization=True)")
    raise CheckpointError(f"{label}: no weights found (expected {INDEX_NAME},"
                          f" {SINGLE_WEIGHTS_NAME} or *.safetensors)")


def _assign_tensors(shards: list[SafetensorsFile], index: dict[str, str] | None,
                    label: str) -> dict[str, SafetensorsFile]:
    """Map each tensor to its shard; with an index, the shards must agree with it exactly."""
    owner: dict[str, SafetensorsFile] = {}
    for shard in shards:
        for name in shard.entries:
            if name in owner:
                raise CheckpointError(f"{label}: tensor {name!r} is in both {owner[name].path.name}"
                                      f" and {shard.path.name}")
            owner[name] = shard
    if index is None:
        return owner
    for name, expected in index.items():
        found = owner.get(name)
        if found is None:
            raise CheckpointError(f"{label}: tensor {name!r}: {INDEX_NAME} says shard {expected},"
                                  f" not found in {expected}")
        if found.path.name != expected:
            raise CheckpointError(f"{label}: tensor {name!r}: {INDEX_NAME} says shard {expected},"
                                  f" found in {found.path.name}")
    for name, shard in owner.items():
        if name not in index:
            raise CheckpointError(f"{label}: shard {shard.path.name} holds tensor {name!r}, which"
                                  f" {INDEX_NAME} does not list")
    return owner


def _source_file(root: Path, name: str) -> SourceFile:
    path = root / name
    return SourceFile(name=name, path=path, size=path.stat().st_size, sha256=_blob_sha256(path))


def _blob_sha256(path: Path) -> str | None:
    """The sha256 a hub cache records as the blob's name (LFS files only; git blobs use sha1)."""
    target = path.resolve()
    if target.parent.name == "blobs" and _SHA256_RE.fullmatch(target.name):
        return target.name
    return None
