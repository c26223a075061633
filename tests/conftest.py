"""Shared fixtures for the conversion tests: tiny real Hugging Face checkpoints, built once per
session with transformers (random init, then every parameter re-drawn so norms and biases are not
constant) and saved with save_pretrained. Each fixture exercises one feature:

    llama3   Llama-3: llama3 RoPE scaling, GQA, tied embeddings, bf16, tokenizer files
    llama2   Llama-2: MHA, untied head, f32, tokenizer.model
    mistral  Mistral: sliding_window on every layer, bf16
    qwen2    Qwen2: q/k/v bias, tied embeddings, pad token, bf16, tokenizer.json
    qwen3    Qwen3: q/k norm, head_dim 16 != hidden 32 / 4 heads, untied, f32
    sharded  Llama: GQA, untied, bf16, saved in 8 KB shards with an index

The expected manifest `model` of each is written out by hand from the config built here; nothing in
these fixtures is computed with thinconv.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

BIN = Path(sys.executable).parent / "thinconv"
KINDS = ("llama3", "llama2", "mistral", "qwen2", "qwen3", "sharded")
# Files a checkpoint may carry that thinconv must copy verbatim (spec §2.3), and one it must not.
TOKENIZER_FILES = {
    "llama3": {"tokenizer.json": b'{"version":"1.0","model":{"type":"BPE","vocab":{"a":0}}}\n',
               "tokenizer_config.json": b'{"model_max_length": 512, "bos_token": "<s>"}',
               "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}\u00e9{% endfor %}".encode(),
               "special_tokens_map.json": b"{}"},
    "llama2": {"tokenizer.model": bytes(range(256)) * 40},  # 10 KiB: several pages at --page-size 4KiB
    "qwen2": {"tokenizer.json": b'{"version":"1.0","added_tokens":[]}'},
}
ASSET_ORDER = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
               "tokenizer_config.json", "chat_template.jinja")


@dataclass
class Ckpt:
    kind: str
    path: Path
    dtype: str  # dtype of the saved matrices: "bf16" or "f32"
    model: dict  # the manifest `model` section expected for the default options
    tensors: dict[str, np.ndarray]  # every saved tensor, exactly as stored (bf16 via ml_dtypes)
    inv_freq: np.ndarray  # transformers' rotary_emb.inv_freq (f32, computed before any cast)

    @property
    def arch(self) -> str:
        return self.model["source_architecture"]


def _model(arch: str, family: str, *, hidden: int, inter: int, heads: int, kv: int, head_dim: int, vocab: int,
           max_pos: int, tied: bool, eps: float, theta: float, scaling=None, qkv_bias=False, qk_norm=False,
           window=None, layers=2, special=None) -> dict:
    """The expected manifest `model` section, spelled out (spec §2.1)."""
    return {
        "architecture": family, "source_architecture": arch, "hidden_size": hidden, "intermediate_size": inter,
        "num_layers": layers, "num_attention_heads": heads, "num_kv_heads": kv, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": max_pos, "tie_word_embeddings": tied,
        "norm": {"type": "rmsnorm", "eps": eps}, "mlp": {"type": "gated", "activation": "silu"},
        "attention": {"qkv_bias": qkv_bias, "o_bias": False, "qk_norm": qk_norm, "sliding_window": window,
                      "layer_types": ["sliding" if window else "full"] * layers, "scale": head_dim ** -0.5},
        "rope": {"theta": theta, "rotary_dim": head_dim, "layout": "half", "scaling": scaling,
                 "attention_factor": 1.0},
        "special_tokens": special,
    }


def _build(kind: str):
    """(transformers config, expected model, saved dtype, save kwargs, generation eos override)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
                          rope_parameters=rope, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        model = _model("LlamaForCausalLM", "llama", hidden=64, inter=128, heads=4, kv=2, head_dim=16, vocab=256,
                       max_pos=512, tied=True, eps=1e-5, theta=500000.0,
                       scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64},
                       special={"bos": 1, "eos": [2, 9], "pad": None})
        return cfg, model, "bf16", {}, [2, 9]
    if kind in ("llama2", "sharded"):
        kv = 4 if kind == "llama2" else 2
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=kv, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        model = _model("LlamaForCausalLM", "llama", hidden=32, inter=64, heads=4, kv=kv, head_dim=8, vocab=128,
                       max_pos=256, tied=False, eps=1e-5, theta=10000.0, special={"bos": 1, "eos": [2], "pad": None})
        if kind == "llama2":
            return cfg, model, "f32", {}, None
        return cfg, model, "bf16", {"max_shard_size": "8KB"}, None
    if kind == "mistral":
        cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
                            sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        model = _model("MistralForCausalLM", "mistral", hidden=32, inter=64, heads=4, kv=2, head_dim=8, vocab=128,
                       max_pos=256, tied=False, eps=1e-5, theta=1000000.0, window=16,
                       special={"bos": 1, "eos": [2], "pad": None})
        return cfg, model, "bf16", {}, None
    if kind == "qwen2":
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          tie_word_embeddings=True, bos_token_id=None, eos_token_id=5, pad_token_id=7)
        model = _model("Qwen2ForCausalLM", "qwen2", hidden=32, inter=64, heads=4, kv=2, head_dim=8, vocab=256,
                       max_pos=128, tied=True, eps=1e-6, theta=1000000.0, qkv_bias=True,
                       special={"bos": None, "eos": [5], "pad": 7})
        return cfg, model, "bf16", {}, None
    if kind == "qwen3":
        cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128,
                          rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          tie_word_embeddings=False, bos_token_id=3, eos_token_id=4)
        model = _model("Qwen3ForCausalLM", "qwen3", hidden=32, inter=64, heads=4, kv=2, head_dim=16, vocab=128,
                       max_pos=128, tied=False, eps=1e-6, theta=1000000.0, qk_norm=True,
                       special={"bos": 3, "eos": [4], "pad": None})
        return cfg, model, "f32", {}, None
    raise KeyError(kind)


def load_safetensors_file(path: Path) -> dict[str, np.ndarray]:
    """One file's tensors in data-offset order, via the safetensors package (not thinconv)."""
    import torch
    from safetensors.torch import load_file

    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    tensors = load_file(path)
    out = {}
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        t = tensors[name]
        out[name] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    return out


def load_safetensors_folder(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of every *.safetensors file in `folder`."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_safetensors_file(f))
    return out


def make_checkpoint(kind: str, folder: Path, seed: int = 0) -> Ckpt:
    import torch
    from transformers import AutoModelForCausalLM

    cfg, model, dtype, save_kwargs, gen_eos = _build(kind)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg)
    hf.eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in hf.named_parameters():  # tied weights appear once
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.25 * noise if p.ndim == 1 else 0.5 * noise)
    inv_freq = hf.model.rotary_emb.inv_freq.detach().to(torch.float32).numpy().copy()
    if gen_eos is not None:
        hf.generation_config.eos_token_id = gen_eos
    if dtype == "bf16":
        hf = hf.to(torch.bfloat16)
    hf.save_pretrained(folder, **save_kwargs)
    for name, data in TOKENIZER_FILES.get(kind, {}).items():
        (folder / name).write_bytes(data)
    if kind == "sharded":
        assert len(list(folder.glob("*.safetensors"))) > 2 and (folder / "model.safetensors.index.json").is_file()
    return Ckpt(kind, folder, dtype, model, load_safetensors_folder(folder), inv_freq)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ckpt]:
    """All six tiny checkpoints, built once."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    base = tmp_path_factory.mktemp("ckpts")
    return {k: make_checkpoint(k, base / k) for k in KINDS}


@pytest.fixture(params=KINDS)
def ckpt(request, ckpts) -> Ckpt:
    return ckpts[request.param]


@pytest.fixture
def llama_copy(ckpts, tmp_path) -> Ckpt:
    """A private, editable copy of the small f32 Llama-2 checkpoint (for breaking it)."""
    c = ckpts["llama2"]
    dst = tmp_path / "src"
    shutil.copytree(c.path, dst)
    return Ckpt(c.kind, dst, c.dtype, copy.deepcopy(c.model), dict(c.tensors), c.inv_freq)


# ---------------------------------------------------------------- helpers shared by the test files

def hf_source_name(canonical: str) -> str:
    """The HF tensor a canonical THIN name comes from, for every family here (written out, not the recipe)."""
    table = {
        "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
        "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    if canonical.startswith("blk."):
        _, layer, role = canonical.split(".", 2)
        return f"model.layers.{layer}.{table[role]}"
    return table[canonical]


def expected_names(model: dict) -> list[str]:
    """Decode order (spec §2.2), spelled out independently of thinconv.format.spec."""
    att = model["attention"]
    roles = ["attn_norm.weight", "attn_q.weight"] + (["attn_q.bias"] if att["qkv_bias"] else []) + \
        ["attn_k.weight"] + (["attn_k.bias"] if att["qkv_bias"] else []) + \
        ["attn_v.weight"] + (["attn_v.bias"] if att["qkv_bias"] else []) + \
        (["attn_q_norm.weight", "attn_k_norm.weight"] if att["qk_norm"] else []) + \
        ["attn_output.weight"] + (["attn_output.bias"] if att["o_bias"] else []) + \
        ["ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    names = ["rope_freqs"] if (model["rope"]["scaling"] or {}).get("type") in (None, "linear", "llama3", "yarn") else []
    names.append("token_embd.weight")
    for layer in range(model["num_layers"]):
        names += [f"blk.{layer}.{r}" for r in roles]
    names.append("output_norm.weight")
    if not model["tie_word_embeddings"]:
        names.append("output.weight")
    return names


def interleave_reference(a: np.ndarray, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Spec §2.1, literally: within each head, new row 2i = old row i, new row 2i+1 = old row i + rotary_dim/2."""
    out = a.copy()
    half = rotary_dim // 2
    for h in range(a.shape[0] // head_dim):
        base = h * head_dim
        for i in range(half):
            out[base + 2 * i] = a[base + i]
            out[base + 2 * i + 1] = a[base + i + half]
    return out


def run_cli(*args: str, env: dict | None = None, preexec_fn=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real console script in a subprocess (per-recipe sub-commands, env vars, rlimits).
    `env` adds variables to this process's environment; a None value removes one."""
    full_env = {**os.environ, "COLUMNS": "200"}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, env=full_env,
                          preexec_fn=preexec_fn, timeout=timeout)


def assert_one_line_error(stderr: str, *needles: str) -> str:
    """stderr is exactly one non-empty `error:` line, no traceback, mentioning every needle."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert "Traceback" not in stderr
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    return line


def leftovers(folder: Path) -> list[str]:
    """Files in `folder` (temp files of an interrupted write included)."""
    return sorted(p.name for p in Path(folder).iterdir())


def assert_convert_refused(src: Path, out_dir: Path, *needles: str) -> None:
    """`thinconv convert src out_dir/out.thin` exits 1 with one error line naming every needle, and
    leaves nothing in `out_dir` (created here)."""
    from typer.testing import CliRunner

    from thinconv.cli import app

    out_dir.mkdir(parents=True)
    r = CliRunner().invoke(app, ["convert", str(src), str(out_dir / "out.thin")])
    assert r.exit_code == 1, r.output
    assert_one_line_error(r.stderr, *needles)
    assert leftovers(out_dir) == []


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file by hand (bf16 and fp8 arrays included), tensors in the given order."""
    codes = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype("float64"): "F64", np.dtype("int64"): "I64", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, blobs, off = ({"__metadata__": metadata} if metadata is not None else {}), [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": codes[arr.dtype], "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


# ---------------------------------------------------------------- an independent .thin reader (spec §1)

@dataclass
class Thin:
    """A .thin archive parsed by hand from the spec (not with thinconv.format.reader)."""

    data: bytes
    manifest: dict
    pages: dict[str, bytes]  # id → stored bytes, in page-table order
    offsets: dict[str, int]

    NP = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype(ml_dtypes.bfloat16)}

    @classmethod
    def read(cls, path: Path) -> "Thin":
        import struct

        data = Path(path).read_bytes()
        magic, hlen, version, moff, mlen, ptoff, count, doff, _ = struct.unpack("<8sIIQQQQQ32s", data[:88])
        assert (magic, hlen, version, moff) == (b"THINv0\0\0", 88, 0, 88)
        manifest = json.loads(data[moff:moff + mlen])
        pages, offsets, pos = {}, {}, ptoff
        for _ in range(count):
            n = int.from_bytes(data[pos:pos + 2], "little")
            pid = data[pos + 2:pos + 2 + n].decode()
            off, stored, raw, flags, _ = struct.unpack("<QQQI32s", data[pos + 2 + n:pos + 62 + n])
            pos += 62 + n
            assert stored == raw and flags == 0
            pages[pid], offsets[pid] = data[off:off + stored], off
        assert len(data) == off + stored  # no trailing bytes
        return cls(data, manifest, pages, offsets)

    def tensor_entry(self, name: str) -> dict:
        return next(t for t in self.manifest["tensors"] if t["name"] == name)

    def raw(self, name: str) -> bytes:
        return b"".join(self.pages[p] for p in self.tensor_entry(name)["pages"])

    def array(self, name: str) -> np.ndarray:
        t = self.tensor_entry(name)
        return np.frombuffer(self.raw(name), self.NP[t["dtype"]]).reshape(t["shape"])

    def asset(self, name: str) -> bytes:
        a = next(a for a in self.manifest["assets"] if a["name"] == name)
        return b"".join(self.pages[p] for p in a["pages"])


def make_llama(folder: Path, hidden: int = 512, inter: int = 1536, layers: int = 8, vocab: int = 8192) -> Path:
    """A Llama checkpoint of ~130 MiB (f32): its q4_0 conversion takes a second or more."""
    heads, kv = 8, 4
    hd = hidden // heads
    folder.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(cfg))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
                       p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
    rng = np.random.default_rng(0)
    write_safetensors(folder / "model.safetensors",
                      {k: rng.standard_normal(s, dtype=np.float32) * 0.05 for k, s in shapes.items()})
    return folder
