"""GGUF -> Hugging Face layout conversion, cached on disk.

Reading a GGUF file with the `gguf` package and converting its tokenizer is slow (Python over
every tensor and token); so the first load converts the file once into a plain HF directory
(config.json, model.safetensors in float32, tokenizer.json, tokenizer_config.json) under
the cache, keyed by the file's size and a hash of its head and tail. Later loads read
that directory, which is quick.

A file of an architecture without a native decoder that transformers' GGUF reader knows is
converted once by transformers instead (`adapter_dir`) and runs through HFAdapter. Every load
first checks the file (`inspect_file`): not GGUF, truncated, or missing tensors is one ModelError
naming the file.

Dequantization is `gguf.quants.dequantize` (exact for every ggml type it supports).
llama.cpp stores Llama q/k rows permuted for its interleaved RoPE; they are permuted
back to the rotate-half (HF) order here. Qwen2 GGUF files use the NeoX order already.
Qwen3.5 ("qwen35") has its own names and transforms, undone in models/qwen3_5_gguf.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .config import ModelConfig, ModelError
from .moe import GGUF_NAMES as MOE_NAMES
from .moe import split_stacked, stacked_name

FORMAT_VERSION = 3   # 2: end-of-generation tokens of the vocabulary added to the EOS ids; 3: Qwen3.5's MTP head
NATIVE_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma4", "qwen35", "qwen3moe", "qwen35moe",
                "gpt-oss")
# llama.cpp's names of architectures that transformers files under another (its load_gguf_checkpoint)
TRANSFORMERS_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                      "minimax-m2": "minimax_m2", "t5encoder": "t5"}


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
    config = read_config(reader, path)
    listing = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in reversed(t.shape)],
                "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]
    table = {"config": asdict(config), "tensors": listing}
    _write_dir(path, out, config, {"tensors.json": json.dumps(table)})
    return out


def native_weights(path: Path, dtype, device) -> tuple[ModelConfig, dict]:
    """The file's tensors in HF names without dequantizing the projections: each q/k/v/o/gate/
    up/down and the output matrix whose format has a native kernel (fast.quant.NATIVE_TYPES, rows
    a multiple of 64) stays a QuantWeight of the file's own blocks, views of the memory-mapped file (read
    in place: no copy in memory; QuantLinear repacks what its kernels read otherwise); norms, biases and the token
    embedding (read one row per token) are dequantized to `dtype`. A tied output matrix is the
    quantized token embedding."""
    import torch
    from gguf.quants import dequantize

    from ..fast.quant import QuantWeight, release_pages

    table = json.loads((tokenizer_dir(path) / "tensors.json").read_text())
    config = ModelConfig(**dict(table["config"], eos_token_ids=tuple(table["config"]["eos_token_ids"])))
    raw = np.memmap(path, dtype=np.uint8, mode="c")     # private: the weights are views of the file, read in place
    weights: dict = {}
    for t in table["tensors"]:
        name, qtype, shape = _hf_name(t["name"], config.arch, config.num_layers), t["type"], tuple(t["shape"])
        if name is None:
            continue
        data = raw[t["offset"]:t["offset"] + t["bytes"]]
        if len(shape) == 3 and stacked_name(name):   # every expert's matrix [E, out, in]: read in place
            if kept_as_stored(name, qtype, (shape[0] * shape[1], shape[2])):
                weights[name] = QuantWeight.from_blocks(qtype, data, (shape[0] * shape[1], shape[2]), mapped=True)
                continue
        if kept_as_stored(name, qtype, shape):
            qw = QuantWeight.from_blocks(qtype, data, shape, mapped=True)
            if config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in name else config.num_kv_heads
                order = torch.from_numpy(_unpermute(np.arange(shape[0]), heads).copy())
                qw = qw.permute_rows(order)
            if name == "model.embed_tokens.weight":
                if config.tie_word_embeddings:
                    weights["lm_head.weight"] = qw
                if device.type == "cpu":
                    weights[name] = mapped_embedding(path, qw, dtype)
                else:
                    weights[name] = qw.dequantize(dtype).to(device)
                    release_pages(qw.segments[0][1])       # read once: its rows live on dequantized
            else:
                weights[name] = qw
            continue
        array = dequantize(np.asarray(data), qtype).astype(np.float32, copy=False).reshape(shape)
        weights[name] = torch.from_numpy(_hf_order(name, array, config, grouped=False)).to(device=device,
                                                                                           dtype=dtype)
    return config, weights


def mapped_embedding(path: Path, weight, dtype):
    """A GGUF file's token embedding (a QuantWeight [V, D]) dequantized to `dtype`, as a memory-mapped file
    under the cache written once (FILE-embed-DTYPE.bin): a pass reads one row per token, so only the rows
    of the tokens seen become resident, and the page cache can drop them again, as llama.cpp's embedding
    rows read from its mapped file. Written DEQUANT_ROWS rows at a time, the file's blocks of each chunk
    given back once read: no whole copy of the embedding in memory, then or later."""
    import torch

    from ..fast.quant import DEQUANT_ROWS, QuantWeight, release_pages
    out = cache_root() / "converted" / f"{file_key(path)}-embed-{str(dtype).split('.')[-1]}.bin"
    rows, cols = weight.shape
    size = torch.empty(0, dtype=dtype).element_size()
    if not out.is_file() or out.stat().st_size != rows * cols * size:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            for qtype, data in weight.segments:
                for first in range(0, data.shape[0], DEQUANT_ROWS):
                    chunk = data[first:first + DEQUANT_ROWS]
                    f.write(QuantWeight([(qtype, chunk)], cols).dequantize(dtype).view(torch.uint8).numpy().data)
                    if weight.mapped:
                        release_pages(chunk)
        tmp.replace(out)
    table = np.memmap(out, dtype=np.uint8, mode="c", shape=(rows, cols * size))   # private: never written back
    return torch.from_numpy(table).view(dtype)                                        # [V, D]


def kept_as_stored(hf_name: str, qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether native_weights keeps a tensor (by its HF name) as the file's own blocks for the native
    kernels: a projection or the output matrix in a format they read (fast.quant.NATIVE_TYPES), rows a
    multiple of 64 weights. Anything else is dequantized at load."""
    from ..fast.quant import NATIVE_TYPES
    projection = stacked_name(hf_name) or hf_name.endswith((
        "proj.weight", "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")) or \
        hf_name in ("lm_head.weight", "model.embed_tokens.weight", "mtp.fc.weight")
    return projection and len(shape) == 2 and qtype in NATIVE_TYPES and shape[1] % 64 == 0


def tensor_table(path: Path) -> tuple[str | None, list[tuple[str | None, str, int, tuple[int, ...]]]]:
    """(architecture, [(HF name or None, GGUF name, ggml type, shape [out, in])]) from the file's header
    alone (no weights read, nothing cached); ModelError for a file that is not GGUF or is damaged."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file")
    try:
        arch, tensors = _header(path)
    except Exception as exc:  # noqa: BLE001  (as in inspect_file)
        raise ModelError(f"{path} is a damaged GGUF file ({type(exc).__name__}: {exc})") from None
    return arch, [(_hf_name(name, arch), name, qtype, shape) for name, qtype, shape, _ in tensors]


def _open(path: Path):
    from gguf import GGUFReader
    inspect_file(path)
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises many kinds for a bad file
        raise ModelError(f"{path} is not a readable GGUF file: {exc}") from None


def inspect_file(path: Path) -> str:
    """The file's architecture (general.architecture), after checking that it is a whole GGUF
    file: the magic bytes, a readable header, and every tensor's bytes inside the file."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    record = cache_root() / "converted" / (file_key(path) + "-checked.json")   # this size and content passed
    if record.is_file():
        return json.loads(record.read_text())["architecture"]
    try:
        arch, tensors = _header(path)
        ends = [(name, end) for name, _, _, end in tensors]
    except Exception as exc:  # struct / numpy / the gguf package raise many kinds for a cut header
        raise ModelError(f"{path} is a damaged GGUF file (truncated or corrupt header: {type(exc).__name__}: "
                         f"{exc})") from None
    if not arch:
        raise ModelError(f"{path} is a damaged GGUF file: its metadata has no general.architecture")
    size = path.stat().st_size
    cut = [(name, end) for name, end in ends if end > size]
    if cut:
        raise ModelError(f"{path} is truncated: it has {size} bytes but tensor {cut[0][0]} ends at byte "
                         f"{cut[0][1]} ({len(cut)} of {len(ends)} tensors are cut off)")
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"architecture": str(arch), "source": str(path)}))
    return str(arch)


def _header(path: Path) -> tuple[str | None, list[tuple[str, int, tuple[int, ...], int]]]:
    """(architecture, [(tensor name, ggml type, shape [out, in], byte offset just past its data)]).
    transformers' header reader skips the vocabulary (milliseconds); the gguf package's reader parses
    it (seconds) and is the fallback for what the former does not read."""
    try:
        from transformers.integrations.gguf.reader import GgufHeader
        h = GgufHeader.from_file(str(path))
        return h.architecture, [(t.name, int(t.ggml_type), tuple(int(d) for d in t.shape),
                                 h.data_start + t.offset + t.nbytes) for t in h.tensors]
    except Exception:  # noqa: BLE001  (an older transformers, or a type / header it does not read)
        from gguf import GGUFReader
        reader = GGUFReader(str(path))
        return _field(reader, "general.architecture"), [
            (t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), int(t.data_offset) + int(t.n_bytes))
            for t in reader.tensors]


def transformers_archs() -> tuple[str, ...]:
    """The GGUF architectures the installed transformers can read."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return ()
    return tuple(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def adapter_dir(path: Path, arch: str) -> Path:
    """An HF directory for a GGUF file of an architecture without a native decoder, converted once
    by transformers (weights dequantized to float32, its tokenizer) under the cache; an architecture
    transformers cannot read either is refused, listing what is supported."""
    others = [a for a in transformers_archs() if a not in NATIVE_ARCHS]
    if TRANSFORMERS_NAMES.get(arch, arch) not in others:
        raise ModelError(f"{path}: GGUF architecture {arch!r} is not supported (native: {', '.join(NATIVE_ARCHS)}; "
                         f"through transformers: {', '.join(others) or 'none (transformers is not installed)'})")
    out = cache_root() / "converted" / (file_key(path) + "-hf")
    if (out / "DONE").is_file():
        return out
    import shutil

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"specdecode: converting {path.name} once with transformers into {out}", file=sys.stderr)
    _quiet_transformers()
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    options = {dtype_arg: torch.float32}
    try:      # transformers >= 5 can keep the blocks quantized: dense here (HFAdapter takes any dtype)
        from transformers import GgufConfig
        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           output_loading_info=True, **options)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many kinds for a file it cannot use
        raise ModelError(f"transformers cannot load {path} ({arch}): {type(exc).__name__}: {exc}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelError(f"{path} is missing tensors: {len(missing)} weights of the {arch} model are not in the "
                         f"file ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
    tmp = out.with_name(out.name + ".tmp")
    model.hf_quantizer = None                      # dense now: saved as a plain checkpoint
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "DONE").write_text(json.dumps({"source": str(path), "format_version": FORMAT_VERSION}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _quiet_transformers() -> None:
    import logging

    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def required_tensors(config: ModelConfig) -> list[str]:
    """The GGUF tensors a native decoder of `config` reads (output.weight only when untied)."""
    if config.arch == "qwen3_5":
        from .qwen3_5_gguf import required_tensors as qwen3_5_tensors
        return qwen3_5_tensors(config)
    if config.arch == "gemma4":
        from .gemma4_gguf import required_tensors as gemma4_tensors
        return gemma4_tensors(config)
    if config.moe is not None and config.arch == "qwen3moe":
        from .moe import required_tensors as moe_tensors
        return moe_tensors(config)
    if config.arch == "gpt-oss":
        from .gpt_oss import required_tensors as gpt_oss_tensors
        return gpt_oss_tensors(config)
    per_layer = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    if config.arch == "phi3":      # q|k|v fused in attn_qkv, gate|up in ffn_up
        per_layer = ["attn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_norm.weight",
                     "ffn_up.weight", "ffn_down.weight"]
    if config.is_gemma:            # sandwich norms: post_attention_norm, ffn_norm (pre-MLP), post_ffw_norm
        per_layer += ["post_attention_norm.weight", "post_ffw_norm.weight"]
    if config.attention_bias:
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if config.qk_norm:
        per_layer += ["attn_q_norm.weight", "attn_k_norm.weight"]
    return ["token_embd.weight", "output_norm.weight"] + [f"blk.{i}.{n}" for i in range(config.num_layers)
                                                        for n in per_layer]


def _hf_order(name: str, array: np.ndarray, config: ModelConfig, grouped: bool = True) -> np.ndarray:
    """A dequantized tensor as fp32, C order, with llama.cpp's q/k row permutation, Gemma norm
    shift and Qwen3.5 transforms undone (`grouped`: its value heads too, qwen3_5_gguf.hf_order)."""
    from .gemma_config import gguf_norm_shift
    if config.arch == "qwen3_5":
        from .qwen3_5_gguf import hf_order
        return np.array(hf_order(name, array, config, grouped), dtype=np.float32, order="C")
    array = array - gguf_norm_shift(name, config) if gguf_norm_shift(name, config) else array
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
    _convert_tokenizer(path, tmp, config.arch)
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

_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}   # ffn_up holds gate|up


def _hf_name(name: str, arch: str | None = None, num_layers: int | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not read, e.g. a layer past `num_layers`)."""
    if arch == "gemma4":                      # its own names (models/gemma4_gguf.py)
        from .gemma4_gguf import hf_name as gemma4_name
        return gemma4_name(name, num_layers)
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if arch in ("qwen35", "qwen35moe", "qwen3_5") and parts[0] == "blk":   # its blocks past num_layers: the MTP head
        from .qwen3_5_gguf import hf_name
        return hf_name(parts, num_layers)
    if parts[0] == "blk" and num_layers is not None and int(parts[1]) >= num_layers:
        return None                           # a block the decoder does not run
    from .gemma_config import GGUF_NAMES  # llama.cpp's names of Gemma's four layer norms
    if arch in ("gemma2", "gemma3") and parts[0] == "blk" and parts[2] in GGUF_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
    if arch == "gpt-oss" and parts[0] == "blk":                      # its sinks and post-attention norm
        from .gpt_oss import gguf_name
        name = gguf_name(parts)
        if name is not None:
            return name
    if arch == "phi3" and parts[0] == "blk" and parts[2] in _PHI3_NAMES:   # llama.cpp's fused phi3 tensors
        return f"model.layers.{parts[1]}.{_PHI3_NAMES[parts[2]]}.{parts[3]}"
    if parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    if parts[0] == "blk" and parts[2] in MOE_NAMES:                 # a MoE layer's router and expert stacks
        return f"model.layers.{parts[1]}.{MOE_NAMES[parts[2]]}.{parts[3]}"
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


def read_config(reader, path: Path | str = "the GGUF file") -> ModelConfig:
    """The native config of a file of a NATIVE_ARCHS architecture; ModelError if a tensor it needs is missing."""
    arch = _field(reader, "general.architecture")
    if arch not in NATIVE_ARCHS:
        raise ModelError(f"{path}: GGUF architecture {arch!r} has no native decoder "
                         f"(native: {', '.join(NATIVE_ARCHS)})")
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"type": "linear", "factor": float(g("rope.scaling.factor"))}
    if "rope_factors_long.weight" in names:       # Phi-3 128k: per-dimension factors (HF rope_scaling longrope)
        raise ModelError(f"{path}: longrope scaling (tensor rope_factors_long) is not supported natively")
    head_dim = int(g("attention.key_length", hidden // heads))
    window = g("attention.sliding_window")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(int(x) for x in (eos, eot) if x is not None) + end_of_generation_ids(reader)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if arch == "gemma4":                          # its own metadata (models/gemma4_gguf.py)
        from .gemma4_gguf import hf_config as gemma4_config
        config = ModelConfig.from_hf(gemma4_config(g, reader, names, path, int(vocab), bos,
                                                   tuple(dict.fromkeys(eos_ids))))
        return _checked(config, names, path, arch)
    fields = dict(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length", 0) or 0), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, attention_bias=arch == "qwen2",
        bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        qk_norm=arch in ("qwen3", "qwen3moe"), sliding_window=int(window) if window else None,
        partial_rotary_factor=int(g("rope.dimension_count", head_dim)) / head_dim,
    )
    if arch in ("qwen35", "qwen35moe"):           # hybrid DeltaNet / attention layers (models/qwen3_5_gguf.py)
        from .qwen3_5_gguf import gguf_fields as qwen3_5_fields
        fields.update(qwen3_5_fields(g, path, moe=arch == "qwen35moe"))
    if arch == "qwen3moe":                        # mixture-of-experts MLPs (models/moe.py)
        from .moe import gguf_fields as moe_fields
        fields.update(moe_fields(g))
    if arch == "gpt-oss":                         # sinks, windows, YaRN, biased experts (models/gpt_oss.py)
        from .gpt_oss import gguf_fields as gpt_oss_fields
        fields.update(gpt_oss_fields(g))
    config = ModelConfig(**fields)
    if config.is_gemma:
        from dataclasses import replace

        from .gemma_config import gguf_fields
        config = replace(config, **gguf_fields(arch, g, config))
    return _checked(config, names, path, arch)


def _checked(config: ModelConfig, names: set[str], path, arch: str) -> ModelConfig:
    """`config`, once every tensor its decoder reads is in the file (else one ModelError naming them)."""
    missing = [n for n in required_tensors(config) if n not in names]
    if missing:
        raise ModelError(f"{path} is missing tensors: {len(missing)} of the {arch} model's are not in the file "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
    return config


def convert(path: Path, out: Path) -> None:
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    print(f"specdecode: converting {path.name} once into {out} (later loads take under a second)",
          file=sys.stderr)
    reader = _open(path)
    config = read_config(reader, path)
    weights = {}
    for tensor in tqdm(reader.tensors, desc="dequantize", unit="tensor", file=sys.stderr, leave=False):
        name = _hf_name(tensor.name, config.arch, config.num_layers)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        weights[name] = torch.from_numpy(_hf_order(name, array, config))
        if stacked_name(name) and name.endswith(".weight") and config.arch != "gpt-oss":
            weights.update(split_stacked(name, weights.pop(name)))   # a stack: the checkpoint's one per expert
    if config.arch == "gpt-oss":                 # gpt_oss checkpoints hold stacks of their own layout
        from .gpt_oss import checkpoint_weights
        checkpoint_weights(weights, config)
    _write_dir(path, out, config, {}, weights)


def _convert_tokenizer(path: Path, out: Path, arch: str | None = None) -> None:
    """transformers' GGUF tokenizer converter produces the tokenizer.json and chat template (for
    gemma4 through the tokenizer class itself: AutoTokenizer first builds the file's config, which
    transformers' reader gets wrong where kv heads differ per layer)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    _quiet_transformers()
    cls = PreTrainedTokenizerFast if arch == "gemma4" else AutoTokenizer
    with _rope_scaling_fields_first():
        tokenizer = cls.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))


@contextmanager
def _rope_scaling_fields_first():
    """transformers (5.25)'s GGUF reader takes a gpt-oss file's rope.scaling values from the first
    part of each field, which is the key's length: within this block the gguf package's reader puts a
    copy of the value (a Python scalar or bytes) first in those fields, so reading them succeeds."""
    import gguf
    base = gguf.GGUFReader

    class Reader(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for key, field in list(self.fields.items()):
                if key.startswith("gpt-oss.rope.scaling.") and len(field.data) == 1:
                    value = field.parts[field.data[0]]
                    text = field.types and field.types[0] == gguf.GGUFValueType.STRING
                    first = bytes(value) if text else value.item()
                    self.fields[key] = field._replace(parts=[first] + list(field.parts), data=[field.data[0] + 1])
    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = base
