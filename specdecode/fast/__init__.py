"""Native fast paths for CPU decoding (see README.md). Import is cheap; compilation is lazy.

This package is the one place where fast kernels live; `specdecode.models.transformer.eager_linear`
is the reference path kept for tests (`--eager`, `LLM(fast=False)`).
"""
from __future__ import annotations

import torch

from .linear import PackedLinear, available, reason, self_check
from .quant import QuantLinear, QuantWeight

__all__ = ["PackedLinear", "QuantLinear", "QuantWeight", "available", "reason", "self_check", "make_linear",
           "fused_decoder"]


def make_linear(weight, bias: torch.Tensor | None = None):
    """A projection x[..., in] -> [..., out]: the packed native kernel on CPU when it loads,
    else F.linear (PackedLinear falls back by itself); a QuantWeight runs the quantized kernel."""
    if isinstance(weight, QuantWeight):
        return QuantLinear(weight, bias)
    return PackedLinear(weight, bias)


def fused_decoder(model):
    """The fused native decoder for a Transformer built with make_linear (None if unavailable).
    Transformer.__init__ calls this through `make_linear.fused_decoder`."""
    from .decoder import fused_decoder as _fused
    return _fused(model)


make_linear.fused_decoder = fused_decoder
