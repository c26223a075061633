"""Mutation fuzzer for checkpoints: safetensors header edits (any field of any entry, added and
renamed entries, the header length, raw bytes and number spellings, truncation), config.json and
generation_config.json edits (any key replaced or removed, RoPE sections of every kind, raw number
spellings, duplicate keys, deep nesting) and a safetensors index, each run through `convert`
in-process (with or without the probe, at several page sizes); an archive it writes must verify.
Prints the tally (see fuzz_common).

    python bench/fuzz_checkpoints.py --cases 10000 --seed 1    # the large run (bench/RESULTS.md)
    python bench/fuzz_checkpoints.py --cases 100               # what the test suite runs
"""

from __future__ import annotations

import copy
import json
import random
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from fuzz_common import INTERESTING, RAW_NUMBERS, ROOT, Tally, main, run_case

from thinconv.convert import convert as write_archive, open_plan  # noqa: E402
from thinconv.format.reader import open_archive  # noqa: E402
from thinconv.plan import ConvertOptions  # noqa: E402
from thinconv.recipe import load_registry  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny-llama"
CONFIG_KEYS = ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "hidden_act", "attention_bias",
               "mlp_bias", "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id", "model_type",
               "torch_dtype", "dtype", "layer_types", "quantization_config", "partial_rotary_factor"]
ROPE_KEYS = ["rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "attention_factor", "low_freq_factor", "high_freq_factor", "short_factor",
             "long_factor", "truncate"]
ST_FIELDS = ["dtype", "shape", "data_offsets"]


def _value(rng: random.Random):
    v = rng.choice(INTERESTING)
    if rng.random() < 0.1:
        v = rng.choice([[v] * rng.randint(2, 3000), {"k": v}, "s" * rng.randint(100, 5000)])
    return copy.deepcopy(v)


def _number_near(rng: random.Random, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _value(rng)
    out = rng.choice([v * 10 ** rng.randint(1, 30), -v, v + 1, v - 1, v * 2 ** rng.randint(1, 64), 0, v / 2])
    return out if isinstance(out, int) or abs(out) < 1e308 else 1e308


def _raw_number(text: str, rng: random.Random) -> str:
    nums = [m.span() for m in re.finditer(r"(?<=[:\[,\s])-?[0-9][0-9.eE+-]*", text)]
    if not nums:
        return text
    s, e = rng.choice(nums)
    return text[:s] + rng.choice(RAW_NUMBERS).decode() + text[e:]


def _edit_config(text: str, rng: random.Random) -> str:
    config = json.loads(text)
    op = rng.random()
    if op < 0.45:
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(CONFIG_KEYS)
            r = rng.random()
            if r < 0.2:
                config.pop(key, None)
            elif r < 0.6 and key in config:
                config[key] = _number_near(rng, config[key])
            else:
                config[key] = _value(rng)
    elif op < 0.75:  # a RoPE section of any kind, with any parameters
        rope = {"rope_type": rng.choice(["default", "linear", "dynamic", "yarn", "llama3", "longrope", "x"])}
        for k in rng.sample(ROPE_KEYS[1:], rng.randint(0, len(ROPE_KEYS) - 1)):
            rope[k] = rng.choice([_value(rng), 1, 1.0, 0, 1e-300, 1e308, 4.0, 64, 32, 10000.0, -1, [1.0] * 8])
        if rng.random() < 0.5:
            rope["rope_theta"] = rng.choice([1, 1.0, 1e-300, 5e-324, 1e308, 0, -1, 2.0, 500000.0])
        config[rng.choice(["rope_parameters", "rope_parameters", "rope_scaling"])] = rope
    else:
        text = json.dumps(config, indent=2)
        r = rng.random()
        if r < 0.5:
            return _raw_number(text, rng)
        if r < 0.75:
            return text[:-2] + f',\n  "{rng.choice(CONFIG_KEYS)}": 1\n}}'  # a duplicate key, maybe
        depth = rng.choice([100, 1000, 5000, 100000])
        return text[:-2] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    return json.dumps(config, indent=2)


def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: dict | bytes, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def _edit_safetensors(data: bytes, rng: random.Random) -> bytes:
    header, body = _split(data)
    names = [k for k in header if k != "__metadata__"]
    op = rng.random()
    if op < 0.5:
        for _ in range(rng.randint(1, 2)):
            name = rng.choice(names)
            entry = header[name]
            if not isinstance(entry, dict):
                continue
            fld = rng.choice(ST_FIELDS)
            r = rng.random()
            if r < 0.1:
                entry.pop(fld, None)
            elif r < 0.5 and fld != "dtype" and isinstance(entry.get(fld), list):
                entry[fld] = [_number_near(rng, x) if rng.random() < 0.5 else x for x in entry[fld]] \
                    + ([rng.choice(INTERESTING)] if rng.random() < 0.1 else [])
            else:
                entry[fld] = _value(rng)
        return _join(header, body)
    if op < 0.65:  # an added, renamed or removed entry
        name = rng.choice(names)
        r = rng.random()
        if r < 0.4:
            header[rng.choice([name + ".x", "model.layers.7.mlp.up_proj.weight", "model.layers.99999999.x", "lm_head.weight",
                               "model.rotary_emb.inv_freq", "", "__metadata__"])] = copy.deepcopy(header[name])
        elif r < 0.7:
            header[name.replace("layers.1", "layers.2").replace("layers.0", "layers.1")] = header.pop(name)
        else:
            del header[name]
        return _join(header, body)
    if op < 0.75:
        header["__metadata__"] = _value(rng)
        return _join(header, body)
    n = int.from_bytes(data[:8], "little")
    if op < 0.82:  # the header length field
        value = rng.choice([0, 1, 7, 8, n - 8, n - 1, n + 1, n + 8, len(data), len(data) - 8, 2**63, 2**64 - 1,
                            100 * 2**20, rng.randrange(2**64)])
        return struct.pack("<Q", value) + data[8:]
    if op < 0.88:  # raw number spellings, or bytes flipped, in the header text
        text = data[8:8 + n].decode()
        if rng.random() < 0.5:
            return _join(_raw_number(text, rng).encode(), body)
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(8, 8 + n)] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if op < 0.94:
        return data[:rng.randrange(len(data))]
    return data + bytes(rng.randint(1, 5000))


def _edit_index(folder: Path, rng: random.Random) -> None:
    """A safetensors index next to the shard: right, missing a name, naming other files."""
    header, _ = _split((EXAMPLE / "model.safetensors").read_bytes())
    weight_map = {k: "model.safetensors" for k in header if k != "__metadata__"}
    r = rng.random()
    if r < 0.3 and weight_map:
        weight_map.pop(rng.choice(list(weight_map)))
    elif r < 0.6:
        weight_map[rng.choice(list(weight_map) + ["extra"])] = rng.choice(
            ["other.safetensors", "../model.safetensors", "/etc/passwd", "", "model.safetensors", 1])
    index = {"metadata": {"total_size": rng.choice([0, 1, 2**63])}, "weight_map": weight_map}
    if rng.random() < 0.2:
        index = rng.choice([[], {"weight_map": []}, {"weight_map": {}}, {"metadata": 1}])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def mutate(folder: Path, rng: random.Random) -> str:
    """Reset `folder` to the example checkpoint and break it in one or two ways; returns a label."""
    for f in folder.iterdir():
        f.unlink()
    for f in EXAMPLE.iterdir():
        shutil.copyfile(f, folder / f.name)
    kinds = rng.sample(["config", "safetensors", "generation", "index"], rng.choice([1, 1, 1, 2]),
                       counts=[3, 4, 1, 1])
    kinds = sorted(set(kinds), key=kinds.index)
    for kind in kinds:
        if kind == "config":
            (folder / "config.json").write_text(_edit_config((folder / "config.json").read_text(), rng))
        elif kind == "safetensors":
            path = folder / "model.safetensors"
            path.write_bytes(_edit_safetensors(path.read_bytes(), rng))
        elif kind == "generation":
            path = folder / "generation_config.json"
            gen = json.loads(path.read_text())
            gen[rng.choice(["eos_token_id", "bos_token_id", "pad_token_id", "max_length"])] = _value(rng)
            path.write_text(_raw_number(json.dumps(gen), rng) if rng.random() < 0.3 else json.dumps(gen))
        else:
            _edit_index(folder, rng)
    return "+".join(kinds)


_REGISTRY = []  # the built-in recipes, loaded once (80 ms a load: most of a case's time otherwise)


def check_one(src: Path, out: Path, rng: random.Random) -> bool:
    """Convert as `thinconv.convert` does (open and plan, write); an archive written must open and
    verify. True when converted."""
    if not _REGISTRY:
        _REGISTRY.append(load_registry([]))
    options = ConvertOptions(dtype=rng.choice(["auto", "auto", "f32", "f16", "q8_0", "q4_0"]),
                             page_size=rng.choice([4096, 65536, 16 * 2**20]), probe=rng.random() < 0.25)
    with open_plan(src, options, registry=_REGISTRY[0]) as (ckpt, plan):
        write_archive(ckpt, plan, out, force=True)
    with open_archive(out) as a:
        report = a.verify()
        if not report.ok:
            raise AssertionError(f"convert wrote an archive that fails verify: {report.failures[:2]}")
    return True


def fuzz(cases: int, seed: int = 0, report_every: int = 0) -> Tally:
    """Run `cases` mutated checkpoints through convert; return the tally."""
    tally = Tally()
    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="thin-fuzz-ckpt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    src, out = base / "src", base / "out.thin"
    src.mkdir()
    try:
        t0 = time.perf_counter()
        for i in range(cases):
            kind = mutate(src, rng)
            case_rng = random.Random(rng.random())
            run_case(tally, f"case {i} (seed {seed}, {kind})", lambda: check_one(src, out, case_rng))
            tally.progress(i + 1, t0, report_every)
        tally.elapsed = time.perf_counter() - t0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return tally


if __name__ == "__main__":
    sys.exit(main('fuzz_checkpoints', __doc__, fuzz))
