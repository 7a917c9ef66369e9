"""--dtype / LLM(dtype=...) names: the long and short spellings vLLM, transformers and llama.cpp
users type, any case, and "auto" (the checkpoint's own float type); a bad name is one clear error."""
import json
import subprocess
import sys

import pytest
import torch

from specdecode import LLM
from specdecode.cli_common import DTYPE_NAMES
from specdecode.models.config import ModelError
from specdecode.models.loader import DTYPE_NAMES as LOADER_NAMES
from specdecode.models.loader import parse_dtype


def test_names_and_aliases():
    assert DTYPE_NAMES == LOADER_NAMES          # the CLI's list (torch-free) is the loader's
    for names, dtype in ((("bf16", "bfloat16", "BFloat16"), torch.bfloat16),
                         (("fp32", "float32", "float", "FLOAT"), torch.float32),
                         (("fp16", "float16", "half"), torch.float16)):
        assert all(parse_dtype(n) is dtype for n in names)
    assert parse_dtype("auto") is None and parse_dtype("AUTO") is None
    with pytest.raises(ModelError, match=r"dtype must be one of auto, fp32.*got 'f8'"):
        parse_dtype("f8")


def test_auto_takes_the_checkpoint_dtype(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    saved = json.loads((folder / "config.json").read_text())
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16}[saved.get("torch_dtype") or saved.get("dtype")]
    assert LLM(model=str(folder), dtype="auto", progress=False).target.model.dtype == want
    assert LLM(model=str(folder), dtype="Float", progress=False).target.model.dtype == torch.float32
    with pytest.raises(ModelError, match="dtype must be one of"):
        LLM(model=str(folder), dtype="float64", progress=False)


def test_cli_refuses_a_bad_dtype_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", "hi", "--dtype", "f8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "argument --dtype: invalid choice: 'f8'" in proc.stderr and "Traceback" not in proc.stderr
