"""Gemma 2 and Gemma 3 text decoders natively (Gemma Team 2024, 2025), as transformers computes them
(models/gemma2/modeling_gemma2.py, models/gemma3/modeling_gemma3.py):

- the token embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype;
- every RMSNorm multiplies by (1 + weight) and is computed in float32, the result cast back;
- a layer is  h += post_attention_norm(attention(input_norm(h)));
              h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))
  with a GeGLU MLP: down(gelu_tanh(gate(x)) * up(x));
- attention scores are scaled by query_pre_attn_scalar**-0.5, and in Gemma 2 soft-capped
  (cap * tanh(scores / cap)) before the mask; the logits are soft-capped too when the config says so;
- some layers see only the last `sliding_window` keys (Gemma 2: every other layer from the first,
  Gemma 3: five of every six), counted along each node's own path in a tree pass as for Mistral;
- Gemma 3 normalizes each q / k head (1 + weight) before RoPE, and its windowed layers use their own
  RoPE base (rope_local_base_freq, unscaled) while the global ones use rope_theta with any scaling.

The fused C decoder (fast/decoder.c) runs them too, batch invariant as for the other families; the
eager path here is the reference and runs what it does not take (layer skipping, long batched
prefills, no native kernels). GGUF files (llama.cpp's gemma2 / gemma3) store each norm weight with
the 1 already added (convert_hf_to_gguf.py); `gguf_norm_shift` (models/gemma_config.py) names the
tensors read back minus 1.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cache.contiguous import KVCache
from ..forward import ForwardBatch
from .config import ModelConfig
from .transformer import Transformer, apply_rope, attention_mask, eager_linear, rope_at, rope_inv_freq


def fp32_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x normalized in float32 times `weight` (1 + the stored weight, float32),
    cast back to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def softcapped_attention(q: torch.Tensor,             # [B, H, T, HD]
                         keys: torch.Tensor,          # [B, KVH, L, HD]
                         values: torch.Tensor,        # [B, KVH, L, HD]
                         mask: torch.Tensor | None,   # broadcastable to [B, H, T, L] bool; None = all
                         scale: float, cap: float) -> torch.Tensor:   # [B, H, T, HD]
    """Attention with scores soft-capped before the mask (Gemma 2), as transformers' eager path."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale                       # [B, H, T, L]
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


class GemmaTransformer(Transformer):
    """A Gemma 2 / Gemma 3 decoder with the interface of `Transformer` (run, logits, forward,
    new_cache); weights in the Hugging Face layout (norm weights without the 1)."""

    fused_in_init = False       # built at the end of __init__, from the Gemma fields

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 make_linear: Callable = eager_linear) -> None:
        super().__init__(config, weights, make_linear)   # projections, embedding, global RoPE tables

        def plus_one(name: str) -> torch.Tensor:     # [dim] float32, as transformers' (1.0 + weight.float())
            return 1.0 + weights[name].float()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer["attn_norm"] = plus_one(p + "input_layernorm.weight")
            layer["post_attn_norm"] = plus_one(p + "post_attention_layernorm.weight")
            layer["mlp_norm"] = plus_one(p + "pre_feedforward_layernorm.weight")
            layer["post_mlp_norm"] = plus_one(p + "post_feedforward_layernorm.weight")
            if config.qk_norm:
                layer["q_norm"] = plus_one(p + "self_attn.q_norm.weight")
                layer["k_norm"] = plus_one(p + "self_attn.k_norm.weight")
        self.final_norm_fp32 = plus_one("model.norm.weight")                 # [D]
        self.final_norm = self.final_norm_fp32.to(self.dtype)   # (1 + w) for heads that apply it with F.rms_norm
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype, device=self.device)
        self.local_rope = None              # (cos, sin) of the windowed layers when their base differs
        if config.rope_local_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            positions = torch.arange(config.max_position_embeddings + 64, dtype=torch.float32)
            angles = torch.outer(positions, rope_inv_freq(local))
            angles = torch.cat([angles, angles], dim=-1)                     # [max_pos, rotary_dim]
            self.local_rope = (angles.cos().to(self.dtype).to(self.device), angles.sin().to(self.dtype).to(self.device))
        if getattr(make_linear, "fused_decoder", None) is not None:      # reads the fields above
            self.fused = make_linear.fused_decoder(self)

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, cache: KVCache, skip: frozenset[int] = frozenset()) -> torch.Tensor:
        """As `Transformer.run` (every pass kind; fused when it can, else eager): the hidden states
        [B, T, D] before the final norm."""
        hidden = self._run_fused(fb, cache, skip)
        if hidden is not None:
            return hidden
        c = self.config
        tokens, start, rows = fb.tokens, fb.start, fb.rows
        batch, num_tokens = tokens.shape
        global_rope = rope_at(self.rope_cos, self.rope_sin, fb, self.device)
        local_rope = global_rope if self.local_rope is None else rope_at(*self.local_rope, fb, self.device)
        masks = {w: attention_mask(fb, w, self.device) for w in {c.layer_window(i) for i in range(c.num_layers)}}
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        eps, scale = c.rms_norm_eps, c.attention_scale

        hidden = F.embedding(tokens, self.embed) * self.embed_scale                 # [B, T, D]
        for index, layer in enumerate(self.layers):
            if index in skip:
                continue
            # 1. attention: norm, q/k/v, (q/k norms,) RoPE, cache write, attention, o, post-norm
            x = fp32_rms_norm(hidden, layer["attn_norm"], eps)
            q, k, v = layer["qkv"](x).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(batch, num_tokens, c.num_heads, c.head_dim).transpose(1, 2)
            k = k.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
            if c.qk_norm:
                q, k = fp32_rms_norm(q, layer["q_norm"], eps), fp32_rms_norm(k, layer["k_norm"], eps)
            sliding = c.sliding_layers is None or c.sliding_layers[index]
            cos, sin = local_rope if sliding else global_rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = cache.write(index, rows, start, k, v)
            mask = masks[c.layer_window(index)]
            if c.attn_logit_softcapping is None:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            else:
                attn = softcapped_attention(q, keys, values, mask, scale, c.attn_logit_softcapping)
            attn = attn.transpose(1, 2).reshape(batch, num_tokens, q_size)
            hidden = hidden + fp32_rms_norm(layer["o"](attn), layer["post_attn_norm"], eps)
            # 2. MLP: norm, GeGLU with fused gate/up, post-norm
            x = fp32_rms_norm(hidden, layer["mlp_norm"], eps)
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            mlp = layer["down"](F.gelu(gate, approximate="tanh") * up)
            hidden = hidden + fp32_rms_norm(mlp, layer["post_mlp_norm"], eps)
        return hidden

    def _final(self, hidden: torch.Tensor, head=None) -> torch.Tensor:   # [B, n, D] -> [B, n, vocab] float32
        return softcapped_final(self, hidden, head)


def softcapped_final(model, hidden: torch.Tensor, head=None) -> torch.Tensor:   # [B, n, D] -> [B, n, vocab]
    """A Gemma's final fp32 norm (`final_norm_fp32`: 1 + w for Gemma 2/3, w for Gemma 4), LM head
    (model.lm_head unless given) and the final soft-cap, in float32."""
    hidden = fp32_rms_norm(hidden, model.final_norm_fp32, model.config.rms_norm_eps)
    logits = (model.lm_head if head is None else head)(hidden).float()
    cap = model.config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def prepare_tokenizer(tokenizer, config: ModelConfig) -> tuple[int, ...]:
    """Gemma is trained with <bos> first: plain prompts get it whatever tokenizer_config.json says
    (chat templates write it themselves), named by the config's bos_token_id if the tokenizer has
    none. Returns the end-of-turn ids to stop at besides the configured EOS ids: <end_of_turn>
    (Gemma 2 / 3) or <turn|> (Gemma 4), which end a chat turn, also when a checkpoint's
    generation_config.json does not list them."""
    if tokenizer.bos_token is None and config.bos_token_id is not None:
        tokenizer.bos_token = tokenizer.backend.id_to_token(int(config.bos_token_id))
    tokenizer.add_bos = tokenizer.bos_token is not None
    ends = (tokenizer.token_id("<end_of_turn>"), tokenizer.token_id("<turn|>"))
    return tuple(t for t in ends if t is not None)
