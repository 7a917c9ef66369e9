"""specdecode: lossless speculative decoding for Llama/Qwen2-family models."""
from .params import ParamError, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "ParamError", "RequestOutput"]


def __getattr__(name):  # keep `import specdecode` light: torch loads on first use of LLM
    if name in ("LLM", "RequestOutput"):
        from . import api
        return getattr(api, name)
    raise AttributeError(name)
