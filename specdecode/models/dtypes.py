"""The one parser of dtype names, for the CLI (`--dtype`, `--draft-dtype`), `LLM(dtype=...)` and the
server. Torch-free, so the CLI parses its arguments before importing torch.

Accepted (any case): `auto` (the checkpoint's own float type; a GGUF file computes on its quantized
weights), `bfloat16`/`bf16`, `float32`/`fp32`/`float`, `float16`/`fp16`/`half`; a draft model also
takes `int8` (weights quantized per output channel) or `q4_0` (re-quantized to 4-bit blocks of 32).
The result is the canonical name.
"""
from __future__ import annotations

import argparse

from .config import ModelError

# canonical name -> the spellings vLLM, transformers and llama.cpp users type
CANONICAL = {"auto": ("auto",), "bfloat16": ("bfloat16", "bf16"), "float32": ("float32", "fp32", "float"),
             "float16": ("float16", "fp16", "half")}
INT8 = "int8"     # drafts only: see load_model
QUANTIZED = (INT8, "q4_0")   # the draft-only kinds: weights re-quantized at load
ALIASES = {alias: name for name, aliases in CANONICAL.items() for alias in aliases}
DTYPE_NAMES = tuple(ALIASES)          # every accepted spelling, canonical first within each group


def accepted(allow_int8: bool = False) -> str:
    """The accepted values, for messages: 'auto, bfloat16 (bf16), float32 (fp32, float), ...'."""
    groups = [name + (f" ({', '.join(aliases[1:])})" if len(aliases) > 1 else "")
              for name, aliases in CANONICAL.items()]
    return ", ".join(groups + (list(QUANTIZED) if allow_int8 else []))


def canonical_dtype(value, param: str = "dtype", allow_int8: bool = False) -> str | None:
    """`value` (a name in any case, a torch.dtype, or None) -> its canonical name, None for None.
    Anything else raises one ModelError naming `param` and listing the accepted values."""
    if value is None:
        return None
    text = str(value)
    key = text.lower().removeprefix("torch.") if text.startswith("torch.") or isinstance(value, str) else None
    if key in ALIASES:
        return ALIASES[key]
    if allow_int8 and key in QUANTIZED:
        return key
    raise ModelError(f"{param}: unknown dtype {value!r}; accepted (any case): {accepted(allow_int8)}")


class DtypeAction(argparse.Action):
    """`--dtype` / `--draft-dtype`: stores the canonical name; a bad value prints the one line
    `specdecode: error: --dtype: ...` and exits with code 2 (no usage block, no traceback)."""

    def __init__(self, option_strings, dest, allow_int8: bool = False, **kwargs) -> None:
        self.allow_int8 = allow_int8
        kwargs.setdefault("metavar", "DTYPE")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            setattr(namespace, self.dest, canonical_dtype(values, option_string or self.dest, self.allow_int8))
        except ModelError as exc:
            parser.exit(2, f"specdecode: error: {exc}\n")
