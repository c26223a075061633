"""Write examples/tiny-llama/: a tiny Llama-3-style checkpoint with a real BPE tokenizer.

Deterministic (fixed seeds, one CPU thread): rerunning it reproduces the same files. The model is
briefly trained on the text below so greedy decoding produces recognisable words, which makes
conversion mistakes visible as garbled text, not just as shifted logits.

    . /tmp/venv/bin/activate && python examples/make_tiny_llama.py [OUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 384
SEED = 0
TRAIN_STEPS = 300
CONTEXT = 64
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"  # ids 0, 1, 2

TEXT = """\
The river ran slowly through the old town, past the mill and under the stone bridge. In the
morning the water was grey and quiet, and the fishermen stood on the bank with their long rods.
By noon the sun had warmed the streets, and the market filled with voices, carts and the smell
of fresh bread.

A small library stood at the corner of the square. Its shelves held maps of distant coasts,
books about the stars, and notebooks written by travellers who had passed through the town many
years ago. The librarian knew every book by heart, and she liked to say that a good question is
worth more than a quick answer.

In the evening the children gathered by the river to watch the boats return. The light turned
gold, then red, and the first lamps were lit along the water. Somebody began to sing an old song
about the sea, and one by one the others joined in, until the whole bank was singing together.

Winter came early that year. Snow covered the roofs and the bridge, and the river froze at the
edges. The baker opened his shop before dawn, and the warm light from his window was the first
thing people saw on their way to work. Nobody hurried; the town had learned to wait for spring.

When spring arrived, the ice broke with a sound like distant thunder. The fields turned green,
the birds came back to the trees by the mill, and the market was busy again. The librarian
opened every window, and the wind carried the smell of rain and new grass between the shelves.
"""


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2 / Llama-3 style) with exactly VOCAB_SIZE entries; BOS is prepended."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT.split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer: trained {tok.get_vocab_size()} entries, expected {VOCAB_SIZE}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def build_model(tok: Tokenizer) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=None,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(cfg)  # initialised in f32; cast to bf16 after training


def train(model: LlamaForCausalLM, ids: list[int]) -> float:
    """A few hundred AdamW steps of next-token prediction on TEXT; returns the final loss."""
    data = torch.tensor(ids)
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, len(data) - CONTEXT, (8,), generator=gen)
        batch = torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss  # HF shifts the labels itself
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def main(out: Path) -> None:
    torch.set_num_threads(1)  # reductions in a fixed order → the same bytes on every run
    torch.use_deterministic_algorithms(True)
    tok = train_tokenizer()
    model = build_model(tok)
    ids = tok.encode(TEXT).ids
    loss = train(model, ids)
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    eos_ids = [tok.token_to_id(EOS), tok.token_to_id(EOT)]
    gen = GenerationConfig(bos_token_id=tok.token_to_id(BOS), eos_token_id=eos_ids, do_sample=False)
    gen.save_pretrained(out)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, model_max_length=512)
    fast.save_pretrained(out)
    # Name the class every transformers version knows (v5 writes its own "TokenizersBackend").
    tok_cfg = out / "tokenizer_config.json"
    cfg = json.loads(tok_cfg.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; these files are meant to be shared
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size} bytes, {len(ids)} training tokens, final loss {loss:.3f})")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "tiny-llama")
