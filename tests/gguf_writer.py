"""Write a transformers model and a byte-level BPE tokenizer.json as a GGUF file with the `gguf`
package, so tests can build tiny GGUF files of any family transformers' GGUF reader knows.

Tensor names come from gguf's own TensorNameMap (the table llama.cpp's converter uses) and the
architecture's metadata keys from transformers' GGUF_CONFIG_MAPPING (the keys its reader reads
back), so a family needs no code here unless llama.cpp stores a tensor differently from
transformers: GPT-2 style Conv1D weights are transposed (the reader transposes them back), and
`permute_qk` applies llama.cpp's q/k row permutation for llama-layout models, and `norm_shift` adds
what llama.cpp's converter adds to every norm weight (1 for Gemma 2 / Gemma 3, whose RMSNorm
multiplies by 1 + weight).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def _arch_enum(arch: str):
    import gguf
    for key, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return key
    raise ValueError(f"gguf knows no architecture {arch!r}")


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved pairs) from the HF rotate-half order."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_tokenizer(writer, tokenizer_json: Path | dict, eos_token: str, bos_token: str | None = None) -> None:
    """A byte-level BPE tokenizer.json (its path, or its content) as llama.cpp's "gpt2" tokenizer metadata."""
    import gguf
    spec = tokenizer_json if isinstance(tokenizer_json, dict) else json.loads(Path(tokenizer_json).read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [None] * (max(vocab.values()) + 1)
    for text, index in vocab.items():
        tokens[index] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab[eos_token])
    if bos_token is not None:
        writer.add_bos_token_id(vocab[bos_token])


def write_gguf(path: Path, model, arch: str, tokenizer_json: Path, eos_token: str,
               bos_token: str | None = None, permute_qk: bool = False, skip: tuple[str, ...] = (),
               metadata: dict[str, int | float | str] | None = None, norm_shift: float = 0.0) -> Path:
    """`model` (a transformers causal LM) as an F32 GGUF file of llama.cpp architecture `arch`.
    `skip`: GGUF tensor names to leave out (to build a file with missing tensors); `metadata`: more
    keys, uint32 / float32 / string by the value's type (e.g. "llama.attention.sliding_window", which
    transformers' reader does not map)."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.pytorch_utils import Conv1D

    config = model.config
    layers = config.num_hidden_layers
    names = gguf.TensorNameMap(_arch_enum(arch), layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    for gguf_key, hf_key in GGUF_CONFIG_MAPPING[arch].items():   # the keys transformers reads back
        value = getattr(config, hf_key, None) if hf_key else None
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{gguf_key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{gguf_key}", value)
    for key, value in (metadata or {}).items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}[type(value)]
        add(key, value)
    write_tokenizer(writer, tokenizer_json, eos_token, bos_token)
    conv1d = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Conv1D)}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None or name in skip or (tied and name == "output.weight"):
            continue                         # buffers (masks, rotary tables), and the tied output matrix
        array = tensor.detach().to(torch.float32).numpy()
        if hf_name in conv1d:
            array = array.T
        if name.endswith("norm.weight"):
            array = array + norm_shift
        if permute_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
            array = _permute(array, config.num_attention_heads)
        elif permute_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
            array = _permute(array, config.num_key_value_heads)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiled(array: np.ndarray, axis: int, groups: int, width: int) -> np.ndarray:
    """llama.cpp's value-head order (tiled over the key heads) from transformers' (grouped by key head)."""
    a = np.moveaxis(array, axis, 0)
    a = a.reshape(groups, a.shape[0] // groups // width, width, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.moveaxis(a, 0, axis)


def _qwen35_tensor(name: str, array: np.ndarray, config) -> tuple[str, np.ndarray]:
    """One Qwen3.5 tensor as llama.cpp's converter (Qwen3_5TextModel) stores it: value heads tiled,
    A_log as -exp(A_log), dt_bias renamed, the conv1d kernel squeezed, norms but the DeltaNet's + 1."""
    groups, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    if groups != config.linear_num_value_heads and ".linear_attn." in name:
        qk = 2 * groups * dk
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            array = np.concatenate([array[:qk], _tiled(array[qk:], 0, groups, dv)])
        elif name.endswith("in_proj_z.weight"):
            array = _tiled(array, 0, groups, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            array = _tiled(array, 0, groups, 1)
        elif name.endswith("out_proj.weight"):
            array = _tiled(array, 1, groups, dv)
    if name.endswith("A_log"):
        array = -np.exp(array)
    elif name.endswith("dt_bias"):
        name = name[:-len("dt_bias")] + "dt_proj.bias"
    elif name.endswith("conv1d.weight"):
        array = array.reshape(array.shape[0], -1)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        array = array + 1.0
    return name, array


def _mtp_tensors(mtp: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """A checkpoint's MTP head (`mtp.*`) under the names llama.cpp's converter gives it before its
    tensor map (_Qwen35MtpMixin.filter_tensors): block `layers` and on, the head's own tensors as that
    block's eh_proj, enorm, hnorm and shared_head.norm."""
    own = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
           "norm": "shared_head.norm"}
    out = {}
    for name, tensor in mtp.items():
        parts = name.split(".", 3)
        if parts[1] == "layers":
            out[f"model.layers.{layers + int(parts[2])}.{parts[3]}"] = tensor
        else:
            out[f"model.layers.{layers}.{own[parts[1]]}.{parts[2]}"] = tensor
    return out


def write_qwen35_gguf(path: Path, model, tokenizer_json: Path, eos_token: str, qtype: str = "F32",
                      vocab_size: int | None = None, skip: tuple[str, ...] = (),
                      mtp: dict[str, torch.Tensor] | None = None) -> Path:
    """A transformers Qwen3.5 (Qwen3_5ForCausalLM) as a GGUF file of llama.cpp's "qwen35" architecture,
    with the metadata and tensors its convert_hf_to_gguf.py writes. qtype "Q8_0": every matrix with rows
    of a multiple of 32 weights in Q8_0 blocks (as `--outtype q8_0`), the rest F32. `vocab_size`: pad
    the tokenizer's vocabulary with unused tokens up to the model's (llama.cpp wants one per row);
    `skip`: GGUF tensor names to leave out. `mtp`: the checkpoint's multi-token-prediction head
    (its `mtp.*` tensors, which transformers does not hold), written as the converter writes it: one
    more block (nextn_predict_layers) with an attention block's names and blk.N.nextn.* for its own."""
    import gguf
    from gguf.quants import quantize

    c = model.config
    layers = c.num_hidden_layers
    extra = len({n.split(".")[2] for n in mtp or {} if n.startswith("mtp.layers.")})
    moe = hasattr(c, "num_experts")             # Qwen3.5-MoE: llama.cpp's qwen35moe
    arch = "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(layers + extra)
    if extra:
        writer.add_nextn_predict_layers(extra)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    if moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    else:
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(int(c.head_dim * rope.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections(list(rope.get("mrope_section", [11, 11, 10])) + [0])
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in c.layer_types] + [False] * extra)   # MTP: attention
    writer.add_full_attention_interval(4)
    spec = json.loads(Path(tokenizer_json).read_text())
    if vocab_size is not None:                  # unused tokens after the tokenizer's own
        size = max(len(spec["model"]["vocab"]), max(t["id"] for t in spec["added_tokens"]) + 1)
        spec["model"]["vocab"].update({f"<|unused_{i}|>": i for i in range(size, vocab_size)})
    write_tokenizer(writer, spec, eos_token)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35, layers + extra)
    nextn = gguf.TensorNameMap(gguf.MODEL_ARCH.GLM4_MOE, layers + extra)   # gguf 0.19's QWEN35 lacks nextn
    tied = bool(c.tie_word_embeddings)
    tensors = {**model.state_dict(), **_mtp_tensors(mtp or {}, layers)}
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:   # stacks per kind, as the converter
        p = name[:-len("gate_up_proj")]
        gate, up = tensors.pop(name).chunk(2, dim=1)
        tensors.update({p + "gate_proj.weight": gate, p + "up_proj.weight": up,
                        p + "down_proj.weight": tensors.pop(p + "down_proj")})
    for hf_name, tensor in tensors.items():
        hf_name, array = _qwen35_tensor(hf_name, tensor.detach().to(torch.float32).numpy(), c)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:                     # the MTP block's own: blk.N.nextn.*
            name = nextn.get_name(hf_name, try_suffixes=(".weight",))
            name = name if name and ".nextn." in name else None
        if name is None or name in skip or (tied and name == "output.weight"):
            continue
        array = np.ascontiguousarray(array, dtype=np.float32)
        if (qtype == "Q8_0" and array.ndim >= 2 and array.shape[-1] % 32 == 0 and "ssm_conv1d" not in name
                and "ffn_gate_inp" not in name):
            writer.add_tensor(name, quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen3moe_gguf(path: Path, model, tokenizer_json: Path, eos_token: str, qtype: str = "F32") -> Path:
    """A transformers Qwen3-MoE (Qwen3MoeForCausalLM) as llama.cpp's converter writes it (its
    Qwen3MoeModel, through Qwen2MoeModel.modify_tensors): every expert's gate / up / down matrix
    stacked into one tensor per layer (blk.N.ffn_{gate,up,down}_exps [n_expert, out, in]), the router
    as blk.N.ffn_gate_inp, and the expert metadata. qtype "Q8_0": matrices and expert stacks whose rows
    are a multiple of 32 weights in Q8_0 blocks, the router and norms F32 (llama.cpp's quantizer keeps
    ffn_gate_inp in F32 too)."""
    import gguf
    from gguf.quants import quantize

    c = model.config
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("tiny-qwen3moe")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    write_tokenizer(writer, tokenizer_json, eos_token)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3MOE, c.num_hidden_layers)
    state = model.state_dict()        # transformers 5 holds the experts fused: gate_up_proj [E, 2I, D], down_proj
    tensors = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        gate, up = state[p + "gate_up_proj"].chunk(2, dim=1)
        tensors.update({p + "gate_proj.weight": gate, p + "up_proj.weight": up,
                        p + "down_proj.weight": state[p + "down_proj"]})
    tied = bool(c.tie_word_embeddings)
    for hf_name, tensor in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None or (tied and name == "output.weight"):
            continue
        array = np.ascontiguousarray(tensor.detach().to(torch.float32).numpy())
        if qtype == "Q8_0" and array.ndim >= 2 and array.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name:
            writer.add_tensor(name, quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gpt_oss_gguf(path: Path, model, tokenizer_json: Path, eos_token: str, rest: str = "Q8_0") -> Path:
    """A transformers gpt-oss (GptOssForCausalLM) as llama.cpp's converter writes it (its GptOssModel):
    the interleaved gate_up_proj [E, D, 2I] split into gate (even columns) and up (odd) stacks and every
    stack transposed to [E, out, in] (blk.N.ffn_{gate,up,down}_exps) in MXFP4 blocks, their biases
    split alike (F32), the router as blk.N.ffn_gate_inp (F32, weight and bias), the sinks as
    blk.N.attn_sinks.weight, the post-attention norm as blk.N.post_attention_norm, YaRN and the window
    in the metadata; the other matrices in `rest` ("Q8_0" as llama.cpp's published files, or "F32")."""
    import gguf
    from gguf.quants import quantize

    c = model.config
    arch, q = "gpt-oss", gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-gpt-oss")
    write_gpt_oss_metadata(writer, c)
    write_tokenizer(writer, tokenizer_json, eos_token)
    state = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"], "output.weight": state["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        tensors.update({b + "attn_norm.weight": state[p + "input_layernorm.weight"],
                        b + "post_attention_norm.weight": state[p + "post_attention_layernorm.weight"],
                        b + "attn_sinks.weight": state[p + "self_attn.sinks"],
                        b + "ffn_gate_inp.weight": state[p + "mlp.router.weight"],
                        b + "ffn_gate_inp.bias": state[p + "mlp.router.bias"]})
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            for kind in ("weight", "bias"):
                tensors[f"{b}{ours}.{kind}"] = state[f"{p}self_attn.{theirs}.{kind}"]
        gate_up, gate_up_bias = state[p + "mlp.experts.gate_up_proj"], state[p + "mlp.experts.gate_up_proj_bias"]
        tensors.update({b + "ffn_gate_exps.weight": gate_up[..., ::2].transpose(1, 2),
                        b + "ffn_up_exps.weight": gate_up[..., 1::2].transpose(1, 2),
                        b + "ffn_down_exps.weight": state[p + "mlp.experts.down_proj"].transpose(1, 2),
                        b + "ffn_gate_exps.bias": gate_up_bias[:, ::2], b + "ffn_up_exps.bias": gate_up_bias[:, 1::2],
                        b + "ffn_down_exps.bias": state[p + "mlp.experts.down_proj_bias"]})
    for name, tensor in tensors.items():
        array = np.ascontiguousarray(tensor.numpy())
        if name.endswith("_exps.weight"):
            writer.add_tensor(name, quantize(array, q.MXFP4), raw_dtype=q.MXFP4)
        elif (rest == "Q8_0" and name.endswith(".weight") and array.ndim == 2 and "ffn_gate_inp" not in name
              and array.shape[-1] % 32 == 0):
            writer.add_tensor(name, quantize(array, q.Q8_0), raw_dtype=q.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gemma4_gguf(path: Path, model, tokenizer_json: Path, eos_token: str, bos_token: str,
                      qtype: str = "F32", skip: tuple[str, ...] = ()) -> Path:
    """A transformers Gemma 4 text model (Gemma4ForCausalLM, dense or with MoE blocks) as llama.cpp's
    converter writes it (its Gemma4Model on Gemma3Model): head dims, kv heads and MLP widths per layer
    type, the window pattern, proportional RoPE as the rope_freqs tensor (1 where a frequency turns,
    1e30 where it stays), norms as stored (no + 1), the router's scale as ffn_gate_inp.scale, the
    per-expert scales as ffn_down_exps.scale, the expert stacks as ffn_gate_up_exps / ffn_down_exps,
    layer_scalar as layer_output_scale. qtype "Q8_0": matrices and expert stacks whose rows are a
    multiple of 32 weights in Q8_0 blocks, the router, norms and scales F32. `skip`: GGUF tensor names
    to leave out."""
    import gguf
    from gguf.quants import quantize

    c = model.config.to_dict()          # per layer type: its head dim and kv heads (per_layer_config)
    layers, arch = c["num_hidden_layers"], "gemma4"
    swa = [t == "sliding_attention" for t in c["layer_types"]]
    shape = [dict({"head_dim": c["head_dim"], "num_key_value_heads": c["num_key_value_heads"]},
                  **c["per_layer_config"].get(str(i), {})) for i in range(layers)]
    global_dim = shape[swa.index(False)]["head_dim"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-gemma4")
    writer.add_block_count(layers)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    shared = c["num_kv_shared_layers"]
    wide = [2 if c["use_double_wide_mlp"] and i >= layers - shared else 1 for i in range(layers)]
    ff = c["intermediate_size"]
    writer.add_feed_forward_length([ff * w for w in wide] if max(wide) > 1 else ff)
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv([s["num_key_value_heads"] for s in shape])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(global_dim)
    writer.add_value_length(global_dim)
    writer.add_key_length_swa(c["head_dim"])
    writer.add_value_length_swa(c["head_dim"])
    rope = c["rope_parameters"]
    writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    writer.add_rope_dimension_count(global_dim)
    writer.add_rope_dimension_count_swa(c["head_dim"])
    if c["final_logit_softcapping"]:
        writer.add_final_logit_softcapping(float(c["final_logit_softcapping"]))
    writer.add_sliding_window(c["sliding_window"])
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"] or 0)
    if c["enable_moe_block"]:
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["top_k_experts"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    write_tokenizer(writer, tokenizer_json, eos_token, bos_token)
    turning = int(global_dim * rope["full_attention"].get("partial_rotary_factor", 1.0) / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (global_dim // 2 - turning),
                                                    dtype=np.float32))
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GEMMA4, layers)
    own = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
           "layer_scalar": "layer_output_scale.weight", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
           "experts.down_proj": "ffn_down_exps.weight"}
    tied = bool(c["tie_word_embeddings"])
    for hf_name, tensor in model.state_dict().items():
        parts = hf_name.split(".")
        tail = ".".join(parts[3:]) if parts[:2] == ["model", "layers"] else None
        name = f"blk.{parts[2]}.{own[tail]}" if tail in own else names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None or (tied and name == "output.weight"):
            continue
        if not name.endswith((".weight", ".scale")):
            name += ".weight"
        if name in skip:
            continue
        array = np.ascontiguousarray(tensor.detach().to(torch.float32).numpy())
        if (qtype == "Q8_0" and array.ndim >= 2 and array.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name
                and "rope_freqs" not in name):
            writer.add_tensor(name, quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gpt_oss_metadata(writer, c) -> None:
    """gpt-oss's hyper-parameters as llama.cpp's converter writes them (`c`: a GptOssConfig or one with
    its fields)."""
    import gguf
    rope = c.rope_parameters
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_sliding_window(c.sliding_window)
    writer.add_expert_feed_forward_length(c.intermediate_size)
