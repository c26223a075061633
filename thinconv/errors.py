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


# ---------------------------------------------------------------- one short line per message

MAX_MESSAGE = 300  # characters a message is composed to stay within: lists show a few items, values are cut
MAX_LINE = 500  # the CLI's last resort: a longer line is cut in the middle (a long path + a long message)


def clipped(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, ending in "..." when cut."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def listed(items, limit: int = 3, sep: str = ", ", width: int | None = 80) -> str:
    """At most `limit` items joined by `sep`, then "and N more": lists in messages stay short
    however many problems (or names) there are. Items longer than `width` are cut (a name in a
    hostile file may be 5,000 characters); None keeps them whole (a list of messages)."""
    items = [text if width is None else clipped(text, width) for text in map(str, items)]
    shown = sep.join(items[:limit])
    joiner = " " if sep.strip() == "," else sep
    return f"{shown}{joiner}and {len(items) - limit} more" if len(items) > limit else shown


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """`message` on one line of at most `limit` characters: the middle of a longer one is cut, so
    that both what it names (the start) and what was expected (the end) remain."""
    text = " ".join(str(message).split())
    if len(text) <= limit:
        return text
    head = (limit - 3) * 2 // 3
    return text[:head] + " … " + text[len(text) - (limit - 3 - head):]


def shown(value, limit: int = 60) -> str:
    """A value as a message shows it: its repr, cut to `limit` characters (a config may hold a
    list of 3,000 items where a number belongs)."""
    return clipped(repr(value), limit)
