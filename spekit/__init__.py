"""spekit: lossless speculative decoding for Hugging Face models."""
from .config import SamplingConfig, UserError

__all__ = ["SamplingConfig", "Spekit", "UserError"]


def __getattr__(name: str):
    if name == "Spekit":          # keep `import spekit` light: the API pulls in transformers
        from .api import Spekit
        return Spekit
    raise AttributeError(name)
