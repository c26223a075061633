"""What every command shares: the typer app, the consoles, error reporting, progress, units."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Iterator

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from thinconv.errors import ThinError, UsageError

app = typer.Typer(help="Convert Hugging Face checkpoints into .thin archives, and inspect or verify them.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
recipe_app = typer.Typer(help="Work with recipes.", no_args_is_help=True)
# Text is printed as is (messages carry user data: paths, names with [brackets]); the few styled
# lines opt in with markup=True and escape what they interpolate. soft_wrap keeps long lines
# (paths, hashes) whole when output goes to a file or a narrow terminal.
out = Console(markup=False, highlight=False, soft_wrap=True)
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    raise typer.Exit(code)


@contextmanager
def reported() -> Iterator[None]:
    """Turn library errors into one line on stderr and the right exit code."""
    try:
        yield
    except UsageError as e:
        fail(str(e), 2)
    except ThinError as e:
        fail(str(e), 1)
    except KeyboardInterrupt:
        fail("interrupted (no partial output is left behind)", 1)


def byte_progress(enabled: bool = True) -> Progress:
    """A transient progress bar with bytes/s on stderr (only on a terminal); tasks are added by callers."""
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=True, disable=not enabled or not err.is_terminal)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
