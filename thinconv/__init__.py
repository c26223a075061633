"""thinconv: convert Hugging Face checkpoints into .thin archives for single-token decode runtimes."""

from thinconv.errors import (
    CheckpointError, ConversionError, PackError, RecipeError, ThinError, ThinFormatError, UsageError,
)
from thinconv.format import Archive, open_archive, pack, validate_manifest

__version__ = "0.1.0"

open = open_archive  # noqa: A001 - `thinconv.open(path)` mirrors the built-in on purpose

__all__ = [
    "Archive", "CheckpointError", "ConversionError", "PackError", "RecipeError", "ThinError",
    "ThinFormatError", "UsageError", "open", "open_archive", "pack", "validate_manifest", "__version__",
]
