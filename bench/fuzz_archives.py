"""Mutation fuzzer for .thin archives: bit flips, truncation, header and page-table field edits,
manifest JSON edits (any node replaced, deleted or duplicated; the `model` section in particular;
raw number spellings) with the archive re-laid-out and re-hashed so that the edits reach the
validator and `verify`'s computed checks. Each case runs in-process: open, verify, inspect's
summary, every tensor and asset read. Prints the tally (see fuzz_common).

    python bench/fuzz_archives.py --cases 100000 --seed 1      # the large run (bench/RESULTS.md)
    python bench/fuzz_archives.py --cases 300                  # what the test suite runs
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from fuzz_common import INTERESTING, RAW_NUMBERS, ROOT, Tally, main, run_case

import blake3  # noqa: E402

from thinconv.format import spec  # noqa: E402
from thinconv.format.reader import open_archive  # noqa: E402
from thinconv.summary import summarize  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny-llama"
HEADER_FIELDS = [(8, "<I"), (12, "<I"), (16, "<Q"), (24, "<Q"), (32, "<Q"), (40, "<Q"), (48, "<Q")]


class Base:
    """A real archive (examples/tiny-llama, 4 KiB pages) taken apart: manifest, page records, data."""

    def __init__(self, folder: Path):
        import thinconv

        path = folder / "base.thin"
        thinconv.convert(EXAMPLE, path, page_size=4096, probe=False)
        self.buf = path.read_bytes()
        with open_archive(path) as a:
            self.manifest = copy.deepcopy(a.manifest)
            self.records = [(p.id, p.size, p.checksum) for p in a.pages]
            self.datas = [bytes(a.page_bytes(p.id)) for p in a.pages]
            self.data_off = a.header.data_off
            self.record_offsets = [p.record_offset for p in a.pages]

    def assemble(self, manifest: bytes) -> bytes:
        """The archive with these manifest bytes: offsets, lengths and archive hash recomputed."""
        table = b"".join(struct.pack("<H", len(pid)) + pid.encode() + struct.pack("<QQQI32s", 0, size, size, 0, cs)
                         for pid, size, cs in self.records)
        pt_off = spec.HEADER_LEN + len(manifest)
        data_off = spec.align_up(pt_off + len(table))
        out, cursor, recs = bytearray(), data_off, []
        for (pid, size, cs), data in zip(self.records, self.datas):
            recs.append(struct.pack("<H", len(pid)) + pid.encode() + struct.pack("<QQQI32s", cursor, size, size, 0, cs))
            cursor = spec.align_up(cursor + size)
        table = b"".join(recs)
        head = spec.HEADER.pack(spec.MAGIC, spec.HEADER_LEN, spec.VERSION, spec.HEADER_LEN, len(manifest), pt_off,
                                len(self.records), data_off, blake3.blake3(manifest + table).digest())
        out += head + manifest + table
        for data in self.datas:
            out += bytes(spec.align_up(len(out)) - len(out)) if len(out) > data_off else bytes(data_off - len(out))
            out += data
        return bytes(out)


def _nodes(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _nodes(v, path + (i,))


def _value(rng: random.Random):
    v = rng.choice(INTERESTING)
    if rng.random() < 0.1:  # a deep or long value
        v = rng.choice([[v] * rng.randint(2, 2000), {"k": v, "l": [v, v]}, "s" * rng.randint(100, 5000)])
    return copy.deepcopy(v)


def _edit_tree(m: dict, rng: random.Random, paths: list[tuple]) -> None:
    path = rng.choice(paths)
    parent = m
    try:  # an earlier edit of this case may have removed or replaced the path
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]]
    except (KeyError, IndexError, TypeError):
        return
    if not isinstance(parent, (dict, list)):
        return
    key = path[-1]
    op = rng.random()
    if op < 0.15:
        del parent[key]
    elif op < 0.25 and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif op < 0.35 and isinstance(parent, dict):
        parent[rng.choice(["extra", "type", "factor", "beta_fast", "beta_slow", "mscale", "sliding", "bias"])] = \
            _value(rng)
    elif op < 0.5 and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = rng.choice([parent[key] * 10 ** rng.randint(1, 300), -parent[key], parent[key] + 1,
                                  parent[key] - 1, parent[key] * 2**rng.randint(1, 70)])
        if isinstance(parent[key], float) and parent[key] != parent[key] * 1:  # inf or nan: not JSON
            parent[key] = 1e308
    else:
        parent[key] = _value(rng)


YARN_KEYS = ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "low_freq_factor", "high_freq_factor", "truncate"]


def _rope_edit(m: dict, rng: random.Random) -> None:
    """A RoPE section of a random kind with random parameters (the YaRN / llama3 / linear maths)."""
    rope = m["model"]["rope"]
    kind = rng.choice(["yarn", "linear", "llama3", "dynamic", "longrope", None])
    if rng.random() < 0.5:
        rope["theta"] = rng.choice([1, 1.0, 1e-300, 5e-324, 2.0, 1e308, 0.5, 10000.0, -1.0, 0])
    if kind is None:
        rope["scaling"] = None
        return
    scaling = {"type": kind}
    for k in rng.sample(YARN_KEYS, rng.randint(0, len(YARN_KEYS))):
        scaling[k] = _value(rng) if rng.random() < 0.5 else rng.choice([0, 1, 0.0, 1e-300, 1e308, 4.0, 32, 64, -1])
    rope["scaling"] = scaling


def _raw_edit(text: bytes, rng: random.Random) -> bytes:
    """Edits no JSON object can express: number spellings, duplicate keys, deep nesting."""
    op = rng.random()
    if op < 0.5:
        import re

        nums = [mt.span() for mt in re.finditer(rb"(?<=[:\[,])-?[0-9][0-9.eE+-]*", text)]
        if nums:
            s, e = rng.choice(nums)
            return text[:s] + rng.choice(RAW_NUMBERS) + text[e:]
    if op < 0.75 or not text.startswith(b"{"):
        at = text.find(b'"model":{')
        at = at + len(b'"model":{') if at >= 0 else 1
        return text[:at] + b'"num_layers":2,' + text[at:]  # a duplicate key (or broken JSON)
    depth = rng.choice([100, 1000, 5000, 100000])
    return b'{"zz":' + b'{"a":' * depth + b"1" + b"}" * depth + b"," + text[1:]


def mutate(base: Base, rng: random.Random, paths: list[tuple], model_paths: list[tuple]) -> tuple[str, bytes]:
    """(description, archive bytes) of one mutated archive."""
    kind = rng.choices(["flip", "truncate", "field", "tree", "model", "rope", "raw"],
                       weights=[20, 5, 10, 25, 20, 12, 8])[0]
    buf = bytearray(base.buf)
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(base.data_off if rng.random() < 0.7 else len(buf))
            buf[pos] ^= 1 << rng.randrange(8)
        return kind, bytes(buf)
    if kind == "truncate":
        n = rng.randrange(len(buf))
        return kind, bytes(buf[:n]) if rng.random() < 0.8 else bytes(buf) + bytes(rng.randint(1, 9000))
    if kind == "field":
        if rng.random() < 0.5:
            off, fmt = rng.choice(HEADER_FIELDS)
        else:
            k = rng.randrange(len(base.records))
            at = base.record_offsets[k]
            tail = at + 2 + len(base.records[k][0])
            off, fmt = rng.choice([(at, "<H"), (tail, "<Q"), (tail + 8, "<Q"), (tail + 16, "<Q"), (tail + 24, "<I")])
        bits = 8 * struct.calcsize(fmt)
        choices = [v for v in INTERESTING if isinstance(v, int) and not isinstance(v, bool)]
        choices += [rng.randrange(2**bits), len(buf), len(buf) - 1, len(buf) + 1, base.data_off]
        value = rng.choice([v for v in choices if 0 <= v < 2**bits])
        struct.pack_into(fmt, buf, off, value)
        return f"{kind}@{off}={value}", bytes(buf)
    m = copy.deepcopy(base.manifest)
    if kind == "tree":
        for _ in range(rng.randint(1, 3)):
            _edit_tree(m, rng, paths)
    elif kind == "model":
        for _ in range(rng.randint(1, 3)):
            _edit_tree(m, rng, model_paths)
    elif kind == "rope":
        _rope_edit(m, rng)
    try:
        text = spec.canonical_json(m)
    except (ValueError, TypeError, KeyError, IndexError):
        text = json.dumps(m).encode()
    if kind == "raw":
        text = _raw_edit(text, rng)
    return kind, base.assemble(text)


def check_one(path: Path) -> bool:
    """What the CLI does with an archive: open (structure), verify (checksums, RoPE), inspect's
    summary, and every tensor and asset read. True when the archive is valid."""
    with open_archive(path) as a:
        report = a.verify()
        if not report.ok:
            return False
        summarize(a, with_tensors=True)
        for name in a.tensor_names:
            info = a.tensor_info(name)
            if info["dtype"] in ("f32", "f16", "bf16"):
                a.tensor(name)
            else:
                a.dequantize(name)
        for name in a.asset_names:
            a.asset_bytes(name)
    return True


def fuzz(cases: int, seed: int = 0, report_every: int = 0) -> Tally:
    """Run `cases` mutated archives; return the tally."""
    tally = Tally()
    rng = random.Random(seed)
    folder = Path(tempfile.mkdtemp(prefix="thin-fuzz-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        base = Base(folder)
        paths = [p for p in _nodes(base.manifest) if p]
        model_paths = [p for p in paths if p[0] == "model" and len(p) > 1]
        target = folder / "case.thin"
        t0 = time.perf_counter()
        for i in range(cases):
            kind, data = mutate(base, rng, paths, model_paths)
            target.write_bytes(data)
            run_case(tally, f"case {i} (seed {seed}, {kind})", lambda: check_one(target))
            tally.progress(i + 1, t0, report_every)
        tally.elapsed = time.perf_counter() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return tally


if __name__ == "__main__":
    sys.exit(main('fuzz_archives', __doc__, fuzz))
