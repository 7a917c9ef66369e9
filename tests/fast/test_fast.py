"""Native fast paths: batch (row) invariance of PackedLinear and of the fused decoder, and the
fused decoder against the eager reference."""
from pathlib import Path

import pytest
import torch
from conftest import make_model

from specdecode.fast import linear as fast_linear
from specdecode.fast.decoder import MAX_T, fused_decoder, why_not
from specdecode.forward import ForwardBatch
from specdecode.models.loader import load_model

needs_native = pytest.mark.skipif(not fast_linear.available(), reason=fast_linear.reason())
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _bf16_ok():
    return fast_linear._load()["bf16"]


def _skip_if_unsupported(dtype):
    if dtype == "bf16" and not _bf16_ok():
        pytest.skip("no avx512_bf16")


# ------------------------------------------------------------------ PackedLinear row invariance

@needs_native
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("path", ["default", "avx512bf16"])
@pytest.mark.parametrize("shape", [(960, 576), (40, 70)])
def test_packed_linear_rows_are_batch_invariant(dtype, path, shape):
    _skip_if_unsupported(dtype)
    if path != "default" and dtype != "bf16":
        pytest.skip("fp32 has one path")
    N, K = shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g).to(DTYPES[dtype])
    b = torch.randn(N, generator=g).to(DTYPES[dtype])
    lin = fast_linear.PackedLinear(w, b)
    assert lin.fast
    if path == "avx512bf16":
        lin._amx = False            # the fallback kernel for CPUs without AMX
    x = torch.randn(16, K, generator=g).to(DTYPES[dtype])
    alone = torch.cat([lin(x[i:i + 1]) for i in range(16)])
    for M in range(1, 17):
        block = lin(x[:M])
        assert torch.equal(block, alone[:M]), f"M={M}: rows differ from single-row results"


# ------------------------------------------------------------------ fused decoder

@pytest.fixture(scope="session")
def odd_model(tmp_path_factory) -> Path:
    """Qwen2 with hidden 80 (not a multiple of 32: padded K), 5 q heads / 1 kv head (GQA 5:1)."""
    return make_model(tmp_path_factory.mktemp("odd") / "qwen2_odd", "qwen2", seed=5, layers=2,
                      hidden=80, heads=5, kv_heads=1, tie=False)


@pytest.fixture(scope="session")
def wide_head_model(tmp_path_factory) -> Path:
    """Llama with head_dim 32 and GQA 4:1."""
    return make_model(tmp_path_factory.mktemp("wide") / "llama_wide", "llama", seed=6, layers=2,
                      hidden=128, heads=4, kv_heads=1)


def _models(tiny_models, odd_model, wide_head_model):
    return {"llama": tiny_models["llama"], "qwen2": tiny_models["qwen2"], "qwen2_odd": odd_model,
            "llama_hd32": wide_head_model}


def _load(path, dtype):
    lm = load_model(str(path), dtype=dtype, progress=False)
    if lm.model.fused is None:
        pytest.skip(f"fused decoder unavailable: {why_not(lm.model)}")
    return lm.model


ARCHES = ["llama", "qwen2", "qwen2_odd", "llama_hd32"]


@needs_native
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ARCHES)
def test_fused_verify_block_equals_single_token_decodes(tiny_models, odd_model, wide_head_model, arch, dtype):
    """Row t of a T=6 block is bitwise equal to decoding its tokens one at a time (same prefix)."""
    _skip_if_unsupported(dtype)
    model = _load(_models(tiny_models, odd_model, wide_head_model)[arch], dtype)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.vocab_size, (1, 37), generator=gen)
    block = torch.randint(0, model.vocab_size, (1, 6), generator=gen)
    p = prompt.shape[1]
    a, b = model.new_cache(1, 96), model.new_cache(1, 96)
    model.forward(prompt, a, 0, logit_index=torch.zeros(1, 0, dtype=torch.long))
    model.forward(prompt, b, 0, logit_index=torch.zeros(1, 0, dtype=torch.long))
    verify = model.forward(block, a, p)                                   # [1, 6, V]
    for t in range(6):
        single = model.forward(block[:, t:t + 1], b, p + t)
        assert torch.equal(single[0, 0], verify[0, t]), f"row {t} differs"
    for layer in range(len(a.keys)):
        assert torch.equal(a.keys[layer][:, :, :p + 6], b.keys[layer][:, :, :p + 6])
        assert torch.equal(a.values[layer][:, :, :p + 6], b.values[layer][:, :, :p + 6])
    # a subset of rows via logit_index, and a partial block
    sub = model.forward(block[:, :4], a, p, logit_index=torch.tensor([[3, 1]]))
    assert torch.equal(sub[0], verify[0, [3, 1]])


def _with_hidden(model, tokens, cache, start, rows=None):
    """(logits of every row, hidden states) of one chain pass through the typed interface."""
    hidden = model.run(ForwardBatch.chain(tokens, start, rows), cache)
    return model.logits(hidden), hidden


@needs_native
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fused_returns_hidden_like_eager(tiny_models, dtype):
    """The features EAGLE heads read (last hidden states before the final norm), fused vs eager,
    over a chunked prefill (> MAX_T) and a verify-sized block."""
    _skip_if_unsupported(dtype)
    model = _load(tiny_models["llama"], dtype)
    eager = load_model(str(tiny_models["llama"]), dtype=dtype, progress=False, fast=False).model
    tokens = torch.randint(0, model.vocab_size, (1, 90), generator=torch.Generator().manual_seed(4))
    cf, ce = model.new_cache(1, 128), eager.new_cache(1, 128)
    for start, end in ((0, 80), (80, 90)):
        logits, hidden = _with_hidden(model, tokens[:, start:end], cf, start)
        ref_logits, ref_hidden = _with_hidden(eager, tokens[:, start:end], ce, start)
        assert hidden.shape == (1, end - start, model.config.hidden_size) and hidden.dtype == model.dtype
        tol = 1e-4 if dtype == "fp32" else 0.05
        scale = ref_hidden.float().abs().max().item()
        assert (hidden.float() - ref_hidden.float()).abs().max().item() < tol * max(1.0, scale)
    plain = model.forward(tokens[:, :80], model.new_cache(1, 128), 0)
    with_hidden, _ = _with_hidden(model, tokens[:, :80], model.new_cache(1, 128), 0)
    assert torch.equal(plain, with_hidden)          # asking for features changes nothing else


@needs_native
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ARCHES)
def test_fused_matches_eager(tiny_models, odd_model, wide_head_model, arch, dtype):
    _skip_if_unsupported(dtype)
    path = _models(tiny_models, odd_model, wide_head_model)[arch]
    model = _load(path, dtype)
    eager = load_model(str(path), dtype=dtype, progress=False, fast=False).model
    assert eager.fused is None
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.vocab_size, (1, 150), generator=gen)
    cf, ce = model.new_cache(1, 200), eager.new_cache(1, 200)
    # prefill longer than one native block (chunks of MAX_T) with an unsorted logit subset
    assert tokens.shape[1] - 10 > MAX_T
    index = torch.tensor([[139, 0, 70, 63, 64]])
    got = model.fused.head(model.fused.forward(tokens[:, :140], cf, 0), index)  # chunked fused prefill
    ref = eager.forward(tokens[:, :140], ce, 0, logit_index=index)
    blocks = [got.clone()], [ref.clone()]
    for pos in (140, 141):                                                # decode
        blocks[0].append(model.forward(tokens[:, pos:pos + 1], cf, pos))
        blocks[1].append(eager.forward(tokens[:, pos:pos + 1], ce, pos))
    blocks[0].append(model.forward(tokens[:, 142:150], cf, 142))          # verify-sized
    blocks[1].append(eager.forward(tokens[:, 142:150], ce, 142))
    got, ref = torch.cat(blocks[0], 1), torch.cat(blocks[1], 1)
    assert got.shape == ref.shape and got.dtype == torch.float32
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    if dtype == "fp32":
        assert err < 1e-3 * max(1.0, scale), err
    else:
        assert err < 0.05 * scale, (err, scale)
        # and the argmax agrees except at near-ties
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= 0.9


@needs_native
def test_fused_edge_cases(tiny_models):
    model = _load(tiny_models["llama"], "fp32")
    cache = model.new_cache(1, 16)
    tokens = torch.tensor([[5, 6, 7]])
    empty = model.forward(tokens, cache, 0, logit_index=torch.zeros(1, 0, dtype=torch.long))
    assert empty.shape == (1, 0, model.vocab_size)
    with pytest.raises(ValueError):
        model.forward(tokens, cache, 14)                                  # past the cache end
    with pytest.raises(ValueError):
        model.forward(tokens, cache, 0, logit_index=torch.tensor([[3]]))  # row outside the block
    # batch > 1 and ragged calls still take the eager path
    cache2 = model.new_cache(2, 16)
    out = model.forward(torch.tensor([[5, 6], [7, 8]]), cache2, 0)
    assert out.shape == (2, 2, model.vocab_size)
    assert fused_decoder(load_model(str(tiny_models["llama"]), dtype="fp32", progress=False, fast=False).model) is None


@needs_native
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2_odd"])
def test_fused_batched_and_paged_rows_equal_batch_one(tiny_models, odd_model, wide_head_model, arch, dtype):
    """Ragged batches (per-row starts, cache rows) through the fused decoder, on a contiguous cache
    and on paged caches of several block sizes (16: in-place key chunks; 4 and 5: chunks across
    blocks), give each row the logits and hidden states of the same tokens run alone at batch 1."""
    from specdecode.cache.contiguous import KVCache
    from specdecode.cache.paged import PagedKVCache
    _skip_if_unsupported(dtype)
    model = _load(_models(tiny_models, odd_model, wide_head_model)[arch], dtype)
    c = model.config
    gen = torch.Generator().manual_seed(3)
    lengths = (37, 50, 12)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen) for n in lengths]
    none = torch.zeros(1, 0, dtype=torch.long)
    refs = []
    for p in prompts:                       # batch 1: prefill, then a 6-token verify-sized pass
        cache = model.new_cache(1, 96)
        model.forward(p[None, :-6], cache, 0, logit_index=none)
        refs.append(_with_hidden(model, p[None, -6:], cache, len(p) - 6))
    blocks = torch.stack([p[-6:] for p in prompts])
    starts = torch.tensor([n - 6 for n in lengths])
    caches = [KVCache(c.num_layers, 3, c.num_kv_heads, c.head_dim, 96, model.dtype)]
    caches += [PagedKVCache(c.num_layers, 4, c.num_kv_heads, c.head_dim, 96, 80, bs, model.dtype) for bs in (16, 4, 5)]
    for cache in caches:
        paged = isinstance(cache, PagedKVCache)
        rows = torch.tensor([3, 1, 2]) if paged else torch.tensor([2, 0, 1])
        for r, p in zip(rows.tolist(), prompts):
            if paged:
                cache.reserve(r, 60)
            model.forward(p[None, :-6], cache, torch.tensor([0]), rows=torch.tensor([r]), logit_index=none)
        logits, hidden = _with_hidden(model, blocks, cache, starts, rows)
        for i, (ref_logits, ref_hidden) in enumerate(refs):
            assert torch.equal(logits[i], ref_logits[0]), (type(cache).__name__, i)
            assert torch.equal(hidden[i], ref_hidden[0])
        sub = model.forward(blocks[:, :4], cache, starts, rows=rows, logit_index=torch.tensor([[3, 0]] * 3))
        assert torch.equal(sub, logits[:, [3, 0]])


@pytest.fixture(scope="session")
def long_models(tmp_path_factory) -> dict:
    """Llama with head_dim 64 and GQA 3:1 (SmolLM2-135M's attention shape), and with head_dim 48
    (one 32-element unit and a half one in the attention kernels)."""
    root = tmp_path_factory.mktemp("long")
    return {"llama_hd64": make_model(root / "llama_hd64", "llama", seed=7, hidden=192, heads=3, kv_heads=1),
            "llama_hd48": make_model(root / "llama_hd48", "llama", seed=8, hidden=96, heads=2, kv_heads=1)}


@needs_native
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["llama_hd64", "llama_hd48"])
def test_long_rows_on_scattered_blocks_equal_rows_alone(long_models, arch, dtype):
    """Rows of different lengths (90..250 keys: up to 16 cache blocks, past the attention's prefetch
    distance) in one pass over a paged cache whose blocks interleave in the pool (prefilled turn by
    turn), a decode step and then a 6-token block per row, give each row the logits and hidden
    states of the same tokens run alone at batch 1 on a contiguous cache."""
    from specdecode.cache.paged import PagedKVCache
    _skip_if_unsupported(dtype)
    model = _load(long_models[arch], dtype)
    c = model.config
    gen = torch.Generator().manual_seed(4)
    lengths = (250, 133, 201, 90)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen) for n in lengths]
    none = torch.zeros(1, 0, dtype=torch.long)
    cache = PagedKVCache(c.num_layers, 5, c.num_kv_heads, c.head_dim, 256, 80, 16, model.dtype)
    rows = torch.tensor([4, 0, 2, 1])
    for r in rows.tolist():
        cache.reserve(r, 256)
    for s0 in range(0, max(lengths) - 7, 37):          # 37 tokens of each row in turn
        for r, p in zip(rows.tolist(), prompts):
            if s0 < len(p) - 7:
                model.forward(p[None, s0:min(s0 + 37, len(p) - 7)], cache, torch.tensor([s0]), rows=torch.tensor([r]),
                              logit_index=none)
    starts = torch.tensor([n - 7 for n in lengths])
    step = _with_hidden(model, torch.stack([p[-7:-6] for p in prompts]), cache, starts, rows)
    block = _with_hidden(model, torch.stack([p[-6:] for p in prompts]), cache, starts + 1, rows)
    for i, p in enumerate(prompts):
        alone = model.new_cache(1, 256)
        model.forward(p[None, :-7], alone, 0, logit_index=none)
        for (logits, hidden), ref in ((step, _with_hidden(model, p[None, -7:-6], alone, len(p) - 7)),
                                      (block, _with_hidden(model, p[None, -6:], alone, len(p) - 6))):
            assert torch.equal(logits[i], ref[0][0]), (i, logits.shape)
            assert torch.equal(hidden[i], ref[1][0]), (i, logits.shape)


@needs_native
def test_large_passes_stay_in_the_fused_decoder(tiny_models):
    """However many token rows a pass has (a batched verify of 40 rows x 8, a long prompt), it runs
    natively, so each row equals the same tokens run alone and a prompt prefilled in one pass
    equals the same prompt prefilled in chunks (eager torch would be neither)."""
    model = _load(tiny_models["llama"], "bf16")
    gen = torch.Generator().manual_seed(11)
    rows, width, prefix = 40, 8, 5
    tokens = torch.randint(0, model.vocab_size, (rows, prefix + width), generator=gen)
    none = torch.zeros(rows, 0, dtype=torch.long)
    cache = model.new_cache(rows, 32)
    model.forward(tokens[:, :prefix], cache, 0, logit_index=none)
    batched = model.forward(tokens[:, prefix:], cache, prefix)                        # 320 token rows
    for r in (0, 17, 39):
        alone = model.new_cache(1, 32)
        model.forward(tokens[r:r + 1, :prefix], alone, 0, logit_index=none[:1])
        assert torch.equal(batched[r], model.forward(tokens[r:r + 1, prefix:], alone, prefix)[0])
    prompt = torch.randint(0, model.vocab_size, (1, 300), generator=gen)
    whole = model.forward(prompt, model.new_cache(1, 320), 0, logit_index=torch.tensor([[299]]))
    chunked = model.new_cache(1, 320)
    for start in range(0, 296, 37):
        model.forward(prompt[:, start:min(start + 37, 296)], chunked, start, logit_index=none[:1])
    assert torch.equal(whole, model.forward(prompt[:, 296:], chunked, 296, logit_index=torch.tensor([[3]])))


@needs_native
def test_fused_logit_rows_may_repeat_past_the_row_limit(tiny_models):
    """The engine repeats a row's last position for drafts it lacks, so a pass can ask for more
    logit rows than it has token rows (here 68 > 64): each distinct row is computed once and the
    repeats are copies (the native scratch holds 64 rows)."""
    model = _load(tiny_models["llama"], "fp32")
    c = model.config
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, model.vocab_size, (4, 17), generator=gen)
    index = torch.cat([torch.arange(17)[None], torch.zeros(3, 17, dtype=torch.long)])     # [4, 17]
    cache = model.new_cache(4, 40)
    logits = model.forward(tokens, cache, torch.tensor([0, 0, 0, 0]), rows=torch.arange(4), logit_index=index)
    full = model.forward(tokens, model.new_cache(4, 40), torch.tensor([0, 0, 0, 0]), rows=torch.arange(4))
    assert torch.equal(logits, full.gather(1, index[:, :, None].expand(-1, -1, full.shape[-1])))
    one = model.forward(tokens[:1, :1], model.new_cache(1, 40), 0, logit_index=torch.zeros(1, 80, dtype=torch.long))
    assert one.shape == (1, 80, c.vocab_size) and torch.equal(one[0, 5], full[0, 0])


def test_weight_buffers_are_huge_page_aligned(monkeypatch):
    """Packed weights get their own 2 MB-aligned range (madvise'd for transparent huge pages);
    small ones and SPECDECODE_HUGEPAGES=0 get a plain torch.empty."""
    from specdecode.fast.linear import weight_empty
    big = weight_empty(5 << 20, torch.bfloat16)
    assert big.shape == (5 << 20,) and big.dtype == torch.bfloat16 and big.is_contiguous()
    assert big.data_ptr() % (2 << 20) == 0
    big.fill_(1.5)
    assert float(big.float().sum()) == 1.5 * (5 << 20)
    small = weight_empty(1000, torch.uint8)
    assert small.shape == (1000,) and small.dtype == torch.uint8
    monkeypatch.setenv("SPECDECODE_HUGEPAGES", "0")
    assert weight_empty(5 << 20, torch.uint8).untyped_storage().nbytes() == 5 << 20


def test_kernels_compile_for_avx2_cpus(tmp_path):
    """The AVX2 build (AVX512 intrinsics through SIMDe, no AMX) compiles wherever the tests run, so
    a change that only builds on AVX512 / AMX hosts is caught here too (e.g. an AMX-only symbol)."""
    import shutil
    import subprocess

    from specdecode.fast import linear
    if not linear._simde_available() or not shutil.which("gcc"):
        pytest.skip("needs gcc and the SIMDe headers (libsimde-dev)")
    flags = [f for f in linear._CFLAGS if f not in ("-march=native", "-O3")] + ["-march=haswell", "-O1"]
    r = subprocess.run(["gcc", *flags, str(linear._SRC), "-o", str(tmp_path / "k.so")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_quantized_kernels_prefetch_on_intel_and_zen5_only(monkeypatch):
    """The software prefetch distance (a build flag; results are the same bits either way): Intel and
    AMD family 26+ (Zen 5) default to 2048 bytes, Zen 4 and older AMD to 0, SPECDECODE_QPREFETCH wins."""
    from specdecode.fast import linear
    monkeypatch.delenv("SPECDECODE_QPREFETCH", raising=False)
    for vendor, family, expected in (("GenuineIntel", "6", 2048), ("AuthenticAMD", "26", 2048),
                                     ("AuthenticAMD", "25", 0), ("AuthenticAMD", "23", 0), ("", "", 0)):
        info = {"vendor_id": vendor, "cpu family": family}
        monkeypatch.setattr(linear, "_cpuinfo", lambda field, info=info: info.get(field, ""))
        assert linear._qprefetch_bytes() == expected, (vendor, family)
    monkeypatch.setenv("SPECDECODE_QPREFETCH", "512")
    assert linear._qprefetch_bytes() == 512
    monkeypatch.setenv("SPECDECODE_QPREFETCH", "0")
    assert linear._qprefetch_bytes() == 0


@needs_native
def test_native_top_k_equals_torch_topk():
    """The native top-k (token recycling's every-step read) returns torch.topk's indices, best
    first, on rows of any width (tails of < 16 values); -1 past a row's values above -inf; other
    dtypes go to torch.topk."""
    from specdecode.fast import top_k_indices
    gen = torch.Generator().manual_seed(0)
    for shape, k in (((1, 1, 49152), 8), ((2, 6, 1000), 5), ((3, 37), 1), ((1, 7), 7), ((4, 64), 64)):
        x = torch.randn(*shape, generator=gen)
        assert torch.equal(top_k_indices(x, k), x.topk(k, dim=-1).indices)
    masked = torch.full((1, 40), float("-inf"))
    masked[0, 33], masked[0, 5] = 1.0, 2.0
    assert top_k_indices(masked, 4).tolist() == [[5, 33, -1, -1]]
    half = torch.randn(2, 300, generator=gen).to(torch.bfloat16)
    assert torch.equal(top_k_indices(half, 3), half.topk(3, dim=-1).indices)


def test_argmax_last_is_torchs_argmax():
    """A greedy step's target tokens (the native scan where it runs): torch's argmax on random
    rows, the lower index on a tie, and a row of nothing but -inf or NaN answered as torch answers."""
    from specdecode.fast import argmax_last
    gen = torch.Generator().manual_seed(1)
    for shape in ((1, 1, 49152), (2, 6, 1000), (3, 37), (1, 7)):
        x = torch.randn(*shape, generator=gen)
        assert torch.equal(argmax_last(x), x.max(dim=-1).indices)
    tie = torch.zeros(2, 50)
    tie[0, [7, 30]] = 1.0
    assert argmax_last(tie).tolist() == [7, 0]
    dead = torch.randn(2, 40, generator=gen)
    dead[1] = float("-inf")
    assert torch.equal(argmax_last(dead), dead.max(dim=-1).indices)
    dead[1] = float("nan")
    assert torch.equal(argmax_last(dead), dead.max(dim=-1).indices)
    half = torch.randn(2, 300, generator=gen).to(torch.bfloat16)
    assert torch.equal(argmax_last(half), half.max(dim=-1).indices)
