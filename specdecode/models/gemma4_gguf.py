"""Gemma 4 GGUF files (llama.cpp's `gemma4`) as llama.cpp's converter writes them (convert_hf_to_gguf.py's
Gemma4Model, on Gemma3Model and TextModel), read back into the Hugging Face layout models/gemma4.py runs:

- metadata: the global layers' head dim as attention.key_length, the windowed ones' as key_length_swa;
  head_count_kv and feed_forward_length per layer where they differ (the global layers' kv heads, the
  double-wide MLPs of the kv-shared layers); attention.sliding_window_pattern one flag per layer;
  attention.shared_kv_layers; embedding_length_per_layer_input (0: no per-layer inputs);
  rope.freq_base (global) and rope.freq_base_swa; the MoE block's expert_count, expert_used_count and
  expert_feed_forward_length;
- norm weights as stored (Gemma 4's RMSNorm multiplies by the weight itself: no + 1 to undo);
- proportional RoPE as a `rope_freqs` tensor over the global heads' frequencies: 1 on the ones that
  turn, 1e30 on the rest (so they stay at angle 0): its count of 1s gives partial_rotary_factor;
- values equal to keys (attention_k_eq_v) as global layers without attn_v;
- the MoE block: router.proj as ffn_gate_inp.weight, router.scale as ffn_gate_inp.scale,
  per_expert_scale as ffn_down_exps.scale, the expert stacks as ffn_gate_up_exps / ffn_down_exps
  ([E, 2I, D] and [E, D, I], read in place, one view per expert: models/moe.py), its norms as
  pre_ffw_norm_2 / post_ffw_norm_1 / post_ffw_norm_2; layer_scalar as layer_output_scale.
"""
from __future__ import annotations

from typing import Any

from .errors import ModelError

# llama.cpp's per-layer names -> the Hugging Face ones under model.layers.N (suffix kept: .weight)
NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2", "ffn_gate_inp": "router.proj",
}
# (llama.cpp's name, suffix) -> the Hugging Face name under model.layers.N, where it has no .weight
OWN = {("ffn_gate_inp", "scale"): "router.scale", ("ffn_down_exps", "scale"): "router.per_expert_scale",
       ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj", ("ffn_down_exps", "weight"): "experts.down_proj",
       ("layer_output_scale", "weight"): "layer_scalar"}
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight", "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
          "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
          "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}


def hf_name(name: str, num_layers: int | None = None) -> str | None:
    """The Hugging Face name of a gemma4 GGUF tensor (None: not read, e.g. rope_freqs, read as config)."""
    if name in GLOBAL:
        return GLOBAL[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or (num_layers is not None and int(parts[1]) >= num_layers):
        return None
    own = OWN.get((parts[2], parts[3]))
    if own is not None:
        return f"model.layers.{parts[1]}.{own}"
    return f"model.layers.{parts[1]}.{NAMES[parts[2]]}.{parts[3]}" if parts[2] in NAMES else None


def hf_config(g, reader, names: set[str], path, vocab: int, bos: int | None, eos: tuple[int, ...]) -> dict[str, Any]:
    """A gemma4_text config.json from the file's metadata (`g(key, default)`: `gemma4.key`) and tensors,
    which gemma_config.gemma4_fields reads as any checkpoint's (`vocab`, `bos`, `eos`: as the other
    families' files give them)."""
    layers = int(g("block_count"))
    swa = [bool(x) for x in g("attention.sliding_window_pattern") or ()]
    if len(swa) != layers or all(swa):
        raise ModelError(f"{path}: gemma4.attention.sliding_window_pattern must name each of the {layers} layers "
                         f"and at least one global layer, got {len(swa)} flags")
    first_global = swa.index(False)
    per_layer = lambda key: [int(x) for x in g(key)] if isinstance(g(key), list) else [int(g(key))] * layers  # noqa: E731
    kv, ff = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
    shared = int(g("attention.shared_kv_layers", 0) or 0)
    if len(set(ff[:layers - shared])) > 1 or (shared and len(set(ff[layers - shared:])) > 1):
        raise ModelError(f"{path}: feed_forward_length {ff} is not one width (and twice it on the kv-shared layers)")
    head_dim, global_dim = int(g("attention.key_length_swa")), int(g("attention.key_length"))
    per_layer_input = int(g("embedding_length_per_layer_input", 0) or 0)
    per_layer_vocab = 0
    turning = global_dim // 2
    for t in reader.tensors:
        if t.name == "per_layer_token_embd.weight":
            per_layer_vocab = int(t.shape[-1])               # [L * P, V'] in ggml order
        elif t.name == "rope_freqs.weight":                 # 1 where a frequency turns, 1e30 where it stays
            turning = int((t.data < 1e29).sum())
    cfg = {
        "model_type": "gemma4_text", "vocab_size": vocab, "hidden_size": int(g("embedding_length")),
        "intermediate_size": ff[0], "num_hidden_layers": layers, "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": kv[swa.index(True)] if True in swa else kv[0], "head_dim": head_dim,
        "global_head_dim": global_dim, "attention_k_eq_v": f"blk.{first_global}.attn_v.weight" not in names,
        "per_layer_config": {str(i): {"head_dim": global_dim, "num_key_value_heads": kv[i]}
                             for i in range(layers) if not swa[i]},
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(g("context_length", 131072)),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(g("rope.freq_base_swa", 10000.0))},
            "full_attention": {"rope_type": "proportional", "rope_theta": float(g("rope.freq_base", 1e6)),
                               "partial_rotary_factor": 2 * turning / global_dim}},
        "tie_word_embeddings": "output.weight" not in names, "bos_token_id": bos,
        "eos_token_id": list(eos), "sliding_window": int(g("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "final_logit_softcapping": g("final_logit_softcapping"), "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": per_layer_input, "vocab_size_per_layer_input": per_layer_vocab,
        "use_double_wide_mlp": bool(shared) and ff[-1] == 2 * ff[0],
    }
    if "blk.0.ffn_gate_inp.weight" in names:          # 26B-A4B: a MoE block in every layer
        cfg.update(enable_moe_block=True, num_experts=int(g("expert_count")), top_k_experts=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length")))
    return cfg


def required_tensors(config) -> list[str]:
    """The GGUF tensors the Gemma 4 decoder reads (output.weight only when untied)."""
    first_shared = config.num_layers - config.kv_shared_layers
    out = ["token_embd.weight", "output_norm.weight"] + ([] if config.tie_word_embeddings else ["output.weight"])
    if config.per_layer_input_size:
        out += ["per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"]
    for i in range(config.num_layers):
        names = ["attn_norm.weight", "attn_q.weight", "attn_q_norm.weight", "attn_output.weight",
                 "post_attention_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                 "ffn_down.weight", "post_ffw_norm.weight"]
        if i < first_shared:
            names += ["attn_k.weight", "attn_k_norm.weight"]
            names += [] if config.k_eq_v and not config.sliding_layers[i] else ["attn_v.weight"]
        if config.per_layer_input_size:
            names += ["inp_gate.weight", "proj.weight", "post_norm.weight"]
        if config.moe is not None and config.moe_layers[i]:
            names += ["ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_gate_up_exps.weight", "ffn_down_exps.weight",
                      "ffn_down_exps.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight",
                      "post_ffw_norm_2.weight"]
        out += [f"blk.{i}.{n}" for n in names]
    return out
