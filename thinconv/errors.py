"""Every error thinconv reports to a user: one class per concern, one line per message.

The CLI prints ``str(error)`` and exits 1 (2 for :class:`UsageError`); it never shows a
traceback for these. Messages name the file, tensor, page or key path and what was expected.
"""

from __future__ import annotations


class ThinError(Exception):
    """Base class: a problem with the user's input or environment, reported in one line."""


class ThinFormatError(ThinError):
    """A .thin archive (or its manifest) breaks the THIN v0 contract."""


class PackError(ThinError):
    """The packer refused to write an archive (invalid manifest, bad or missing page)."""


class CheckpointError(ThinError):
    """A source checkpoint is missing, unsafe (pickle) or malformed (safetensors, index, config)."""


class RecipeError(ThinError):
    """A recipe file is invalid, or no recipe handles the checkpoint's architecture."""


class ConversionError(ThinError):
    """The checkpoint does not fit its recipe (unmapped/missing tensor, shape vs config, values)."""


class UsageError(ThinError):
    """A command-line option has an invalid value (exit code 2)."""


class JobsFileError(UsageError):
    """A batch jobs file is invalid (exit code 2); `problems` lists every problem found, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ExportError(ThinError):
    """An archive cannot be exported (unsupported family or feature, output exists, write failed)."""


class PublishError(ThinError):
    """Publishing to the Hugging Face Hub failed (bad repo id, no token, upload refused)."""
