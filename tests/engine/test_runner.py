"""The model runner's passes (engine/runner.py) and the ragged passes they run: a pass whose rows
are of different lengths computes only their real tokens, bit for bit what the padded pass gives."""
from __future__ import annotations

import pytest
import torch

from specdecode.cache.paged import PagedKVCache
from specdecode.forward import ForwardBatch
from specdecode.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(str(tiny_models["llama"]), dtype="fp32", progress=False)


def paged(model, rows=4):
    c = model.config
    cache = PagedKVCache(c.num_layers, rows, c.num_kv_heads, c.head_dim, 160, 96, 8, model.dtype, model.device)
    for row in range(rows):
        cache.reserve(row, 40)
    return cache


@pytest.mark.parametrize("tree", [False, True])
def test_a_ragged_pass_computes_only_real_tokens_and_equals_the_padded_one(target, tree):
    model = target.model
    if model.fused is None:
        pytest.skip("no native kernels on this machine")
    torch.manual_seed(0)
    prompts = torch.randint(3, 200, (3, 20))
    lengths = [7, 1, 5]                                      # real tokens per row; the rest is padding
    tokens = torch.randint(3, 200, (3, 7))
    results, counted = [], []
    for ragged in (False, True):
        cache = paged(model)
        rows = torch.tensor([0, 2, 3])
        model.run(ForwardBatch.chain(prompts, torch.zeros(3, dtype=torch.long), rows), cache)
        start = torch.full((3,), 20, dtype=torch.long)
        if tree:                                             # one pending token, then 6 nodes: a root and children
            parents = torch.tensor([[-1, 0, 0, 1, 2, 3]] * 3)
            fb = ForwardBatch.tree(tokens, start, rows, [1, 1, 1], parents,
                                   lengths=lengths if ragged else None)
        else:
            fb = ForwardBatch.chain(tokens, start, rows, lengths=lengths if ragged else None)
        calls = []
        inner = model.fused._rows_fn

        def spy(*args, calls=calls, inner=inner):
            calls.append(args[6])                            # the rows computed in that call
            return inner(*args)
        model.fused._rows_fn = spy
        try:
            results.append(model.run(fb, cache))
        finally:
            model.fused._rows_fn = inner
        counted.append(sum(calls))
    padded, packed = results
    assert counted == [21, sum(lengths)]
    for b, n in enumerate(lengths):
        assert torch.equal(padded[b, :n], packed[b, :n])
        assert not packed[b, n:].any()                       # padding: zeros, never computed
