"""Export an archive as a GGUF file in llama.cpp's conventions: the tensors, metadata keys and Q/K
layout llama.cpp's own `convert_hf_to_gguf.py` (commit 0c1e57098, llama-cpp-python 0.3.36) writes
for the same source — Llama, Mistral, Qwen2 and Qwen3. Other families are refused in one line.

What is copied and what is computed:

* Tensor names: the archive's names are llama.cpp's (token_embd, blk.N.attn_q, …, output).
* Bytes: q8_0 / q4_0 / q4_1 blocks are ggml's Q8_0 / Q4_0 / Q4_1 byte for byte and are copied as
  stored; f32 / f16 / bf16 matrices are copied too; 1-D tensors (norms, biases) are F32. A matrix
  a block-quantized archive could not quantize (cols not a multiple of 32, noted in
  validation.quant) is written F16, as the converter's q8_0 fallback does.
* Q/K rows: llama.cpp runs the `llama` architecture (Llama, Mistral) with interleaved RoPE pairs,
  so attn_q / attn_k (weights and biases) are written in the interleaved layout — the
  converter's `LlamaModel.permute`, identical to `--rope-layout interleaved` — and Qwen2 / Qwen3
  (NEOX RoPE) in the half layout. Rows are permuted whole, so quantized blocks move unchanged.
* `rope_freqs.weight` (llama3 RoPE scaling only) holds llama.cpp's per-dimension *divisors* (1,
  the factor, or the smoothed value), not the inverse frequencies of the archive's `rope_freqs`;
  computed here in float32 as the converter computes them with torch.
* Tensor order: rope_freqs first, then by source tensor name — the converter's order for a
  single-file checkpoint (it goes shard by shard, which the archive does not record, so a sharded
  source's GGUF lists the same tensors in another order).
* Hyperparameters come from the archive's `model` (the source config as read at conversion),
  `general.file_type` from the matrices' dtype (f32 0, f16 1, q4_0 2, q4_1 3, q8_0 7, bf16 32).
* Tokenizer: from the archive's tokenizer assets, by the converter's rules — tokenizer.model →
  SentencePiece (`llama` model; needs the sentencepiece package); a Llama-2-style byte-fallback
  tokenizer.json → gguf's LlamaHfVocab (needs transformers); any other BPE tokenizer.json → the
  `gpt2` model, with `tokenizer.ggml.pre` looked up by the hash of the tokenizer's ids for a fixed
  text (thinconv.export.gguf_pre), or given as `tokenizer_pre` when llama.cpp does not know it.
  Special ids, merges and the chat template come from gguf's SpecialVocab over the same files.
* `general.*`: the converter derives name, basename, finetune, version and size label from the
  model folder's name (and a README, which archives do not keep), sampling keys from
  generation_config.json. Here gguf's own `Metadata.load` runs on the archive's assets in a folder
  named after the source repo (validation.source.repo_id, e.g. `meta-llama/Llama-3.2-1B` →
  `Llama-3.2-1B`), or after the archive's file name for a local source: the keys the converter
  writes for a clone of that repo. No license, tags, languages or base_model keys (no README).
  `general.sampling.penalty_repeat` is taken from generation_config's repetition_penalty as
  llama.cpp's gguf-py does (PyPI's gguf 0.19.0 misses it).

Streaming: the GGUF header, metadata and tensor table are written first, then each tensor in row
chunks; the file is written beside the target and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from thinconv.errors import ExportError
from thinconv.export.common import (ExportResult, Progress, TensorRows, archive_recipe, atomic_file, cast,
                                    check_untransformed, no_progress, rope_order)
from thinconv.format import dtypes, schema
from thinconv.format.reader import Archive, open_archive
from thinconv.mapping import Entry

# HF class → (GGUF architecture, layout of Q/K rows llama.cpp expects, config class always has head_dim)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "interleaved", True),
    "MistralForCausalLM": ("llama", "interleaved", True),
    "Qwen2ForCausalLM": ("qwen2", "half", False),
    "Qwen3ForCausalLM": ("qwen3", "half", True),
}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_GGML = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
_FILE_TYPE = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}
_TOKENIZER_ASSETS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                     "tokenizer_config.json", "chat_template.jinja")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ExportError("GGUF export needs the gguf package: pip install 'thinconv[gguf]'") from None
    return gguf


@dataclass
class GgufTensor:
    name: str
    ggml_type: str  # GGMLQuantizationType name
    shape: list[int]  # numpy order ([rows, cols]); GGUF stores it reversed
    nbytes: int
    write: Callable[[object, Progress], None]  # writes the bytes to a file object


def supported(model: dict) -> str | None:
    """Why the archive's model cannot be exported to GGUF yet (None: it can)."""
    arch, family = model["source_architecture"], model["architecture"]
    if arch not in ARCHITECTURES or family not in FAMILIES:
        return (f"{family} ({arch}) cannot be exported to GGUF yet (supported: Llama, Mistral, Qwen2, Qwen3)")
    if schema.value(model, "moe") is not None:
        return f"{family} with mixture-of-experts layers cannot be exported to GGUF yet"
    rope = model["rope"]
    if rope["rotary_dim"] != model["head_dim"]:
        return f"partial rotary embeddings (rotary_dim {rope['rotary_dim']} < head_dim {model['head_dim']}) " \
               f"cannot be exported to GGUF yet"
    kind = (rope["scaling"] or {}).get("type")
    gguf_arch = ARCHITECTURES[arch][0]
    if kind not in (None, "linear", "yarn") and not (kind == "llama3" and gguf_arch == "llama"):
        return f"RoPE scaling {kind!r} on {family} cannot be exported to GGUF yet"
    return None


def _file_type(archive: Archive) -> str:
    """The matrices' dtype (the most common one in a mixed archive)."""
    counts: dict[str, int] = {}
    quant = archive.manifest["validation"].get("quant") or {}
    for t in archive.manifest["tensors"]:
        if len(t["shape"]) >= 2 and "note" not in (quant.get(t["name"]) or {}):
            counts[t["dtype"]] = counts.get(t["dtype"], 0) + 1
    return max(sorted(counts), key=counts.get)


def llama3_rope_factors(dim: int, theta: float, scaling: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling (conversion/llama.py `generate_extra_tensors`), in
    float32 with torch's semantics: `scalar / tensor` is reciprocal() × scalar (two roundings).
    The base frequencies use numpy's powf, which matched torch's pow for every Llama 3.x config
    (for a few other theta/dim pairs the two differ by one ulp)."""
    f32 = np.float32
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    freqs = f32(1.0) / (f32(theta) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    low_wavelen, high_wavelen = old / low, old / high  # Python floats, as in the converter
    out = []
    for freq in freqs:
        wavelen = (f32(1) / f32(freq)) * f32(2 * math.pi)
        if wavelen < f32(high_wavelen):
            out.append(f32(1))
        elif wavelen > f32(low_wavelen):
            out.append(f32(factor))
        else:
            smooth = ((f32(1) / wavelen) * f32(old) - f32(low)) / f32(high - low)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(out, dtype=f32)


def _tensors(archive: Archive, gguf_arch: str, qk_layout: str, gguf) -> list[GgufTensor]:
    model = archive.model
    out: list[GgufTensor] = []
    scaling = model["rope"]["scaling"] or {}
    if gguf_arch == "llama" and scaling.get("type") == "llama3":
        factors = llama3_rope_factors(model["head_dim"], model["rope"]["theta"], scaling)
        out.append(GgufTensor("rope_freqs.weight", "F32", [factors.size], factors.nbytes,
                              lambda f, p, a=factors: (f.write(a.tobytes()), p.advance(a.nbytes))))
    quant = archive.manifest["validation"].get("quant") or {}
    tensors = [t for t in archive.manifest["tensors"] if t["source"]]
    tensors.sort(key=lambda t: Entry.parse(t["source"][0]).name)
    for t in tensors:
        name, shape, dt = t["name"], t["shape"], t["dtype"]
        rows = TensorRows(archive, name, rope_order(archive, name, qk_layout))
        if len(shape) >= 2 and "note" in (quant.get(name) or {}):
            out.append(GgufTensor(name, "F16", shape, rows.rows * rows.cols * 2, _writer(rows, "f16")))
        else:
            out.append(GgufTensor(name, _GGML[dt], shape, rows.rows * dtypes.row_bytes(dt, rows.cols),
                                  _writer(rows, None)))
    return out


def _writer(rows: TensorRows, cast_to: str | None) -> Callable[[object, Progress], None]:
    def write(f, progress: Progress) -> None:
        for a in range(0, rows.rows, rows.chunk_rows):
            b = min(a + rows.chunk_rows, rows.rows)
            chunk = rows.stored(a, b) if cast_to is None else cast(rows.floats(a, b, "f32"), cast_to)
            data = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
            f.write(data)
            progress.advance(data.nbytes)
        rows.release()
    return write


def _hparams(archive: Archive) -> dict:
    try:
        return json.loads(archive.asset_bytes("config.json"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"{archive.path.name}: asset config.json is not valid JSON ({e})") from None


def _add_parameters(w, gguf, model: dict, hparams: dict, gguf_arch: str, has_head_dim: bool, file_type: str) -> None:
    """TextModel.set_gguf_parameters (+ LlamaModel's) for these architectures, in its key order."""
    w.add_block_count(model["num_layers"])
    w.add_context_length(model["max_position_embeddings"])
    w.add_embedding_length(model["hidden_size"])
    w.add_feed_forward_length(model["intermediate_size"])
    w.add_head_count(model["num_attention_heads"])
    w.add_head_count_kv(model["num_kv_heads"])
    scaling = model["rope"]["scaling"] or {}
    kind, factor = scaling.get("type"), scaling.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if (ext := scaling.get("extrapolation_factor")) is not None:
            w.add_rope_scaling_yarn_ext_factor(ext)
        if (attn := scaling.get("attention_factor", scaling.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
        if (fast := scaling.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(fast)
        if (slow := scaling.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(slow)
    w.add_rope_freq_base(model["rope"]["theta"])
    w.add_layer_norm_rms_eps(model["norm"]["eps"])
    # The converter writes key/value length when the transformers config has head_dim: Llama,
    # Mistral and Qwen3 configs always do, Qwen2's only when config.json spells it out.
    if has_head_dim or hparams.get("head_dim") is not None:
        w.add_key_length(model["head_dim"])
        w.add_value_length(model["head_dim"])
    w.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPE[file_type]))
    if gguf_arch == "llama":
        w.add_vocab_size(model["vocab_size"])
        w.add_rope_dimension_count(model["head_dim"])


def _metadata_folder(archive: Archive) -> str:
    repo_id = (archive.manifest["validation"].get("source") or {}).get("repo_id")
    name = repo_id.rsplit("/", 1)[-1] if isinstance(repo_id, str) and repo_id else archive.path.stem
    return name or "model"


# ---------------------------------------------------------------- tokenizer (the converter's set_vocab)

def _looks_special(token: str) -> bool:
    """TextModel.does_token_look_special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _bpe_vocab(folder: Path, vocab_size: int, tokenizer_pre: str | None, gguf) -> tuple[list[str], list[int], str]:
    """TextModel.get_vocab_base (the `gpt2` tokenizer model) from tokenizer.json, with the
    `tokenizers` library instead of transformers' AutoTokenizer (same vocabulary, same ids)."""
    from tokenizers import Tokenizer

    from thinconv.export.gguf_pre import CHKTXT, PRE_TOKENIZERS

    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception type
        raise ExportError(f"asset tokenizer.json cannot be loaded ({e})") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    if vocab and max(vocab.values()) >= vocab_size:
        raise ExportError(f"asset tokenizer.json has token id {max(vocab.values())}, beyond vocab_size {vocab_size}")
    chkhsh = hashlib.sha256(str(tok.encode(CHKTXT).ids).encode()).hexdigest()
    pre = tokenizer_pre or PRE_TOKENIZERS.get(chkhsh)
    if pre is None:
        raise ExportError(f"asset tokenizer.json: llama.cpp does not know this BPE pre-tokenizer (hash {chkhsh}); "
                          f"name the closest one with --tokenizer-pre (e.g. llama-bpe, qwen2, gpt-2)")
    added = tok.get_added_tokens_decoder()
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = reverse[i]
        if i in added:
            if not added[i].normalized:  # the converter re-encodes these (a no-op for ordinary tokens)
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if added[i].special or _looks_special(token):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(token)
    return tokens, types, pre


def _spm_vocab(folder: Path, vocab_size: int, gguf) -> tuple[list[bytes], list[float], list[int]]:
    """TextModel._create_vocab_sentencepiece (no added_tokens.json: archives do not keep it)."""
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ExportError("asset tokenizer.model is a SentencePiece model: GGUF export needs the sentencepiece "
                          "package for it (pip install sentencepiece)") from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(folder / "tokenizer.model"))
    except (OSError, RuntimeError) as e:
        raise ExportError(f"asset tokenizer.model cannot be loaded ({e})") from None
    T = gguf.TokenType
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(T.UNUSED)] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        kind = T.NORMAL
        if sp.IsUnknown(i):
            kind = T.UNKNOWN
        elif sp.IsControl(i):
            kind = T.CONTROL
        elif sp.IsUnused(i):
            kind = T.UNUSED
        elif sp.IsByte(i):
            kind = T.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), int(kind)
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        decoder = json.loads(config_path.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        for key, data in decoder.items():
            i, token = int(key), data["content"]
            if i >= vocab_size:
                continue
            if data.get("special") or _looks_special(token):
                types[i] = int(T.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types[i] = int(T.USER_DEFINED)
            scores[i], tokens[i] = -1000.0, token.encode("utf-8")
    return tokens, scores, types


def _llama_hf_style(folder: Path) -> bool:
    """A Llama-2-style tokenizer.json (BPE with byte fallback, a Sequence decoder): gguf's LlamaHfVocab."""
    try:
        tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        m = tj["model"]
        if m["type"] == "BPE" and m.get("ignore_merges", False) and not m.get("byte_fallback", True):
            return False
        return m["type"] == "BPE" and bool(m.get("byte_fallback", False)) and tj["decoder"]["type"] == "Sequence"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _add_vocab(w, gguf, folder: Path, model: dict, gguf_arch: str, tokenizer_pre: str | None) -> None:
    vocab_size = model["vocab_size"]
    if gguf_arch == "llama" and (folder / "tokenizer_config.json").is_file():
        tc = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if (aps := tc.get("add_prefix_space")) is not None:
            w.add_add_space_prefix(aps)
    if (folder / "tokenizer.model").is_file():
        tokens, scores, types = _spm_vocab(folder, vocab_size, gguf)
        _add_llama_vocab(w, gguf, folder, tokens, scores, types)
    elif (folder / "tokenizer.json").is_file() and gguf_arch == "llama" and _llama_hf_style(folder):
        try:
            vocab = gguf.LlamaHfVocab(folder)
        except ImportError:
            raise ExportError("asset tokenizer.json is a Llama-2-style (byte fallback) tokenizer: GGUF export reads it "
                              "with transformers (pip install 'thinconv[check]')") from None
        tokens, scores, types = map(list, zip(*vocab.all_tokens())) if vocab.vocab_size else ([], [], [])
        _add_llama_vocab(w, gguf, folder, tokens, scores, [int(t) for t in types])
    elif (folder / "tokenizer.json").is_file():
        tokens, types, pre = _bpe_vocab(folder, vocab_size, tokenizer_pre, gguf)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w, quiet=True)
    else:
        raise ExportError("the archive has no tokenizer (neither tokenizer.json nor tokenizer.model): GGUF files "
                          "carry one")
    if gguf_arch == "llama" and vocab_size == 32016:  # CodeLlama's infill tokens
        special = gguf.SpecialVocab(folder, load_merges=False,
                                    special_token_types=["prefix", "suffix", "middle", "eot"])
        for kind, i in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
            special._set_special_token(kind, i)
        special.add_to_gguf(w, quiet=True)
    if gguf_arch == "llama" and vocab_size == 49152:  # Granite's small models
        w.add_add_bos_token(False)


def _add_llama_vocab(w, gguf, folder: Path, tokens: list, scores: list, types: list) -> None:
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


# ---------------------------------------------------------------- the file

def export_gguf(archive: Archive | str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
                tokenizer_pre: str | None = None, recipes: tuple[str | os.PathLike, ...] = (),
                progress: Progress | None = None) -> ExportResult:
    """Write `archive` as a GGUF file at `out` (see the module docstring). `tokenizer_pre` names
    llama.cpp's BPE pre-tokenizer when it does not know the tokenizer's hash (or to override it)."""
    if not isinstance(archive, Archive):
        with open_archive(archive) as a:
            return export_gguf(a, out, force=force, tokenizer_pre=tokenizer_pre, recipes=recipes, progress=progress)
    gguf = _gguf()
    import logging

    logging.getLogger("gguf").setLevel(logging.ERROR)  # its info lines would interleave with ours
    out = Path(out)
    model = archive.model
    problem = supported(model)
    if problem:
        raise ExportError(f"{archive.path.name}: {problem}")
    check_untransformed(archive, archive_recipe(archive, recipes))
    gguf_arch, qk_layout, has_head_dim = ARCHITECTURES[model["source_architecture"]]
    if gguf_arch == "qwen3" and "reranker" in _metadata_folder(archive).lower():
        raise ExportError(f"{archive.path.name}: Qwen3 rerankers cannot be exported to GGUF yet")
    hparams = _hparams(archive)
    file_type = _file_type(archive)
    progress = progress or no_progress()
    tensors = _tensors(archive, gguf_arch, qk_layout, gguf)

    w = gguf.GGUFWriter(path=None, arch=gguf_arch)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                          raw_dtype=getattr(gguf.GGMLQuantizationType, t.ggml_type))
    with tempfile.TemporaryDirectory(prefix="thinconv-gguf-") as tmp:
        folder = Path(tmp) / _metadata_folder(archive)
        folder.mkdir()
        for asset in archive.manifest["assets"]:
            if asset["name"] in _TOKENIZER_ASSETS:
                (folder / asset["name"]).write_bytes(archive.asset_bytes(asset["name"]))
        # ModelBase.prepare_metadata
        total, shared, expert, n_expert = w.get_total_parameter_count()
        md = gguf.Metadata.load(None, folder, None, total)
        if md.sampling_penalty_repeat is None and (folder / "generation_config.json").is_file():
            gen = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
            md.sampling_penalty_repeat = gen.get("repetition_penalty")
        if md.name is None:
            md.name = folder.name
        if md.size_label is None and total > 0:
            md.size_label = gguf.size_label(total, shared, expert, n_expert)
        w.add_type(gguf.GGUFType.MODEL)
        md.set_gguf_meta_model(w)
        _add_parameters(w, gguf, model, hparams, gguf_arch, has_head_dim, file_type)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_vocab(w, gguf, folder, model, gguf_arch, tokenizer_pre)

    progress.start("exporting", sum(t.nbytes for t in tensors))
    with atomic_file(out, force) as tmp_path:
        try:
            w.write_header_to_file(path=tmp_path)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            f = w.fout[0]
            for t in tensors:
                w.write_padding(f, f.tell())
                t.write(f, progress)
            w.write_padding(f, f.tell())  # GGUFWriter pads the last tensor too
            f.flush()
            os.fsync(f.fileno())
        finally:
            w.close()
    size = out.stat().st_size
    return ExportResult(out, "gguf", [out.name], size, len(tensors), _FILE_TYPE[file_type])
