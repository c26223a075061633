"""`check` and `run`: the reference decoder on an archive (library imports are lazy: start-up time)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from thinconv.cli.app import app, err, examples, out, print_json, print_table, reported
from thinconv.errors import UsageError


JSON = typer.Option(False, "--json", help="Print one JSON object (README: JSON output).")


@app.command(epilog=examples("thinconv check tiny.thin", "thinconv check tiny.thin --against examples/tiny-llama",
                             "thinconv check tiny.thin --prompt 'Once upon a time' --json"))
def check(archive: Path = typer.Argument(..., metavar="ARCHIVE", help="A .thin archive."),
          against: Optional[str] = typer.Option(None, "--against", metavar="SRC", help="Source checkpoint (folder or "
                                                "hub id) to compare with under transformers; default: the archive's "
                                                "probe."),
          prompt: Optional[str] = typer.Option(None, "--prompt", metavar="TEXT", help="Text, tokenized with the "
                                               "embedded tokenizer."),
          tokens: Optional[str] = typer.Option(None, "--tokens", metavar="IDS", help="Comma-separated token ids."),
          steps: Optional[int] = typer.Option(None, "--steps", metavar="N", help="Positions to compare (default: "
                                              "longer than any sliding window)."),
          revision: Optional[str] = typer.Option(None, "--revision", metavar="REV", help="Hub revision of --against."),
          strict: bool = typer.Option(False, "--strict", help="Also hold q4 archives to a KL bound."),
          recipes: list[Path] = typer.Option([], "--recipes", metavar="DIR", help="Extra recipe folder "
                                             "(repeatable): the archive's recipe, when it is not built in."),
          as_json: bool = JSON) -> None:
    """Prove that an archive computes what its source computes, on one token sequence.

    Proves, with --against SRC: the archive's model section is the one thinconv derives from SRC's
    config.json (every key, before decoding); and the reference decoder on the archive matches
    transformers on SRC at every position of a sequence long enough for each sliding window and
    RoPE switch (up to 256 positions), within the bounds of what the converter did to the weights:
    exact copies max rel diff ≤ 1e-3 and top-1 100 %; casts and transforms rel ≤ 5e-2, mean KL ≤
    1e-3; q8_0 mean KL ≤ 1e-2; q4 reported (--strict: ≤ 0.1). A lossy archive is compared twice:
    semantics, transformers on the archive's own dequantized weights, to the exact bound; fidelity,
    against the source's weights, to the lossy bounds. Without --against: the logits match the probe
    stored at conversion (top 8 logits of 8 positions, from the source weights).

    Does not prove: the same on other sequences, or past the positions decoded (the notes name any
    window or switch not reached); the absence of a difference smaller than the bound; without
    --against, the model section (compared only when the archive's hub source is in the local
    cache) and what 8 probe positions cannot show (special tokens, names, a window or switch beyond
    them); the semantics of weights a recipe transform changed (fidelity only); that other runtimes
    read the archive right; the bytes' integrity (thinconv verify)."""
    from thinconv.check import archive_tokenizer, parse_tokens, run_check
    from thinconv.checkpoint.source import open_checkpoint
    from thinconv.format.reader import open_archive
    from thinconv.recipe import load_registry

    with reported(), open_archive(archive) as a:
        if prompt is not None and tokens is not None:
            raise UsageError("give --prompt or --tokens, not both")
        if steps is not None and steps < 1:
            raise UsageError(f"--steps {steps}: expected ≥ 1")
        ids = None
        if tokens is not None:
            ids = parse_tokens(tokens, a.model["vocab_size"])
        elif prompt is not None:
            ids = archive_tokenizer(a).encode(prompt).ids
        if ids is not None and steps is not None:
            ids = ids[:steps]
        registry = load_registry(recipes)
        if against is not None:
            with open_checkpoint(against, revision=revision, token=os.environ.get("HF_TOKEN")) as ckpt:
                result = run_check(a, ids, ckpt, steps=steps, strict_q4=strict, registry=registry)
        else:
            result = run_check(a, ids, None, steps=steps, strict_q4=strict, registry=registry)
    if as_json:
        print_json(result.to_json())
    else:
        _print_result(archive, result)
    raise typer.Exit(0 if result.ok else 1)


def _print_result(archive: Path, result) -> None:
    """The text report: the model comparison, semantics, the fidelity table, notes, the verdict."""
    if result.model_compared:
        verdict = "differs" if result.model_differences else "matches"
        out.print(f"model section {verdict} the one the source's config implies")
    if result.semantics is not None:
        sem = result.semantics.summary()
        out.print(f"semantics ({result.semantics.reference} vs the reference decoder, exact bound): max |Δlogit| "
                  f"{sem['max_abs_diff']:.3g} (rel {sem['max_rel_diff']:.3g}), top-1 {100 * sem['top1_agreement']:.1f} %"
                  f" — {'PASS' if result.semantics.ok else 'FAIL'}")
    if result.positions:
        how = " (computed layer by layer: the model exceeds the decode memory budget)" if result.engine == "prefill" \
            else ""
        what = "fidelity: " if result.semantics is not None else ""
        table = Table(title=f"{what}{archive}: {result.dtype_class} archive vs {result.reference}{how}",
                      title_justify="left")
        for col in ("pos", "max |Δlogit|", "rel", "top-1", "KL"):
            table.add_column(col, justify="right")
        for p in result.positions:
            table.add_row(str(p.position), f"{p.max_abs:.3g}", f"{p.max_rel:.3g}", "✓" if p.top1_match else "✗",
                          f"{p.kl:.3g}")
        print_table(table)
        s = result.summary()
        out.print(f"overall: max |Δlogit| {s['max_abs_diff']:.3g} (rel {s['max_rel_diff']:.3g}), top-1 "
                  f"{100 * s['top1_agreement']:.1f} %, mean KL {s['mean_kl']:.3g}, max KL {s['max_kl']:.3g}")
    for note in result.notes:
        out.print(f"note: {note}")
    if result.ok and not result.thresholds:
        out.print(f"{result.dtype_class}: reported only (use --strict to apply a bound)")
    elif result.ok:
        both = "semantics within the exact bound, fidelity " if result.semantics is not None else ""
        out.print(f"[bold green]PASS[/] {both}within the {result.dtype_class} bounds "
                  f"({', '.join(f'{k} {v:g}' for k, v in result.thresholds.items())})", markup=True)
    else:
        for f in result.failures:
            err.print(f"[bold red]FAIL[/] {escape(f)}", markup=True)


@app.command(epilog=examples("thinconv run tiny.thin --prompt 'Once upon a time'",
                             "thinconv run tiny.thin --prompt 'Once upon a time' --max-new-tokens 8 --json"))
def run(archive: Path = typer.Argument(..., metavar="ARCHIVE", help="A .thin archive."),
        prompt: str = typer.Option(..., "--prompt", metavar="TEXT", help="Text to continue."),
        max_new_tokens: int = typer.Option(32, "--max-new-tokens", metavar="N", help="Tokens to generate at most."),
        as_json: bool = JSON) -> None:
    """Greedy generation with the reference decoder and the embedded tokenizer (the archive alone)."""
    from thinconv.check import ArchiveProvider, archive_tokenizer
    from thinconv.decoder import Decoder
    from thinconv.format.reader import open_archive

    with reported(), open_archive(archive) as a:
        tok = archive_tokenizer(a)
        ids = tok.encode(prompt).ids
        if not ids:
            raise UsageError("--prompt encodes to no tokens")
        decoder = Decoder(ArchiveProvider(a))
        if as_json:
            new = list(decoder.generate(ids, max_new_tokens))
            text = tok.decode(list(ids) + new, skip_special_tokens=True)
            shown = len(tok.decode(ids, skip_special_tokens=True))
            print_json({"path": str(archive), "prompt": prompt, "prompt_tokens": list(ids), "tokens": new,
                        "text": text[shown:]})
            return
        sys.stdout.write(prompt)
        sys.stdout.flush()
        # Decode prompt + new tokens together (a tokenizer may attach a space or half a
        # character to a token's neighbour) and print only what follows the prompt's text;
        # a trailing U+FFFD is a character still being completed by the next token.
        shown = len(tok.decode(ids, skip_special_tokens=True))
        seq = list(ids)
        text = ""
        for t in decoder.generate(ids, max_new_tokens):
            seq.append(t)
            text = tok.decode(seq, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        sys.stdout.write(text[shown:])
        sys.stdout.write("\n")
