"""A tree pass (specdecode/forward.py) scores every node as the same path scored as a chain: bitwise
in the fused native decoder (contiguous and paged caches), within float tolerance eagerly; and
after compaction the cache holds what a chain pass would have written."""
import pytest
import torch
from conftest import make_model

from specdecode.fast import linear as fast_linear
from specdecode.forward import ForwardBatch
from specdecode.models.loader import load_model
from specdecode.tree import ancestors, depths

PARENTS = [-1, -1, 0, 0, 2, 1, 5, -1, 4, 4]          # 10 nodes: branching at the root, depth up to 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("treefwd")
    return {"llama": make_model(root / "llama", "llama", seed=11, layers=2),
            "qwen2": make_model(root / "qwen2", "qwen2", seed=12, layers=2, hidden=80, heads=5, kv_heads=1, tie=False)}


def _load(path, dtype, fast):
    lm = load_model(str(path), dtype=dtype, progress=False, fast=fast)
    if fast and lm.model.fused is None:
        pytest.skip("fused decoder unavailable")
    return lm.model


def _logits(model, fb, cache):
    """Logits of the rows `fb` asks for, through the typed interface (run, then logits)."""
    return model.logits(model.run(fb, cache), fb.logit_index)


def _path(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


def _cases():
    out = []
    for dtype in ("fp32", "bf16"):
        for fast in (True, False):
            out.append((dtype, fast))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype,fast", _cases())
@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_tree_pass_equals_chain_per_path(models, arch, dtype, fast, cache_kind):
    from specdecode.cache.paged import PagedKVCache
    if fast and not fast_linear.available():
        pytest.skip(fast_linear.reason())
    if fast and dtype == "bf16" and not fast_linear._load()["bf16"]:
        pytest.skip("no avx512_bf16")
    model = _load(models[arch], dtype, fast)
    c = model.config
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, model.vocab_size, (37,), generator=gen)     # last token pending
    nodes = torch.randint(0, model.vocab_size, (len(PARENTS),), generator=gen)
    parents = torch.tensor([PARENTS])
    n = len(PARENTS)

    def new_cache(rows):
        if cache_kind == "paged":
            cache = PagedKVCache(c.num_layers, rows, c.num_kv_heads, c.head_dim, 96, 40, 16, model.dtype)
            for r in range(rows):
                cache.reserve(r, 90)
            return cache
        return model.new_cache(rows, 96)

    none = torch.zeros(1, 0, dtype=torch.long)
    row0 = torch.tensor([0])
    # tree: row 1 of a 2-row cache, two pending tokens (the last two of the prompt)
    cache = new_cache(2)
    model.run(ForwardBatch.chain(prompt[None, :-2], torch.tensor([0]), torch.tensor([1]), none), cache)
    tokens = torch.cat([prompt[-2:], nodes])[None]
    index = torch.arange(1, n + 2)[None]                                 # root (last pending) + every node
    fb = ForwardBatch.tree(tokens, torch.tensor([35]), torch.tensor([1]), [2], parents, index)
    tree_logits = _logits(model, fb, cache)[0]                            # [n+1, vocab]
    eps = 2e-2 if dtype == "bf16" else 1e-4
    tol = dict(rtol=0, atol=0) if fast else dict(rtol=eps, atol=eps)
    for node in range(n):
        path = _path(node)
        ref_cache = new_cache(1)
        model.run(ForwardBatch.chain(prompt[None, :-2], torch.tensor([0]), row0, none), ref_cache)
        chain = torch.cat([prompt[-2:], nodes[path]])[None]
        span = torch.tensor([[1, chain.shape[1] - 1]])
        ref = _logits(model, ForwardBatch.chain(chain, torch.tensor([35]), row0, span), ref_cache)[0]
        torch.testing.assert_close(tree_logits[0], ref[0], **tol)
        torch.testing.assert_close(tree_logits[node + 1], ref[1], **tol, msg=f"node {node} path {path}")
    # compaction: keep the path to node 8 (depth 4), then one more token sees the chain's cache
    path = _path(8)
    cache.move(1, [37 + i for i in path], [37 + d for d in range(len(path))])
    cache.truncate(1, 37 + len(path))
    nxt = torch.tensor([[7]])
    got = _logits(model, ForwardBatch.chain(nxt, torch.tensor([37 + len(path)]), torch.tensor([1])), cache)[0]
    ref_cache = new_cache(1)
    model.run(ForwardBatch.chain(torch.cat([prompt, nodes[path], nxt[0]])[None, :-1], torch.tensor([0]), row0, none),
              ref_cache)
    ref = _logits(model, ForwardBatch.chain(nxt, torch.tensor([37 + len(path)]), row0), ref_cache)[0]
    torch.testing.assert_close(got, ref, **tol)


def test_forward_batch_visibility_and_positions():
    tokens = torch.zeros(1, 2 + len(PARENTS), dtype=torch.long)
    fb = ForwardBatch.tree(tokens, torch.tensor([10]), None, [2], torch.tensor([PARENTS]))
    depth = depths(torch.tensor([PARENTS]))[0]
    assert fb.rope_positions()[0].tolist() == [10, 11] + (11 + depth).tolist()
    visible = fb.visible(10 + tokens.shape[1])[0]
    path = ancestors(torch.tensor([PARENTS]))[0]                          # [n+1, n]
    for i in range(len(PARENTS)):
        row = visible[2 + i]
        assert row[:12].all()                                              # committed + pending
        assert row[12:].tolist() == path[i + 1].tolist()
    chain = ForwardBatch.chain(tokens, 10)
    assert torch.equal(chain.visible(22)[0], torch.arange(22)[None, :] <= torch.arange(10, 22)[:, None])
