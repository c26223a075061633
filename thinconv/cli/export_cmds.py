"""`export` (to a Hugging Face folder or a GGUF file) and `upload` (to the Hub, with a model card),
and what `convert --upload-repo / --model-card` runs after a conversion (library imports are lazy:
start-up time)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from thinconv.cli.app import RichProgress, app, byte_progress, err, examples, human, out, print_json, reported
from thinconv.errors import UsageError

FORMATS = ("safetensors", "gguf")


JSON = typer.Option(False, "--json", help="Print one JSON object (README: JSON output).")


@app.command("export", epilog=examples("thinconv export model.thin hf-model/ --to safetensors",
                                       "thinconv export model.thin hf-model/ --dtype bf16 --force",
                                       "thinconv export model-q8_0.thin model-q8_0.gguf --to gguf"))
def export_cmd(
    archive: Path = typer.Argument(..., metavar="ARCHIVE", help="A .thin archive."),
    output: Path = typer.Argument(..., metavar="OUTPUT", help="The folder to write (--to safetensors) or the .gguf "
                                  "file (--to gguf)."),
    to: str = typer.Option("safetensors", "--to", metavar="FORMAT", help="safetensors (a Hugging Face folder) | gguf (llama.cpp)"),
    dtype: str = typer.Option("auto", "--dtype", metavar="DTYPE", help="safetensors: auto (every value exactly: floats as stored, "
                                                       "quantized tensors dequantized to f32) | bf16 | f16 | f32"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", metavar="SIZE", help="safetensors: largest shard file "
                                       "(e.g. 5GB, 500MB); more than one adds model.safetensors.index.json."),
    tokenizer_pre: Optional[str] = typer.Option(None, "--tokenizer-pre", metavar="NAME", help="gguf: llama.cpp's BPE pre-tokenizer "
                                                "name, when it does not know the tokenizer (e.g. llama-bpe, qwen2)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    recipes: list[Path] = typer.Option([], "--recipes", metavar="DIR", help="Extra recipe folder (repeatable), for an archive "
                                       "converted with a user recipe."),
    as_json: bool = JSON,
) -> None:
    """Export an archive: a Hugging Face folder (config, tokenizer, safetensors under the source's
    tensor names; transformers loads it) or a GGUF file in llama.cpp's conventions."""
    with reported():
        if to not in FORMATS:
            raise UsageError(f"--to {to!r}: expected one of {', '.join(FORMATS)}")
        with byte_progress(enabled=not as_json) as bar:
            if to == "safetensors":
                from thinconv.export import export_safetensors

                if tokenizer_pre is not None:
                    raise UsageError("--tokenizer-pre applies to --to gguf only")
                result = export_safetensors(archive, output, dtype=dtype, force=force,
                                            max_shard_size=_size(max_shard_size), recipes=tuple(recipes),
                                            progress=RichProgress(bar))
            else:
                from thinconv.export import export_gguf

                if dtype != "auto":
                    raise UsageError("--dtype applies to --to safetensors only (a GGUF file keeps the archive's "
                                     "dtypes; quantized blocks are copied as they are)")
                result = export_gguf(archive, output, force=force, tokenizer_pre=tokenizer_pre,
                                     recipes=tuple(recipes), progress=RichProgress(bar))
    if as_json:
        print_json({"path": str(result.path), "format": result.format, "files": result.files, "size": result.size,
                    "tensors": result.tensors, "dtype": result.dtype})
        return
    what = f"{len(result.files)} files" if result.format == "safetensors" else "GGUF"
    out.print(f"[bold green]wrote[/] {escape(str(result.path))}  {what}, {human(result.size)}, "
              f"{result.tensors} tensors, {result.dtype}", markup=True)


def _size(text: str) -> int:
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise UsageError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))


@app.command("upload", epilog=examples("thinconv upload llama-1b-q8_0.thin my-org/Llama-3.2-1B-thin",
                                       "thinconv upload llama-1b-q8_0.thin my-org/Llama-3.2-1B-thin --check --private",
                                       "thinconv upload llama-1b-q8_0.thin my-org/Llama-3.2-1B-thin --check-result "
                                       "check.json"))
def upload_cmd(
    archive: Path = typer.Argument(..., metavar="ARCHIVE", help="A .thin archive."),
    repo_id: str = typer.Argument(..., metavar="ORG/NAME", help="The Hub model repo to publish to, ORG/NAME (created if missing)."),
    check: bool = typer.Option(False, "--check", help="Run `thinconv check` against the archive's probe first; "
                               "record it in the card, and upload nothing if it fails."),
    check_result: Optional[Path] = typer.Option(None, "--check-result", metavar="FILE", help="A saved `thinconv check --json` "
                                                "result to record in the card (e.g. a check --against the source)."),
    private: bool = typer.Option(False, "--private", help="Create the repo private."),
    as_json: bool = JSON,
) -> None:
    """Publish an archive to the Hugging Face Hub with a generated model card (README.md):
    verified first, then uploaded with $HF_TOKEN. --check-result takes the saved output of e.g.
    `thinconv check ARCHIVE --against SRC --json > check.json`."""
    from thinconv.publish import read_check_result, upload

    with reported():
        _check_repo_id(repo_id, "")
        if check and check_result is not None:
            raise UsageError("give --check or --check-result, not both")
        saved = read_check_result(check_result) if check_result is not None else None
        result = upload(archive, repo_id, private=private, run_check=check, check=saved)
    _report_upload(result, as_json)


def _report_upload(result, as_json: bool, *, stream=None) -> None:
    if as_json:
        print_json({"repo_id": result.repo_id, "url": result.url, "files": result.files,
                    "check": result.check and {"ok": result.check["ok"], "reference": result.check["reference"]}})
        return
    (stream or out).print(f"[bold green]published[/] {escape(result.url)}  ({', '.join(result.files)})", markup=True)


# ---------------------------------------------------------------- after `convert`

def _check_repo_id(repo_id: str, what: str) -> None:
    """A malformed ORG/NAME is a usage error (exit 2)."""
    from thinconv.errors import PublishError
    from thinconv.publish import check_repo_id

    try:
        check_repo_id(repo_id)
    except PublishError as e:
        raise UsageError(f"{what}: {e}" if what else str(e)) from None


def check_publish_options(upload_repo: Optional[str]) -> None:
    """Before converting: a malformed --upload-repo fails now, not after the conversion."""
    if upload_repo is not None:
        with reported():
            _check_repo_id(upload_repo, "--upload-repo")


def after_convert(output: Path, upload_repo: Optional[str], model_card: bool, as_json: bool) -> None:
    """`convert --model-card` writes the card beside the archive; `--upload-repo` publishes it.
    With --json, stdout holds the conversion's JSON only: these report on stderr."""
    if upload_repo is None and not model_card:
        return
    from thinconv.publish import upload, write_model_card

    stream = err if as_json else out
    with reported():
        if model_card:
            path = write_model_card(output, repo_id=upload_repo)
            stream.print(f"wrote model card {path}")
        if upload_repo is not None:
            result = upload(output, upload_repo, token=os.environ.get("HF_TOKEN"))
            _report_upload(result, False, stream=stream)
