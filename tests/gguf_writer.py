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


def write_tokenizer(writer, tokenizer_json: Path, eos_token: str, bos_token: str | None = None) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer metadata."""
    import gguf
    spec = json.loads(Path(tokenizer_json).read_text())
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
