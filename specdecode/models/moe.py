"""Mixture-of-experts MLPs (Qwen3-MoE: transformers' `qwen3_moe`, llama.cpp's `qwen3moe`).

A MoE layer replaces the dense SwiGLU MLP by a router and `experts` SwiGLU MLPs of `intermediate`
width each: the router's logits (a linear map of the normed hidden state, in the model dtype) pick
`used` experts per token (top-k; ties go to the lower expert id), weighted by their softmax
probabilities over all experts, renormalised over the k when `norm_topk`, rounded to the model
dtype; the token's output is the weighted sum of its experts' outputs, added in ascending expert id
with a rounding after each add (transformers' index_add_ in the model dtype).

`moe_mlp` is the eager form (the reference the tests compare against, and the path without native
kernels); the fused decoder runs the same sums natively (specdecode/fast/decoder_moe.c), grouping a
pass's rows by expert so that each routed expert's weights are read once per pass.

Weights, as the decoder reads them (`build_layer`), under model.layers.N.mlp.:
- `gate.weight` [E, D]: the router (llama.cpp: blk.N.ffn_gate_inp);
- a Hugging Face checkpoint's experts.{e}.{gate,up,down}_proj.weight, one matrix per expert, or
- llama.cpp's stacks (blk.N.ffn_{gate,up,down}_exps [E, out, in]) as experts.{gate,up,down}_proj.weight:
  a quantized stack stays the file's blocks, each expert a view of its rows (no copy).
and, where the checkpoint has them (gpt-oss), their biases: mlp.gate.bias [E] and the stacks'
experts.{gate,up,down}_proj.bias [E, out] (llama.cpp: ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias).

Variants, by `moe` keys (absent: Qwen3's):
- `router`: "softmax" (the softmax over all experts, then top-k), "topk_softmax" (gpt-oss: the top-k
  logits, then a softmax over those k, in the model dtype) or "gemma4" (below);
- `activation`: "silu" (SwiGLU) or "swiglu_clamp" (gpt-oss: the gate clamped from above and up on both
  sides at `limit`, then (up + 1) * gate * sigmoid(`alpha` * gate); models/gpt_oss.py) or "gelu_tanh"
  (Gemma 4: GeGLU).

Gemma 4's MoE block (`moe["router"] == "gemma4"`, transformers' Gemma4TextRouter / Gemma4TextExperts)
sits beside the dense MLP, not in its place (models/gemma4.py adds the two): the router reads the
residual stream itself, normed without weight (float32, cast to the model dtype), times its `scale`
vector and hidden_size**-0.5; softmax over all experts in float32, top-k, renormalised over the k,
each weight times its expert's `per_expert_scale`, left in float32 (so y * w is rounded once, on the
add); the experts are GeGLU (gelu_tanh) on their own pre-norm of the residual. Its weights: under
model.layers.N. `router.proj.weight` [E, D], `router.scale` [D], `router.per_expert_scale` [E], and
every expert's gate|up and down as one stack each, `experts.gate_up_proj` [E, 2I, D] and
`experts.down_proj` [E, D, I] (llama.cpp: blk.N.ffn_gate_up_exps, blk.N.ffn_down_exps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import ModelError

MAX_EXPERTS = 512        # SD_MOE_MAX_E in specdecode/fast/decoder_moe.c
MAX_USED = 16            # SD_MOE_MAX_K
STACKED = ("gate_proj", "up_proj", "down_proj")
ROUTERS = ("softmax", "topk_softmax", "gemma4")
ACTIVATIONS = ("silu", "swiglu_clamp", "gelu_tanh")
GEMMA4_STACKS = (".experts.gate_up_proj", ".experts.down_proj")
# llama.cpp's per-layer names of a MoE layer -> the Hugging Face ones under model.layers.N
GGUF_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
              "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}


def check_config(config) -> None:
    """A clear error for MoE settings the decoder cannot run."""
    moe = config.moe
    experts, used, width = int(moe.get("experts", 0)), int(moe.get("used", 0)), int(moe.get("intermediate", 0))
    if not 1 <= experts <= MAX_EXPERTS:
        raise ModelError(f"num_experts must be in [1, {MAX_EXPERTS}], got {experts}")
    if not 1 <= used <= min(experts, MAX_USED):
        raise ModelError(f"num_experts_per_tok must be in [1, {min(experts, MAX_USED)}], got {used}")
    if width < 1:
        raise ModelError(f"moe_intermediate_size must be >= 1, got {width}")
    if moe.get("router", "softmax") not in ROUTERS:
        raise ModelError(f"MoE router must be one of {', '.join(ROUTERS)}, got {moe.get('router')!r}")
    if moe.get("activation", "silu") not in ACTIVATIONS:
        raise ModelError(f"MoE activation must be one of {', '.join(ACTIVATIONS)}, got {moe.get('activation')!r}")
    if moe.get("activation") == "swiglu_clamp" and not (moe.get("limit", 0) > 0 and moe.get("alpha", 0) > 0):
        raise ModelError(f"swiglu_limit and swiglu_alpha must be > 0, got {moe.get('limit')} and {moe.get('alpha')}")
    layers = config.moe_layers
    if layers is None or len(layers) != config.num_layers:
        raise ModelError(f"MoE layers name {0 if layers is None else len(layers)} layers, "
                         f"the model has {config.num_layers}")
    object.__setattr__(config, "moe_layers", tuple(bool(x) for x in layers))


def hf_fields(cfg: dict) -> dict:
    """The ModelConfig fields of a qwen3_moe config.json: its experts and which layers have them
    (`mlp_only_layers` and `decoder_sparse_step` as transformers' Qwen3MoeDecoderLayer decides)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"]))
    return {"moe": {"experts": experts, "used": int(cfg["num_experts_per_tok"]),
                    "intermediate": int(cfg["moe_intermediate_size"]),
                    "norm_topk": bool(cfg.get("norm_topk_prob", False))},
            "moe_layers": layers}


def gguf_fields(g) -> dict:
    """The MoE fields of a llama.cpp qwen3moe file (`g(key)`: its metadata under the architecture):
    every layer a MoE layer; llama.cpp renormalises the top-k weights of qwen3moe always."""
    return {"moe": {"experts": int(g("expert_count")), "used": int(g("expert_used_count")),
                    "intermediate": int(g("expert_feed_forward_length")),
                    "norm_topk": bool(g("expert_weights_norm", True))},
            "moe_layers": (True,) * int(g("block_count"))}


def hf_config(config) -> dict:
    """config.json for transformers' Qwen3MoeForCausalLM (the converted-GGUF cache)."""
    from dataclasses import replace
    out = replace(config, arch="qwen3", moe=None, moe_layers=None).to_hf()
    moe = config.moe
    out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=moe["experts"],
               num_experts_per_tok=moe["used"], moe_intermediate_size=moe["intermediate"],
               norm_topk_prob=moe["norm_topk"], decoder_sparse_step=1,
               mlp_only_layers=[i for i, m in enumerate(config.moe_layers) if not m])
    return out


def required_tensors(config) -> list[str]:
    """The per-layer GGUF tensors of a qwen3moe file (attention as Qwen3's, the MLP as experts)."""
    per_layer = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight"]
    moe = ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
    dense = ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    return ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}" for i in range(config.num_layers) for n in per_layer + (moe if config.moe_layers[i] else dense)]


def stacked_name(name: str) -> bool:
    """Whether `name` (a Hugging Face name) is llama.cpp's stack of every expert's matrix (Gemma 4's
    checkpoints hold them stacked too: experts.gate_up_proj, experts.down_proj)."""
    return (".mlp.experts." in name and name.rsplit(".", 2)[-2] in STACKED) or name.endswith(GEMMA4_STACKS)


def split_stacked(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stack [E, out, in] as the Hugging Face checkpoint holds it: one matrix per expert (Qwen3-MoE),
    or the stack itself (Gemma 4)."""
    if name.endswith(GEMMA4_STACKS):
        return {name: tensor}
    head, kind = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
    return {f"{head}.{e}.{kind}.weight": tensor[e].contiguous() for e in range(tensor.shape[0])}


def _expert_bias(weights: dict, prefix: str, kind: str, e: int) -> torch.Tensor | None:
    """Expert e's `kind` bias [out] from its stack [E, out], or None without biases."""
    stack = weights.get(f"{prefix}mlp.experts.{kind}.bias")
    return None if stack is None else stack[e]


def _expert(weights: dict, prefix: str, kind: str, e: int, experts: int):
    """Expert e's `kind` matrix [out, in]: its own tensor, or its rows of llama.cpp's stack (a
    QuantWeight [E * out, in] as the file's blocks, or a dense [E, out, in])."""
    own = weights.get(f"{prefix}mlp.experts.{e}.{kind}.weight")
    if own is not None:
        return own
    stack = weights.get(f"{prefix}mlp.experts.{kind}.weight")
    if stack is None:
        raise ModelError(f"the checkpoint has no {prefix}mlp.experts.{e}.{kind}.weight (nor llama.cpp's stack)")
    return _stack_row(stack, e, experts)


def build_layer(weights: dict, prefix: str, config, make_linear) -> dict:
    """Layer `prefix`'s MoE projections: the router, and each expert's gate|up [2I, D] and down [D, I]
    (quantized rows stay views of the file's blocks: gate and up two segments of one matrix)."""
    from ..fast.quant import QuantWeight
    experts = config.moe["experts"]
    gate_up, down = [], []
    for e in range(experts):
        gate, up = (_expert(weights, prefix, k, e, experts) for k in ("gate_proj", "up_proj"))
        if isinstance(gate, QuantWeight) and isinstance(up, QuantWeight):
            fused = QuantWeight(gate.segments + up.segments, gate.in_features, gate.mapped and up.mapped)
        else:
            fused = torch.cat([w.dequantize(config_dtype(weights)) if isinstance(w, QuantWeight) else w
                               for w in (gate, up)])
        biases = [_expert_bias(weights, prefix, k, e) for k in ("gate_proj", "up_proj")]
        gate_up.append(make_linear(fused, None if biases[0] is None else torch.cat(biases)))
        down.append(make_linear(_expert(weights, prefix, "down_proj", e, experts),
                                _expert_bias(weights, prefix, "down_proj", e)))
    return {"router": make_linear(weights[prefix + "mlp.gate.weight"], weights.get(prefix + "mlp.gate.bias")),
            "experts_gate_up": gate_up, "experts_down": down}


def config_dtype(weights: dict) -> torch.dtype:
    return weights["model.embed_tokens.weight"].dtype


def route(logits: torch.Tensor,       # [N, E] router logits, model dtype
          used: int, norm_topk: bool, router: str = "softmax",
          ) -> tuple[torch.Tensor, torch.Tensor]:   # -> [N, k] weights, [N, k] ids
    """Top-k experts of each row and their weights in the model dtype (transformers' Qwen3MoeTopKRouter;
    "topk_softmax": GptOssTopKRouter)."""
    if router == "topk_softmax":
        top, ids = torch.topk(logits, used, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, used, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, moe: dict) -> torch.Tensor:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate): the gate clamped from
    above and up on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""
    limit = moe["limit"]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * moe["alpha"]))


def moe_mlp(layer: dict, x: torch.Tensor,      # [B, T, D] normed hidden states
            moe: dict,
            routing: tuple[torch.Tensor, torch.Tensor] | None = None,   # [N, k] weights, ids; None: route x
            ) -> torch.Tensor:                  # -> [B, T, D] the MLP's output
    """The eager MoE MLP: route (or take `routing`: Gemma 4 routes the residual, not x), then each
    routed expert on the rows routed to it, in ascending expert id, the weighted outputs added into
    the rows (index_add_ in the model dtype); then, where the layer has one (Qwen3.5), the shared
    expert's output times sigmoid(its gate) added. The experts' activation: `moe["activation"]` (silu;
    gelu_tanh: Gemma 4; swiglu_clamp: gpt-oss). The number of distinct experts the rows routed to is
    left in layer["distinct"] (what the pass read)."""
    flat = x.reshape(-1, x.shape[-1])                                       # [N, D]
    weights, ids = routing or route(layer["router"](flat), moe["used"], moe["norm_topk"], moe.get("router", "softmax"))
    out = torch.zeros_like(flat)
    experts = sorted(set(ids.reshape(-1).tolist()))
    layer["distinct"] = len(experts)                                        # read by engine/costs.ExpertCounter
    for e in experts:
        rows, rank = torch.where(ids == e)
        order = torch.argsort(rows)                                         # rows ascending
        rows, rank = rows[order], rank[order]
        gate, up = layer["experts_gate_up"][e](flat[rows]).chunk(2, dim=-1)
        if moe.get("activation") == "swiglu_clamp":
            act = clamped_swiglu(gate, up, moe)
        elif moe.get("activation") == "gelu_tanh":
            act = F.gelu(gate, approximate="tanh") * up
        else:
            act = F.silu(gate) * up
        y = layer["experts_down"][e](act)                                   # [n, D]
        out.index_add_(0, rows, (y * weights[rows, rank, None]).to(out.dtype))
    if "shared_gate_up" in layer:                                           # Qwen3.5's shared expert
        gate, up = layer["shared_gate_up"](flat).chunk(2, dim=-1)
        out = out + torch.sigmoid(layer["shared_gate"](flat)) * layer["shared_down"](F.silu(gate) * up)
    return out.view_as(x)


def projections(layer: dict) -> list:
    """A MoE layer's projections: router, then every expert's gate|up and down (and the shared expert's)."""
    shared = [layer[k] for k in ("shared_gate", "shared_gate_up", "shared_down") if k in layer]
    return [layer["router"]] + layer["experts_gate_up"] + layer["experts_down"] + shared


def build_shared(weights: dict, prefix: str, make_linear, cat) -> dict:
    """Qwen3.5's shared expert (mlp.shared_expert.{gate,up,down}_proj) and its gate (mlp.shared_expert_gate,
    [1, D]: the sigmoid weight of its output), where the layer has one. `cat`: the model's row-wise
    concatenation of weights (transformer.cat_rows at its dtype; not imported here: transformer imports this)."""
    s = prefix + "mlp.shared_expert."
    if s + "gate_proj.weight" not in weights:
        return {}
    gate_up = cat([weights[s + "gate_proj.weight"], weights[s + "up_proj.weight"]])
    return {"shared_gate_up": make_linear(gate_up, None),
            "shared_down": make_linear(weights[s + "down_proj.weight"], None),
            "shared_gate": make_linear(weights[prefix + "mlp.shared_expert_gate.weight"].reshape(1, -1), None)}


def qwen3_5_fields(cfg: dict) -> dict:
    """The MoE fields of a qwen3_5_moe_text config.json: every layer a MoE layer with a shared expert,
    the top-k weights always renormalised (transformers' Qwen3_5MoeTopKRouter)."""
    return {"moe": {"experts": int(cfg["num_experts"]), "used": int(cfg["num_experts_per_tok"]),
                    "intermediate": int(cfg["moe_intermediate_size"]), "norm_topk": True,
                    "shared": int(cfg.get("shared_expert_intermediate_size") or 0)},
            "moe_layers": (True,) * int(cfg["num_hidden_layers"])}


def gemma4_fields(cfg: dict) -> dict:
    """The MoE fields of a gemma4_text config.json with `enable_moe_block`: every layer has the block
    beside its dense MLP; the top-k weights always renormalised, then scaled per expert."""
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not cfg.get(key):
            raise ModelError(f"enable_moe_block needs {key} (>= 1) in the config, got {cfg.get(key)!r}")
    return {"moe": {"experts": int(cfg["num_experts"]), "used": int(cfg["top_k_experts"]),
                    "intermediate": int(cfg["moe_intermediate_size"]), "norm_topk": True, "router": "gemma4",
                    "activation": "gelu_tanh"},
            "moe_layers": (True,) * int(cfg.get("num_hidden_layers", 30))}


def build_gemma4_layer(weights: dict, prefix: str, config, make_linear) -> dict:
    """Layer `prefix`'s Gemma 4 MoE block: its router (projection, input scale [D] and per-expert
    scales [E], both in the model dtype), and each expert's gate|up [2I, D] and down [D, I] from the
    stacks (a quantized stack's rows stay views of the file's blocks)."""
    experts = config.moe["experts"]
    stacks = {}
    for kind, rows in (("gate_up_proj", 2 * config.moe["intermediate"]), ("down_proj", config.hidden_size)):
        stack = weights.get(f"{prefix}experts.{kind}")
        if stack is None:
            raise ModelError(f"the checkpoint has no {prefix}experts.{kind} (Gemma 4's expert stack)")
        shape = tuple(stack.shape)          # [E, rows, in] dense, [E * rows, in] quantized blocks
        if shape[:-1] not in ((experts, rows), (experts * rows,)):
            raise ModelError(f"{prefix}experts.{kind} has shape {tuple(stack.shape)}, expected {experts} experts "
                             f"of {rows} rows")
        stacks[kind] = [_stack_row(stack, e, experts) for e in range(experts)]
    return {"router": make_linear(weights[prefix + "router.proj.weight"], None),
            "router_scale": weights[prefix + "router.scale"],
            "expert_scale": weights[prefix + "router.per_expert_scale"],
            "experts_gate_up": [make_linear(w, None) for w in stacks["gate_up_proj"]],
            "experts_down": [make_linear(w, None) for w in stacks["down_proj"]]}


def _stack_row(stack, e: int, experts: int):
    """Expert e's matrix of a stack: a view of a dense [E, out, in], or of a QuantWeight [E * out, in]'s
    blocks (the file's, read in place)."""
    if isinstance(stack, torch.Tensor):
        return stack[e]
    from ..fast.quant import QuantWeight
    (qtype, data), = stack.segments
    rows = data.shape[0] // experts
    return QuantWeight([(qtype, data[e * rows:(e + 1) * rows])], stack.in_features, stack.mapped)


def gemma4_route(layer: dict, residual: torch.Tensor,    # [N, D] the residual stream, model dtype
                 used: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:   # -> [N, k] fp32 weights, ids
    """Gemma 4's router (transformers' Gemma4TextRouter): the scaled, weightless norm of the residual,
    its logits, softmax in float32, top-k renormalised, times each chosen expert's scale."""
    normed = F.rms_norm(residual.float(), (residual.shape[-1],), None, eps).to(residual.dtype)
    x = normed * layer["router_scale"] * residual.shape[-1] ** -0.5
    probs = F.softmax(layer["router"](x), dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, used, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top * layer["expert_scale"][ids], ids
