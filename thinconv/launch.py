"""The `thinconv` console script (pyproject's [project.scripts]): signal handlers first, then the CLI.

SIGINT and SIGTERM end every command the same way: the command stops, its temp output is
removed, one line goes to stderr (under --json, the JSON error object goes to stdout instead),
and the exit code is 128 + the signal (130, 143), as a shell reports a killed command.

The handlers are installed before anything heavy is imported (typer, rich, numpy …). Until the
command line is loaded, a signal ends the process at once — nothing has been written yet — rather
than surfacing as a traceback (or an ImportError) from whichever import it interrupted. Once a
command runs, the signal raises :class:`Interrupted` in the main thread, so that every clean-up on
the way up (temp files, worker threads, progress bars) runs; a signal that lands inside a lazy
import is re-delivered a moment later, outside it. Only stdlib modules are imported here.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import sys
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REDELIVER_AFTER = 0.02  # seconds: how soon a signal deferred out of an import comes back


class Interrupted(BaseException):
    """SIGINT / SIGTERM arrived while a command ran. A BaseException, so that neither an
    `except Exception` nor click's KeyboardInterrupt handling ("Aborted!") stops it on its way to
    :func:`main`; clean-ups written as `except BaseException` / `finally` run."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _SignalState:
    """What the handler knows: whether the command line is loaded, the first signal, whether
    Interrupted was raised (further signals then wait for the clean-up to finish)."""

    def __init__(self) -> None:
        self.running = False
        self.signum: int | None = None
        self.raised = False


_STATE = _SignalState()


def exit_code(signum: int) -> int:
    """128 + the signal number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def interrupted_message(signum: int) -> str:
    return f"interrupted by {signal.Signals(signum).name} (no partial output is left behind)"


def _report(signum: int) -> None:
    """The one line (or the JSON error object), written straight to the file descriptor: this
    may run inside a signal handler, where buffered streams may be mid-write."""
    message = interrupted_message(signum)
    if "--json" in sys.argv[1:]:
        text = json.dumps({"error": {"message": message, "kind": "interrupted", "exit_code": exit_code(signum)}},
                          indent=2) + "\n"
        fd = 1
    else:
        text, fd = f"error: {message}\n", 2
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except (OSError, ValueError, RuntimeError):
        pass  # a stream closed or being written by the interrupted code: the line still goes out
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    except OSError:
        pass


def _in_import(frame: FrameType | None) -> bool:
    """Whether the main thread is executing an import (module code run by importlib)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _redeliver(signum: int) -> None:
    threading.Event().wait(REDELIVER_AFTER)
    _thread.interrupt_main(signum)  # runs the Python handler again, in the main thread


def _on_signal(signum: int, frame: FrameType | None) -> None:
    st = _STATE
    if st.signum is None:
        st.signum = signum
    if not st.running:  # start-up (nothing written yet) or after the command (everything cleaned up)
        _report(st.signum)
        os._exit(exit_code(st.signum))  # no import left half-done, no exit handler interrupted
    if st.raised:
        return  # already stopping: let the clean-up finish
    if _in_import(frame):
        # An exception inside an import can be turned into an ImportError by extension modules, or
        # swallowed by an `except ImportError` fallback: raise it once the import is over.
        threading.Thread(target=_redeliver, args=(signum,), daemon=True).start()
        return
    st.raised = True
    raise Interrupted(st.signum)


def install_handlers() -> None:
    """Route SIGINT and SIGTERM to the handler above (main thread only; idempotent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def main() -> None:
    """The console script: handlers, then the command line, then one line if a signal stopped it."""
    install_handlers()
    from thinconv.cli import main as cli_main  # typer, rich and the command modules

    _STATE.running = True
    try:
        cli_main()
    except BaseException:
        if _STATE.signum is None:
            raise
    finally:
        _STATE.running = False  # interpreter shutdown (exit handlers) must not see Interrupted
    if _STATE.signum is None:
        return
    # Whatever ended the command (Interrupted, or an error a library made of it), it was the signal.
    _report(_STATE.signum)
    sys.exit(exit_code(_STATE.signum))
