"""gpt-oss (transformers' `gpt_oss`, llama.cpp's `gpt-oss`): a Transformer with learned attention
sinks, alternating sliding-window and full layers, biases on q/k/v/o, YaRN RoPE, and MoE MLPs whose
router is a linear map with a bias, top-k of its logits then a softmax over those k, and whose experts
have biases and a clamped SwiGLU (models/moe.py: the `router` and `activation` keys of `moe`).

Attention sinks: each q head has a learned logit that joins the softmax's denominator (as if a key
with that score and a zero value were always visible): weights = exp(s_j - m) / (sum_j exp(s_j - m) +
exp(sink - m)), m the max over the scores and the sink. The sliding layers see the last
`sliding_window` keys (`layer_types`: sliding_attention / full_attention).

A checkpoint stores each layer's experts as stacks with the input first (gate_up_proj [E, D, 2I], gate
and up interleaved column by column, down_proj [E, I, D]) and the router as mlp.router; `hf_weights`
renames them to the layout models/moe.py reads (llama.cpp's: stacks [E, out, in], gate and up apart),
so a Hugging Face directory and a GGUF file build the same layers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .errors import ModelError
from .transformer import Transformer

MODEL_TYPE = "gpt_oss"
ARCH = "gpt-oss"


def hf_fields(cfg: dict) -> dict:
    """The ModelConfig fields of a gpt_oss config.json."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ModelError(f"layer_types must name sliding_attention / full_attention for each of {layers} layers, "
                         f"got {types}")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rope.pop("rope_theta", None) or 150000.0)
    rope.pop("rope_theta", None)
    if rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = {}
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    window = cfg.get("sliding_window")
    return dict(
        arch=ARCH, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=rope or None,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", True)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(t == "sliding_attention" for t in types) if window else None,
        attention_sinks=True,
        moe={"experts": int(cfg.get("num_local_experts") or cfg.get("num_experts")),
             "used": int(cfg["num_experts_per_tok"]), "intermediate": int(cfg["intermediate_size"]),
             "norm_topk": False, "router": "topk_softmax", "activation": "swiglu_clamp",
             "alpha": float(cfg.get("swiglu_alpha", 1.702)), "limit": float(cfg.get("swiglu_limit", 7.0))},
        moe_layers=(True,) * layers)


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


def hf_weights(weights: dict, config) -> None:
    """A gpt_oss checkpoint's MoE tensors renamed in place to llama.cpp's layout (models/moe.py):
    mlp.router -> mlp.gate; experts.gate_up_proj [E, D, 2I] (gate and up interleaved) -> gate_proj and
    up_proj stacks [E, I, D]; down_proj [E, I, D] -> [E, D, I]; their biases alongside. A GGUF file's
    tensors already have that layout and pass as they are."""
    for i in range(config.num_layers):
        p = f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            if p + "router." + kind in weights:
                weights[p + "gate." + kind] = weights.pop(p + "router." + kind)
        gate_up = weights.pop(p + "experts.gate_up_proj", None)
        if gate_up is None:
            continue
        gate_up_bias = weights.pop(p + "experts.gate_up_proj_bias")                    # [E, 2I]
        weights[p + "experts.gate_proj.weight"] = gate_up[..., ::2].transpose(1, 2).contiguous()   # [E, I, D]
        weights[p + "experts.up_proj.weight"] = gate_up[..., 1::2].transpose(1, 2).contiguous()
        weights[p + "experts.gate_proj.bias"] = gate_up_bias[:, ::2].contiguous()
        weights[p + "experts.up_proj.bias"] = gate_up_bias[:, 1::2].contiguous()
        weights[p + "experts.down_proj.weight"] = weights.pop(p + "experts.down_proj").transpose(1, 2).contiguous()
        weights[p + "experts.down_proj.bias"] = weights.pop(p + "experts.down_proj_bias")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, moe: dict) -> torch.Tensor:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate): the gate clamped from
    above and up on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""
    limit = moe["limit"]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * moe["alpha"]))


def sink_attention(q: torch.Tensor,            # [B, H, T, HD]
                   keys: torch.Tensor,         # [B, KVH, L, HD]
                   values: torch.Tensor,       # [B, KVH, L, HD]
                   mask: torch.Tensor | None,  # [T, L] or [B, 1, T, L] bool (True: seen), None: all
                   sinks: torch.Tensor,        # [H] the sink logits
                   scale: float) -> torch.Tensor:   # -> [B, H, T, HD]
    """Attention whose softmax denominator has each head's sink (transformers' eager_attention_forward
    for gpt_oss)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale                       # [B, H, T, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


class GptOssTransformer(Transformer):
    """The decoder of models/transformer.py with gpt-oss's sinks (in its attention) and MoE layout."""

    def __init__(self, config, weights: dict, make_linear) -> None:
        hf_weights(weights, config)
        self.sinks = [weights[f"model.layers.{i}.self_attn.sinks"].float().contiguous()
                      for i in range(config.num_layers)]
        super().__init__(config, weights, make_linear)

    def attend(self, index: int, q, keys, values, mask):
        return sink_attention(q, keys, values, mask, self.sinks[index], self.config.attention_scale)


# llama.cpp's per-layer names of gpt-oss's own tensors (the rest as Llama's and models/moe.py's)
GGUF_NAMES = {"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm"}


def gguf_name(parts: list[str]) -> str | None:
    """The Hugging Face name of a gpt-oss block tensor (`parts`: its GGUF name split at dots), or None
    for one named as in other families. The sinks are a parameter of their own (no `.weight`)."""
    if parts[2] == "attn_sinks":
        return f"model.layers.{parts[1]}.self_attn.sinks"
    if parts[2] in GGUF_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def gguf_fields(g) -> dict:
    """The gpt-oss fields of a llama.cpp file (`g(key, default)`: its metadata under the architecture):
    llama.cpp windows every even layer (its swa pattern of 2) and fixes the SwiGLU's alpha and limit;
    YaRN without truncation, as gpt-oss's config.json has it."""
    layers = int(g("block_count"))
    window = g("attention.sliding_window")
    rope = None
    if g("rope.scaling.type") == "yarn":
        rope = {"rope_type": "yarn", "factor": float(g("rope.scaling.factor")), "truncate": False,
                "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
                "beta_fast": float(g("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(g("rope.scaling.yarn_beta_slow", 1.0))}
    return {"rope_scaling": rope, "attention_bias": True, "attention_sinks": True,
            "sliding_window": int(window) if window else None,
            "sliding_layers": tuple(i % 2 == 0 for i in range(layers)) if window else None,
            "intermediate_size": int(g("expert_feed_forward_length")),
            "moe": {"experts": int(g("expert_count")), "used": int(g("expert_used_count")),
                    "intermediate": int(g("expert_feed_forward_length")), "norm_topk": False,
                    "router": "topk_softmax", "activation": "swiglu_clamp", "alpha": 1.702, "limit": 7.0},
            "moe_layers": (True,) * layers}


def required_tensors(config) -> list[str]:
    """The GGUF tensors of a gpt-oss file (output.weight only when untied)."""
    per_layer = [f"{n}.{k}" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps",
                                      "ffn_up_exps", "ffn_down_exps") for k in ("weight", "bias")]
    per_layer += ["attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight"]
    return ["token_embd.weight", "output_norm.weight"] + [f"blk.{i}.{n}" for i in range(config.num_layers)
                                                        for n in per_layer]


def checkpoint_weights(weights: dict, config) -> None:
    """The inverse of `hf_weights`, in place: llama.cpp's layout back to a gpt_oss checkpoint's (the
    dense conversion of a GGUF file, which transformers also loads)."""
    for i in range(config.num_layers):
        p = f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            weights[p + "router." + kind] = weights.pop(p + "gate." + kind)
        gate, up = (weights.pop(p + f"experts.{k}_proj.weight").transpose(1, 2) for k in ("gate", "up"))   # [E, D, I]
        weights[p + "experts.gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2).contiguous()  # interleaved
        gate_b, up_b = (weights.pop(p + f"experts.{k}_proj.bias") for k in ("gate", "up"))
        weights[p + "experts.gate_up_proj_bias"] = torch.stack([gate_b, up_b], dim=-1).flatten(-2).contiguous()
        weights[p + "experts.down_proj"] = weights.pop(p + "experts.down_proj.weight").transpose(1, 2).contiguous()
        weights[p + "experts.down_proj_bias"] = weights.pop(p + "experts.down_proj.bias")


def hf_config(config) -> dict:
    """config.json for transformers' GptOssForCausalLM (the converted-GGUF cache)."""
    moe = config.moe
    eos = list(config.eos_token_ids)
    rope = dict(config.rope_scaling or {"rope_type": "default"}, rope_theta=config.rope_theta)
    return {"architectures": ["GptOssForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": moe["intermediate"],
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.rms_norm_eps, "rope_parameters": rope,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
            "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "num_local_experts": moe["experts"], "num_experts_per_tok": moe["used"],
            "swiglu_alpha": moe["alpha"], "swiglu_limit": moe["limit"], "sliding_window": config.sliding_window,
            "layer_types": ["sliding_attention" if config.layer_window(i) else "full_attention"
                            for i in range(config.num_layers)], "torch_dtype": "float32"}
