"""GGUF -> Hugging Face layout conversion, cached on disk.

Reading a GGUF file with the `gguf` package and converting its tokenizer takes ~20 s on
2 cores; so the first load converts the file once into a plain HF directory
(config.json, model.safetensors in float32, tokenizer.json, tokenizer_config.json) under
the cache, keyed by the file's size and a hash of its head and tail. Later loads read
that directory in well under a second.

Dequantization is `gguf.quants.dequantize` (exact for every ggml type it supports).
llama.cpp stores Llama q/k rows permuted for its interleaved RoPE; they are permuted
back to the rotate-half (HF) order here. Qwen2 GGUF files use the NeoX order already.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from .config import ModelConfig, ModelError

FORMAT_VERSION = 2   # 2: end-of-generation tokens of the vocabulary added to the EOS ids


def cache_root() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))


def file_key(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"{path.stem}-{digest.hexdigest()[:16]}-v{FORMAT_VERSION}"


def converted_dir(path: Path) -> Path:
    """The converted HF directory for a GGUF file, converting on first use."""
    out = cache_root() / "converted" / file_key(path)
    if (out / "DONE").is_file():
        return out
    convert(path, out)
    return out


def tokenizer_dir(path: Path) -> Path:
    """A directory with the GGUF file's config.json, tokenizer and tensor table (tensors.json:
    name, type, shape, file offset and size of every tensor), no weights: what the native quantized
    load needs besides the file itself, so later loads skip the gguf reader's vocabulary parse."""
    out = cache_root() / "converted" / (file_key(path) + "-tokenizer")
    if (out / "DONE").is_file():
        return out
    from dataclasses import asdict
    reader = _open(path)
    config = read_config(reader)
    listing = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in reversed(t.shape)],
                "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]
    table = {"config": asdict(config), "tensors": listing}
    _write_dir(path, out, config, {"tensors.json": json.dumps(table)})
    return out


def native_weights(path: Path, dtype, device) -> tuple[ModelConfig, dict]:
    """The file's tensors in HF names without dequantizing the projections: each q/k/v/o/gate/
    up/down and the output matrix whose format has a native kernel (fast.quant.NATIVE_TYPES, rows
    a multiple of 64) stays a QuantWeight of the file's own blocks; norms, biases and the token
    embedding (read one row per token) are dequantized to `dtype`. A tied output matrix is the
    quantized token embedding."""
    import torch
    from gguf.quants import dequantize

    from ..fast.quant import NATIVE_TYPES, QuantWeight

    table = json.loads((tokenizer_dir(path) / "tensors.json").read_text())
    config = ModelConfig(**dict(table["config"], eos_token_ids=tuple(table["config"]["eos_token_ids"])))
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict = {}
    for t in table["tensors"]:
        name, qtype, shape = _hf_name(t["name"]), t["type"], tuple(t["shape"])
        if name is None:
            continue
        data = raw[t["offset"]:t["offset"] + t["bytes"]]
        projection = name.endswith("proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")
        if projection and len(shape) == 2 and qtype in NATIVE_TYPES and shape[1] % 64 == 0:
            qw = QuantWeight.from_blocks(qtype, np.array(data, copy=True), shape)
            if config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in name else config.num_kv_heads
                order = torch.from_numpy(_unpermute(np.arange(shape[0]), heads).copy())
                qw = qw.permute_rows(order)
            if name == "model.embed_tokens.weight":
                if config.tie_word_embeddings:
                    weights["lm_head.weight"] = qw
                weights[name] = qw.dequantize(dtype).to(device)
            else:
                weights[name] = qw
            continue
        array = dequantize(np.asarray(data), qtype).astype(np.float32, copy=False).reshape(shape)
        weights[name] = torch.from_numpy(_hf_order(name, array, config)).to(device=device, dtype=dtype)
    return config, weights


def _open(path: Path):
    from gguf import GGUFReader
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises many kinds for a bad file
        raise ModelError(f"{path} is not a readable GGUF file: {exc}") from None


def _hf_order(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A dequantized tensor as fp32, C order, with llama.cpp's q/k row permutation undone."""
    if config.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        array = _unpermute(array, config.num_heads)
    elif config.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        array = _unpermute(array, config.num_kv_heads)
    return np.array(array, dtype=np.float32, order="C")


def _write_dir(path: Path, out: Path, config: ModelConfig, files: dict[str, str], weights=None) -> None:
    """Write a cache directory for `path` next to `out` (config.json, tokenizer, `files`, the
    weights if given) and move it into place once complete (DONE marks it)."""
    import shutil
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if weights is not None:
        from safetensors.torch import save_file
        save_file(weights, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    for name, text in files.items():
        (tmp / name).write_text(text)
    _convert_tokenizer(path, tmp)
    (tmp / "DONE").write_text(json.dumps({"source": str(path), "format_version": FORMAT_VERSION}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half pairs)."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    return None


# Tokens that end a generation wherever a vocabulary has them (a GGUF file names one EOS token, but
# e.g. Qwen2.5 instruct models end a raw completion with <|endoftext|> and a chat turn with
# <|im_end|>; transformers' generation_config and llama.cpp's end-of-generation list stop at both).
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
                     "<end_of_turn>", "<|end|>")


def end_of_generation_ids(reader) -> tuple[int, ...]:
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return ()
    found = []
    for token_id, index in enumerate(field.data):   # field.data: the parts holding each token's text
        part = field.parts[index]
        if len(part) <= 16 and bytes(part).decode("utf-8", errors="replace") in END_OF_GENERATION:
            found.append(token_id)
    return tuple(found)


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelError(f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2, qwen3)")
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"type": "linear", "factor": float(g("rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(int(x) for x in (eos, eot) if x is not None) + end_of_generation_ids(reader)
    return ModelConfig(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, attention_bias=arch == "qwen2",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        qk_norm=arch == "qwen3",
    )


def convert(path: Path, out: Path) -> None:
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    print(f"specdecode: converting {path.name} once into {out} (later loads take under a second)",
          file=sys.stderr)
    reader = _open(path)
    config = read_config(reader)
    weights = {}
    for tensor in tqdm(reader.tensors, desc="dequantize", unit="tensor", file=sys.stderr, leave=False):
        name = _hf_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        weights[name] = torch.from_numpy(_hf_order(name, array, config))
    _write_dir(path, out, config, {}, weights)


def _convert_tokenizer(path: Path, out: Path) -> None:
    """transformers' GGUF tokenizer converter produces the tokenizer.json and chat template."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))
