"""Bytes of a native model's weights and of its KV cache per token, from its config (the
server's memory budget; a draft model's cost relative to its target)."""
from __future__ import annotations

from pathlib import Path


def weights_bytes(model) -> int:
    """Bytes of a native model's weights, from its config (an untied LM head counted too)."""
    if model is None:
        return 0
    c = model.config
    element = model.embed.element_size()
    if getattr(model, "quantized", False):      # quantized projections: their own bytes
        return (sum(lin.nbytes if hasattr(lin, "nbytes") else lin.out_features * lin.in_features * element
                    for lin in model.projections()) + model.embed.numel() * element)
    untied_head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return (c.weight_count() + untied_head) * element


def kv_bytes_per_token(model) -> int:
    if model is None or not hasattr(model, "config"):     # none, or the transformers adapter's own caches
        return 0
    return model.config.kv_elements_per_token() * model.embed.element_size()


def gguf_footprint(path) -> dict:
    """What a GGUF file takes in memory loaded natively, from its header alone (nothing is read or
    cached): `weights` bytes (projections as stored, repacked for the kernels at the same size; the
    token embedding also dequantized to bf16 when its blocks are the tied LM head; everything else
    in bf16), `kv_per_token` bytes (bf16 keys and values), and `context` (the model's own) with
    `total` = weights + a full context of KV."""
    from pathlib import Path

    from .fast.quant import row_bytes
    from .models.gguf import _open, kept_as_stored, read_config, tensor_table
    from .models.moe import stacked_name
    path = Path(path)
    _, tensors = tensor_table(path)
    config = read_config(_open(path), path)
    bf16 = 2
    tied = not any(name == "output.weight" for _, name, _, _ in tensors)    # the LM head is the embedding
    weights = 0
    for hf, _gguf, qtype, shape in tensors:
        elements = 1
        for dim in shape:
            elements *= int(dim)
        if hf is None:
            continue
        if len(shape) == 3 and stacked_name(hf):              # every expert's matrix [E, out, in], as stored
            rows = int(shape[0]) * int(shape[1])
            weights += (rows * row_bytes(qtype, int(shape[2])) if kept_as_stored(hf, qtype, (rows, int(shape[2])))
                        else elements * bf16)
            continue
        embedding = hf == "model.embed_tokens.weight"        # its rows in bf16 (read one per token) ...
        rows = elements // int(shape[-1]) if shape else 0     # an expert stack [E, out, in]: E * out rows
        stored = (len(shape) == 2 or (len(shape) == 3 and stacked_name(hf))) and kept_as_stored(
            hf, qtype, (rows, int(shape[-1])))
        if stored and (tied or not embedding):
            weights += rows * row_bytes(qtype, int(shape[-1]))   # ... and its blocks as the tied LM head
        weights += elements * bf16 if embedding or not stored else 0
    kv = config.kv_elements_per_token() * bf16
    context = config.max_position_embeddings
    return {"weights": weights, "kv_per_token": kv, "context": context, "total": weights + kv * context}


def available_bytes() -> int | None:
    """MemAvailable, lowered to the cgroup (container) limit when there is one; None if unknown."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        try:
            import psutil
            available = int(psutil.virtual_memory().available)
        except ImportError:
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return available


def check_fits(path, available: int | None) -> None:
    """ModelError, before anything is loaded, when a GGUF file's weights (gguf_footprint) exceed the
    memory available (available_bytes: MemAvailable, or the cgroup's limit); None
    `available` (unknown) passes."""
    from .models.config import ModelError
    if available is None:
        return
    need = gguf_footprint(path)["weights"]
    if need > available:
        raise ModelError(f"{path}: its weights need {need / 2**30:.1f} GiB of memory loaded, and this machine has "
                         f"{available / 2**30:.1f} GiB available (MemAvailable, or the container's limit): it would "
                         f"swap or be killed; free memory or pick a smaller quantization of the model "
                         f"(`specdecode info --model FILE` says what a file needs)")
