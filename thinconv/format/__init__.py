"""The THIN v0 format core: constants, manifest validation, packer and reader.

Imports nothing from transformers, torch or huggingface_hub.
"""

from thinconv.format.manifest import ValidationReport, parse_manifest, validate_manifest
from thinconv.format.reader import Archive, VerifyReport, open_archive
from thinconv.format.writer import BufferPage, FilePage, LazyPage, PackResult, PageSource, pack

__all__ = [
    "Archive", "BufferPage", "FilePage", "LazyPage", "PackResult", "PageSource", "ValidationReport",
    "VerifyReport", "open_archive", "pack", "parse_manifest", "validate_manifest",
]
