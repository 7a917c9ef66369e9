"""Per-row ops of a layer that runs eagerly around native projections (rowops.c): Qwen3.5's fp32
RMS norms (the residual add folded in), q / k head norms with partial RoPE, SwiGLU and the attention
output gate, each one native call where the eager form is several small torch ops.

`RowOps` answers as `models/qwen3_5.py`'s `EagerRowOps` does, to the rounding of the model dtype
(bf16 or fp32): each row computed alone in a fixed order, whatever the other rows of the pass.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from . import linear as _lin

__all__ = ["RowOps", "row_ops"]

P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


@functools.cache
def row_ops() -> RowOps | None:
    """The native row ops, or None where the kernel library does not load."""
    lib = _lin._load()["lib"]
    if lib is None or not hasattr(lib, "sd_rows_rms_norm"):
        return None
    return RowOps(lib)


def _rows(x: Tensor) -> tuple[int, int, int, int]:
    """x [..., n0-ish, (n1,) D] as rows (i, j) at i * s0 + j * s1 (elements): (n0, s0, n1, s1)."""
    if x.stride(-1) != 1:
        raise ValueError(f"rows need a unit last stride, got strides {x.stride()}")
    if x.dim() == 4:                                   # [B, T, heads, D]: (b, t) rows of heads
        batch, num_tokens, heads, _ = x.shape
        step = x.stride(0) if num_tokens == 1 else x.stride(1)           # a size-1 dim's stride is any
        if batch > 1 and num_tokens > 1 and x.stride(0) != num_tokens * step:
            raise ValueError(f"rows of {tuple(x.shape)} with strides {x.stride()} are not (b, t) uniform")
        return batch * num_tokens, step, heads, x.stride(2)
    flat = x.reshape(-1, x.shape[-1]) if x.is_contiguous() else None
    if flat is None:
        raise ValueError(f"rows of {tuple(x.shape)} with strides {x.stride()}")
    return flat.shape[0], x.shape[-1], 1, 0


class RowOps:
    def __init__(self, lib) -> None:
        self._norm = lib.sd_rows_rms_norm
        self._norm.argtypes = [P, I, L, I, L, I, P, F, I, P, P, I, I, P]
        self._add_norm = lib.sd_add_rms_norm
        self._add_norm.argtypes = [P, P, I, I, P, F, I, P, P]
        self._silu_mul = lib.sd_silu_mul
        self._silu_mul.argtypes = [P, I, I, I, P]
        self._gate = lib.sd_sigmoid_gate
        self._gate.argtypes = [P, P, I, L, I, L, I, I, P]
        for f in (self._norm, self._add_norm, self._silu_mul, self._gate):
            f.restype = None
        self._attend = lib.sd_chain_attention
        self._attend.argtypes = [P, P, P, P, P, P, I, I, L, L, L, I, I, I, I, I, P, F, I, P, I]
        self._attend.restype = I

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float32)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float,     # x [..., D] (heads of a fused projection ok)
                 cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor:   # [rows of x, rot] or None
        """rms_norm(x) * weight (fp32) in x's dtype, contiguous; with cos / sin also RoPE on the first
        rot dims, the tables' row i % len(cos) for row i of x's (b, t) rows."""
        n0, s0, n1, s1 = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        rot = 0 if cos is None else cos.shape[-1]
        self._norm(x.data_ptr(), n0, s0, n1, s1, x.shape[-1], weight.data_ptr(), eps, int(x.dtype == torch.bfloat16),
                   None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                   1 if cos is None else cos.shape[0], rot, out.data_ptr())
        return out

    def add_rms_norm(self, hidden: Tensor, delta: Tensor, weight: Tensor,   # [..., D] contiguous, same dtype
                     eps: float) -> tuple[Tensor, Tensor]:
        """(hidden + delta, rms_norm(hidden + delta) * weight): a residual add and the next norm."""
        total = torch.empty_like(hidden)
        out = torch.empty_like(hidden)
        d = hidden.shape[-1]
        self._add_norm(hidden.data_ptr(), delta.contiguous().data_ptr(), hidden.numel() // d, d, weight.data_ptr(),
                       eps, int(hidden.dtype == torch.bfloat16), total.data_ptr(), out.data_ptr())
        return total, out

    def silu_mul(self, gate_up: Tensor) -> Tensor:     # [..., 2I] contiguous -> [..., I]
        """silu(gate) * up of a fused gate|up projection's output."""
        inter = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter,
                       int(gate_up.dtype == torch.bfloat16), out.data_ptr())
        return out

    def sigmoid_gate(self, attn: Tensor,                # [B, T, heads, hd] contiguous
                     gate: Tensor) -> Tensor:           # [B, T, heads, hd], heads of a fused projection ok
        """attn * sigmoid(gate), contiguous like attn."""
        n0, s0, n1, s1 = _rows(gate)
        out = torch.empty_like(attn)
        self._gate(attn.data_ptr(), gate.data_ptr(), n0, s0, n1, s1, gate.shape[-1],
                   int(attn.dtype == torch.bfloat16), out.data_ptr())
        return out

    def chain_attention(self, q: Tensor,                # [B, T, H, hd] contiguous (normed, roped)
                        k: Tensor, v: Tensor,           # [B, T, KVH, hd] contiguous
                        layout, layer: int,             # the cache's CacheLayout of this pass, its layer
                        starts: list[int], scale: float) -> Tensor:     # -> [B, T, H, hd]
        """A chain pass's attention over the cache: writes k, v at each row's slots from its start,
        then token t of row b attends to the row's keys 0 .. starts[b] + t (no mask tensor)."""
        batch, num_tokens, heads, hd = q.shape
        kv_heads = k.shape[2]
        out = torch.empty_like(q)
        tables = layout.tables.contiguous()
        begin = (ctypes.c_int64 * batch)(*starts)
        if self._attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), layout.keys[layer].data_ptr(),
                        layout.values[layer].data_ptr(), tables.data_ptr(), tables.shape[1], layout.block,
                        layout.block_stride, layout.key_stride, layout.head_stride, batch, num_tokens, heads,
                        kv_heads, hd, begin, scale, int(q.dtype == torch.bfloat16), out.data_ptr(),
                        torch.get_num_threads()):
            raise ValueError(f"sd_chain_attention rejected q {tuple(q.shape)}, k {tuple(k.shape)}, starts {starts}")
        return out
