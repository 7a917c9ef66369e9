"""Native fast paths for CPU decoding (see README.md). Import is cheap; compilation is lazy.

This package is the one place where fast kernels live; `specdecode.models.transformer.eager_linear`
is the reference path kept for tests (`--eager`, `LLM(fast=False)`).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .linear import PackedLinear, available, reason, self_check
from .quant import QuantLinear, QuantWeight

__all__ = ["PackedLinear", "QuantLinear", "QuantWeight", "available", "reason", "self_check", "make_linear",
           "fused_decoder", "top_k_indices"]


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


def delta_net_kernels():
    """The native Gated DeltaNet kernels (deltanet.py), None if unavailable. Qwen35Transformer.__init__
    calls this through `make_linear.delta_net`."""
    from .deltanet import kernels
    return kernels()


make_linear.delta_net = delta_net_kernels


def row_ops():
    """The native per-row ops (rowops.py: norms, SwiGLU, the attention gate), None if unavailable.
    Qwen35Transformer.__init__ calls this through `make_linear.row_ops`."""
    from .rowops import row_ops as _row_ops
    return _row_ops()


make_linear.row_ops = row_ops


def hybrid_stack(model):
    """Qwen3.5's layer stack in one native call per short pass (hybrid.py), None if it cannot run
    `model`. Qwen35Transformer.__init__ calls this through `make_linear.hybrid_stack`."""
    from .hybrid import hybrid_stack as _stack
    return _stack(model)


make_linear.hybrid_stack = hybrid_stack


def top_k_indices(values: torch.Tensor,          # [..., n] float32 (a step's logits)
                  k: int) -> torch.Tensor:       # -> [..., k] int64, best first
    """Indices of the k largest values along the last dimension, best first: the native scan on a
    contiguous float32 CPU tensor (one pass over the values, many times faster than torch.topk; a
    tie keeps the lower index first, -1 where a row has fewer than k values above -inf), else
    torch.topk. Token recycling reads the target's top-k at every step, also where it does not
    draft."""
    topk = _topk_fn() if values.device.type == "cpu" else None
    if topk is None or values.dtype != torch.float32 or not 1 <= k <= 64 or k > values.shape[-1] \
            or not values.is_contiguous():
        return values.topk(k, dim=-1).indices
    out = torch.empty(*values.shape[:-1], k, dtype=torch.int64)
    topk(values.data_ptr(), values.numel() // values.shape[-1], values.shape[-1], k, out.data_ptr())
    return out


def argmax_last(values: torch.Tensor) -> torch.Tensor:     # [..., n] -> [...] int64
    """Index of the largest value along the last dimension (a tie: the lower index): the native
    scan on a contiguous float32 CPU tensor, else torch. A greedy step takes its target tokens so:
    torch's max over a whole vocabulary is the largest cost of a small model's step outside its
    pass, and the scan is a fraction of it (specdecode/engine/README.md, "Rules the code keeps"). A
    row with nothing but NaN or -inf goes to torch, which answers for it as plain torch code would."""
    scan = _topk_fn() if values.device.type == "cpu" and values.dtype == torch.float32 else None
    if scan is not None and values.is_contiguous() and values.numel():
        # as few torch calls as can be: right after a step's pass each is dear (its code and data left
        # the caches), so top_k_indices(values, 1)[..., 0] checked with a min would cost several
        out = torch.empty(values.shape[:-1], dtype=torch.int64)
        scan(values.data_ptr(), values.numel() // values.shape[-1], values.shape[-1], 1, out.data_ptr())
        if -1 not in out.view(-1).tolist():
            return out
    return values.max(dim=-1).indices


@functools.cache
def _topk_fn():
    """The native top-k (argument types declared once), or None without the kernels."""
    from .linear import _load
    lib = _load()["lib"]
    if lib is None:
        return None
    fn = lib.sd_topk_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = None
    return fn
