"""A lean Llama / Mistral / SmolLM3 / Qwen2 / Qwen3 / Phi-3 decoder (GQA, RoPE with optional scaling,
RMSNorm, SwiGLU, optional sliding attention window).

Qwen2 differs from Llama only by biases on the q/k/v projections, which `ModelConfig.attention_bias`
switches on; Qwen3 by an RMSNorm over each q and k head before RoPE (`ModelConfig.qk_norm`);
Mistral by a sliding window (`ModelConfig.sliding_window`: a query at position p sees the keys at
positions p-W+1..p, counted along its own path in a tree pass); SmolLM3 by layers without RoPE
(`ModelConfig.rope_layers`: position reaches them only through the other layers); Phi-3 stores
q|k|v and gate|up already fused (qkv_proj, gate_up_proj) and may rotate only part of each head
(`ModelConfig.partial_rotary_factor`). Tied or untied LM heads both work. Weights use the Hugging
Face layout (q/k rows in rotate-half order); q/k/v and gate/up are fused into one matrix each at load.

The model interface: `run(ForwardBatch, cache)` takes a batch of sequences at different positions
(ragged, chain or tree; specdecode/forward.py), writes keys/values into a position-addressed
`KVCache` and returns the hidden states; `logits(hidden, logit_index)` computes logits only for
the positions asked for (prefill needs none, verification needs k+1); `forward` is the two for a
chain.

References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), Ainslie et al. 2023 (GQA).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cache.contiguous import KVCache
from ..fast.quant import QuantWeight
from ..forward import ForwardBatch
from .config import ModelConfig
from .interface import HeadRows
from .moe import build_layer as build_moe
from .moe import moe_mlp
from .moe import projections as moe_projections

LinearFn = Callable[[torch.Tensor], torch.Tensor]


def eager_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearFn:
    if isinstance(weight, QuantWeight):       # the reference path: exact dequantized weights
        weight = weight.dequantize(bias.dtype if bias is not None else torch.bfloat16)
    return lambda x: F.linear(x, weight, bias)


Weight = torch.Tensor | QuantWeight   # a projection's weight: dense, or quantized blocks as stored


def cat_rows(weights: list[Weight], dtype: torch.dtype) -> Weight:
    """Row-wise concatenation of projection weights (q|k|v, gate|up): quantized blocks stay
    quantized when all parts are; a mix is dequantized."""
    if all(isinstance(w, QuantWeight) for w in weights):
        return QuantWeight.cat(weights)
    return torch.cat([w.dequantize(dtype) if isinstance(w, QuantWeight) else w for w in weights])


def yarn(config, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [dim / 2] (float32) and attention factor (cos and sin times it), as
    transformers' _compute_yarn_parameters computes them from `config.rope_scaling`."""
    p = config.rope_scaling
    base, factor = config.rope_theta, float(p["factor"])
    original = float(p.get("original_max_position_embeddings") or config.max_position_embeddings)
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")

        def get(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        attention = get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction(fast), correction(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32 (as transformers and llama.cpp compute
    them), with linear, llama3 or YaRN scaling applied (YaRN also scales cos and sin: `rope_factor`)."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        inv_freq = yarn(config, dim)[0]
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq


def rope_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 for the other kinds)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    return yarn(config, config.rotary_dim)[1]


def fused_projections(weights: dict, prefix: str, config: ModelConfig,
                      dtype: torch.dtype) -> tuple[Weight, torch.Tensor | None, Weight | None]:
    """Layer `prefix`'s q|k|v weight [(H+2KVH)*HD, D], its bias (or None) and gate|up weight [2I, D]:
    Phi-3 stores them fused already (qkv_proj; gate_up_proj with gate first, as here), the other
    families as separate q/k/v and gate/up projections."""
    qkv = weights.get(prefix + "self_attn.qkv_proj.weight")
    if qkv is None:
        qkv = cat_rows([weights[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"], dtype)
    qkv_bias = None
    if config.attention_bias:
        qkv_bias = weights.get(prefix + "self_attn.qkv_proj.bias")
        if qkv_bias is None:
            qkv_bias = torch.cat([weights[prefix + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    gate_up = weights.get(prefix + "mlp.gate_up_proj.weight")
    if gate_up is None and prefix + "mlp.gate_proj.weight" in weights:     # none: a MoE layer (models/moe.py)
        gate_up = cat_rows([weights[prefix + "mlp.gate_proj.weight"], weights[prefix + "mlp.up_proj.weight"]], dtype)
    return qkv, qkv_bias, gate_up


def apply_rope(x: torch.Tensor,       # [B, heads, T, head_dim]
               cos: torch.Tensor,     # broadcastable to [B, heads, T, rotary_dim]
               sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first rotary_dim dims of each head (all of them unless partial); the rest pass."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_at(rope_cos: torch.Tensor, rope_sin: torch.Tensor,   # [max_pos, rotary_dim] each
            fb: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin at the pass's RoPE positions: [1, 1, T, rotary_dim] for a uniform chain, else
    [B, 1, T, rotary_dim]."""
    if fb.uniform:
        positions = torch.arange(fb.start, fb.start + fb.tokens.shape[1], device=device)
        return rope_cos[positions][None, None], rope_sin[positions][None, None]
    positions = fb.rope_positions().to(device)                                   # [B, T]
    return rope_cos[positions][:, None], rope_sin[positions][:, None]


def attention_mask(fb: ForwardBatch, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which cache keys each token of the pass sees, with a sliding `window` (None: all earlier
    ones): [T, L] bool for a uniform chain (None when a single token sees every key written),
    else [B, 1, T, L] (a tree node sees its own path; the window counted along it)."""
    num_tokens = fb.tokens.shape[1]
    if fb.uniform:
        start = fb.start
        if num_tokens == 1 and (window is None or start + 1 <= window):
            return None
        positions = torch.arange(start, start + num_tokens, device=device)
        keys = torch.arange(start + num_tokens, device=device)[None, :]
        mask = keys <= positions[:, None]                                          # [T, L]
        if window is not None:
            mask &= keys > positions[:, None] - window
        return mask
    key_len = max(fb.starts()) + num_tokens          # the cache write returns slots < key_len
    return fb.visible(key_len, window).to(device)[:, None]                         # [B, 1, T, L]


class Transformer:
    """Inference-only decoder. `weights` maps HF parameter names to tensors already in the
    target dtype/device; `make_linear` builds each projection (eager here, fused/fast in
    `specdecode.fast`)."""

    supports_trees = True     # `run` verifies draft trees (specdecode/forward.py)
    has_features = True       # `run` returns the last hidden states (models/interface.py)
    fused_in_init = True      # a subclass that sets up more first builds the fused decoder itself

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 make_linear: Callable[[torch.Tensor, torch.Tensor | None], LinearFn] = eager_linear) -> None:
        self.config = config
        self.embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv, qkv_bias, gate_up = fused_projections(weights, p, config, self.dtype)
            moe = config.moe_layers is not None and config.moe_layers[i]
            self.layers.append({
                "attn_norm": weights[p + "input_layernorm.weight"],
                "qkv": make_linear(qkv, qkv_bias),
                "o": make_linear(weights[p + "self_attn.o_proj.weight"], weights.get(p + "self_attn.o_proj.bias")),
                "mlp_norm": weights[p + "post_attention_layernorm.weight"],
                "gate_up": None if moe else make_linear(gate_up, None),
                "down": None if moe else make_linear(weights[p + "mlp.down_proj.weight"], None),
                "q_norm": weights[p + "self_attn.q_norm.weight"] if config.qk_norm else None,
                "k_norm": weights[p + "self_attn.k_norm.weight"] if config.qk_norm else None,
                **(build_moe(weights, p, config, make_linear) if moe else {}),
            })
        self.final_norm = weights["model.norm.weight"]
        self._init_head(weights, make_linear)
        self.rope_layers = config.rope_layers or (True,) * config.num_layers   # SmolLM3: no RoPE on some
        positions = torch.arange(config.max_position_embeddings + 64, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(config))
        angles = torch.cat([angles, angles], dim=-1)                     # [max_pos, rotary_dim]
        factor = rope_factor(config)
        self.rope_cos = (angles.cos() * factor).to(self.dtype).to(self.device)
        self.rope_sin = (angles.sin() * factor).to(self.dtype).to(self.device)
        # Fused native stack for batch-1 blocks (specdecode.fast.decoder); None = eager only.
        self.fused = None
        self._skip_decoders: dict = {}      # layer-skip drafts: skipped set -> fused decoder of the rest
        if getattr(make_linear, "fused_decoder", None) is not None and self.fused_in_init:
            self.fused = make_linear.fused_decoder(self)

    def _init_head(self, weights: dict, make_linear: Callable) -> None:
        """The LM head (the embedding when tied) and what `head_rows` and `weight_bytes` read."""
        # a quantized file keeps its (tied or own) output matrix quantized under "lm_head.weight"
        head = weights.get("lm_head.weight")
        if head is None or (self.config.tie_word_embeddings and not isinstance(head, QuantWeight)):
            head = self.embed
        self.lm_head = make_linear(head, None)
        self._make_linear = make_linear
        self._head_weight = self._head_source = head       # source: as loaded, for `head_rows`
        self.quantized = any(isinstance(w, QuantWeight) for w in weights.values())

    def projections(self) -> list:
        """Every projection: the LM head, then each layer's qkv, o, gate_up and down (a MoE layer: its
        router and experts, models/moe.py)."""
        return [self.lm_head] + [lin for ly in self.layers for lin in (
            [ly["qkv"], ly["o"]] + (moe_projections(ly) if "router" in ly else [ly["gate_up"], ly["down"]]))]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output matrix [vocab, hidden] as a dense tensor in the model dtype (EAGLE heads and
        distillation read it); a quantized one is dequantized on first use."""
        if isinstance(self._head_weight, QuantWeight):
            self._head_weight = self._head_weight.dequantize(self.dtype)
        return self._head_weight

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_len(self) -> int:
        return self.config.max_position_embeddings

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        layers, heads, dims = self.config.kv_geometry()
        return KVCache(layers, batch_size, heads, dims, max_len, self.dtype, self.device)

    def weight_bytes(self) -> int:
        """Bytes of weights read per decoded token (a MoE layer's experts: the share a token routes to)."""
        if not self.quantized:
            return self.config.weight_count() * self.embed.element_size()
        esz = self.embed.element_size()

        def read(lins) -> int:
            return sum(lin.nbytes if hasattr(lin, "nbytes") else
                       getattr(lin, "out_features", 0) * getattr(lin, "in_features", 0) * esz for lin in lins)

        experts = [ly["experts_gate_up"] + ly["experts_down"] for ly in self.layers if "router" in ly]
        moe = self.config.moe or {"used": 0, "experts": 1}
        routed = sum(read(lins) for lins in experts) * moe["used"] // moe["experts"]
        routed_ids = {id(lin) for lins in experts for lin in lins}
        others = [lin for lin in self.projections() if id(lin) not in routed_ids]
        return read(others) + routed + self.config.hidden_size * esz

    def forward(self,
                tokens: torch.Tensor,                 # [B, T] int64
                cache: KVCache,
                start: int | torch.Tensor,            # slot of tokens[:, 0]: int (all rows) or [B]
                rows: torch.Tensor | None = None,     # [B] cache rows; None = rows 0..B-1 of the cache
                logit_index: torch.Tensor | None = None,  # [B, n] positions in 0..T-1 that need logits; None = all
                head_rows: HeadRows | None = None,    # logits of those token ids only (see `logits`)
                ) -> torch.Tensor:                    # [B, n, vocab] float32
        """A chain pass and its logits: `logits(run(ForwardBatch.chain(...)), logit_index)`."""
        return self.logits(self.run(ForwardBatch.chain(tokens, start, rows, logit_index), cache), logit_index,
                           head_rows)

    def _run_fused(self, fb: ForwardBatch, cache: KVCache, skip: frozenset[int]) -> torch.Tensor | None:
        """The pass in the fused native decoder when it takes it (batch-1 chains by their own entry,
        other passes of any size on caches with a layout, 64 token rows per native call; skipped
        layers: a decoder over the kept ones, built once per set), else None. Eager torch is not
        batch invariant: a pass never goes there for its size."""
        fused, tokens = self._skip_decoder(skip) if skip else self.fused, fb.tokens
        if fused is not None and fb.uniform and tokens.shape[0] == 1 and tokens.shape[1] <= 64:
            return fused.forward(tokens, cache, fb.start)
        if fused is not None and hasattr(cache, "layout"):
            return fused.forward_rows(fb, cache)
        return None

    def _skip_decoder(self, skip: frozenset[int]):
        """The fused decoder over the layers not in `skip` (None without a fused decoder)."""
        if self.fused is None:
            return None
        decoders = self._skip_decoders
        if skip not in decoders:
            kept = [i for i in range(self.config.num_layers) if i not in skip]
            while len(decoders) >= 4:               # a calibration tries dozens of sets once each
                decoders.pop(next(iter(decoders)))
            decoders[skip] = type(self.fused)(self, kept) if kept else None
        return decoders[skip]

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, cache: KVCache,
            skip: frozenset[int] = frozenset()) -> torch.Tensor:
        """One pass as `fb` describes it (specdecode/forward.py): chain or tree, any rows. Writes
        the keys/values into `cache` and returns the last hidden states of every token, before
        the final norm: [B, T, D] in the model dtype (the features EAGLE heads read; logits:
        `logits`). The fused native decoder runs it when it can (batch-1 chains by their own
        entry), else eager torch. `skip`: layer indices left out (their residual passes through;
        layer-skip self-drafting)."""
        hidden = self._run_fused(fb, cache, skip)
        if hidden is not None:
            return hidden
        tokens = fb.tokens
        c = self.config
        batch, num_tokens = tokens.shape
        start, rows = fb.start, fb.rows
        cos, sin = rope_at(self.rope_cos, self.rope_sin, fb, self.device)
        masks = {w: attention_mask(fb, w, self.device) for w in {c.layer_window(i) for i in range(c.num_layers)}}
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        hidden = F.embedding(tokens, self.embed)                              # [B, T, D]
        for index, layer in enumerate(self.layers):
            if index in skip:
                continue
            # 1. attention: fused qkv projection, RoPE, cache write, GQA attention
            x = F.rms_norm(hidden, (c.hidden_size,), layer["attn_norm"], c.rms_norm_eps)
            qkv = layer["qkv"](x)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(batch, num_tokens, c.num_heads, c.head_dim).transpose(1, 2)
            k = k.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
            if c.qk_norm:
                q = F.rms_norm(q, (c.head_dim,), layer["q_norm"], c.rms_norm_eps)
                k = F.rms_norm(k, (c.head_dim,), layer["k_norm"], c.rms_norm_eps)
            if self.rope_layers[index]:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = cache.write(index, rows, start, k, v)
            attn = self.attend(index, q, keys, values, masks[c.layer_window(index)])
            attn = attn.transpose(1, 2).reshape(batch, num_tokens, q_size)
            hidden = hidden + layer["o"](attn)
            # 2. MLP: SwiGLU with fused gate/up, or a mixture of experts
            x = F.rms_norm(hidden, (c.hidden_size,), layer["mlp_norm"], c.rms_norm_eps)
            if "router" in layer:
                hidden = hidden + moe_mlp(layer, x, c.moe)
                continue
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            hidden = hidden + layer["down"](F.silu(gate) * up)

        return hidden

    def attend(self, index: int,
               q: torch.Tensor,                   # [B, H, T, HD] roped queries
               keys: torch.Tensor,                # [B, KVH, L, HD] the cache's keys (values alike)
               values: torch.Tensor,
               mask: torch.Tensor | None,         # attention_mask's; None: every key
               ) -> torch.Tensor:                 # -> [B, H, T, HD]
        """Layer `index`'s eager attention (a family with its own softmax overrides it: gpt_oss.py)."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    @torch.inference_mode()
    def logits(self,
               hidden: torch.Tensor,                    # [B, T, D] from `run`
               logit_index: torch.Tensor | None = None,  # [B, n] token indices 0..T-1; None = all
               head_rows: HeadRows | None = None,       # logits of those token ids only
               ) -> torch.Tensor:                       # [B, n, vocab] float32 (vocab = len(head_rows))
        """Final norm and LM head on the rows asked for (each row as in a pass of any size).
        `head_rows` (from `head_rows(ids)`): only those token ids' logits, from their rows of the
        head matrix alone (a draft's reduced head)."""
        if head_rows is not None and head_rows.owner is not self:
            raise ValueError("head_rows was made by another model")
        if self.fused is not None:
            return self.fused.head(hidden, logit_index, head_rows)
        if logit_index is not None:
            hidden = torch.gather(hidden, 1, logit_index[:, :, None].expand(-1, -1, hidden.shape[-1]))
        return self._final(hidden, self.lm_head if head_rows is None else head_rows.linear)

    def head_rows(self, ids) -> HeadRows:
        """An LM head over token ids `ids` only ([n] ascending, n a multiple of 32): their rows of
        the head matrix gathered into a projection of the same kind (quantized rows stay as stored),
        so each logit is bitwise the whole head's."""
        ids = HeadRows.checked_ids(ids, self.vocab_size)
        source = self._head_source
        rows = source.select_rows(ids) if isinstance(source, QuantWeight) else source[ids].contiguous()
        return HeadRows(self, ids, self._make_linear(rows, None))

    def _final(self, hidden: torch.Tensor,              # [B, n, D]
               head=None,                               # the projection: self.lm_head unless given
               ) -> torch.Tensor:                       # [B, n, vocab] float32
        """The eager final norm and LM head (a family's own in its subclass)."""
        hidden = F.rms_norm(hidden, (self.config.hidden_size,), self.final_norm, self.config.rms_norm_eps)
        return (self.lm_head if head is None else head)(hidden).float()
