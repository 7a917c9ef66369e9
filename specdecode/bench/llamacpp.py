"""llama.cpp through `llama-cpp-python` on the same GGUF file: plain decoding and its
prompt-lookup drafter (`LlamaPromptLookupDecoding`). An optional extra
(`.venv/bin/pip install -e '.[llamacpp]'` from the clone, which builds llama.cpp from source): when it is
missing, the target is not a GGUF file, or a 2-token test generation in a child process
fails (a crashing build would otherwise take the whole run down), it is skipped with a note.

Generation goes through `Llama.generate` (the token generator under `create_completion`)
on the very token ids the other systems get, stopping at the target's EOS ids or
max_tokens. Each call starts from an empty KV cache (`reset()` first): no prefix reuse
across prompts, as for the other systems. Steps are counted by wrapping the instance's
`eval` (one call per target pass), which gives the mean accepted length cheaply.
"""
from __future__ import annotations

import time
from pathlib import Path

from .systems import Cell, System, measurement

INSTALL_NOTE = "llama.cpp: skipped — pip install -e '.[llamacpp]' in the specdecode repository"


def available() -> tuple[bool, str | None]:
    """(importable, version)."""
    try:
        import llama_cpp
    except Exception:  # noqa: BLE001  (ImportError, or a broken native library)
        return False, None
    return True, getattr(llama_cpp, "__version__", "?")


def gguf_path(model: str | None) -> Path | None:
    """The GGUF file llama.cpp would load for this target (None: the target is not GGUF); a
    Hugging Face id resolves as the target did (models/hub.py)."""
    from ..models.loader import model_path
    path = model_path(model)
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, verbose=False)
tokens = llm.tokenize(b"The capital of France is a city that", add_bos=False)   # a batch of several tokens
for _, token in zip(range(2), llm.generate(tokens, top_k=0, top_p=1.0, min_p=0.0, temp=0.0)):
    pass
"""


def probe(model_path: Path, timeout: float = 300) -> str | None:
    """Run a 2-token generation in a child process: a llama-cpp-python build that crashes
    (a segfault would take the whole bench down) is skipped with a note instead.
    Returns None when it works, else why not."""
    import subprocess
    import sys
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE, str(model_path)], capture_output=True,
                              timeout=timeout, text=True)
    except subprocess.TimeoutExpired:
        return f"a 2-token test generation took over {timeout:.0f} s"
    if proc.returncode != 0:
        if proc.returncode < 0:
            import signal
            return f"a 2-token test generation crashed ({signal.Signals(-proc.returncode).name})"
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return f"a 2-token test generation failed (exit code {proc.returncode}: {last[:160]})"
    return None


class LlamaCppSystem(System):
    name = "llama.cpp"

    def __init__(self, model_path: Path, eos_ids: tuple[int, ...], n_ctx: int, threads: int, ks: list[int]) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        def load(draft=None):
            return Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, logits_all=draft is not None, verbose=False)

        self.eos = set(eos_ids)
        # the drafter is fixed at construction: one instance per k (the GGUF file is mmap-ed once by the OS)
        self.models = {0: load()}
        for k in ks:
            self.models[k] = load(LlamaPromptLookupDecoding(num_pred_tokens=k))

    def supports(self, method: str) -> bool:
        return method == "ngram"

    def run(self, cell: Cell, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int,
            schema: str | None = None) -> dict:
        llm = self.models[cell.k if cell.method == "ngram" else 0]
        if temperature > 0 and hasattr(llm, "set_seed"):
            llm.set_seed(seed)
        passes = [0]
        original_eval = type(llm).eval

        def counting_eval(tokens):
            passes[0] += 1
            return original_eval(llm, tokens)

        llm.eval = counting_eval
        llm.reset()
        ids: list[int] = []
        first = None
        started = time.perf_counter()
        gen = llm.generate(list(prompt_ids), top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, temp=temperature,
                           repeat_penalty=1.0, reset=True)
        try:
            for token in gen:
                if first is None:
                    first = time.perf_counter()
                ids.append(int(token))
                if int(token) in self.eos or len(ids) >= max_tokens:
                    break
        finally:
            gen.close()
            del llm.eval
        seconds = time.perf_counter() - started
        return measurement(ids, seconds, None if first is None else first - started, steps=passes[0] or None)
