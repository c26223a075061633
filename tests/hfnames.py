"""HF tensor names → canonical THIN names (spec §2.2), written out independently of the recipes
so tests can map a transformers model's state dict by hand."""

from __future__ import annotations

import re

HF_TO_CANONICAL: list[tuple[str, str]] = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"blk.\1.attn_\2_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2.weight"),
]


def canonical_name(hf_name: str) -> str:
    """The canonical name of an HF tensor; AssertionError for one the table does not know."""
    for pattern, repl in HF_TO_CANONICAL:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, repl, hf_name)
    raise AssertionError(f"unmapped HF tensor {hf_name}")
