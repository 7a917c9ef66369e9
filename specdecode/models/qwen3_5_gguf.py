"""Qwen3.5 in llama.cpp's GGUF layout (architecture "qwen35"; its converter's Qwen3_5TextModel in
convert_hf_to_gguf.py, its loader src/models/qwen35.cpp): names, metadata, and the transforms undone.

llama.cpp's converter stores, against the Hugging Face checkpoint:
- every RMSNorm weight but the DeltaNet output norm (ssm_norm) with 1 added: llama.cpp multiplies
  by the stored weight, transformers by (1 + weight);
- A_log as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the conv1d kernel [C, 1, K] as [C, K];
- with fewer key heads than value heads, every per-value-head tensor (the v rows of in_proj_qkv,
  in_proj_z, in_proj_b, in_proj_a, A_log, dt_bias, conv1d's v channels, out_proj's columns) with the
  value heads tiled (head j of key head g at j * key_heads + g) instead of grouped (g * r + j), so
  that ggml can broadcast the key heads;
- the attention q_proj as it is (each head's query, then its gate); block_count counts the
  multi-token-prediction layers too (nextn_predict_layers), which are not part of the decoder.

The multi-token-prediction head (`mtp.*`), where the converter kept it (its _Qwen35MtpMixin, in
conversion/qwen.py; `--no-mtp` leaves it out), is block num_layers: mtp.layers.0's tensors under the
names of an attention block (blk.N.attn_q, ...), mtp.fc as blk.N.nextn.eh_proj, and its norms
(pre_fc_norm_embedding, pre_fc_norm_hidden, norm) as nextn.enorm, nextn.hnorm and
nextn.shared_head_norm, every norm + 1 as the decoder's. The embedding and LM head are the model's
own (no nextn.embed_tokens or nextn.shared_head_head); read back as `mtp.*` for models/qwen3_5.py.

The native decoder runs on the tiled order as stored (`linear_attention["tiled"]`: each key head is
repeated over the value heads, not interleaved), as out_proj's quantized blocks cannot have their
columns moved; the dense Hugging Face directory (gguf.convert) gets the grouped order back.
"""
from __future__ import annotations

import numpy as np

from .errors import ModelError

# llama.cpp's per-layer names -> the Hugging Face ones under model.layers.N (suffix kept)
GGUF_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    # qwen35moe: the router, the expert stacks (models/moe.py) and the shared expert with its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
ATTENTION = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
             "attn_k_norm.weight"]
DELTA_NET = ["attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_conv1d.weight",
             "ssm_dt.bias", "ssm_a", "ssm_norm.weight", "ssm_out.weight"]
# the MTP block's own tensors (blk.N.nextn.*, N = num_layers) -> the checkpoint's mtp.* names
NEXTN_NAMES = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
               "shared_head_norm": "norm"}
SHARED = ["attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
MOE = ["attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
       "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
       "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight"]


def hf_name(parts: list[str], num_layers: int | None = None) -> str | None:
    """A "blk.N...." tensor name, split at the dots, as its Hugging Face name (None: not read). With
    `num_layers`, a block past the decoder's is the MTP head's (mtp.layers.{N - num_layers}.*, mtp.*)."""
    block = int(parts[1])
    layer = f"model.layers.{block}."
    if num_layers is not None and block >= num_layers:
        if parts[2] == "nextn":      # embed_tokens / shared_head_head, where written: the model's own again
            known = block == num_layers and len(parts) == 5 and parts[3] in NEXTN_NAMES
            return f"mtp.{NEXTN_NAMES[parts[3]]}.{parts[4]}" if known else None
        layer = f"mtp.layers.{block - num_layers}."
    if parts[2:] == ["ssm_a"]:
        return layer + "linear_attn.A_log"
    if parts[2:] == ["ssm_dt", "bias"]:
        return layer + "linear_attn.dt_bias"
    if len(parts) == 4 and parts[2] in GGUF_NAMES:
        return layer + f"{GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def gguf_fields(g, path, moe: bool = False) -> dict:
    """ModelConfig fields of a qwen35 (`moe`: qwen35moe) file from its metadata (`g(key, default)` reads
    <arch>.<key>)."""
    layers = int(g("block_count")) - int(g("nextn_predict_layers", 0) or 0)
    flags = g("attention.recurrent_layers")
    if flags is None:
        every = int(g("full_attention_interval", 4))
        flags = [(i + 1) % every != 0 for i in range(layers)]
    key_heads, value_heads = int(g("ssm.group_count")), int(g("ssm.time_step_rank"))
    if not key_heads or value_heads % key_heads:
        raise ModelError(f"{path}: qwen35.ssm.time_step_rank (value heads, {value_heads}) must be a multiple of "
                         f"qwen35.ssm.group_count (key heads, {key_heads})")
    experts = {}
    if moe:            # every MLP a MoE layer with a shared expert; the top-k weights renormalised
        experts = {"moe": {"experts": int(g("expert_count")), "used": int(g("expert_used_count")),
                           "intermediate": int(g("expert_feed_forward_length")), "norm_topk": True,
                           "shared": int(g("expert_shared_feed_forward_length", 0) or 0)},
                   "moe_layers": (True,) * layers, "intermediate_size": int(g("expert_feed_forward_length"))}
    return {**experts, "arch": "qwen3_5", "num_layers": layers, "qk_norm": True, "attention_bias": False,
            "linear_layers": tuple(bool(x) for x in list(flags)[:layers]),
            "linear_attention": {"key_heads": key_heads, "value_heads": value_heads,
                                 "key_dim": int(g("ssm.state_size")),
                                 "value_dim": int(g("ssm.inner_size")) // value_heads,
                                 "conv_kernel": int(g("ssm.conv_kernel")), "tiled": int(key_heads != value_heads)}}


def required_tensors(config) -> list[str]:
    return ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}" for i in range(config.num_layers)
        for n in (MOE if config.moe else SHARED) + (DELTA_NET if config.linear_layers[i] else ATTENTION)]


def hf_order(name: str, array: np.ndarray, config, grouped: bool) -> np.ndarray:
    """A dequantized tensor (fp32) as the Hugging Face checkpoint holds it; `grouped`: value heads
    back in the grouped order too (a dense HF directory), else left tiled (the native decoder)."""
    if (name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")
            or name.startswith("mtp.pre_fc_norm_")):       # stored as nextn.enorm / nextn.hnorm
        array = array - 1.0
    elif name.endswith("A_log"):
        array = np.log(-array)
    elif name.endswith("conv1d.weight"):
        array = array.reshape(array.shape[0], 1, -1)
    lin = config.linear_attention
    if grouped and lin.get("tiled") and ".linear_attn." in name:
        array = _grouped(name, array, lin)
    return array


def _grouped(name: str, array: np.ndarray, lin: dict) -> np.ndarray:
    """Undo the converter's value-head reorder (tiled -> grouped by key head) of one tensor."""
    heads, groups = lin["value_heads"], lin["key_heads"]

    def regroup(a: np.ndarray, axis: int, width: int) -> np.ndarray:
        a = np.moveaxis(a, axis, 0)
        shape = a.shape
        a = a.reshape(heads // groups, groups, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.moveaxis(a, 0, axis)

    qk = 2 * groups * lin["key_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([array[:qk], regroup(array[qk:], 0, lin["value_dim"])])
    if name.endswith("in_proj_z.weight"):
        return regroup(array, 0, lin["value_dim"])
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return regroup(array, 0, 1)
    if name.endswith("out_proj.weight"):
        return regroup(array, 1, lin["value_dim"])
    return array


def hf_config(config) -> dict:
    """A config.json transformers loads as Qwen3_5ForCausalLM (grouped value heads)."""
    lin = config.linear_attention
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos, "hidden_act": "silu", "torch_dtype": "float32",
        "layer_types": ["linear_attention" if x else "full_attention" for x in config.linear_layers],
        "linear_num_key_heads": lin["key_heads"], "linear_num_value_heads": lin["value_heads"],
        "linear_key_head_dim": lin["key_dim"], "linear_value_head_dim": lin["value_dim"],
        "linear_conv_kernel_dim": lin["conv_kernel"],
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.partial_rotary_factor},
        **({} if config.moe is None else {
            "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "num_experts": config.moe["experts"], "num_experts_per_tok": config.moe["used"],
            "moe_intermediate_size": config.moe["intermediate"],
            "shared_expert_intermediate_size": config.moe["shared"]}),
    }
