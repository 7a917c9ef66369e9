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

import torch
import torch.nn.functional as F

from .gpt_oss_config import ARCH, MODEL_TYPE  # noqa: F401  (the names gguf.py and the tests read here)
from .transformer import Transformer


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
