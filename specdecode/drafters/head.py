"""The EAGLE-style draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"; reduced draft vocabulary as in EAGLE-3).

Terms: the target's *feature* at position p is its last hidden state there, before the final
norm. Head *slot* j reads the feature of position j and the embedding of token j+1 and predicts
the feature of position j+1; the target's final norm and LM head (restricted to the draft
vocabulary) turn that prediction into a distribution for token j+2. Drafting chains slots: the
first slot of a step reads a true feature, later ones the head's own predictions.

    feature[j] --in_norm--+
                          cat -> fc -> decoder layer (GQA attention + SwiGLU) -> predicted feature[j+1]
    embed(token[j+1]) ----+                                                      |
                                                         final_norm -> lm_head[draft_vocab] -> logits

The block is written once (`head_block`) and used by training (full causal attention over a
sequence) and by the drafter (a one-layer KV cache, position-addressed like the target's).

`mtp_block` is the same slot for the multi-token-prediction head a Qwen3.5 checkpoint ships
(drafters/mtp.py): its input is the target's hidden state after the final norm, both inputs
get their own (1 + w) norm, the layer is one of the target's gated attention layers, and its
output, normed by the head's own norm, goes straight to the target's whole LM head and is the
next chained slot's input.

    hidden[j] --pre_fc_norm_hidden----+
                                      cat -> fc -> gated attention layer -> norm -> hidden'[j+1]
    embed(token[j+1]) --pre_fc_norm_embedding--+                                 |
                                                                            lm_head -> logits
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..models.gemma import fp32_rms_norm
from ..models.qwen3_5 import decoder_layer, gated_attention
from ..models.transformer import rope_inv_freq, rotate_half

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    draft_vocab_size: int
    target_vocab_size: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Head:
    """What a drafter on a head (drafters/eagle.py's `HeadDrafter`) drafts with."""
    config: HeadConfig
    block: Callable                  # one head pass: head_block or mtp_block
    params: dict                     # the block's weights: norms (tensors) and projections (callables)
    draft_vocab: torch.Tensor        # [V_draft] the target token ids of the LM head's rows
    lm_head: Callable                # [B, D] -> [B, V_draft]
    final_norm: torch.Tensor | None  # applied to a predicted feature before lm_head; None: the block norms
    cos: torch.Tensor                # [positions, rotary_dim] RoPE tables of the head's attention
    sin: torch.Tensor
    relative_cost: float             # priors of the draft budget (DrafterCapabilities)
    prior_acceptance: float | None = None


def head_block(p: Mapping, config: HeadConfig,
               token_embeds: torch.Tensor,   # [B, T, D] embeddings of token j+1 for each slot j
               features: torch.Tensor,       # [B, T, D] feature of position j (true or predicted)
               cos: torch.Tensor, sin: torch.Tensor,   # broadcastable to [B, heads, T, head_dim]
               attend: Attend) -> torch.Tensor:          # -> [B, T, D] predicted features of j+1
    """One head pass; `p` maps names to tensors (norm weights) or callables (projections)."""
    c = config
    batch, num_tokens, _ = features.shape
    eps = c.rms_norm_eps
    x = torch.cat([token_embeds, F.rms_norm(features, (c.hidden_size,), p["in_norm"], eps)], dim=-1)
    hidden = p["fc"](x)
    x = F.rms_norm(hidden, (c.hidden_size,), p["attn_norm"], eps)
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = p["qkv"](x).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(batch, num_tokens, c.num_heads, c.head_dim).transpose(1, 2)
    k = k.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = v.view(batch, num_tokens, c.num_kv_heads, c.head_dim).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    attn = attend(q, k, v).transpose(1, 2).reshape(batch, num_tokens, q_size)
    hidden = hidden + p["o"](attn)
    x = F.rms_norm(hidden, (c.hidden_size,), p["mlp_norm"], eps)
    gate, up = p["gate_up"](x).chunk(2, dim=-1)
    return hidden + p["down"](F.silu(gate) * up)


def mtp_block(p: Mapping, config: HeadConfig,
              token_embeds: torch.Tensor,   # [B, T, D] embeddings of token j+1 for each slot j
              hidden: torch.Tensor,         # [B, T, D] the target's normed hidden state at j, or the head's output
              cos: torch.Tensor, sin: torch.Tensor,   # broadcastable to [B, heads, T, rotary_dim]
              attend: Attend) -> torch.Tensor:          # -> [B, T, D] normed hidden states of j+1
    """One pass of a Qwen3.5 MTP head; `p`: the target model's `mtp` (models/qwen3_5.py)."""
    eps = config.rms_norm_eps
    x = torch.cat([fp32_rms_norm(token_embeds, p["embed_norm"], eps), fp32_rms_norm(hidden, p["hidden_norm"], eps)],
                  dim=-1)
    mix = partial(gated_attention, p["layer"], config, cos=cos, sin=sin, attend=attend)
    return fp32_rms_norm(decoder_layer(p["layer"], eps, p["fc"](x), mix), p["norm"], eps)


def rope_tables(config: HeadConfig, length: int, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = type("RopeCfg", (), {"head_dim": config.head_dim, "rotary_dim": config.head_dim,
                               "rope_theta": config.rope_theta, "rope_scaling": None})
    angles = torch.outer(torch.arange(length, dtype=torch.float32), rope_inv_freq(cfg))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


PROJECTIONS = ("fc", "qkv", "o", "gate_up", "down")
NORMS = ("in_norm", "attn_norm", "mlp_norm")


class EagleHead(nn.Module):
    """Trainable parameters of the head. The target's embedding, final norm and LM-head rows
    are frozen buffers (not saved: the drafter takes them from the target at load)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        d = c.hidden_size
        qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.qkv = nn.Linear(d, qkv_out, bias=False)
        self.o = nn.Linear(c.num_heads * c.head_dim, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, d, bias=False)
        for name in NORMS:
            self.register_parameter(name, nn.Parameter(torch.ones(d)))
        self.register_buffer("draft_vocab", torch.arange(c.draft_vocab_size), persistent=True)

    @staticmethod
    def from_target(target_model, draft_vocab: torch.Tensor) -> EagleHead:
        """A head shaped like one target layer, initialised from the target's last layer; fc keeps
        nn.Linear's random init (an identity on the feature part would start the head predicting
        the target's *current* token with high confidence: a poor start)."""
        tc = target_model.config
        config = HeadConfig(tc.hidden_size, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size,
                            tc.rms_norm_eps, tc.rope_theta, int(draft_vocab.numel()), tc.vocab_size)
        head = EagleHead(config)
        weights = target_layer_weights(target_model, tc.num_layers - 1)
        with torch.no_grad():
            for name in ("qkv", "o", "gate_up", "down"):
                getattr(head, name).weight.copy_(weights[name])
            head.attn_norm.copy_(weights["attn_norm"])
            head.mlp_norm.copy_(weights["mlp_norm"])
            head.in_norm.copy_(target_model.final_norm.float())
            head.fc.bias.zero_()
            head.draft_vocab.copy_(draft_vocab)
        return head

    def params(self) -> dict:
        return {**{n: getattr(self, n) for n in PROJECTIONS}, **{n: getattr(self, n) for n in NORMS}}

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor,   # [B, T, D] each
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:       # -> [B, T, D]
        """Training pass over whole sequences (slot j attends to slots <= j)."""
        causal: Attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                                         enable_gqa=True)
        return head_block(self.params(), self.config, token_embeds, features, cos, sin, causal)


def target_layer_weights(target_model, index: int) -> dict[str, torch.Tensor]:
    """Float32 [out, in] weights of one target layer, whatever the projections were packed into."""
    c = target_model.config
    layer = target_model.layers[index]
    inputs = {"qkv": c.hidden_size, "o": c.num_heads * c.head_dim, "gate_up": c.hidden_size,
              "down": c.intermediate_size}
    out = {"attn_norm": layer["attn_norm"].float(), "mlp_norm": layer["mlp_norm"].float()}
    for name, in_features in inputs.items():
        out[name] = unpack_weight(layer[name], in_features, target_model.dtype)
    return out


@torch.no_grad()
def unpack_weight(linear, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] float32 weight of any projection callable (eager closure or PackedLinear),
    recovered by applying it to the identity minus its bias (exact: one nonzero term per output)."""
    eye = torch.eye(in_features, dtype=dtype)
    zero = torch.zeros(1, in_features, dtype=dtype)
    return (linear(eye).float() - linear(zero).float()).t().contiguous()
