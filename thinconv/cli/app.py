"""What every command shares: the typer app, the consoles, error reporting (text or JSON),
progress, units, tables.

Conventions every command follows (README, "Command line"): `-h`/`--help`, `--json` (one JSON
object on stdout; on failure `{"error": {"message", "kind", "exit_code"}}` on stdout instead of the
`error:` line on stderr, same exit code), binary units (KiB, MiB, GiB) in text and progress bars,
hashes printed whole, and help that ends with examples.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from thinconv.errors import MAX_LINE, JobsFileError, ThinError, UsageError, one_line

try:  # typer ≥ 0.24 vendors click as typer._click
    from typer._click import exceptions as _click_exc
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as _click_exc
    from click.globals import get_current_context


# ---------------------------------------------------------------- help: plain usage lines, no Python types

class _Argument(TyperArgument):
    """An argument shown by its metavar (`SRC`), never as `{src}` or with a `<str>` type."""

    def _usage_display_name(self) -> str:
        name = self.metavar or (self.name or "").upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    def display_type_rich(self, ctx) -> Optional[str]:
        return None


class _Option(TyperOption):
    """An option shown by its metavar (`--dtype DTYPE`); flags show no type at all (no `<bool>`)."""

    def display_type_rich(self, ctx) -> Optional[str]:
        if self.is_flag or self.count:
            return None
        return self.metavar or (self.name or "VALUE").upper()


def _plain(params: list) -> list:
    for p in params:
        if type(p) is TyperArgument:
            p.__class__ = _Argument
        elif type(p) is TyperOption:
            p.__class__ = _Option
    return params


def _error_kind(e: BaseException) -> str:
    """The `kind` of a JSON error: one word per error class (README, "JSON output")."""
    if isinstance(e, JobsFileError):
        return "jobs_file"
    if isinstance(e, ThinError):
        name = type(e).__name__
        for cls in type(e).__mro__:
            if cls.__module__ == "thinconv.errors" and cls is not ThinError:
                name = cls.__name__
                break
        kind = name.removesuffix("Error").removeprefix("Thin").lower()
        return kind or "error"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return "usage"


class Command(TyperCommand):
    def get_params(self, ctx) -> list:
        return _plain(super().get_params(ctx))


class Group(TyperGroup):
    """The root command: a JSON error object for usage errors too when `--json` is on the line."""

    def get_params(self, ctx) -> list:
        return _plain(super().get_params(ctx))

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if "--json" not in argv or not standalone_mode:
            return super().main(args=argv, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=standalone_mode, **extra)
        try:
            rv = super().main(args=argv, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                              **extra)
        except _click_exc.ClickException as e:
            print_json_error(e.format_message(), "usage", e.exit_code)
            sys.exit(e.exit_code)
        except _click_exc.Abort:
            print_json_error("interrupted", "interrupted", 1)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


class ThinTyper(typer.Typer):
    """Every command of the app and its sub-apps gets the plain help (`Command`)."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or Command, **kwargs)


def examples(*lines: str) -> str:
    """A command's help epilog: two or three runnable examples."""
    return "Examples:\n" + "\n".join(f"  {escape(line)}" for line in lines)


CONTEXT = {"help_option_names": ["-h", "--help"]}
app = ThinTyper(help="Convert Hugging Face checkpoints into .thin archives, and inspect or verify them.",
                no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False, cls=Group,
                context_settings=CONTEXT,
                epilog=examples("thinconv convert examples/tiny-llama tiny.thin",
                                "thinconv inspect tiny.thin",
                                "thinconv verify tiny.thin --json"))
recipe_app = ThinTyper(help="Work with recipes.", no_args_is_help=True, cls=Group, context_settings=CONTEXT,
                       epilog=examples("thinconv recipe check llama examples/tiny-llama",
                                       "thinconv recipe check my-recipe.toml ./ckpt --json"))


def _version(value: bool) -> None:
    if value:
        from thinconv import __version__

        out.print(f"thinconv {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Convert Hugging Face checkpoints into .thin archives, and inspect or verify them."""


# Text is printed as is (messages carry user data: paths, names with [brackets]); the few styled
# lines opt in with markup=True and escape what they interpolate. soft_wrap keeps long lines
# (paths, hashes) whole when output goes to a file or a narrow terminal.
out = Console(markup=False, highlight=False, soft_wrap=True)
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


class _WarningLines(logging.Handler):
    """The library's `thinconv` logger (e.g. "cannot reach the Hub") as `warning:` lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        err.print(f"[yellow]warning:[/] {escape(record.getMessage())}", markup=True)


_logger = logging.getLogger("thinconv")
if not any(isinstance(h, _WarningLines) for h in _logger.handlers):
    _logger.addHandler(_WarningLines(logging.WARNING))


# ---------------------------------------------------------------- errors

def json_mode() -> bool:
    """Whether the running command was given --json."""
    ctx = get_current_context(silent=True)
    while ctx is not None:
        if ctx.params.get("as_json"):
            return True
        ctx = ctx.parent
    return False


def print_json_error(message: str, kind: str, code: int, **more: Any) -> None:
    print_json({"error": {"message": message, "kind": kind, "exit_code": code, **more}})


def fail(message: str, code: int = 1, kind: str = "error", **more: Any) -> None:
    """Report a failure (one `error:` line on stderr, or the JSON error object on stdout under
    --json) and exit with `code`. A message is clipped so that its line has at most MAX_LINE characters
    (a jobs file's problems are one line each, and keep theirs)."""
    if kind != "jobs_file":
        message = one_line(message, MAX_LINE - len("error: "))  # the printed line: at most MAX_LINE
    if json_mode():
        print_json_error(message, kind, code, **more)
    else:
        err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    raise typer.Exit(code)


@contextmanager
def reported() -> Iterator[None]:
    """Turn library errors into one line on stderr (or a JSON error object) and the right exit code."""
    try:
        yield
    except JobsFileError as e:
        fail(str(e), 2, "jobs_file", problems=e.problems)
    except UsageError as e:
        fail(str(e), 2, "usage")
    except ThinError as e:
        fail(str(e), 1, _error_kind(e))
    except KeyboardInterrupt:  # Ctrl-C without the console script's handlers (thinconv.launch)
        fail("interrupted by SIGINT (no partial output is left behind)", 130, "interrupted")


# ---------------------------------------------------------------- units, progress, tables

def human(n: float) -> str:
    """A byte count in binary units (B, KiB, MiB, GiB, TiB): the one unit system of every output."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class BinarySpeedColumn(ProgressColumn):
    """Bytes per second in binary units (rich's TransferSpeedColumn is decimal only)."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("?" if speed is None else f"{human(speed)}/s", style="progress.data.speed")


def byte_progress(enabled: bool = True) -> Progress:
    """A transient progress bar with bytes/s on stderr (only on a terminal); tasks are added by callers.
    Binary units, like every size thinconv prints."""
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                    BinarySpeedColumn(), TimeRemainingColumn(), console=err, transient=True,
                    disable=not enabled or not err.is_terminal)


class RichProgress:
    """Adapter from the converter's phases to a rich progress bar with bytes/s."""

    def __init__(self, bar: Progress):
        self.bar, self.task = bar, None

    def start(self, phase: str, total: int) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(phase, total=total)

    def advance(self, n: int) -> None:
        self.bar.advance(self.task, n)


def print_table(table: Table) -> None:
    """A table at the terminal's width; untruncated (at its natural width) when stdout is not a
    terminal, so that logs and pipes get every name whole."""
    if out.is_terminal:
        out.print(table)
        return
    wide = out.options.update(width=1 << 16, max_width=1 << 16)
    width = Measurement.get(out, wide, table).maximum
    # Console.print(width=…) cannot exceed the console's width: a console of the table's own width.
    Console(width=max(width, 40), markup=False, highlight=False, soft_wrap=True).print(table)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def render_removed_temps(paths) -> None:
    """The stale temp files of this output that a killed earlier run left, and this run removed."""
    for p in paths:
        out.print(f"removed a stale temp file left by an interrupted run: {p}")
