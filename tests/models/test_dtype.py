"""--dtype / LLM(dtype=...) names (models/dtypes.py): the long and short spellings vLLM, transformers
and llama.cpp users type, any case, and "auto" (the checkpoint's own float type); a bad name is one
clear error naming the parameter and listing the accepted values."""
import json
import re
import subprocess
import sys

import pytest
import torch

from specdecode import LLM
from specdecode.cli_common import DTYPE_NAMES
from specdecode.models.config import ModelError
from specdecode.models.dtypes import DTYPE_NAMES as PARSER_NAMES
from specdecode.models.dtypes import canonical_dtype
from specdecode.models.loader import DTYPES, parse_dtype

ACCEPTED = "auto, bfloat16 (bf16), float32 (fp32, float), float16 (fp16, half)"


def test_names_and_aliases():
    assert DTYPE_NAMES == PARSER_NAMES          # the CLI uses the one parser
    # every canonical name has a torch dtype
    assert set(DTYPES) == {canonical_dtype(n) for n in DTYPE_NAMES} - {"auto"}
    for names, canonical, dtype in ((("bf16", "bfloat16", "BFloat16", "BF16"), "bfloat16", torch.bfloat16),
                                    (("fp32", "float32", "float", "FLOAT"), "float32", torch.float32),
                                    (("fp16", "float16", "half", "Half"), "float16", torch.float16)):
        assert {canonical_dtype(n) for n in names} == {canonical}
        assert all(parse_dtype(n) is dtype for n in names)
        assert canonical_dtype(dtype) == canonical          # a torch dtype passes through
    assert parse_dtype("auto") is None and parse_dtype("AUTO") is None and canonical_dtype("Auto") == "auto"
    assert canonical_dtype(None) is None
    assert canonical_dtype("INT8", "--draft-dtype", allow_int8=True) == "int8"
    with pytest.raises(ModelError, match=rf"^dtype: unknown dtype 'f8'; accepted \(any case\): {re.escape(ACCEPTED)}$"):
        parse_dtype("f8")
    with pytest.raises(ModelError, match=r"^--dtype: unknown dtype 'int8'"):
        canonical_dtype("int8", "--dtype")
    with pytest.raises(ModelError, match=r"^--draft-dtype: unknown dtype 'q4'.*half\), int8, q4_0$"):
        canonical_dtype("q4", "--draft-dtype", allow_int8=True)
    with pytest.raises(ModelError, match=r"unknown dtype torch.float64"):
        canonical_dtype(torch.float64)


def test_auto_takes_the_checkpoint_dtype(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    saved = json.loads((folder / "config.json").read_text())
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16}[saved.get("torch_dtype") or saved.get("dtype")]
    assert LLM(model=str(folder), dtype="auto", progress=False).target.model.dtype == want
    assert LLM(model=str(folder), dtype="Float", progress=False).target.model.dtype == torch.float32
    assert LLM(model=str(folder), dtype=torch.float32, progress=False).target.model.dtype == torch.float32
    with pytest.raises(ModelError, match="^dtype: unknown dtype 'float64'; accepted"):
        LLM(model=str(folder), dtype="float64", progress=False)
    with pytest.raises(ModelError, match="^draft_dtype: unknown dtype 'bf8'; accepted"):
        LLM(model=str(folder), draft=str(folder), draft_dtype="bf8", progress=False)


@pytest.mark.parametrize("command,option,value", [
    ("generate", "--dtype", "f8"), ("generate", "--draft-dtype", "q4"), ("serve", "--dtype", "int8"),
    ("bench", "--dtype", "double"),
])
def test_cli_refuses_a_bad_dtype_in_one_line(command, option, value):
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", command, *(["hi"] if command == "generate" else []),
                           option, value], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [f"specdecode: error: {option}: unknown dtype {value!r}; accepted (any "
                                        f"case): {ACCEPTED}{', int8, q4_0' if option == '--draft-dtype' else ''}"]


def test_cli_parses_every_spelling():
    from specdecode.cli import build_parser
    parser = build_parser()
    for name in DTYPE_NAMES:
        args = parser.parse_args(["generate", "hi", "--dtype", name.upper(), "--draft-dtype", name])
        assert args.dtype == args.draft_dtype == canonical_dtype(name)
    assert parser.parse_args(["generate", "hi", "--draft-dtype", "Int8"]).draft_dtype == "int8"
    assert parser.parse_args(["generate", "hi"]).dtype is None


def test_the_parser_is_torch_free():
    code = ("import sys; from specdecode.models.dtypes import canonical_dtype; canonical_dtype('bf16'); "
            "import specdecode.cli_common; assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
