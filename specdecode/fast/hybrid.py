"""Qwen3.5's layer stack on a short chain pass in one native call (hybrid.c): the Gated DeltaNet
and gated attention layers with their GGUF-quantized projections, in one OpenMP parallel region,
where the per-layer native path (deltanet.py, rowops.py and QuantLinear around Python) makes some
two hundred calls a decode step.

    stack = hybrid_stack(model)            # None: why_not(model) says why
    hidden = stack.run(tokens, cache, rows, starts, widths)     # [B, T, D] before the final norm

The pass computes the per-layer native path's bits (the same C pieces, the same roundings), so the
model may take either; `SPECDECODE_FUSED=0` keeps the per-layer path.
"""
from __future__ import annotations

import ctypes
import os

import torch
from torch import Tensor

from . import linear as _lin
from .decoder import _KV, _ptrs
from .quant import QuantLinear

__all__ = ["HybridStack", "hybrid_stack", "why_not", "MAX_ROWS"]

MAX_ROWS = 64      # token rows (B * T) per call: SD_HY_MAX_T in hybrid.c

P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Hybrid(ctypes.Structure):        # must match sd_hybrid in hybrid.c
    _fields_ = [(n, I) for n in ("D", "I", "L", "H", "KVH", "HD", "rot", "rope_len")] + [
        ("eps", F), ("scale", F)] + [(n, P) for n in (
            "embed", "rope_cos", "rope_sin", "kind", "index", "attn_norm", "mlp_norm", "in_q", "out_q", "gu_q",
            "down_q", "q_norm", "k_norm", "dn", "xn", "proj", "att", "q", "gu", "act")]


class _Recurrent(ctypes.Structure):     # must match sd_recurrent in hybrid.c
    _fields_ = [(n, P) for n in ("conv_state", "rows", "states", "widths", "conv_out", "qo", "ko", "vo", "go",
                                 "bo", "finals")]


def why_not(model) -> str | None:
    """None if `model` (a Qwen35Transformer) can run its short passes in one call, else why not."""
    if os.environ.get("SPECDECODE_FUSED", "1") == "0":
        return "disabled by SPECDECODE_FUSED=0"
    lib = _lin._load()["lib"]
    if lib is None or not hasattr(lib, "sd_hybrid_rows"):
        return "native kernels unavailable"
    if any("router" in layer for layer in model.layers):
        return "mixture-of-experts MLPs run per piece (the one-call stack has dense MLPs only)"
    if model.native is None or model.ops is None:
        return "no native DeltaNet kernels or row ops for this model"
    if model.dtype != torch.bfloat16 or model.device.type != "cpu":
        return f"dtype {model.dtype} on {model.device} (bf16 on the CPU only)"
    c = model.config
    if c.head_dim % 16 or c.head_dim > 256 or c.num_heads % c.num_kv_heads:
        return f"head_dim {c.head_dim}, {c.num_heads} heads over {c.num_kv_heads} kv heads"
    for lin in model.projections()[1:]:
        if not isinstance(lin, QuantLinear) or not lin.fast or lin.bias32 is not None:
            return "projections are not all native GGUF-quantized ones without bias"
    return None


def hybrid_stack(model) -> HybridStack | None:
    return HybridStack(model) if why_not(model) is None else None


class HybridStack:
    def __init__(self, model) -> None:
        reason = why_not(model)
        if reason is not None:
            raise RuntimeError(f"hybrid stack unavailable: {reason}")
        self._fn = _lin._load()["lib"].sd_hybrid_rows
        self._fn.argtypes = [P, P, P, I, I, P, P, P, I]
        self._fn.restype = I
        c, lin = model.config, model.config.linear_attention
        self.model = model
        self.dims = (lin["value_heads"], lin["key_dim"], lin["value_dim"],
                     2 * lin["key_heads"] * lin["key_dim"] + lin["value_heads"] * lin["value_dim"], model.kernel - 1)
        self._keep: list = []               # everything the C side points to
        layers = model.layers

        def arr(values, ctype=P):
            a = (ctype * len(values))(*values)
            self._keep.append(a)
            return a

        def qmats(key: str, other: str | None = None):
            return arr([ctypes.addressof(ly[key if key in ly else other].qmat) for ly in layers])

        def tensors(key: str):
            ts = [ly[key].contiguous() if key in ly else None for ly in layers]
            self._keep.extend(ts)
            return _ptrs(ts)

        ins = [ly["inputs" if ly["kind"] == "linear" else "qkv"] for ly in layers]
        widest = max(p.out_features for p in ins)
        H, HD, D, Im = c.num_heads, c.head_dim, c.hidden_size, c.intermediate_size
        hv, dk, dv, _, _ = self.dims
        scratch = [torch.zeros(MAX_ROWS, n, dtype=torch.bfloat16)
                   for n in (D, widest, max(H * HD, hv * dv), H * HD, 2 * Im, Im)]
        self._keep += scratch + [model.embed, model.rope_cos, model.rope_sin]
        norms = [tensors("attn_norm"), tensors("mlp_norm"), tensors("q_norm"), tensors("k_norm")]
        self._keep += norms
        self.md = _Hybrid(D, Im, len(layers), H, c.num_kv_heads, HD, model.rope_cos.shape[-1],
                          model.rope_cos.shape[0], c.rms_norm_eps, HD ** -0.5,
                          model.embed.data_ptr(), model.rope_cos.data_ptr(), model.rope_sin.data_ptr(),
                          ctypes.addressof(arr([int(ly["kind"] == "linear") for ly in layers], ctypes.c_int32)),
                          ctypes.addressof(arr([ly["index"] for ly in layers], ctypes.c_int32)),
                          ctypes.addressof(norms[0]), ctypes.addressof(norms[1]),
                          ctypes.addressof(qmats("inputs", "qkv")), ctypes.addressof(qmats("out", "o")),
                          ctypes.addressof(qmats("gate_up")), ctypes.addressof(qmats("down")),
                          ctypes.addressof(norms[2]), ctypes.addressof(norms[3]),
                          ctypes.addressof(arr([ctypes.addressof(ly["native"][0]) if "native" in ly else None
                                                for ly in layers])),
                          *(t.data_ptr() for t in scratch))
        if model.embed.dtype != torch.bfloat16 or not model.embed.is_contiguous():
            raise RuntimeError("hybrid stack: the embedding table must be contiguous bf16")

    def run(self, tokens: Tensor,                  # [B, T] int64
            cache, rows: list[int], starts: list[int], widths: list[int]) -> Tensor:    # -> [B, T, D] bf16
        """One chain pass: writes the attention layers' keys and values, records the recurrent
        layers' pass for cache.truncate (cache/recurrent.py), returns the hidden states."""
        batch, num_tokens = tokens.shape
        hv, dk, dv, conv_dim, k1 = self.dims
        layers, f32 = len(cache.conv), torch.float32
        conv_out = torch.empty(layers, batch, conv_dim, k1 + num_tokens, dtype=torch.bfloat16)
        q, k = (torch.empty(layers, batch, num_tokens, hv, dk, dtype=f32) for _ in range(2))
        v = torch.empty(layers, batch, num_tokens, hv, dv, dtype=f32)
        decay, beta = (torch.empty(layers, batch, num_tokens, hv, dtype=f32) for _ in range(2))
        finals = [cache.spare_states(r) for r in rows]         # [Lr, hv, dk, dv] each: the states after the pass
        states = [cache.ssm[layer][r].data_ptr() for layer in range(layers) for r in rows]
        after = [f[layer].data_ptr() for layer in range(layers) for f in finals]
        layout = cache.layout(rows, starts, num_tokens)
        tables = layout.tables.contiguous()
        bases = (_ptrs(layout.keys), _ptrs(layout.values))
        kv = _KV(*(ctypes.cast(a, P) for a in bases), tables.data_ptr(), tables.shape[1], layout.block,
                 layout.block_stride, layout.key_stride, layout.head_stride)
        refs = (_ptrs(cache.conv), (ctypes.c_int64 * batch)(*rows), (ctypes.c_int64 * len(states))(*states),
                (ctypes.c_int32 * batch)(*widths), (ctypes.c_int64 * len(after))(*after))  # alive for the call
        rc = _Recurrent(*(ctypes.addressof(a) for a in refs[:4]),
                        *(t.data_ptr() for t in (conv_out, q, k, v, decay, beta)), ctypes.addressof(refs[4]))
        hidden = torch.empty(batch, num_tokens, self.md.D, dtype=torch.bfloat16)
        tokens = tokens.contiguous()
        begin = (ctypes.c_int64 * batch)(*starts)
        if self._fn(ctypes.byref(self.md), tokens.data_ptr(), begin, batch, num_tokens, ctypes.byref(kv),
                    ctypes.byref(rc), hidden.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"sd_hybrid_rows rejected {batch} rows x {num_tokens} tokens from {starts}")
        cache.record_pass(rows, starts, widths, conv_out, finals, (q, k, v, decay, beta))
        return hidden
