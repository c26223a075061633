"""The jobs file: TOML (`[defaults]` + `[[job]]`) or JSON Lines, read and validated completely
before anything runs, every problem reported with its job number and field (docs/batch.md)."""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinconv.checkpoint.source import looks_like_repo_id
from thinconv.errors import JobsFileError, ThinError
from thinconv.plan import DEFAULT_PAGE_SIZE, ConvertOptions, parse_keep, parse_page_size
from thinconv.recipe import Registry, load_registry

JOB_KEYS = ("source", "out", "recipe", "dtype", "revision", "keep", "page_size", "rope_layout", "strict", "probe",
            "allow_config_keys")
DEFAULT_KEYS = tuple(k for k in JOB_KEYS if k != "out")  # one `out` for several jobs would collide


@dataclass(frozen=True)
class Job:
    """One conversion: a source (hub repo id or absolute local folder) to one archive."""

    index: int  # 1-based position in the jobs file
    source: str
    out: Path  # absolute
    options: ConvertOptions
    recipe: str | None = None
    revision: str | None = None  # hub sources only
    hub: bool = False


def load_jobs(path: str | os.PathLike, *, registry: Registry | None = None) -> list[Job]:
    """Read and validate a jobs file: TOML (``[defaults]`` + ``[[job]]``) or JSON Lines (one job
    object a line, optionally a first ``{"defaults": {...}}`` line). Relative ``source`` and
    ``out`` paths resolve against the file's folder; recipe names are checked against `registry`
    (default: the built-in and $THINCONV_RECIPES recipes).

    Raises :class:`JobsFileError` listing every problem (``FILE: job N (…): field 'x': …``)."""
    path = Path(path)
    name = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobsFileError([f"{path}: no such jobs file"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobsFileError([f"{path}: cannot read ({getattr(e, 'strerror', None) or e})"]) from None
    if _is_jsonl(path, text):
        defaults, entries, problems = _parse_jsonl(name, text)
    else:
        defaults, entries, problems = _parse_toml(name, text)
    if problems:
        raise JobsFileError(problems)
    if registry is None:
        registry = load_registry([])
    base = path.resolve().parent
    checked_defaults: dict[str, Any] = {}
    for key, value in defaults.items():
        if key not in DEFAULT_KEYS:
            hint = " (each job names its own out)" if key == "out" else ""
            problems.append(f"{name}: defaults: unknown field {key!r}{hint} (fields: {', '.join(DEFAULT_KEYS)})")
            continue
        parsed, problem = _check_field(key, value, registry)
        if problem:
            problems.append(f"{name}: defaults: field {key!r}: {problem}")
        else:
            checked_defaults[key] = parsed
    bad_defaults = {k for k in defaults if k not in checked_defaults}
    jobs: list[Job] = []
    outs: dict[Path, int] = {}
    for index, (where, entry) in enumerate(entries, start=1):
        hint = entry.get("out") if isinstance(entry.get("out"), str) else entry.get("source")
        label = f"{name}: job {index} ({where}{hint if isinstance(hint, str) else '?'})"
        job, job_problems = _check_job(index, entry, checked_defaults, bad_defaults, base, registry)
        problems += [f"{label}: {p}" for p in job_problems]
        if job is None:
            continue
        if job.out in outs:
            problems.append(f"{label}: field 'out': {job.out} is also the output of job {outs[job.out]}")
            continue
        outs[job.out] = index
        jobs.append(job)
    if not entries and not problems:
        problems.append(f"{name}: no jobs (add [[job]] tables with source and out)")
    if problems:
        raise JobsFileError(problems)
    return jobs


def _is_jsonl(path: Path, text: str) -> bool:
    if path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
        return True
    if path.suffix.lower() == ".toml":
        return False
    return text.lstrip().startswith("{")


def _parse_toml(name: str, text: str) -> tuple[dict, list[tuple[str, dict]], list[str]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return {}, [], [f"{name}: not valid TOML ({e})"]
    problems = [f"{name}: unknown top-level key {k!r} (expected [defaults] and [[job]])"
                for k in data if k not in ("defaults", "job")]
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        problems.append(f"{name}: 'defaults' must be a table ([defaults])")
        defaults = {}
    jobs = data.get("job", [])
    if not isinstance(jobs, list) or not all(isinstance(j, dict) for j in jobs):
        problems.append(f"{name}: 'job' must be an array of tables ([[job]])")
        jobs = []
    return defaults, [("", j) for j in jobs], problems


def _parse_jsonl(name: str, text: str) -> tuple[dict, list[tuple[str, dict]], list[str]]:
    defaults: dict = {}
    entries: list[tuple[str, dict]] = []
    problems: list[str] = []
    first = True
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            problems.append(f"{name}: line {lineno}: not valid JSON ({e})")
            first = False
            continue
        if not isinstance(obj, dict):
            problems.append(f"{name}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
        elif "defaults" in obj:
            if not first or len(obj) != 1 or not isinstance(obj["defaults"], dict):
                problems.append(f"{name}: line {lineno}: a defaults line must be the first line and hold only "
                                f"{{\"defaults\": {{...}}}}")
            else:
                defaults = obj["defaults"]
        else:
            entries.append((f"line {lineno}: ", obj))
        first = False
    return defaults, entries, problems


def _check_field(key: str, value: Any, registry: Registry) -> tuple[Any, str | None]:
    """(parsed value, None) or (None, what is wrong) for one field of a job or of the defaults."""
    if key in ("source", "out", "revision", "recipe", "dtype", "rope_layout"):
        if not isinstance(value, str) or not value.strip():
            return None, f"expected a non-empty string, got {value!r}"
    if key in ("strict", "probe") and not isinstance(value, bool):
        return None, f"expected true or false, got {value!r}"
    try:
        if key == "dtype":
            ConvertOptions(dtype=value)
        elif key == "rope_layout":
            ConvertOptions(rope_layout=value)
        elif key == "recipe":
            registry.get(value)
        elif key == "page_size":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                return None, f"expected a byte count like 16777216 or \"16MiB\", got {value!r}"
            value = parse_page_size(value) if isinstance(value, str) else value
            ConvertOptions(page_size=value)
        elif key == "keep":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                return None, f"expected a list of \"ROLE_GLOB=DTYPE\" strings, got {value!r}"
            value = parse_keep(value)
            ConvertOptions(keep=value)
        elif key == "allow_config_keys":
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                return None, f"expected a list of config.json key names, got {value!r}"
    except ThinError as e:
        return None, re.sub(r"^--[\w-]+ ", "", str(e))
    return value, None


def _check_job(index: int, entry: dict, defaults: dict, bad_defaults: set[str], base: Path,
               registry: Registry) -> tuple[Job | None, list[str]]:
    """(the job, []) or (None, every problem of this entry)."""
    problems = [f"unknown field {k!r} (fields: {', '.join(JOB_KEYS)})" for k in entry if k not in JOB_KEYS]
    values = dict(defaults)
    bad = set(bad_defaults)
    for key, value in entry.items():
        if key in JOB_KEYS:
            bad.discard(key)
            parsed, problem = _check_field(key, value, registry)
            if problem:
                problems.append(f"field {key!r}: {problem}")
                bad.add(key)
            else:
                values[key] = parsed
    for key in ("source", "out"):
        if key not in values and key not in bad:
            problems.append(f"field {key!r}: missing")
    source, hub = None, False
    if "source" in values and "source" not in bad:
        raw_source = values["source"]
        local = base / Path(raw_source).expanduser()
        if local.is_dir():
            source = str(local.resolve())
        elif not Path(raw_source).is_absolute() and looks_like_repo_id(raw_source) and not local.exists():
            source, hub = raw_source, True
        elif local.exists():
            problems.append(f"field 'source': {local} is a file, expected a checkpoint folder or a hub repo id "
                            f"(org/name)")
        else:
            problems.append(f"field 'source': no such folder {local}, and {raw_source!r} is not a hub repo id "
                            f"(org/name)")
    revision = values.get("revision")
    if revision is not None and source is not None and not hub:
        problems.append(f"field 'revision': {revision!r} applies only to hub repo ids; {source} is a local folder")
    out = None
    if "out" in values and "out" not in bad:
        out = (base / Path(values["out"]).expanduser()).resolve()
        if out.is_dir():
            problems.append(f"field 'out': {out} is a folder; name the .thin file to write")
        elif not out.parent.is_dir():
            problems.append(f"field 'out': the output folder {out.parent} does not exist")
    if problems or bad or source is None or out is None:
        return None, problems
    try:
        options = ConvertOptions(dtype=values.get("dtype", "auto"), page_size=values.get("page_size", DEFAULT_PAGE_SIZE),
                                 rope_layout=values.get("rope_layout", "half"), keep=values.get("keep", ()),
                                 strict=values.get("strict", False), probe=values.get("probe", True),
                                 allow_config_keys=tuple(values.get("allow_config_keys", ())))
    except ThinError as e:
        return None, [f"options: {e}"]
    return Job(index, source, out, options, values.get("recipe"), revision, hub), []
