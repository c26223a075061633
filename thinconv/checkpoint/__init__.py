"""Reading source checkpoints: strict SafeTensors files and local / hub checkpoint folders."""

from thinconv.checkpoint.safetensors import (
    NUMPY_DTYPES,
    SafetensorsFile,
    TensorEntry,
    open_safetensors,
)
from thinconv.checkpoint.source import (
    HUB_ALLOW_PATTERNS,
    Checkpoint,
    SourceFile,
    open_checkpoint,
)

__all__ = [
    "HUB_ALLOW_PATTERNS",
    "NUMPY_DTYPES",
    "Checkpoint",
    "SafetensorsFile",
    "SourceFile",
    "TensorEntry",
    "open_checkpoint",
    "open_safetensors",
]
