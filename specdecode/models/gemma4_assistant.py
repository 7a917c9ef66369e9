"""Gemma 4's assistant (transformers' Gemma4AssistantForCausalLM, model_type gemma4_assistant): a few
Gemma 4 layers that compute no keys or values of their own, trained to draft for one Gemma 4 target.

One step, for each row (transformers' Gemma4AssistantCandidateGenerator feeds the model this way):

- the input is concat(the target's embedding of the row's last token, a feature) through
  `pre_projection` (2 x backbone_hidden_size -> hidden_size). The feature is the target's last hidden
  state (after its final norm) at the position before that token, or, in a chain of steps, the
  previous step's `post_projection` output;
- every layer is a Gemma 4 layer (models/gemma4.py: fp32 norms as stored, q heads normed, scores
  unscaled, GeGLU MLP, layer scalar) whose attention reads the target's keys and values of the last
  target layer of its own type: a global layer every position the target holds, a windowed one the
  last `sliding_window + 1` of them (transformers' bidirectional window mask, flipped to look back).
  The query is rotated at the row's position: the position of that last token, the same at every
  step of a chain (the keys stay the target's);
- after the final norm, `post_projection` gives the next step's feature (backbone_hidden_size) and
  the LM head the logits. With `use_ordered_embeddings` the head scores only the tokens of the
  `centroid_intermediate_top_k` best of `num_centroids` clusters (a centroid projection picks them;
  `token_ordering` lists each cluster's tokens); every other token gets the row's lowest scored
  logit - 1 (transformers takes the lowest over the whole batch: per row keeps rows independent).

No final soft-cap. The config's text model is read with the Gemma 4 text fields (gemma_config.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .errors import ModelError
from .gemma import fp32_rms_norm
from .gemma4 import gemma4_inv_freq
from .gemma_config import gemma4_fields
from .transformer import apply_rope, eager_linear

MODEL_TYPE = "gemma4_assistant"
NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",      # float32, as stored
         "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
         "q_norm": "self_attn.q_norm"}


def assistant_dir(spec) -> Path | None:
    """The directory a model spec (a path or a Hugging Face id: loader.model_path) names when it holds
    a Gemma 4 assistant (config.json model_type gemma4_assistant), else None: also when it names nothing
    readable, which loading it as a model then reports."""
    from .loader import model_path
    try:
        config = model_path(spec) / "config.json"
        cfg = json.loads(config.read_text()) if config.is_file() else None
    except (ModelError, OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return config.parent if isinstance(cfg, dict) and cfg.get("model_type") == MODEL_TYPE else None


@dataclass(frozen=True)
class AssistantConfig:
    text: ModelConfig              # its layers (every one reads the target's keys: kv_shared_layers left 0)
    backbone_hidden_size: int      # the target's hidden size
    ordered_embeddings: bool       # the LM head over the top clusters' tokens only
    num_centroids: int
    centroid_top_k: int

    @staticmethod
    def from_hf(cfg: dict) -> AssistantConfig:
        """The fields of a gemma4_assistant config.json (ModelError naming what is not supported)."""
        if cfg.get("model_type") != MODEL_TYPE:
            raise ModelError(f"model_type must be {MODEL_TYPE!r}, got {cfg.get('model_type')!r}")
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelError("a gemma4_assistant config.json needs its text_config")
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            if text.get(key, 0):     # transformers' assistant validation: the layers take no per-layer inputs
                raise ModelError(f"text_config.{key} must be 0 in a Gemma 4 assistant, got {text[key]}")
        if text.get("use_double_wide_mlp"):
            raise ModelError("text_config.use_double_wide_mlp must be false in a Gemma 4 assistant")
        # every layer reads the target's keys; ModelConfig's own kv-sharing check (a producing layer of
        # each type) is about a model's own cache, which the assistant does not have
        fields = dict(gemma4_fields(text), kv_shared_layers=0, per_layer_input_size=0, per_layer_vocab_size=0)
        config = AssistantConfig(ModelConfig(**fields), int(cfg.get("backbone_hidden_size", 1536)),
                                 bool(cfg.get("use_ordered_embeddings", False)), int(cfg.get("num_centroids", 2048)),
                                 int(cfg.get("centroid_intermediate_top_k", 32)))
        if config.ordered_embeddings:
            vocab = config.text.vocab_size
            if config.num_centroids < 1 or vocab % config.num_centroids:
                raise ModelError(f"num_centroids must divide vocab_size {vocab}, got {config.num_centroids}")
            if not 1 <= config.centroid_top_k <= config.num_centroids:
                raise ModelError(f"centroid_intermediate_top_k must be in [1, num_centroids = {config.num_centroids}], "
                                 f"got {config.centroid_top_k}")
        return config


class Gemma4Assistant:
    """The assistant's weights and its step (see the module docstring)."""

    def __init__(self, config: AssistantConfig, weights: dict[str, torch.Tensor],
                 make_linear: Callable = eager_linear) -> None:
        self.config = config
        c = config.text
        embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device = embed.dtype, embed.device
        self.head_weight = weights.get("lm_head.weight", embed)      # [V, hidden]: tied unless saved apart
        self.lm_head = make_linear(self.head_weight, None)
        self.pre_projection = make_linear(weights["pre_projection.weight"], None)
        self.post_projection = make_linear(weights["post_projection.weight"], None)
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "sliding": c.sliding_layers[i], "head_dim": c.layer_head_dim(i),
                "q": make_linear(weights[p + "self_attn.q_proj.weight"], None),
                "o": make_linear(weights[p + "self_attn.o_proj.weight"], None),
                "gate_up": make_linear(torch.cat([weights[p + "mlp.gate_proj.weight"],
                                                  weights[p + "mlp.up_proj.weight"]]), None),
                "down": make_linear(weights[p + "mlp.down_proj.weight"], None),
                "scalar": weights.get(p + "layer_scalar", torch.ones(1)).to(self.dtype).to(self.device),
            }
            for key, name in NORMS.items():
                layer[key] = weights[p + name + ".weight"].float()
            self.layers.append(layer)
        self.final_norm = weights["model.norm.weight"].float()
        # weights one step reads: its layers, both projections and the head rows it scores
        rows, width = self.head_weight.shape
        if config.ordered_embeddings:
            rows = config.num_centroids + config.centroid_top_k * rows // config.num_centroids
        self.step_elements = rows * width + sum(w.numel() for name, w in weights.items() if name.endswith(
            ("proj.weight", "projection.weight")))
        rope = c.rope_scaling or {}
        self.inv_freq = {True: gemma4_inv_freq(c.rope_local_theta or 10000.0, c.head_dim),   # windowed? ->
                         False: gemma4_inv_freq(c.rope_theta, c.layer_head_dim(c.num_layers - 1),
                                                float(rope.get("partial_rotary_factor", 1.0)),
                                                float(rope.get("factor", 1.0)))}
        if config.ordered_embeddings:
            self.centroids = make_linear(weights["masked_embedding.centroids.weight"], None)
            # [clusters, tokens per cluster]: the token ids of each cluster
            self.clusters = weights["masked_embedding.token_ordering"].long().view(config.num_centroids, -1)

    def key_shapes(self) -> dict[bool, int]:
        """Head dim of each layer type's queries (windowed? -> head dim): the target's keys must match."""
        return {ly["sliding"]: ly["head_dim"] for ly in self.layers}

    def key_positions(self, lengths: torch.Tensor,      # [B] int64: positions each row's target holds (>= 1)
                      ) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type (windowed?), the target positions each row's queries read, [B, L] (clamped to
        the row's last where it has fewer), and which of them it sees, [B, L] bool."""
        out = {}
        window = self.config.text.sliding_window
        for sliding in set(self.key_shapes()):
            seen = lengths if not sliding or window is None else lengths.clamp(max=window + 1)
            span = torch.arange(int(seen.max()), device=lengths.device)[None]                  # [1, L]
            positions = (lengths - seen)[:, None] + span
            out[sliding] = positions.clamp(max=(lengths - 1)[:, None]), span < seen[:, None]
        return out

    @torch.inference_mode()
    def step(self, embeds: torch.Tensor,        # [B, backbone] the target's (scaled) embeddings of the tokens
             features: torch.Tensor,            # [B, backbone] the target's features, or the last step's
             keys: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             # windowed? -> (keys, values [B, kv_heads, L, head_dim], visible [B, L] bool)
             positions: torch.Tensor,           # [B] int64: each row's query position
             ) -> tuple[torch.Tensor, torch.Tensor]:   # -> logits [B, vocab] float32, next features [B, backbone]
        c = self.config.text
        eps, heads, batch = c.rms_norm_eps, c.num_heads, embeds.shape[0]
        hidden = self.pre_projection(torch.cat([embeds, features], dim=-1).to(self.dtype))[:, None]   # [B, 1, D]
        ropes = {}
        for sliding, inv_freq in self.inv_freq.items():
            angles = positions.to(self.device)[:, None].float() * inv_freq.to(self.device)       # [B, hd/2]
            angles = torch.cat([angles, angles], dim=-1)[:, None, None]                        # [B, 1, 1, hd]
            ropes[sliding] = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        masks = {s: visible[:, None, None] for s, (_, _, visible) in keys.items()}             # [B, 1, 1, L]
        for layer in self.layers:
            hd, sliding = layer["head_dim"], layer["sliding"]
            x = fp32_rms_norm(hidden, layer["attn_norm"], eps)
            q = layer["q"](x).view(batch, 1, heads, hd)
            q = apply_rope(fp32_rms_norm(q, layer["q_norm"], eps).transpose(1, 2), *ropes[sliding])
            k, v, _ = keys[sliding]
            attn = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=masks[sliding],
                                                  scale=1.0, enable_gqa=True)
            attn = attn.transpose(1, 2).reshape(batch, 1, heads * hd)
            hidden = hidden + fp32_rms_norm(layer["o"](attn), layer["post_attn_norm"], eps)
            x = fp32_rms_norm(hidden, layer["mlp_norm"], eps)
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            hidden = hidden + fp32_rms_norm(layer["down"](F.gelu(gate, approximate="tanh") * up),
                                            layer["post_mlp_norm"], eps)
            hidden = hidden * layer["scalar"]
        hidden = fp32_rms_norm(hidden, self.final_norm, eps)[:, 0]                              # [B, D]
        return self._logits(hidden), self.post_projection(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:     # [B, D] -> [B, vocab] float32
        if not self.config.ordered_embeddings:
            return self.lm_head(hidden).float()
        top = self.centroids(hidden).topk(self.config.centroid_top_k, dim=-1).indices             # [B, top_k]
        ids = self.clusters[top].flatten(1)                                                    # [B, top_k * K]
        scored = torch.einsum("bd,bnd->bn", hidden, self.head_weight[ids]).float()
        logits = (scored.min(dim=-1, keepdim=True).values - 1.0).expand(-1, self.head_weight.shape[0]).clone()
        return logits.scatter_(1, ids, scored)
