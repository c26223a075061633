"""Tiny random checkpoints of any transformers family, for the family tests: built from a config
class (random init, then every parameter re-drawn so norms, biases and scales are not at their
neutral values), saved with save_pretrained, with the example checkpoint's tokenizer so that
`thinconv run` can decode. Nothing here is computed with thinconv."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama"
VOCAB = 384  # the example tokenizer's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build(config, folder: Path, *, dtype: str = "f32", seed: int = 0, save_kwargs: dict | None = None) -> Path:
    """Random model of `config`'s family, re-drawn, saved in `dtype` ("f32" / "bf16") to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval().float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is shared: drawn once
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))  # around 1, never 0
            elif p.ndim == 1 or name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder, **(save_kwargs or {}))
    for name in TOKENIZER_FILES:
        shutil.copy(EXAMPLE / name, folder / name)
    return folder


def edit_config(folder: Path, **changes) -> None:
    """Change keys of a saved config.json (a value of None removes the key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    path.write_text(json.dumps(config, indent=2))


def hf_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    """The source's logits under transformers (float32, eager)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def hf_greedy(folder: Path, prompt: str, n: int) -> str:
    """transformers' greedy continuation of `prompt` (text, as `thinconv run` prints it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def rewrite(archive: Path, out: Path, edit) -> Path:
    """A lying copy of `archive`: its manifest passed through `edit(manifest)` (which may also drop
    tensors), then packed again through the validating packer — so the lie is a *valid* archive."""
    from thinconv.format import open_archive
    from thinconv.format.staging import pack_staging, unpack

    staging = out.with_suffix(".staging")
    with open_archive(archive) as a:
        unpack(a, staging, force=True)
    manifest = json.loads((staging / "manifest.json").read_text())
    edit(manifest)
    keep = {p["id"] for p in manifest["pages"]}
    for f in (staging / "pages").rglob("*"):
        if f.is_file() and f.relative_to(staging / "pages").as_posix() not in keep:
            f.unlink()
    (staging / "manifest.json").write_text(json.dumps(manifest))
    pack_staging(staging, out, force=True)
    shutil.rmtree(staging)
    return out


def drop_tensors(manifest: dict, predicate) -> None:
    """Remove the tensors whose name satisfies `predicate`, with their pages and statistics."""
    gone = {t["name"] for t in manifest["tensors"] if predicate(t["name"])}
    manifest["tensors"] = [t for t in manifest["tensors"] if t["name"] not in gone]
    manifest["pages"] = [p for p in manifest["pages"] if p.get("tensor") not in gone]
    for section in ("stats", "quant"):
        for name in gone:
            manifest["validation"].get(section, {}).pop(name, None)
