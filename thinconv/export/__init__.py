"""Export a .thin archive back to the formats other tools read: a Hugging Face folder
(safetensors) that transformers loads, and a GGUF file in llama.cpp's conventions.

    from thinconv.export import export_safetensors, export_gguf
    export_safetensors("model.thin", "hf-folder/")           # dtype="auto" keeps every value exactly
    export_gguf("model.thin", "model.gguf")                  # needs the gguf package: thinconv[gguf]
"""

from __future__ import annotations

from thinconv.export.common import ExportResult
from thinconv.export.to_safetensors import EXPORT_DTYPES, export_safetensors


def export_gguf(*args, **kwargs) -> ExportResult:
    """Write an archive as a GGUF file (see `thinconv.export.to_gguf.export_gguf`)."""
    from thinconv.export.to_gguf import export_gguf as run  # lazy: imports the gguf package

    return run(*args, **kwargs)


__all__ = ["EXPORT_DTYPES", "ExportResult", "export_gguf", "export_safetensors"]
