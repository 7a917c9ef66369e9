"""Gemma 4 text decoder natively (the E2B / E4B models made for devices, and the dense larger ones), as
transformers computes it (models/gemma4/modeling_gemma4.py, Gemma4TextModel / Gemma4ForCausalLM):

- the token embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype, as in Gemma 3;
- every RMSNorm is computed in float32 and multiplies by its weight as stored (not 1 + weight as in
  Gemma 2 / 3); the values get a norm without weight;
- a layer is  h += post_attention_norm(attention(input_norm(h)));
              h += post_feedforward_norm(mlp(pre_feedforward_norm(h)));
              h += post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(h)) * p_i));
              h *= layer_scalar
  where p_i is layer i's slice of the per-layer inputs: a second embedding table (times
  sqrt(per_layer_input_size)) plus a projection of the scaled embeddings (times hidden_size**-0.5,
  normed), summed and scaled by 2**-0.5. They give each layer its own view of the token at little
  compute (the table is looked up, not multiplied);
- q and k heads are normed (with weight) before RoPE, v heads without; scores are not scaled
  (the norms fix their size);
- windowed layers see the last `sliding_window` keys (counted along each node's own path in a tree
  pass, as for Gemma 3) with default RoPE on their head dim; the global layers may have wider heads
  (`global_head_dim`), their own kv heads and, with `k_eq_v`, values equal to their keys, and use
  "proportional" RoPE: only the first partial_rotary_factor of each half-head's frequencies turn
  (computed over the whole head dim), the rest stay at angle 0;
- the last `kv_shared_layers` layers compute no keys or values: each reads those of the last earlier
  layer of its own type in the same pass (keys and values are its cache's, written there a few
  layers before), and keeps no cache of its own (the cache has a layer per producing layer only);
- with `double_wide_mlp` those shared layers' MLPs are twice as wide (read from the weights' shapes);
- with a MoE block (26B-A4B: `enable_moe_block`, models/moe.py), the MLP's output is normed on its own,
  the block's output (its router on the residual, its experts on their own pre-norm of it) is normed
  too, and their sum takes the place of the MLP's output before post_feedforward_norm:
              m = post_mlp_norm_1(mlp(pre_feedforward_norm(h))) + post_mlp_norm_2(experts(pre_norm_2(h)));
              h += post_feedforward_norm(m);
- logits are soft-capped (cap * tanh(logits / cap)) when final_logit_softcapping is set.

It runs eagerly (the fused C decoder does not take it); its projections, the per-layer ones
included, go through `make_linear` (the native linear kernels when loaded fast, whose rows do not
depend on the pass), and each query attends alone over the keys it sees (`row_attention`), so a
row's output is what it would be in any other pass: speculation and batching stay lossless in
bf16. RoPE angles are computed per pass from the positions, as transformers does, rather than from
tables: the global heads are wide and the context long, so tables would be large. Layer skipping (self-drafting) skips
a shared layer whose producing layer was skipped: it would have no keys to read.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cache.contiguous import KVCache
from ..forward import ForwardBatch
from .config import ModelConfig
from .gemma import fp32_rms_norm, softcapped_final
from .moe import build_gemma4_layer as build_gemma4_moe
from .moe import gemma4_route, moe_mlp
from .moe import projections as moe_projections
from .transformer import Transformer, apply_rope, cat_rows, eager_linear


def gemma4_inv_freq(theta: float, head_dim: int, proportion: float = 1.0, factor: float = 1.0) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies: the first proportion * head_dim / 2 as default RoPE
    over the whole head dim, the rest 0 (transformers' "proportional" RoPE; default RoPE at 1.0)."""
    turning = int(proportion * head_dim // 2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat([inv_freq, torch.zeros(head_dim // 2 - turning)]) / factor


def rope_now(inv_freq: torch.Tensor, fb: ForwardBatch, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin at the pass's RoPE positions, [1 or B, 1, T, head_dim], computed as transformers does
    (float32 positions times the inverse frequencies, cast to the model dtype)."""
    if fb.uniform:
        positions = torch.arange(fb.start, fb.start + fb.tokens.shape[1], device=device)[None]   # [1, T]
    else:
        positions = fb.rope_positions().to(device)                                                # [B, T]
    angles = positions[..., None].float() * inv_freq.to(device)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def row_attention(q: torch.Tensor,                   # [B, H, T, HD] normed, roped
                  keys: torch.Tensor,                # [B, KVH, L, HD] as the cache write returned them
                  values: torch.Tensor,              # [B, KVH, L, HD]
                  fb: ForwardBatch, window: int | None) -> torch.Tensor:   # -> [B, H, T, HD]
    """Attention (scores unscaled) with each query alone over exactly the keys it sees, gathered: the
    same ops on the same values as when its token is decoded alone, so a row's output does not depend
    on the pass it is in (one SDPA call over the whole pass blocks its sums by the pass's shape, and
    Gemma 4 runs eagerly: the fused decoder's batch invariance is not there to lean on)."""
    batch, heads, num_tokens, _ = q.shape
    visible = None if fb.is_chain else fb.visible(keys.shape[2], window).to(q.device)     # [B, T, L]: trees
    starts = fb.starts()
    out = torch.empty_like(q)
    for b in range(batch):
        for t in range(num_tokens if fb.lengths is None else fb.lengths[b]):
            if visible is None:                  # a chain: slots lo..own, copied as a gather would be
                slot = starts[b] + t
                lo = max(0, slot + 1 - window) if window else 0
                k, v = keys[b, None, :, lo:slot + 1].contiguous(), values[b, None, :, lo:slot + 1].contiguous()
            else:
                idx = visible[b, t].nonzero()[:, 0]
                k, v = keys[b, None, :, idx], values[b, None, :, idx]
            out[b, :, t:t + 1] = F.scaled_dot_product_attention(q[b, None, :, t:t + 1], k, v, scale=1.0,
                                                                enable_gqa=True)[0]
    return out


class Gemma4Transformer(Transformer):
    """A Gemma 4 text decoder with the interface of `Transformer` (run, logits, forward, new_cache);
    weights in the Hugging Face layout of Gemma4ForCausalLM (the multimodal wrapper's text model is
    renamed to it on reading: gemma_config.gemma4_weight_name)."""

    fused_in_init = False

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 make_linear: Callable = eager_linear) -> None:
        c = self.config = config
        self.embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        first_shared = c.num_layers - c.kv_shared_layers
        # the last producing layer of each type is the one the shared layers of that type read
        last_of = {c.sliding_layers[i]: i for i in range(first_shared)}
        self.layers = []
        for i in range(c.num_layers):
            p, sliding = f"model.layers.{i}.", c.sliding_layers[i]
            producer = i < first_shared
            names = ["q"] + (["k"] if producer else []) + (["v"] if producer and not (c.k_eq_v and not sliding) else [])
            layer = {
                "cache": i if producer else None,          # its cache layer (producers are 0..first_shared-1)
                "stores": producer and last_of[sliding] == i,
                "sliding": sliding, "window": c.layer_window(i),
                "head_dim": c.layer_head_dim(i), "kv_heads": c.layer_kv_heads(i),
                "qkv": make_linear(cat_rows([weights[p + f"self_attn.{n}_proj.weight"] for n in names], self.dtype),
                                   None),
                "o": make_linear(weights[p + "self_attn.o_proj.weight"], None),
                "gate_up": make_linear(cat_rows([weights[p + "mlp.gate_proj.weight"],
                                                 weights[p + "mlp.up_proj.weight"]], self.dtype), None),
                "down": make_linear(weights[p + "mlp.down_proj.weight"], None),
                "scalar": weights.get(p + "layer_scalar", torch.ones(1)).to(self.dtype).to(self.device),
            }
            norms = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                     "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
                     "q_norm": "self_attn.q_norm"}
            if producer:
                norms["k_norm"] = "self_attn.k_norm"
            if c.per_layer_input_size:
                norms["per_layer_norm"] = "post_per_layer_input_norm"
                layer["per_layer_gate"] = make_linear(weights[p + "per_layer_input_gate.weight"], None)
                layer["per_layer_proj"] = make_linear(weights[p + "per_layer_projection.weight"], None)
            if c.moe is not None and c.moe_layers[i]:
                layer.update(build_gemma4_moe(weights, p, c, make_linear))
                norms.update(pre_moe_norm="pre_feedforward_layernorm_2", post_mlp_norm_1="post_feedforward_layernorm_1",
                             post_moe_norm="post_feedforward_layernorm_2")
            for key, name in norms.items():              # float32, as stored (no 1 +)
                layer[key] = weights[p + name + ".weight"].float()
            self.layers.append(layer)
        self.final_norm_fp32 = weights["model.norm.weight"].float()
        self.final_norm = self.final_norm_fp32.to(self.dtype)
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=self.dtype, device=self.device)
        if c.per_layer_input_size:
            self.per_layer_embed = weights["model.embed_tokens_per_layer.weight"]      # [V', L * P]
            self.per_layer_embed_scale = torch.tensor(c.per_layer_input_size ** 0.5, dtype=self.dtype,
                                                      device=self.device)
            self.per_layer_model_proj = make_linear(weights["model.per_layer_model_projection.weight"], None)
            self.per_layer_proj_norm = weights["model.per_layer_projection_norm.weight"].float()
        rope = c.rope_scaling or {}
        self.inv_freq = {       # keyed by "is a windowed layer"
            True: gemma4_inv_freq(c.rope_local_theta or 10000.0, c.head_dim),
            False: gemma4_inv_freq(c.rope_theta, c.layer_head_dim(c.num_layers - 1),
                                   float(rope.get("partial_rotary_factor", 1.0)), float(rope.get("factor", 1.0)))}
        self._init_head(weights, make_linear)
        self.fused = None
        self._skip_decoders: dict = {}

    def projections(self) -> list:
        """Every projection: the LM head, each layer's qkv, o, gate_up and down (and its MoE block's
        router and experts), then the per-layer input ones."""
        extra = []
        if self.config.per_layer_input_size:
            extra = [self.per_layer_model_proj] + [ly[k] for ly in self.layers
                                                   for k in ("per_layer_gate", "per_layer_proj")]
        return [self.lm_head] + [lin for ly in self.layers for lin in (
            [ly["qkv"], ly["o"], ly["gate_up"], ly["down"]] + (moe_projections(ly) if "router" in ly else []))] + extra

    def stored_kv_layers(self) -> dict[bool, int]:
        """The cache layer of the last producing layer of each type (windowed? -> cache layer): the
        keys and values the kv-shared layers reuse, and those Gemma 4's assistant attends to."""
        return {layer["sliding"]: layer["cache"] for layer in self.layers if layer["stores"]}

    def _per_layer_inputs(self, tokens: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[B, T, L, P]: each layer's per-layer input for each token (see the module docstring)."""
        c = self.config
        shape = (*tokens.shape, c.num_layers, c.per_layer_input_size)
        table = F.embedding(tokens, self.per_layer_embed) * self.per_layer_embed_scale
        proj = self.per_layer_model_proj(embeds) * (c.hidden_size ** -0.5)
        proj = fp32_rms_norm(proj.view(shape), self.per_layer_proj_norm, c.rms_norm_eps)
        return (proj + table.view(shape)) * (2.0 ** -0.5)

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, cache: KVCache, skip: frozenset[int] = frozenset()) -> torch.Tensor:
        """As `Transformer.run` (every pass kind, eagerly): the hidden states [B, T, D] before the final
        norm. The producing layers write their keys/values in `cache` (layer i at cache layer i); the
        shared layers read their producer's, as this pass's write returned them."""
        c = self.config
        tokens, start, rows = fb.tokens, fb.start, fb.rows
        batch, num_tokens = tokens.shape
        ropes = {kind: rope_now(f, fb, self.dtype, self.device) for kind, f in self.inv_freq.items()}
        eps, heads = c.rms_norm_eps, c.num_heads

        hidden = F.embedding(tokens, self.embed) * self.embed_scale                    # [B, T, D]
        per_layer = self._per_layer_inputs(tokens, hidden) if c.per_layer_input_size else None
        shared: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}    # windowed? -> the keys/values to reuse
        for index, layer in enumerate(self.layers):
            if index in skip or (layer["cache"] is None and layer["sliding"] not in shared):
                continue
            hd, kvh, sliding = layer["head_dim"], layer["kv_heads"], layer["sliding"]
            cos, sin = ropes[sliding]
            # 1. attention: norm, q (k, v), q/k/v norms, RoPE, cache write (or the producer's), o, post-norm
            x = fp32_rms_norm(hidden, layer["attn_norm"], eps)
            qkv = layer["qkv"](x)
            q = qkv[..., :heads * hd].view(batch, num_tokens, heads, hd)
            q = apply_rope(fp32_rms_norm(q, layer["q_norm"], eps).transpose(1, 2), cos, sin)
            if layer["cache"] is None:
                keys, values = shared[sliding]
            else:
                k = qkv[..., heads * hd:(heads + kvh) * hd].view(batch, num_tokens, kvh, hd)
                v = k if qkv.shape[-1] == (heads + kvh) * hd else qkv[..., (heads + kvh) * hd:].view(k.shape)
                k = apply_rope(fp32_rms_norm(k, layer["k_norm"], eps).transpose(1, 2), cos, sin)
                v = F.rms_norm(v.float(), (hd,), None, eps).to(v.dtype).transpose(1, 2)
                keys, values = cache.write(layer["cache"], rows, start, k, v)
                if layer["stores"]:
                    shared[sliding] = keys, values
            attn = row_attention(q, keys, values, fb, layer["window"])
            attn = attn.transpose(1, 2).reshape(batch, num_tokens, heads * hd)
            hidden = hidden + fp32_rms_norm(layer["o"](attn), layer["post_attn_norm"], eps)
            # 2. MLP: norm, GeGLU with fused gate/up, post-norm
            x = fp32_rms_norm(hidden, layer["mlp_norm"], eps)
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            mlp = layer["down"](F.gelu(gate, approximate="tanh") * up)
            if "router" in layer:        # beside it, the MoE block (models/moe.py), each output normed
                routing = gemma4_route(layer, hidden.reshape(-1, c.hidden_size), c.moe["used"], eps)
                experts = moe_mlp(layer, fp32_rms_norm(hidden, layer["pre_moe_norm"], eps), c.moe, routing)
                mlp = (fp32_rms_norm(mlp, layer["post_mlp_norm_1"], eps)
                       + fp32_rms_norm(experts, layer["post_moe_norm"], eps))
            hidden = hidden + fp32_rms_norm(mlp, layer["post_mlp_norm"], eps)
            # 3. the per-layer input, gated by the hidden state; then the layer's scalar
            if per_layer is not None:
                x = F.gelu(layer["per_layer_gate"](hidden), approximate="tanh") * per_layer[:, :, index]
                hidden = hidden + fp32_rms_norm(layer["per_layer_proj"](x), layer["per_layer_norm"], eps)
            hidden = hidden * layer["scalar"]
        return hidden

    def _final(self, hidden: torch.Tensor, head=None) -> torch.Tensor:   # [B, n, D] -> [B, n, vocab] float32
        return softcapped_final(self, hidden, head)
