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
the 1 already added (convert_hf_to_gguf.py); `gguf_norm_shift` names the tensors read back minus 1.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..forward import ForwardBatch
from ..kv_cache import KVCache
from .config import ModelConfig, ModelError
from .transformer import Transformer, apply_rope, attention_mask, eager_linear, rope_at, rope_inv_freq

LAYER_TYPES = ("sliding_attention", "full_attention")
# llama.cpp's layer pattern when the file has no attention.sliding_window_pattern: layer i is windowed
# when i % n < n - 1 (as transformers' default layer_types)
DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}


def gemma_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2 (model_type gemma2) or Gemma 3 text (gemma3_text) config.json,
    in the old (rope_theta, rope_local_base_freq, sliding_window_pattern) or the transformers >= 5
    (rope_parameters per layer type, layer_types) spelling."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(f"hidden_activation {act!r} is not supported natively for {arch} (gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelError("use_bidirectional_attention (an encoder) is not supported natively")
    if cfg.get("attention_bias"):
        raise ModelError(f"attention_bias (biases on q/k/v/o) is not supported natively for {arch}")
    layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = DEFAULT_PATTERN[arch] if arch == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
        layer_types = [LAYER_TYPES[0] if (i + 1) % pattern else LAYER_TYPES[1] for i in range(layers)]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ModelError(f"layer_types {unknown} are not supported natively (supported: {', '.join(LAYER_TYPES)})")
    rope = dict(cfg.get("rope_parameters") or {})
    if arch == "gemma3" and set(rope) & set(LAYER_TYPES):        # transformers >= 5: per layer type
        global_rope, local_rope = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:                          # one set for the global layers; the local base apart (Gemma 3)
        global_rope = rope or dict(cfg.get("rope_scaling") or {})
        local_rope = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    theta = global_rope.pop("rope_theta", None) or cfg.get("rope_theta") or (1e6 if arch == "gemma3" else 1e4)
    local_theta = local_rope.pop("rope_theta", None) or 10000.0
    if local_rope.get("rope_type", local_rope.get("type")) not in (None, "default"):
        raise ModelError(f"rope scaling on the sliding-window layers ({local_rope}) is not supported natively")
    if global_rope.get("rope_type", global_rope.get("type")) in (None, "default"):
        global_rope = {}
    window = cfg.get("sliding_window")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    gemma2 = arch == "gemma2"
    return dict(
        arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=global_rope or None,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        qk_norm=not gemma2, sliding_window=int(window) if window else None,
        sliding_layers=tuple(t == LAYER_TYPES[0] for t in layer_types),
        rope_local_theta=None if gemma2 else float(local_theta),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        # transformers' defaults when the key is absent; Gemma 3's attention ignores the attention cap
        attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0) if gemma2 else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if gemma2 else None),
    )


def gemma_hf_config(c: ModelConfig) -> dict[str, Any]:
    """A config.json for `c` that transformers and `gemma_fields` both read (the GGUF cache)."""
    gemma2 = c.arch == "gemma2"
    global_rope = dict(c.rope_scaling or {"rope_type": "default"}, rope_theta=c.rope_theta)
    eos: Any = list(c.eos_token_ids)
    layer_types = [LAYER_TYPES[0] if s else LAYER_TYPES[1] for s in (c.sliding_layers or [True] * c.num_layers)]
    return {
        "architectures": ["Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM"],
        "model_type": "gemma2" if gemma2 else "gemma3_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": global_rope if gemma2 else {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32",
        "sliding_window": c.sliding_window, "layer_types": layer_types,
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "attn_logit_softcapping": c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping,
    }


def gguf_fields(arch: str, g: Callable[..., Any], config: ModelConfig) -> dict[str, Any]:
    """The Gemma fields of a llama.cpp gemma2 / gemma3 file (`g(key, default)` reads `<arch>.key`),
    with llama.cpp's rules for what the file leaves out: the window pattern (every 2nd / 6th layer
    global), the local RoPE base (10000), and the score scale (1/sqrt(head_dim), or
    1/sqrt(hidden/heads) for the 27B models, which llama.cpp tells apart by their layer count)."""
    pattern = g("attention.sliding_window_pattern", DEFAULT_PATTERN[arch])
    if isinstance(pattern, (list, tuple)):
        sliding = tuple(bool(x) for x in pattern)
    else:
        n = int(pattern)
        sliding = tuple(n == 0 or i % n < n - 1 for i in range(config.num_layers))
    big = config.num_layers == {"gemma2": 46, "gemma3": 62}[arch]
    attn_cap, final_cap = g("attn_logit_softcapping"), g("final_logit_softcapping")
    return dict(
        qk_norm=arch == "gemma3", sliding_layers=sliding,
        rope_local_theta=float(g("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        query_pre_attn_scalar=float(config.hidden_size // config.num_heads if big else config.head_dim),
        attn_logit_softcapping=float(attn_cap if attn_cap is not None else 50.0) if arch == "gemma2" else None,
        final_logit_softcapping=(float(final_cap) if final_cap is not None
                                 else (30.0 if arch == "gemma2" else None)),
    )


# llama.cpp's Gemma layer norms (ffn_norm is the pre-feedforward norm, not Llama's post-attention one)
GGUF_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def gguf_norm_shift(hf_name: str, config: ModelConfig) -> float:
    """What llama.cpp added to a Gemma tensor (1 on every norm weight), to subtract on reading."""
    return 1.0 if config.is_gemma and hf_name.endswith("norm.weight") else 0.0


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

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor,                    # [B, T, D] from `run`
               logit_index: torch.Tensor | None = None,       # [B, n] token indices 0..T-1; None = all
               ) -> torch.Tensor:                             # [B, n, vocab] float32
        """Final norm, LM head and the final soft-cap (in float32) on the rows asked for."""
        if self.fused is not None:
            return self.fused.head(hidden, logit_index)
        if logit_index is not None:
            hidden = torch.gather(hidden, 1, logit_index[:, :, None].expand(-1, -1, hidden.shape[-1]))
        logits = self.lm_head(fp32_rms_norm(hidden, self.final_norm_fp32, self.config.rms_norm_eps)).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def prepare_tokenizer(tokenizer, config: ModelConfig) -> tuple[int, ...]:
    """Gemma is trained with <bos> first: plain prompts get it whatever tokenizer_config.json says
    (chat templates write it themselves), named by the config's bos_token_id if the tokenizer has
    none. Returns the end-of-turn ids to stop at besides the configured EOS ids: <end_of_turn>,
    which ends a chat turn, also when a checkpoint's generation_config.json does not list it."""
    if tokenizer.bos_token is None and config.bos_token_id is not None:
        tokenizer.bos_token = tokenizer.backend.id_to_token(int(config.bos_token_id))
    tokenizer.add_bos = tokenizer.bos_token is not None
    end_of_turn = tokenizer.token_id("<end_of_turn>")
    return () if end_of_turn is None else (end_of_turn,)
