"""A Gated DeltaNet layer's token mixing on short passes, natively (deltanet.c): Qwen3.5's decode
steps and verification passes run one C call per layer after the input projection, where the eager
form (models/qwen3_5.py `_delta_net`) is some forty small torch ops.

    native = kernels()                       # None: no native library (SPECDECODE_FAST=0, no compiler)
    handle = native.layer(layer, lin, eps, dtype)     # once per layer: its constants
    conv_inputs, final, steps, gated = native.mix(handle, proj, conv_states, rows, states, widths)
    state = native.replay(state, steps, kept)         # HybridCache.truncate's replay, the same delta rule

A model that uses `mix` must also replay with `replay` (its cache's `replay`): both run the same C
delta rule, so a state is the same bits whichever computed it (greedy speculative == plain).
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from . import linear as _lin

__all__ = ["DeltaNetKernels", "kernels", "MAX_TOKENS"]

MAX_TOKENS = 64     # tokens per native call (SD_DN_MAX_T in deltanet.c)

P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Layer(ctypes.Structure):     # must match sd_dn_layer in deltanet.c
    _fields_ = [(n, I) for n in ("hk", "hv", "dk", "dv", "kernel", "tiled", "bf")] + [
        ("eps", F), ("conv_w", P), ("decay_rate", P), ("dt_bias", P), ("out_norm", P)]


@functools.cache
def kernels() -> DeltaNetKernels | None:
    """The native DeltaNet kernels, or None where the kernel library does not load."""
    lib = _lin._load()["lib"]
    if lib is None or not hasattr(lib, "sd_deltanet"):
        return None
    return DeltaNetKernels(lib)


class DeltaNetKernels:
    def __init__(self, lib) -> None:
        self._mix = lib.sd_deltanet
        self._mix.argtypes = [P, I, I, P, I, P, P, P, P, P, P, P, P, P, P, P, P, I]
        self._mix.restype = I
        self._rule = lib.sd_delta_rule
        self._rule.argtypes = [P, P, I, I, I, I, P, P, P, P, P, I]
        self._rule.restype = None

    @staticmethod
    def supports(lin: dict, dtype: torch.dtype) -> str | None:
        """None if a layer of this shape (config.linear_attention) and dtype runs natively, else why not."""
        if dtype not in (torch.bfloat16, torch.float32):
            return f"dtype {dtype} (bf16 / fp32 only)"
        if lin["value_heads"] % lin["key_heads"]:
            return "value_heads not a multiple of key_heads"
        return None

    @staticmethod
    def layer(layer: dict, lin: dict, eps: float, dtype: torch.dtype) -> tuple:
        """One DeltaNet layer's constants for `mix` (its weights as the model holds them)."""
        conv_w = layer["conv_f32"].reshape(layer["conv_f32"].shape[0], -1).t().contiguous()   # [kernel, conv_dim]
        keep = (conv_w, layer["decay_rate"].contiguous(), layer["dt_bias"].contiguous(),
                layer["out_norm"].to(dtype).contiguous())
        s = _Layer(lin["key_heads"], lin["value_heads"], lin["key_dim"], lin["value_dim"], conv_w.shape[0],
                   int(bool(lin.get("tiled"))), int(dtype == torch.bfloat16), eps, *(t.data_ptr() for t in keep))
        return s, keep, dtype, lin

    def mix(self, handle: tuple, proj: Tensor,          # [B, T, P] q|k|v, z, b, a (model dtype)
            conv_states: Tensor,                         # [rows, conv_dim, kernel-1]: the cache's
            rows: list[int], states: list[Tensor],       # per row its [hv, dk, dv] fp32 state (read only)
            widths: list[int]) -> tuple[Tensor, Tensor, tuple, Tensor]:
        """The layer's token mixing: conv_inputs [B, conv_dim, kernel-1+T], the final states
        [B, hv, dk, dv] (a new buffer), the steps (q, k [B, T, hv, dk], v [B, T, hv, dv], decay,
        beta [B, T, hv]) and the gated, normed output [B, T, hv*dv] for the out projection."""
        s, _, dtype, lin = handle
        batch, num_tokens, width = proj.shape
        hk, hv, dk, dv = lin["key_heads"], lin["value_heads"], lin["key_dim"], lin["value_dim"]
        conv_dim = 2 * hk * dk + hv * dv
        if proj.dtype != dtype or conv_states.dtype != dtype or not 1 <= num_tokens <= MAX_TOKENS:
            raise ValueError(f"DeltaNet mix: proj {proj.dtype} / conv states {conv_states.dtype} (want {dtype}), "
                             f"{num_tokens} tokens (1..{MAX_TOKENS})")
        proj = proj.contiguous()
        f32 = torch.float32
        conv_inputs = torch.empty(batch, conv_dim, s.kernel - 1 + num_tokens, dtype=dtype)
        q, k = (torch.empty(batch, num_tokens, hv, dk, dtype=f32) for _ in range(2))
        v = torch.empty(batch, num_tokens, hv, dv, dtype=f32)
        decay, beta = (torch.empty(batch, num_tokens, hv, dtype=f32) for _ in range(2))
        final = torch.empty(batch, hv, dk, dv, dtype=f32)
        gated = torch.empty(batch, num_tokens, hv * dv, dtype=dtype)
        row_ids = (ctypes.c_int64 * batch)(*rows)
        addresses = (ctypes.c_int64 * batch)(*(_state_address(st, hv, dk, dv) for st in states))
        lengths = (ctypes.c_int32 * batch)(*widths)
        if self._mix(ctypes.byref(s), batch, num_tokens, proj.data_ptr(), width, conv_states.data_ptr(), row_ids,
                     addresses, lengths, conv_inputs.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     decay.data_ptr(), beta.data_ptr(), final.data_ptr(), gated.data_ptr(),
                     torch.get_num_threads()):
            raise ValueError(f"sd_deltanet rejected {num_tokens} tokens")
        return conv_inputs, final, (q, k, v, decay, beta), gated

    def replay(self, state: Tensor,          # [H, dk, dv] fp32: the state before the steps (read only)
               steps: tuple, kept: int) -> Tensor:   # (q, k [T, H, dk], v [T, H, dv], decay, beta [T, H])
        """The state after the first `kept` of the steps (a new tensor), by the delta rule of `mix`."""
        heads, dk, dv = state.shape
        q, k, v, decay, beta = (t.contiguous() for t in steps)
        if not 1 <= kept <= q.shape[0]:
            raise ValueError(f"replay: kept {kept} of {q.shape[0]} steps")
        new = torch.empty(heads, dk, dv, dtype=torch.float32)
        self._rule(_state_address(state, heads, dk, dv), new.data_ptr(), kept, heads, dk, dv, q.data_ptr(),
                   k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(), torch.get_num_threads())
        return new


def _state_address(state: Tensor, hv: int, dk: int, dv: int) -> int:
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape) != (hv, dk, dv):
        raise ValueError(f"a DeltaNet state must be contiguous float32 [{hv}, {dk}, {dv}], got "
                         f"{state.dtype} {tuple(state.shape)}")
    return state.data_ptr()
