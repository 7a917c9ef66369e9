"""Native quantized weights (fast/quant.c): every GGUF format's kernel against dequantize-then-
matmul, bitwise batch invariance, and a whole model on quantized projections (fused native path
against the eager dequantized reference; speculative greedy output identical to plain)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model

from specdecode.fast.quant import I8, NATIVE_TYPES, QuantLinear, QuantWeight, native_reason, quantize_int8

needs_quant = pytest.mark.skipif(native_reason() is not None, reason=str(native_reason()))

BLOCK = {2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 12: 256, 13: 256, 14: 256}
SIZE = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}
F16_FIELDS = {12: [0, 2], 13: [0, 2], 14: [208]}   # d / dmin of the K formats


def random_weight(qtype: int, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Legacy formats: a random matrix quantized with the gguf package; K formats (which the
    gguf package cannot quantize): random blocks, every bit pattern, with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype == I8:
        return quantize_int8(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
    if qtype in F16_FIELDS:
        raw = rng.integers(0, 256, size=(n, k // BLOCK[qtype], SIZE[qtype]), dtype=np.uint8)
        for off in F16_FIELDS[qtype]:
            d = (rng.standard_normal((n, k // BLOCK[qtype])) * 0.01).astype(np.float16)
            raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n, -1, 2)
        return QuantWeight.from_blocks(qtype, raw.reshape(n, -1), (n, k))
    from gguf.quants import quantize
    dense = rng.standard_normal((n, k)).astype(np.float32)
    return QuantWeight.from_blocks(qtype, quantize(dense, qtype), (n, k))


def error_bound(x: torch.Tensor, w: torch.Tensor, y_ref: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """|y - y_ref| allowed: activations are rounded to int8 per row and chunk of k (error <= d/2
    each, d = max|x| / 127 in the chunk: 32 k in the kernels), fp32 sums, and the bf16 output rounding."""
    M, K = x.shape
    d = torch.zeros(M, K, dtype=torch.float64)
    for c0 in range(0, K, chunk):
        d[:, c0:c0 + chunk] = x[:, c0:c0 + chunk].double().abs().amax(dim=1, keepdim=True) / 127
    quant = (d / 2) @ w.double().abs().t()
    sums = K * 2 ** -22 * (x.double().abs() @ w.double().abs().t())
    return quant * 1.01 + sums + y_ref.abs() * 2 ** -8 + 1e-6


@needs_quant
@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES))
@pytest.mark.parametrize("rows", [7, 20])           # 20: AMX tiles where the CPU has them
@pytest.mark.parametrize("layout", ["16-column", "file"])
def test_kernel_matches_dequantized_matmul(qtype, rows, layout):
    """Within the bound of int8 activations per 32 k (as llama.cpp's Q8_0 / Q8_1), also with an
    outlier activation in every row."""
    k = 512 if BLOCK.get(qtype) == 256 else 320
    n = 48 if layout == "16-column" else 40          # 40 rows: not 16-aligned, the file layout's kernel
    w = random_weight(qtype, n, k)
    dense = w.dequantize()                                   # [n, k] exact fp32
    bias = torch.randn(n)
    lin = QuantLinear(w, bias.to(torch.bfloat16))
    x = torch.randn(rows, k)
    x[torch.arange(rows), torch.randint(0, k, (rows,))] = 60.0              # outliers, as LLM activations have
    x = x.to(torch.bfloat16)
    y = lin(x)
    ref = x.double() @ dense.double().t() + bias.to(torch.bfloat16).double()
    err = (y.double() - ref).abs()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert bool((err <= error_bound(x, dense, ref, 32)).all()), f"{NATIVE_TYPES[qtype]}: max err {err.max():.3g}"


@needs_quant
@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES))
def test_kernel_rows_are_batch_invariant(qtype):
    """Row r of an n-row pass equals the 1-row pass, bitwise, for every n up to 20."""
    k = 768 if BLOCK.get(qtype) == 256 else 192
    lin = QuantLinear(random_weight(qtype, 48, k, seed=1))
    x = torch.randn(20, k).to(torch.bfloat16)
    single = torch.cat([lin(x[i:i + 1]) for i in range(20)])
    for n in (2, 3, 8, 9, 17, 20):
        assert torch.equal(lin(x[:n]), single[:n]), f"{NATIVE_TYPES[qtype]} n={n}"


@needs_quant
def test_q8_0_extreme_weights_are_exact():
    """Q8_0 bytes at both ends (-128 and 127) against activations at both ends: the int8 x int8
    products (the AVX2 kernel multiplies |q| by x carrying q's sign) stay exact, batch invariant."""
    rng = np.random.default_rng(5)
    n, k = 32, 256
    raw = np.zeros((n, k // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.full((n, k // 32), 0.01, dtype=np.float16).view(np.uint8).reshape(n, -1, 2)
    q = rng.choice(np.array([-128, -127, 127, 0, 1], dtype=np.int8), size=(n, k // 32, 32))
    q[:, 0, :] = -128
    raw[:, :, 2:] = q.view(np.uint8)
    w = QuantWeight.from_blocks(8, raw.reshape(n, -1), (n, k))
    dense = w.dequantize()
    x = torch.from_numpy(rng.choice([-3.0, 3.0, 0.5], size=(5, k))).float().to(torch.bfloat16)
    y = QuantLinear(w)(x)
    ref = x.double() @ dense.double().t()
    err = (y.double() - ref).abs()
    assert bool((err <= error_bound(x, dense, ref)).all()), f"max err {err.max():.3g}"
    assert torch.equal(QuantLinear(w)(x[2:3]), y[2:3])


@needs_quant
def test_segments_of_different_formats():
    """A fused q|k|v whose parts use different formats equals the parts computed apart."""
    parts = [random_weight(12, 32, 512, seed=2), random_weight(14, 16, 512, seed=3), random_weight(8, 16, 512, seed=4)]
    fused = QuantWeight.cat(parts)
    assert fused.shape == (64, 512) and fused.type_names() == "Q4_K+Q6_K+Q8_0"
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert torch.equal(QuantLinear(fused)(x), torch.cat([QuantLinear(p)(x) for p in parts], dim=1))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_unsupported_shapes_are_refused_clearly():
    with pytest.raises(ValueError, match="in_features % 256"):
        QuantWeight.from_blocks(12, np.zeros((2, 144), np.uint8), (2, 128))
    with pytest.raises(ValueError, match="no native kernel"):
        QuantWeight.from_blocks(1, np.zeros((2, 64), np.uint8), (2, 32))


def _quantized_tiny(folder, qtypes=(8, 2), head=False):
    """A tiny Llama whose projections (and LM head if `head`) are quantized (alternating formats)
    with the gguf package."""
    import json

    from gguf.quants import quantize

    from specdecode.fast import make_linear
    from specdecode.models.config import ModelConfig
    from specdecode.models.loader import read_weights
    from specdecode.models.transformer import Transformer
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    weights = read_weights(folder, torch.float32, torch.device("cpu"), progress=False)
    quantized = {}
    for i, (name, w) in enumerate(sorted(weights.items())):
        if name.endswith("proj.weight") or (head and name == "lm_head.weight"):
            qtype = qtypes[i % len(qtypes)]
            quantized[name] = QuantWeight.from_blocks(qtype, quantize(w.numpy(), qtype), tuple(w.shape))
        else:
            quantized[name] = w.to(torch.bfloat16)
    return config, quantized, Transformer(config, quantized, make_linear)


@needs_quant
def test_quantized_model_fused_matches_eager_and_is_batch_invariant(tmp_path, one_thread):
    from specdecode.models.transformer import Transformer, eager_linear
    folder = make_model(tmp_path / "m", "llama", seed=5, layers=2, hidden=128, heads=4, kv_heads=2)
    config, weights, model = _quantized_tiny(folder)
    assert model.fused is not None and model.quantized
    eager = Transformer(config, weights, eager_linear)
    tokens = torch.randint(0, config.vocab_size, (1, 12))
    c1, c2 = model.new_cache(1, 64), eager.new_cache(1, 64)
    fused_logits, eager_logits = model.forward(tokens, c1, 0), eager.forward(tokens, c2, 0)
    # int8 activations against bf16 dequantized weights: close, not equal
    assert torch.allclose(fused_logits, eager_logits, atol=0.15 * eager_logits.abs().max().item())
    assert (fused_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean() > 0.8
    # a 5-row verify block equals 5 single steps, bitwise (logits and cache)
    steps = []
    for t in range(5):
        steps.append(model.forward(tokens[:, t:t + 1] * 0 + t + 3, c1, 12 + t))
    block_cache = model.new_cache(1, 64)
    model.forward(tokens, block_cache, 0)
    block = model.forward(torch.arange(3, 8)[None], block_cache, 12)
    assert torch.equal(block, torch.cat(steps, dim=1))


@needs_quant
@pytest.mark.slow
def test_embedded_model_native_weights_speculative_greedy_is_identical():
    """The embedded SmolLM2 Q4_1 file on its own quantized weights: the same fingerprint as the
    dense load (so its shipped drafter is found), and speculative greedy output equal to plain."""
    from specdecode import LLM, SamplingParams
    from specdecode.fast.quant import QuantLinear as QL
    llm = LLM(progress=False, method="ngram")
    assert llm.target.model.quantized and isinstance(llm.target.model.lm_head, QL)
    from specdecode.models.loader import load_model
    assert load_model(None, dtype="bf16", progress=False).fingerprint == llm.target.fingerprint
    prompts = ["Repeat exactly: alpha beta gamma delta epsilon zeta eta theta.", "def add(a, b):"]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    for k in (2, 5):
        spec = llm.generate(prompts, params, num_speculative_tokens=k)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def _cli(*args: str):
    import os
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "specdecode.cli", "generate", *args], env=env,
                          capture_output=True, text=True, timeout=600)


@needs_quant
@pytest.mark.slow
def test_cli_weights_options():
    """The embedded GGUF computes on its own blocks by default; --weights dense / --dtype dequantize
    it; both give speculative output identical to plain decoding on the same weights."""
    import json
    prompt = "Repeat exactly: red, green, blue, red, green, blue, red, green"
    common = ["--no-chat", "--json", "--compare", "--method", "ngram", "--max-tokens", "24", "--threads", "1"]
    native, dense = _cli(prompt, *common), _cli(prompt, *common, "--weights", "dense")
    for run, kind in ((native, "native Q4_1+Q8_0"), (dense, "bfloat16")):
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["weights"] == kind and out["identical"] is True


@needs_quant
@pytest.mark.parametrize("draft_dtype", ["int8", "q4_0"])
def test_cli_quantized_draft_and_native_errors(tiny_models, draft_dtype):
    import json
    model, draft = str(tiny_models["llama"]), str(tiny_models["llama_draft"])
    run = _cli("the quick brown fox", "--no-chat", "--json", "--compare", "--model", model, "--draft", draft,
               "--draft-dtype", draft_dtype, "-k", "3", "--max-tokens", "16", "--threads", "1")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["identical"] is True
    bad = _cli("hi", "--model", model, "--weights", "native")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("specdecode: error: --weights native") and ".gguf" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@needs_quant
def test_q4_0_draft_is_requantized_once_and_cached(tiny_models, tmp_path, monkeypatch):
    """draft dtype q4_0: every projection and the head re-quantized to Q4_0 blocks (the gguf
    package's), kept under $SPECDECODE_CACHE/requantized and read back bitwise by the next load,
    which quantizes nothing."""
    from gguf import quants

    from specdecode.models.loader import load_model
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    first = load_model(str(tiny_models["llama_draft"]), "q4_0", progress=False)
    assert first.weights_kind == "native Q4_0"
    assert len(list((tmp_path / "requantized").glob("*-q4_0.safetensors"))) == 1
    monkeypatch.setattr(quants, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    again = load_model(str(tiny_models["llama_draft"]), "q4_0", progress=False)
    pairs = list(zip(first.model.projections(), again.model.projections()))
    assert pairs and all(torch.equal(a.weight_q.segments[0][1], b.weight_q.segments[0][1]) for a, b in pairs)


@needs_quant
def test_q4_0_draft_from_a_gguf_file_requantizes_its_blocks(tmp_path, monkeypatch, tiny_models):
    """A GGUF draft (the embedded model) with dtype q4_0 is re-quantized from its own blocks,
    exactly dequantized (no dense copy of the file): each Q4_0 matrix is the gguf package's
    quantization of the file's dequantized matrix; as the draft of the same file it stays lossless.
    It is the default for a GGUF draft whose Q4_0 copy streams >= 20% fewer bytes (the embedded
    Q4_1 file with its Q8_0 head: 22%), not for a dense model directory."""
    from gguf.quants import quantize

    from specdecode import LLM, SamplingParams
    from specdecode.fast.quant import QuantWeight
    from specdecode.models.gguf import native_weights
    from specdecode.models.loader import default_draft_dtype, default_model_path, load_model
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert default_draft_dtype(default_model_path(), "cpu") == "q4_0"
    assert default_draft_dtype(default_model_path(), "cpu", fast=False) is None
    assert default_draft_dtype(tiny_models["llama_draft"], "cpu") is None
    draft = load_model(None, "q4_0", progress=False)
    assert draft.weights_kind == "native Q4_0" and draft.gguf_file is not None
    assert not any(p.name.endswith("model.safetensors") for p in (tmp_path / "converted").rglob("*"))  # no dense copy
    _, source = native_weights(default_model_path(), torch.bfloat16, torch.device("cpu"))
    down = source["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, QuantWeight)
    expected = quantize(down.dequantize().numpy(), 2)
    got = draft.model.layers[0]["down"].weight_q.segments[0][1].numpy()
    assert np.array_equal(got.reshape(expected.shape), expected)
    target = LLM(draft=str(default_model_path()), method="model", adaptive=False, progress=False, threads=1)
    assert target.draft.weights_kind == "native Q4_0"                       # the default for this draft
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = target.generate(["The capital of France is"], params, num_speculative_tokens=0)
    spec = target.generate(["The capital of France is"], params, num_speculative_tokens=4)     # k every step
    assert spec[0].token_ids == plain[0].token_ids and spec[0].stats["acceptance_rate"] > 0.2
    from specdecode.forward import ForwardBatch  # a close copy: its next-token choices mostly agree
    ids = torch.tensor([draft.tokenizer.encode("The capital of France is Paris. It is known for the Eiffel "
                                               "Tower, the Louvre and its cafes. " * 3)])
    top1 = [m.logits(m.run(ForwardBatch.chain(ids, 0), m.new_cache(1, ids.shape[1]))).argmax(-1)
            for m in (target.target.model, draft.model)]
    assert (top1[0] == top1[1]).float().mean() > 0.7


@needs_quant
@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES))
def test_native_dequantize_is_bitwise_the_gguf_packages(qtype):
    """QuantWeight.dequantize (C) gives exactly the gguf package's numpy values (fingerprints of
    native and dense loads agree because of it)."""
    from gguf.quants import dequantize
    w = random_weight(qtype, 8, 512, seed=7)
    (t, data), = w.segments
    if qtype == I8:
        ref = data[:, 4:].contiguous().view(torch.int8).float() * data[:, :4].contiguous().view(torch.float32)
    else:
        ref = torch.from_numpy(np.ascontiguousarray(dequantize(data.numpy(), t), dtype=np.float32)).reshape(8, -1)
    assert torch.equal(w.dequantize(), ref)


@needs_quant
@pytest.mark.parametrize("kind", ["int8", "q4_0"])
def test_self_quant_drafter_is_lossless(tiny_models, one_thread, kind):
    """method self-quant: the target's own weights re-quantized draft for it; greedy output equals
    plain decoding, and the draft agrees with the target on most tokens."""
    from specdecode import LLM, SamplingParams
    # adaptive=False: a draft of 4 at every step, so the acceptance below does not depend on the draft
    # budget's timings (with them it drafted a handful of tokens, and a full-suite run fell under 0.5)
    llm = LLM(model=str(tiny_models["qwen2"]), method="self-quant", dtype="bf16", progress=False, self_quant=kind,
              adaptive=False)
    assert llm.drafter.model.quantized
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = ["the quick brown fox jumps over", "def add(a, b):"]
    plain = llm.generate(prompts, params, num_speculative_tokens=0)
    spec = llm.generate(prompts, params, num_speculative_tokens=4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].stats["acceptance_rate"] > (0.5 if kind == "int8" else 0.3)   # random tiny weights


@needs_quant
def test_self_quant_refuses_an_already_quantized_target():
    from specdecode import LLM
    from specdecode.drafters.base import DrafterError
    with pytest.raises(DrafterError, match="already computes on its quantized weights"):
        LLM(method="self-quant", progress=False)


@needs_quant
@pytest.mark.parametrize("qtype", [2, 3, 6, 7, 8, 12, 14])
def test_amx_tiles_equal_vnni_kernels_bitwise(qtype):
    """Where the CPU has AMX-INT8, passes of several rows over the 16-column layouts run on tiles
    (quant16_amx.c); every output equals the VNNI kernel's bit for bit, at 2..16 rows and past 16
    (the K formats run all rows in one pipelined pass, each super-block decoded once for all chunks)."""
    from specdecode.fast import linear
    st = linear._load()
    if not st.get("qamx"):
        pytest.skip("no AMX-INT8 on this CPU")
    k = 768 if BLOCK.get(qtype) == 256 else 576   # 576: a last activation chunk of 2 blocks
    lin = QuantLinear(random_weight(qtype, 64, k, seed=6))
    x = torch.randn(45, k).to(torch.bfloat16)
    tiles = {n: lin(x[:n]) for n in (2, 5, 16, 21, 32, 45)}
    try:
        st["lib"].sd_q_amx(0)
        for n, y in tiles.items():
            assert torch.equal(y, lin(x[:n])), f"{NATIVE_TYPES[qtype]} n={n}"
    finally:
        st["lib"].sd_q_amx(1)


@needs_quant
@pytest.mark.parametrize("quantized_head", [False, True])
def test_head_over_some_token_ids_equals_the_whole_heads_columns(tmp_path, one_thread, quantized_head):
    """logits(..., head_rows=model.head_rows(ids)) (a draft's reduced head) equals the whole head's
    columns `ids` bitwise, dense or quantized head, fused and eager, 3 rows and 20 (AMX tiles from
    12); ids that are not a multiple of 32, not ascending or outside the vocabulary are refused.
    (This tiny vocabulary, 300, is no multiple of 16, so its whole quantized head runs the per-column
    kernel, not the interleaved one: there the reference is a head over the first 288 ids.)"""
    from specdecode.forward import ForwardBatch
    folder = make_model(tmp_path / "m", "llama", seed=7, layers=1, hidden=128, heads=4, kv_heads=2, tie=False)
    config, _, model = _quantized_tiny(folder, head=quantized_head)
    assert model.fused is not None and isinstance(model.lm_head, QuantLinear) == quantized_head
    tokens = torch.randint(0, config.vocab_size, (1, 20))
    hidden = model.run(ForwardBatch.chain(tokens, 0), model.new_cache(1, 32))
    gen = torch.Generator().manual_seed(3)
    subsets = [torch.arange(32), torch.arange(128),
               torch.sort(torch.randperm(288, generator=gen)[:96]).values]
    for index in (torch.tensor([[0, 4, 8]]), torch.arange(20)[None]):
        whole = model.logits(hidden, index)
        reference = model.logits(hidden, index, head_rows=model.head_rows(torch.arange(288))) \
            if quantized_head else whole
        assert torch.allclose(reference[..., :288], whole[..., :288], atol=1e-2)
        for ids in subsets:
            rows = model.head_rows(ids)
            assert torch.equal(model.logits(hidden, index, head_rows=rows), reference[..., ids])
            fused, model.fused = model.fused, None             # the eager path: same rows, same values
            try:
                assert torch.allclose(model.logits(hidden, index, head_rows=rows), whole[..., ids], atol=1e-2)
            finally:
                model.fused = fused
    for bad in (torch.arange(40), torch.arange(32).flip(0), torch.arange(32) + config.vocab_size - 16):
        with pytest.raises(ValueError, match="reduced LM head"):
            model.head_rows(bad)


@needs_quant
def test_embedded_model_native_weights_stay_close_to_the_fp32_model(smollm2):
    """The native Q4_1 path (int8 activations per 32 k) against the same weights dequantized to fp32,
    teacher-forced over a paragraph: mean KL 0.005 here (0.023 with activations per 256 k, whose
    greedy answer to "Hi" ran past the end-of-turn into broken words)."""
    from specdecode.models.loader import load_model
    native = load_model(None, progress=False)
    text = ("The committee reviewed the proposal in detail. Its members agreed that the budget was too "
            "small for the planned work, and asked the authors to explain how the results would be "
            "measured, who would maintain the software afterwards, and what the risks were. "
            "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
    ids = native.tokenizer.encode(text)

    def logits(lm):
        cache = lm.model.new_cache(1, len(ids) + 4)
        return lm.model.forward(torch.tensor([ids]), cache, 0, logit_index=torch.arange(len(ids))[None]).float()[0]
    got, want = logits(native), logits(smollm2)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 0.012, float(kl)
    assert float((got.argmax(-1) == want.argmax(-1)).double().mean()) > 0.9


@needs_quant
def test_a_concatenation_keeps_its_parts_in_place_and_computes_as_one_segment():
    """QuantWeight.cat (q|k|v, gate|up) copies nothing: each part stays a segment, viewing its own
    bytes (the memory-mapped file's, for a GGUF file), and QuantLinear repacks a run of one type
    into one kernel segment: bitwise what the merged copy gave, 16-row aligned or not."""
    for rows in ((32, 16, 16), (8, 8, 16)):               # the second: a run not repacked (8-row boundary)
        parts = [random_weight(12, rows[0], 512, seed=5), random_weight(12, rows[1], 512, seed=6),
                 random_weight(14, rows[2], 512, seed=7)]
        fused = QuantWeight.cat(parts)
        assert [d.data_ptr() for _, d in fused.segments] == [p.segments[0][1].data_ptr() for p in parts]
        assert fused.type_names() == "Q4_K+Q6_K" and [t for t, _ in fused.runs()] == [12, 14]
        merged = QuantWeight([(12, torch.cat([parts[0].segments[0][1], parts[1].segments[0][1]])),
                              parts[2].segments[0]], 512)
        x = torch.randn(5, 512).to(torch.bfloat16)
        assert torch.equal(QuantLinear(fused)(x), QuantLinear(merged)(x))
        assert torch.equal(fused.dequantize(torch.bfloat16), merged.dequantize(torch.bfloat16))


def test_dequantize_a_chunk_of_rows_at_a_time_is_exact(monkeypatch):
    """dequantize expands DEQUANT_ROWS rows at a time (a vocabulary-sized embedding never whole in
    fp32): the same values, in any dtype, as all rows at once."""
    from specdecode.fast import quant
    w = random_weight(8, 10, 256, seed=9)
    whole = {dtype: w.dequantize(dtype) for dtype in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(quant, "DEQUANT_ROWS", 3)
    for dtype, expected in whole.items():
        assert torch.equal(w.dequantize(dtype), expected)


def mapping_rss_kb(path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_release_pages_gives_a_file_views_pages_back(tmp_path):
    """release_pages drops a file view's pages from this process's resident memory (what
    QuantLinear does with a GGUF file's blocks once it has repacked them); a later read maps the
    same bytes again from the file."""
    from specdecode.fast.quant import release_pages
    data = np.random.default_rng(0).integers(0, 256, size=256 * 4096, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    view = torch.as_tensor(np.memmap(path, dtype=np.uint8, mode="c"))
    assert int(view.sum()) == int(data.sum())            # every page read: resident
    before = mapping_rss_kb(path)
    release_pages(view)
    assert before >= 1000 and mapping_rss_kb(path) <= before // 10, (before, mapping_rss_kb(path))
    assert torch.equal(view, torch.from_numpy(data))


@needs_quant
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_a_mapped_weight_is_repacked_a_chunk_at_a_time_and_its_pages_given_back(tmp_path, monkeypatch):
    """QuantLinear repacks a file view's rows DEQUANT_ROWS at a time, giving each chunk's pages back once
    read (a vocabulary-sized head never resident twice): the same products as the weight repacked whole."""
    from specdecode.fast import quant
    w = random_weight(12, 96, 512, seed=11)
    (_, data), = w.segments
    path = tmp_path / "blocks.bin"
    data.numpy().tofile(path)
    mapped = QuantWeight.from_blocks(12, np.memmap(path, dtype=np.uint8, mode="c"), (96, 512), mapped=True)
    monkeypatch.setattr(quant, "DEQUANT_ROWS", 32)
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert torch.equal(QuantLinear(mapped)(x), QuantLinear(w)(x))
    assert mapping_rss_kb(path) <= 4 * 2, mapping_rss_kb(path)      # at most the pages straddling chunk ends


@needs_quant
def test_mxfp4_parts_are_kernel_segments_read_in_place():
    """MXFP4 (never repacked): a gate|up of two stacks' rows is two kernel segments reading those rows
    where they lie, bitwise the merged copy's results; every e2m1 code and a subnormal scale decode as
    the gguf package's values."""
    gate, up = random_weight(39, 24, 320, seed=8), random_weight(39, 40, 320, seed=9)
    lin = QuantLinear(QuantWeight.cat([gate, up]))
    assert lin.qmat.nseg == 2 and [lin.qmat.data[0], lin.qmat.data[1]] == [
        gate.segments[0][1].data_ptr(), up.segments[0][1].data_ptr()]
    merged = QuantWeight([(39, torch.cat([gate.segments[0][1], up.segments[0][1]]))], 320)
    x = torch.randn(6, 320).to(torch.bfloat16)
    assert torch.equal(lin(x), QuantLinear(merged)(x))
    raw = np.zeros((2, 2, 17), np.uint8)
    raw[:, :, 0] = [[1, 127], [130, 0]]                                      # subnormal, 2^-1, 2^2 and 2^-128 scales
    raw[:, :, 1:] = (np.arange(16, dtype=np.uint8) * 17)[None, None]        # every code, low and high nibble
    from gguf.quants import dequantize
    w = QuantWeight.from_blocks(39, raw.reshape(2, -1), (2, 64))
    assert torch.equal(w.dequantize(), torch.from_numpy(dequantize(raw.reshape(2, -1), 39).reshape(2, 64)))
