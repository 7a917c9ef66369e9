"""models/gguf.py's native load holds no whole copy of a GGUF file's token embedding: its bf16 rows are a
memory-mapped file under the cache (written once), so only the rows of the tokens read become resident."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specdecode.fast.quant import QuantWeight, native_reason

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure" / "make_random_gguf.py"


def mapping_of(address: int) -> str:
    """The file behind the mapping of this process that holds `address` ('' for anonymous memory)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 else ""
    return ""


@pytest.mark.skipif(native_reason() is not None, reason=str(native_reason()))
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_the_embedding_rows_are_a_mapped_file_of_the_exact_values(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shape = dict(script.QWEN3_30B_A3B, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, used=2,
                 expert_ff=256, ff=512, vocab=512)
    path = tmp_path / "random-qwen3moe.gguf"
    script.write_qwen3moe(path, 1, seed=0, shape=shape, qtype="Q4_K_M")
    from specdecode.models.gguf import native_weights, tensor_table
    from specdecode.models.loader import load_model
    _, weights = native_weights(path, torch.bfloat16, torch.device("cpu"))
    embed = weights["model.embed_tokens.weight"]
    assert mapping_of(embed.data_ptr()).endswith("-embed-bfloat16.bin")
    (_, name, qtype, dims), = [t for t in tensor_table(path)[1] if t[1] == "token_embd.weight"]
    import numpy as np
    raw = np.memmap(path, dtype=np.uint8, mode="c")
    table = {t["name"]: t for t in __import__("json").loads(
        (next((tmp_path / "cache" / "converted").glob("*-tokenizer")) / "tensors.json").read_text())["tensors"]}
    t = table[name]
    exact = QuantWeight.from_blocks(qtype, raw[t["offset"]:t["offset"] + t["bytes"]], dims).dequantize(torch.bfloat16)
    assert embed.dtype == torch.bfloat16 and torch.equal(embed, exact)
    lm = load_model(str(path), progress=False)          # a second load maps the file written by the first
    assert mapping_of(lm.model.embed.data_ptr()).endswith("-embed-bfloat16.bin")
    assert len(list((tmp_path / "cache" / "converted").glob("*-embed-bfloat16.bin"))) == 1
    assert torch.equal(lm.model.embed, exact)


def file_rss_kb(path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_the_fingerprint_gives_back_the_file_pages_it_maps(tmp_path):
    """weights_fingerprint samples rows all over a mapped weight (and the kernel maps the pages around each
    read): a first load would hold most of the file resident beside its repacked copy. It gives them back."""
    import numpy as np

    from specdecode.models.loader import weights_fingerprint
    blocks = np.random.default_rng(0).integers(0, 256, size=(4096, 8 * 34), dtype=np.uint8)
    blocks[:, ::34], blocks[:, 1::34] = 0, 0x20                       # Q8_0 scales: small finite fp16
    path = tmp_path / "blocks.bin"
    blocks.tofile(path)
    mapped = QuantWeight.from_blocks(8, np.memmap(path, dtype=np.uint8, mode="c"), (4096, 256), mapped=True)
    first = weights_fingerprint({"w": mapped})
    assert file_rss_kb(path) <= 16, file_rss_kb(path)
    assert weights_fingerprint({"w": QuantWeight.from_blocks(8, blocks, (4096, 256))}) == first
