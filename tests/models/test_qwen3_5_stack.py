"""Qwen3.5's whole stack in one native call (fast/hybrid.py) against the per-layer native path it
replaces on short passes: the same bits for hidden states, keys and values, and recurrent states,
on single rows and ragged batches, through rollbacks; and the same greedy text, plain and speculative."""
from __future__ import annotations

import pytest
import torch
from gguf_writer import write_qwen35_gguf

from specdecode.fast import linear as fast_linear
from specdecode.forward import ForwardBatch
from specdecode.models.loader import load_model
from specdecode.params import SamplingParams

pytestmark = pytest.mark.skipif(fast_linear._load()["lib"] is None, reason="needs the native kernels")


@pytest.fixture(scope="module")
def path(qwen35, tmp_path_factory):
    folder, model = qwen35
    return write_qwen35_gguf(tmp_path_factory.mktemp("qwen35_stack") / "tiny-q8_0.gguf", model,
                             folder / "tokenizer.json", "<|im_end|>", qtype="Q8_0")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path_factory.getbasetemp() / "qwen35_cache"))


@pytest.fixture(scope="module")
def model(path):
    model = load_model(str(path), progress=False).model
    assert model.stack is not None, "the tiny Q8_0 model should run its short passes in one call"
    return model


def passes(model, stack):
    """A fixed schedule of passes on three rows (prefills of different lengths, a ragged batch,
    rollbacks to every kind of length), with or without the one-call stack; what each returned."""
    calls = []
    if stack is not None:                                     # count the passes it takes
        stack = type("Counted", (), {"run": lambda self, *a: calls.append(1) or saved.run(*a)})()
    model.stack, saved = stack, model.stack
    g = torch.Generator().manual_seed(0)
    cache = model.new_paged_cache(4, 256, 64, 16)
    seen = []

    def run(tokens, starts, rows, widths=None):
        fb = ForwardBatch.chain(tokens, torch.tensor(starts), torch.tensor(rows), lengths=widths)
        seen.append(model.run(fb, cache).clone())

    try:
        for row, length in zip((0, 1, 2), (9, 3, 30)):
            cache.reserve(row, 120)
            run(torch.randint(0, 200, (1, length), generator=g), [0], [row])
            cache.truncate(row, length)
        lengths = [9, 3, 30]
        for kept in ([1, 5, 3], [5, 5, 5], [2, 1, 4]):        # verification passes of 5, then rollbacks
            run(torch.randint(0, 200, (3, 5), generator=g), lengths, [0, 1, 2], widths=[5, 5, 4])
            for row, k in enumerate(kept):
                lengths[row] += min(k, 4 if row == 2 else 5)
                cache.truncate(row, lengths[row])
        for _ in range(3):                                    # decode steps, one row then two
            run(torch.randint(0, 200, (1, 1), generator=g), [lengths[1]], [1])
            cache.truncate(1, lengths[1] + 1)
            lengths[1] += 1
        run(torch.randint(0, 200, (2, 1), generator=g), [lengths[2], lengths[0]], [2, 0])
    finally:
        model.stack = saved
    assert len(calls) == (len(seen) if stack is not None else 0)
    states = [torch.stack([cache.ssm[layer][row] for layer in range(len(cache.ssm))]) for row in range(3)]
    return seen, states, cache.conv_all[:, :3].clone(), [k.clone() for k in cache.keys], \
        [v.clone() for v in cache.values]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def test_stack_gives_the_bits_of_the_per_layer_path(model):
    one, layered = passes(model, model.stack), passes(model, None)
    for name, got, want in zip(("hidden states", "recurrent states", "conv states", "keys", "values"), one, layered):
        assert same(got, want), name


def test_greedy_text_is_the_same_with_and_without_it(path):
    from specdecode import LLM
    llm = LLM(model=str(path), method="ngram", adaptive=False, num_speculative_tokens=4, progress=False)
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "def add(a, b):\n    return"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    one = [r.token_ids for r in llm.generate(prompts, params)]
    plain = [r.token_ids for r in llm.generate(prompts, params, num_speculative_tokens=0)]
    llm.target.model.stack = None
    layered = [r.token_ids for r in llm.generate(prompts, params, num_speculative_tokens=0)]
    assert one == plain == layered


def test_long_prompts_prefill_in_passes_the_stack_takes(path):
    """The engine prefills such a model 64 tokens a pass; a 150-token prompt's text is the per-layer
    path's and the eager path's in one 150-token pass (the chunked rule in torch, not bitwise)."""
    from specdecode import LLM
    llm = LLM(model=str(path), method="none", progress=False)
    assert llm.core.scheduler.budget.chunk == 64
    prompt = list(range(5, 155))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = llm.generate([prompt], params)[0].token_ids
    llm.target.model.stack = None
    assert llm.generate([prompt], params)[0].token_ids == one
    llm.core.scheduler.budget.chunk = 256
    assert llm.generate([prompt], params)[0].token_ids[:4] == one[:4]


def test_fused_off_keeps_the_per_layer_path(path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_FUSED", "0")
    from specdecode.fast.hybrid import why_not
    model = load_model(str(path), progress=False).model
    assert model.stack is None and why_not(model) == "disabled by SPECDECODE_FUSED=0"
