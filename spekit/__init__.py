"""spekit: lossless speculative decoding for Hugging Face models."""
from importlib import metadata

from .config import SamplingConfig, UserError

__all__ = ["SamplingConfig", "Spekit", "UserError", "__version__"]

try:
    __version__ = metadata.version("spekit")
except metadata.PackageNotFoundError:      # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name == "Spekit":          # keep `import spekit` light: the API pulls in transformers
        from .api import Spekit
        return Spekit
    raise AttributeError(name)
