"""The `thinconv` command line: parses arguments, calls the library, renders results.

One module per group of commands; each imports the library only inside its commands, so that
`thinconv inspect` does not pay for numpy, transformers or the converter (start-up time).
Exit codes: 0 success, 1 failure (invalid input, failed check), 2 usage error.
"""

from __future__ import annotations

import signal
import sys

# Importing the command modules registers their commands on `app`, in this (--help) order.
from thinconv.cli import archive_cmds  # noqa: F401  isort: skip
from thinconv.cli import convert_cmds  # noqa: F401  isort: skip
from thinconv.cli import batch_cmd  # noqa: F401  isort: skip
from thinconv.cli import check_cmds  # noqa: F401  isort: skip
from thinconv.cli import export_cmds  # noqa: F401  isort: skip
from thinconv.cli.app import app
from thinconv.cli.batch_cmd import LiveBatchView, PlainBatchLog
from thinconv.cli.convert_cmds import register_recipe_commands

__all__ = ["app", "main", "LiveBatchView", "PlainBatchLog", "register_recipe_commands"]


def main() -> None:
    # A file-size limit (RLIMIT_FSIZE) must surface as an error we clean up after, not a kill.
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    register_recipe_commands(sys.argv[1:])
    app()
