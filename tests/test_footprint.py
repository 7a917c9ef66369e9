"""footprint.py: what a GGUF file needs in memory, said before loading it (`specdecode info --model`),
and a model whose weights cannot fit refused with one error before anything is read."""
from __future__ import annotations

import pytest

from specdecode.fast.quant import native_reason
from specdecode.models.config import ModelError

needs_quant = pytest.mark.skipif(native_reason() is not None, reason=str(native_reason()))


def embedded_path():
    from specdecode.models.loader import default_model_path
    try:
        return default_model_path()
    except ModelError as exc:
        pytest.skip(str(exc))


@needs_quant
@pytest.mark.slow
def test_the_footprint_is_what_the_loaded_model_holds():
    from specdecode.footprint import gguf_footprint, kv_bytes_per_token, weights_bytes
    from specdecode.models.loader import load_model
    path = embedded_path()
    said = gguf_footprint(path)
    model = load_model(str(path), progress=False).model
    assert said["kv_per_token"] == kv_bytes_per_token(model) and said["context"] == model.max_len
    held = weights_bytes(model)                 # the projections' bytes and the bf16 embedding, not the vectors
    assert held <= said["weights"] <= held * 1.01, (held, said)
    assert said["total"] == said["weights"] + said["kv_per_token"] * said["context"]


def test_a_model_larger_than_the_memory_is_refused_before_loading(monkeypatch, capsys):
    from specdecode import footprint
    from specdecode.footprint import gguf_footprint
    from specdecode.models import gguf, loader
    path = embedded_path()
    if loader.native_weights_reason(path, None, loader.resolve_device("cpu"), True) is not None:
        pytest.skip("the native kernels do not run here")
    need = gguf_footprint(path)["weights"]
    monkeypatch.setattr(footprint, "available_bytes", lambda: need - 1)
    monkeypatch.setattr(gguf, "native_weights", lambda *a: pytest.fail("the weights were read"))
    with pytest.raises(ModelError, match=r"its weights need 0\.1 GiB of memory loaded, and this machine has 0\.1 GiB "
                                         r"available \(MemAvailable, or the container's limit\)"):
        loader.load_model(str(path), progress=False)
    from specdecode.cli import main
    assert main(["info", "--model", str(path)]) == 0
    memory_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  memory"))
    assert "(does not fit: refused)" in memory_line and "KiB per token" in memory_line, memory_line


@needs_quant
def test_the_footprint_counts_expert_stacks_as_stored(tmp_path):
    """A MoE file's expert stacks [E, out, in] are read in place as stored (gpt-oss's MXFP4 ones here,
    make_random_gguf.py's small shape): the footprint counts their bytes, not a bf16 expansion."""
    import importlib.util
    from pathlib import Path

    from specdecode.footprint import gguf_footprint, weights_bytes
    from specdecode.models.loader import load_model
    script = Path(__file__).resolve().parents[1] / "scripts" / "measure" / "make_random_gguf.py"
    spec = importlib.util.spec_from_file_location("make_random_gguf", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "random-gpt-oss.gguf"
    module.write_gpt_oss(out, 2, seed=0, shape=dict(module.GPT_OSS_20B, hidden=128, heads=4, kv_heads=2, head_dim=32,
                                                    experts=8, used=2, expert_ff=64, vocab=512, context=256))
    held = weights_bytes(load_model(str(out), progress=False).model)
    said = gguf_footprint(out)["weights"]
    assert held <= said <= held * 1.05, (held, said)
