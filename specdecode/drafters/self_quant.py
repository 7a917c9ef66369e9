"""Quantized self-drafting: the target's own weights at lower precision draft for it.

No second model and no training: the draft is the target re-quantized (int8 per output channel,
or 4-bit blocks, Q4_0), computed by the native quantized kernels; it reads a half (int8) or
under a third (Q4_0) of a bf16 target's bytes per token and agrees with it on most tokens. It
runs as a draft model (drafters/model.py), with its own KV cache.

It needs dense weights above 4 bits to start from: a bf16 / fp32 target, or a GGUF file loaded
with `--weights dense` (a file's own 4-bit blocks are already what the draft would be).
"""
from __future__ import annotations

from ..models.config import ModelError
from .base import DrafterError
from .model import ModelDrafter
from .registry import register

KINDS = ("int8", "q4_0")


@register("self-quant")
class SelfQuantDrafter(ModelDrafter):
    def __init__(self, target, draft=None, self_quant: str = "int8", **_: object) -> None:
        if draft is not None:
            raise DrafterError("method self-quant drafts with the target's own weights: drop --draft")
        if self_quant not in KINDS:
            raise DrafterError(f"self_quant must be one of {', '.join(KINDS)}, got {self_quant!r}")
        if getattr(target.model, "quantized", False):
            raise DrafterError(f"method self-quant: target {target.name} already computes on its quantized "
                               f"weights ({target.weights_kind}); load it dense (--weights dense / --dtype bf16) "
                               f"to draft with a lower-precision copy")
        from ..models.loader import quantized_copy
        try:
            copy = quantized_copy(target, self_quant)
        except ModelError as exc:
            raise DrafterError(f"method self-quant: {exc}") from None
        super().__init__(target, copy)
