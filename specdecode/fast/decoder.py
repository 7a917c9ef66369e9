"""Fused native decoder stack for batch 1 (see decoder.c and README.md).

``FusedDecoder(model).forward(tokens[1, T], cache, start)`` runs the whole layer stack in one
ctypes call (one OpenMP parallel region) per block of <= 64 tokens (a MoE model's: 256, MAX_MOE_T),
reusing the ``PackedLinear`` weights of the model, and returns the hidden states;
``head(hidden, logit_index)`` computes the logits of the rows that need them in one more call.
Token rows are computed independently of each other and of T (batch invariant): a verify block's
logits are bitwise equal to single-token decodes given the same cache contents, so greedy speculative
decoding in bf16 matches plain decoding exactly.

``fused_decoder(model)`` returns None when the fused path cannot run (no native kernels, non-CPU
tensors, head_dim not a multiple of 16, ...); ``why_not(model)`` says why.
"""
from __future__ import annotations

import ctypes
import math
import os

import torch
from torch import Tensor

from . import linear as _lin
from .decoder_moe import bind_moe
from .linear import PackedLinear
from .quant import QuantLinear

__all__ = ["FusedDecoder", "fused_decoder", "why_not", "MAX_T"]

MAX_T = 64  # rows per native call of a dense model; longer blocks run in chunks
MAX_MOE_T = 256  # rows per call of a MoE model (SD_MAX_T in decoder.c): each call reads the routed experts once
ATT_PAIRS = 8  # attention scratch per thread, in rows of scores (SD_ATT_PAIRS in decoder_attn.c)

P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Model(ctypes.Structure):  # must match sd_model in decoder.c
    _fields_ = [(n, I) for n in ("D", "H", "KVH", "HD", "I", "V", "L", "is_bf16", "use_amx",
                                 "Dp", "Qp", "Ip", "rope_len")] + [
        ("eps", F), ("scale", F),
        ("embed", P), ("rope_cos", P), ("rope_sin", P),
        ("attn_norm", P), ("mlp_norm", P), ("qkv_w", P), ("qkv_b", P), ("o_w", P), ("gu_w", P),
        ("down_w", P), ("final_norm", P), ("head_w", P), ("head_b", P),
        ("hid", P), ("xn", P), ("qkv", P), ("q", P), ("att", P), ("gu", P), ("act", P),
        ("qkv_q", P), ("o_q", P), ("gu_q", P), ("down_q", P), ("head_q", P), ("q_norm", P), ("k_norm", P),
        ("window", I), ("embed_scale", F), ("norm_f32", I), ("post_attn_norm", P), ("post_mlp_norm", P),
        ("windows", P), ("rope_cos_l", P), ("rope_sin_l", P), ("attn_softcap", F), ("final_softcap", F), ("gelu", I),
        ("E", I), ("EK", I), ("EI", I), ("EIp", I), ("norm_topk", I), ("router_w", P), ("egu_w", P), ("edn_w", P),
        ("egu_q", P), ("edn_q", P), ("ex", P), ("egu", P), ("eact", P), ("ey", P), ("rlog", P), ("moe_count", P),
        ("o_b", P), ("sinks", P), ("router_b", P), ("egu_b", P), ("edn_b", P), ("router_kind", I), ("act_kind", I),
        ("swiglu_alpha", F), ("swiglu_limit", F)]


class _KV(ctypes.Structure):  # must match sd_kv in decoder.c
    _fields_ = [("k", P), ("v", P), ("tables", P), ("table_width", I), ("block", I),
                ("block_stride", ctypes.c_long), ("key_stride", ctypes.c_long), ("head_stride", ctypes.c_long)]


def why_not(model) -> str | None:
    """None if `model` can use the fused decoder, else the reason."""
    if os.environ.get("SPECDECODE_FUSED", "1") == "0":
        return "disabled by SPECDECODE_FUSED=0"
    rotary = getattr(getattr(model, "config", None), "rotary_dim", None)
    if rotary is not None and rotary != model.config.head_dim:    # the model's own limit, whatever the CPU
        return (f"partial_rotary_factor {model.config.partial_rotary_factor} (RoPE on {rotary} of "
                f"{model.config.head_dim} dims) runs eagerly")
    rope_layers = getattr(getattr(model, "config", None), "rope_layers", None)
    if rope_layers is not None and not all(rope_layers):
        return "layers without RoPE (SmolLM3) run eagerly"
    st = _lin._load()
    if st["lib"] is None:
        return f"native kernels unavailable: {st['reason']}"
    if not hasattr(st["lib"], "sd_decoder_head"):
        return "kernel library has no sd_decoder_head"
    c = getattr(model, "config", None)
    if c is None or not hasattr(model, "layers"):
        return "not a specdecode Transformer"
    if model.device.type != "cpu":
        return f"tensors on {model.device}"
    if model.dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {model.dtype} (bf16/fp32 only)"
    if c.head_dim % 16 or c.head_dim > 256:
        return f"head_dim {c.head_dim} (needs a multiple of 16, <= 256)"
    if c.num_heads % c.num_kv_heads:
        return "num_heads not a multiple of num_kv_heads"
    for lin in model.projections():
        if not isinstance(lin, (PackedLinear, QuantLinear)) or not lin.fast or lin.dtype != model.dtype:
            return "projections are not native PackedLinear / QuantLinear (eager make_linear?)"
    if model.lm_head.bias32 is not None or any(ly[k] is not None and ly[k].bias32 is not None
                                               for ly in model.layers for k in ("gate_up", "down")):
        return "unexpected bias on gate_up/down/lm_head"
    return None


def fused_decoder(model) -> FusedDecoder | None:
    """A FusedDecoder for `model`, or None when unavailable (see why_not)."""
    if why_not(model) is not None:
        return None
    return FusedDecoder(model)


def _packed(lin):
    """The packed weight of a PackedLinear (None for a QuantLinear: the C side uses its sd_qmat)."""
    return getattr(lin, "wp", None)


def _ptrs(tensors) -> ctypes.Array:
    """Pointer array of tensors (data pointers), addresses (ints) or None."""
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t if isinstance(t, int) else t.data_ptr()
                                              for t in tensors])


class FusedDecoder:
    """The whole stack in one native call per block of token rows. `layers`: the layer indices to
    run, in order (default all); the others are left out, their residual passing through, as
    layer-skip self-drafting asks (drafters/layer_skip.py). A decoder over a subset shares every
    weight with the full one; a cache still holds all layers and only the kept ones are written."""

    def __init__(self, model, layers: list[int] | None = None):
        reason = why_not(model)
        if reason is not None:
            raise RuntimeError(f"fused decoder unavailable: {reason}")
        st = _lin._load()
        self._lib = st["lib"]
        fn = self._lib.sd_decoder_forward
        fn.argtypes = [P, P, I, I, P, P, I, P, I]
        fn.restype = I
        self._fn = fn
        c, dt = model.config, model.dtype
        self.model, self.dtype, self.vocab = model, dt, c.vocab_size
        self.kept = list(range(c.num_layers)) if layers is None else sorted(set(layers))
        if not self.kept or not 0 <= self.kept[0] <= self.kept[-1] < c.num_layers:
            raise ValueError(f"layers must be a non-empty subset of 0..{c.num_layers - 1}")
        kept_layers = self._kept(model.layers)
        D, H, KVH, HD, Im = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        L = len(self.kept)
        ly0 = model.layers[0]
        dense = [ly for ly in model.layers if ly["gate_up"] is not None]   # the others: MoE layers
        Dp, Qp, Ip = ly0["qkv"].Kp, ly0["o"].Kp, dense[0]["down"].Kp if dense else 32
        assert all(ly["gate_up"].Kp == Dp for ly in dense) and model.lm_head.Kp == Dp
        keep = []  # everything the C side points to
        norms_a = [ly["attn_norm"].contiguous() for ly in kept_layers]
        norms_m = [ly["mlp_norm"].contiguous() for ly in kept_layers]
        keep += norms_a + norms_m

        def arr(ts):
            a = _ptrs(ts)
            keep.append(a)
            return ctypes.cast(a, P)

        self.max_rows = MAX_MOE_T if c.moe is not None else MAX_T      # token rows per native call
        z = lambda cols: torch.zeros(self.max_rows, cols, dtype=dt)  # noqa: E731  (zero pads stay zero)
        self._scratch = dict(hid=z(D), xn=z(Dp), qkv=z((H + 2 * KVH) * HD), q=z(H * HD), att=z(Qp),
                             gu=z(2 * Im), act=z(Ip))
        self._embed = model.embed.contiguous()
        self._cos, self._sin = model.rope_cos.contiguous(), model.rope_sin.contiguous()
        self._final = getattr(model, "final_norm_fp32", model.final_norm).contiguous()   # Gemma: fp32 1 + w
        m = _Model(D=D, H=H, KVH=KVH, HD=HD, I=Im, V=c.vocab_size, L=L,
                   is_bf16=int(dt == torch.bfloat16), use_amx=int(bool(st["amx"])),
                   Dp=Dp, Qp=Qp, Ip=Ip, rope_len=self._cos.shape[0],
                   eps=c.rms_norm_eps,
                   scale=c.attention_scale if c.query_pre_attn_scalar else 1.0 / math.sqrt(HD),
                   embed=self._embed.data_ptr(), rope_cos=self._cos.data_ptr(), rope_sin=self._sin.data_ptr(),
                   attn_norm=arr(norms_a), mlp_norm=arr(norms_m),
                   qkv_w=arr([_packed(ly["qkv"]) for ly in kept_layers]),
                   qkv_b=arr([ly["qkv"].bias32 for ly in kept_layers]),
                   o_w=arr([_packed(ly["o"]) for ly in kept_layers]),
                   gu_w=arr([_packed(ly["gate_up"]) for ly in kept_layers]),
                   down_w=arr([_packed(ly["down"]) for ly in kept_layers]),
                   window=c.sliding_window or 0,
                   final_norm=self._final.data_ptr(), head_w=_ptrs([_packed(model.lm_head)])[0], head_b=None,
                   **{k: v.data_ptr() for k, v in self._scratch.items()})
        if any(isinstance(lin, QuantLinear) for lin in model.projections()):
            def qarr(key):
                return arr([ctypes.addressof(ly[key].qmat) if isinstance(ly[key], QuantLinear) else None
                            for ly in kept_layers])
            m.qkv_q, m.o_q, m.gu_q, m.down_q = qarr("qkv"), qarr("o"), qarr("gate_up"), qarr("down")
            if isinstance(model.lm_head, QuantLinear):
                m.head_q = ctypes.addressof(model.lm_head.qmat)
        if c.qk_norm:
            qn = [ly["q_norm"].contiguous() for ly in kept_layers]
            kn = [ly["k_norm"].contiguous() for ly in kept_layers]
            keep += qn + kn
            m.q_norm, m.k_norm = arr(qn), arr(kn)
        if any(ly["o"].bias32 is not None for ly in kept_layers):
            m.o_b = arr([ly["o"].bias32 for ly in kept_layers])
        if c.is_gemma:
            self._gemma(model, m, keep, arr, self.kept)
        elif c.sliding_layers is not None:            # a window on some layers (gpt-oss)
            keep.append(torch.tensor([c.layer_window(i) or 0 for i in self.kept], dtype=torch.int32))
            m.windows = keep[-1].data_ptr()
        m.sinks = arr(self._kept(model.sinks)) if c.attention_sinks else None   # gpt-oss: each q head's
        self.moe_count = None          # distinct experts each layer's last pass read (MoE models)
        if c.moe is not None:
            self.moe_count = bind_moe(model, m, keep, arr, kept_layers, Dp, self.max_rows, _packed)
        self._m, self._keep = m, keep
        self._mref = ctypes.byref(m)
        rows_fn = self._lib.sd_decoder_rows
        rows_fn.argtypes = [P, P, P, P, P, P, I, P, I, P, I]
        rows_fn.restype = I
        self._rows_fn = rows_fn
        head_fn = self._lib.sd_decoder_head
        head_fn.argtypes = [P, P, I, P, I]
        head_fn.restype = I
        self._head_fn = head_fn
        self._cache_key = None
        self._scores = torch.empty(0)
        self._head_refs: dict = {}           # id(HeadRows) -> (sd_model reference, what it points to)

    def _kept(self, per_layer: list) -> list:
        """The entries of a per-layer list (weights, cache tensors) for the layers this decoder runs."""
        return [per_layer[i] for i in self.kept]

    @staticmethod
    def _gemma(model, m: _Model, keep: list, arr, kept: list[int]) -> None:
        """Gemma 2 / 3 (models/gemma.py): embedding scale, fp32 (1 + w) norms (attn_norm / mlp_norm /
        q_norm / k_norm / final already are), the norms of the attention and MLP outputs, GeGLU,
        soft-caps, and each layer's window and RoPE tables."""
        c = model.config
        m.embed_scale, m.norm_f32, m.gelu = float(model.embed_scale), 1, 1
        m.attn_softcap, m.final_softcap = c.attn_logit_softcapping or 0.0, c.final_logit_softcapping or 0.0
        post_a = [model.layers[i]["post_attn_norm"].contiguous() for i in kept]
        post_m = [model.layers[i]["post_mlp_norm"].contiguous() for i in kept]
        windows = torch.tensor([c.layer_window(i) or 0 for i in kept], dtype=torch.int32)
        local = model.local_rope or (model.rope_cos, model.rope_sin)
        sliding = c.sliding_layers or (True,) * c.num_layers
        tables = [t.contiguous() for t in local] + [model.rope_cos.contiguous(), model.rope_sin.contiguous()]
        keep += post_a + post_m + tables + [windows]
        m.post_attn_norm, m.post_mlp_norm, m.windows = arr(post_a), arr(post_m), windows.data_ptr()
        m.rope_cos_l = arr([tables[0] if sliding[i] else tables[2] for i in kept])
        m.rope_sin_l = arr([tables[1] if sliding[i] else tables[3] for i in kept])
        if tables[0].shape[0] != m.rope_len:
            raise RuntimeError("local and global RoPE tables differ in length")

    def _bind_cache(self, cache):
        key = (id(cache), cache.keys[0].data_ptr(), cache.values[0].data_ptr())
        if key != self._cache_key:
            c = self.model.config
            for t in cache.keys + cache.values:
                if (t.dtype != self.dtype or t.device.type != "cpu" or not t.is_contiguous()
                        or tuple(t.shape[1:]) != (c.num_kv_heads, cache.max_len, c.head_dim)):
                    raise ValueError("cache does not match the model (dtype/layout)")
            self._kc, self._vc = _ptrs(self._kept(cache.keys)), _ptrs(self._kept(cache.values))
            self._cache_ref = cache  # keep the tensors alive while their pointers are cached
            self._cache_key = key
        need = torch.get_num_threads() * ATT_PAIRS * (cache.max_len + 16)
        if self._scores.numel() < need:
            self._scores = torch.empty(need, dtype=torch.float32)

    def forward(self, tokens: Tensor, cache, start: int) -> Tensor:
        """tokens [1, T] int64 at positions start..start+T-1 -> the last hidden states before the
        final norm, [1, T, D] in the model dtype (logits: `head`)."""
        T = tokens.shape[1]
        if tokens.shape[0] != 1:
            raise ValueError("FusedDecoder runs batch 1")
        if start < 0 or start + T > cache.max_len or start + T > self._m.rope_len:
            raise ValueError(f"positions {start}..{start + T - 1} exceed the cache ({cache.max_len})")
        self._bind_cache(cache)
        tok = tokens[0]
        if tok.dtype != torch.int64 or not tok.is_contiguous():
            tok = tok.to(torch.int64).contiguous()
        hidden = torch.empty(1, T, self.model.config.hidden_size, dtype=self.dtype)
        nt = torch.get_num_threads()
        for c0 in range(0, T, self.max_rows):
            Tc = min(self.max_rows, T - c0)
            rc = self._fn(self._mref, tok.data_ptr() + 8 * c0, Tc, start + c0, self._kc, self._vc,
                          cache.max_len, self._scores.data_ptr(), nt)
            if rc != 0:
                raise ValueError("sd_decoder_forward rejected its arguments")
            hidden[0, c0:c0 + Tc] = self._scratch["hid"][:Tc]    # the stack leaves them in its scratch
        return hidden

    def _rows_model(self, head_rows):
        """A reference to this decoder's sd_model whose LM head is `head_rows`' gathered rows, built once."""
        key = id(head_rows)
        if key not in self._head_refs:
            m = _Model.from_buffer_copy(self._m)
            lin = head_rows.linear
            m.V = len(head_rows)
            m.head_q = ctypes.addressof(lin.qmat) if isinstance(lin, QuantLinear) else None
            m.head_w = None if isinstance(lin, QuantLinear) else _packed(lin).data_ptr()
            self._head_refs[key] = (ctypes.byref(m), (m, head_rows))    # alive while referenced
        return self._head_refs[key][0]

    def head(self, hidden: Tensor,                       # [B, T, D] model dtype, before the final norm
             logit_index: Tensor | None = None,          # [B, n] rows 0..T-1 that need logits; None = all
             head_rows=None,                             # HeadRows: logits of those token ids only
             ) -> Tensor:                                # [B, n, vocab] float32
        """Final norm and LM head on the rows asked for; each distinct row once (the engine repeats
        a row's last position for missing drafts), at most MAX_T rows per native call. `head_rows`
        (Transformer.head_rows): a head over those token ids only, reading only their rows."""
        width, mref = self.vocab, self._mref
        if head_rows is not None:
            width, mref = len(head_rows), self._rows_model(head_rows)
        B, T, D = hidden.shape
        if hidden.dtype != self.dtype:
            raise ValueError(f"hidden states are {hidden.dtype}, the model computes in {self.dtype}")
        flat = hidden.reshape(B * T, D)
        if logit_index is None:
            wanted = list(range(B * T))
        else:
            if logit_index.numel() and not 0 <= int(logit_index.min()) <= int(logit_index.max()) < T:
                raise ValueError(f"logit_index outside 0..{T - 1}")
            wanted = [r + b * T for b, row in enumerate(logit_index.tolist()) for r in row]
        n = len(wanted) // B if B else 0
        uniq = sorted(set(wanted))
        first = uniq[0] if uniq else 0
        if len(uniq) == len(wanted) and (not uniq or uniq[-1] - first == len(uniq) - 1):
            rows, inverse = flat[first:first + len(uniq)], None          # consecutive rows: a slice
            if uniq != wanted:
                inverse = torch.tensor([w - first for w in wanted])
        else:
            rows = flat[torch.tensor(uniq)]
            where = {r: i for i, r in enumerate(uniq)}
            inverse = torch.tensor([where[w] for w in wanted])
        rows = rows.contiguous()
        logits = torch.empty(rows.shape[0], width, dtype=torch.float32)
        nt = torch.get_num_threads()
        for c0 in range(0, rows.shape[0], MAX_T):
            m = min(MAX_T, rows.shape[0] - c0)
            rc = self._head_fn(mref, rows.data_ptr() + c0 * D * rows.element_size(), m,
                               logits.data_ptr() + c0 * width * 4, nt)
            if rc != 0:
                raise ValueError("sd_decoder_head rejected its arguments")
        if inverse is not None:                  # repeated or unordered rows: copies
            logits = logits[inverse]
        return logits.view(B, n, width)

    def _bind_layout(self, lay):
        """Layer base pointers of a layout's cache tensors, checked and built once per cache."""
        key = (id(lay.keys), id(lay.values), lay.keys[0].data_ptr(), lay.values[0].data_ptr())
        if key != getattr(self, "_layout_key", None):
            for t in lay.keys + lay.values:
                if t.dtype != self.dtype or t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError("cache does not match the model (dtype/layout)")
            arrays = (_ptrs(self._kept(lay.keys)), _ptrs(self._kept(lay.values)))
            self._layout_bases = tuple(ctypes.cast(a, P) for a in arrays)
            self._layout_ref = (arrays, lay.keys, lay.values)   # alive while their pointers are cached
            self._layout_key = key
        return self._layout_bases

    def forward_rows(self, fb, cache) -> Tensor:
        """Batched form of `forward` for any pass description `fb` (specdecode/forward.py: chain or
        tree, per-row starts and cache rows) and any cache with a `layout` (contiguous or paged).
        Returns the hidden states [B, T, D] (logits: `head`). Every token row is computed as in
        `forward` and a tree node as the same path verified as a chain, so a request's results
        depend neither on the rest of the batch nor on the shape of its draft."""
        tokens = fb.tokens
        B, T = tokens.shape
        starts = fb.starts()
        row_ids = list(range(B)) if fb.rows is None else [int(r) for r in fb.rows.reshape(-1).tolist()]
        R = B * T
        # slots (and a chain's RoPE positions): start + 0..T-1 per row
        slot = torch.tensor(starts, dtype=torch.int32)
        if T > 1:
            slot = (slot[:, None] + torch.arange(T, dtype=torch.int32)).reshape(R)
        if fb.positions is None:
            pos, low, high = slot, min(starts), max(starts) + T - 1
        else:
            pos = fb.positions.to(torch.int32).reshape(R).contiguous()                # [R] a tree's depths
            low, high = int(pos.min()), int(pos.max())
        if low < 0 or high >= self._m.rope_len:
            raise ValueError(f"positions {low}..{high} exceed the rope tables ({self._m.rope_len})")
        lay = cache.layout(row_ids, starts, T)
        kbase, vbase = self._bind_layout(lay)
        tok = tokens.reshape(R).to(torch.int64).contiguous()
        if fb.is_chain:
            base = mask = None
        else:
            base = fb.tree_base.to(torch.int32).reshape(R).contiguous()
            mask = fb.tree_mask.to(torch.int64).reshape(R).contiguous()
        tables = lay.tables.to(torch.int32)                                            # [B, blocks]
        tables = (tables if T == 1 else tables.repeat_interleave(T, 0)).contiguous()  # [R, blocks]
        keep = None           # a ragged pass (prefill chunks, drafts of different sizes): its padding is not computed
        if fb.lengths is not None and sum(fb.lengths) < R:
            keep = torch.cat([torch.arange(b * T, b * T + n) for b, n in enumerate(fb.lengths) if n])   # [R real]
            tok, slot, tables = tok[keep], slot[keep], tables[keep].contiguous()
            pos = slot if fb.positions is None else pos[keep].contiguous()
            if base is not None:
                base, mask = base[keep].contiguous(), mask[keep].contiguous()
        rows_real = R if keep is None else keep.numel()
        hidden = torch.empty(rows_real, self.model.config.hidden_size, dtype=self.dtype)
        nt = torch.get_num_threads()
        score_len = high + 17
        if self._scores.numel() < nt * ATT_PAIRS * score_len:
            self._scores = torch.empty(nt * ATT_PAIRS * score_len, dtype=torch.float32)
        for c0 in range(0, rows_real, self.max_rows):
            Rc = min(self.max_rows, rows_real - c0)
            kv = _KV(kbase, vbase, tables.data_ptr() + 4 * c0 * tables.shape[1],
                     tables.shape[1], lay.block, lay.block_stride, lay.key_stride, lay.head_stride)
            rc = self._rows_fn(self._mref, tok.data_ptr() + 8 * c0, pos.data_ptr() + 4 * c0, slot.data_ptr() + 4 * c0,
                               None if base is None else base.data_ptr() + 4 * c0,
                               None if mask is None else mask.data_ptr() + 8 * c0, Rc, ctypes.byref(kv),
                               score_len, self._scores.data_ptr(), nt)
            if rc != 0:
                raise ValueError("sd_decoder_rows rejected its arguments")
            hidden[c0:c0 + Rc] = self._scratch["hid"][:Rc]
        if keep is not None:                       # back to [B, T]: padding rows zero
            full = torch.zeros(R, hidden.shape[1], dtype=self.dtype)
            full[keep] = hidden
            hidden = full
        return hidden.view(B, T, -1)
