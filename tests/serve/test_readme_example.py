"""The README's OpenAI example, run as written against `specdecode serve`'s default model (the
embedded SmolLM2-135M on its own quantized weights): its answer is on topic. At the API's default
temperature of 1 the 135M answered "Hi" with gibberish; the example asks greedily."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def readme_openai_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = [block for block in blocks if "OpenAI(" in block]
    assert len(found) == 1, found
    return found[0]


def test_the_readme_openai_example_answers_the_question():
    code = readme_openai_example()
    assert 'base_url="http://127.0.0.1:8000/v1"' in code            # `specdecode serve`'s default address
    llm = LLM(progress=False)                                        # what a plain `specdecode serve` loads
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=1024))
    with BackgroundServer(create_app(state)) as server:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
    answer = out.getvalue().lower()
    assert all(color in answer for color in ("red", "blue", "yellow")), answer
