"""Qwen3.5's DeltaNet layers on the native kernels (fast/deltanet.py, deltanet.c) against the eager
torch form (models/qwen3_5.py `_delta_net` without them): outputs, the final states and what the
cache keeps for a replay, for one and several tokens, rows of different widths (padding), grouped
and tiled heads, fp32 and bf16; and the invariants speculation needs (a row's bits do not depend on
the other rows or on how many tokens its pass has; a replay is the bits of a pass)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdecode.cache.recurrent import HybridCache, _replay
from specdecode.models.qwen3_5 import Qwen35Transformer

deltanet = pytest.importorskip("specdecode.fast.deltanet")
native = deltanet.kernels()
pytestmark = pytest.mark.skipif(native is None, reason="native kernels unavailable")

KERNEL = 4


def make_layer(lin: dict, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random weights of one DeltaNet layer (its projections stand aside: `inputs` returns the
    projection it is given, `out` its input)."""
    g = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = lin["key_heads"], lin["value_heads"], lin["key_dim"], lin["value_dim"]
    conv = (torch.randn(2 * hk * dk + hv * dv, 1, KERNEL, generator=g) * 0.5).to(dtype)
    return {"kind": "linear", "index": 0, "conv": conv, "conv_f32": conv.float(),
            "decay_rate": -torch.rand(hv, generator=g).add(0.2), "dt_bias": torch.randn(hv, generator=g),
            "out_norm": (1 + 0.3 * torch.randn(dv, generator=g)).to(dtype),
            "inputs": lambda x: x, "out": lambda y: y}


def run(lin: dict, layer: dict, dtype, proj: torch.Tensor, widths: list[int], use_native: bool, seed: int = 1):
    """One pass of the layer over proj [B, T, P] on a cache of B rows with random states: (output,
    the rows' pending records, the cache)."""
    batch, num_tokens, _ = proj.shape
    hk, hv, dk, dv = lin["key_heads"], lin["value_heads"], lin["key_dim"], lin["value_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    fake = SimpleNamespace(config=SimpleNamespace(linear_attention=lin, rms_norm_eps=1e-6), kernel=KERNEL,
                           native=native if use_native else None)
    if use_native:
        layer = dict(layer, native=native.layer(layer, lin, 1e-6, dtype))
    cache = HybridCache(1, 1, conv_dim, KERNEL, hv, dk, dv, batch, 1, 16, 64, 16, 16, dtype,
                        replay=native.replay if use_native else None)
    for row in range(batch):
        cache.reserve(row, 32)
    for row in range(batch):                                                   # row r's states: seed + r
        g = torch.Generator().manual_seed(seed + row)
        cache.conv[0][row] = torch.randn(cache.conv[0].shape[1:], generator=g)
        cache.ssm[0][row] = torch.randn(hv, dk, dv, generator=g) * 0.3
    before = [s.clone() for s in cache.ssm[0]]
    rows = list(range(batch))
    out = Qwen35Transformer._delta_net(fake, layer, proj, cache, rows, [10] * batch, widths)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.ssm[0]))        # a pass never changes the cache
    return out, [cache.passes[r] for r in rows], cache


def inputs(lin: dict, dtype, batch: int, num_tokens: int, seed: int = 2) -> torch.Tensor:
    hk, hv, dk, dv = lin["key_heads"], lin["value_heads"], lin["key_dim"], lin["value_dim"]
    width = 2 * hk * dk + 2 * hv * dv + 2 * hv
    return torch.randn(batch, num_tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


SHAPES = [dict(key_heads=2, value_heads=4, key_dim=8, value_dim=16, tiled=0),      # the test model's (tails)
          dict(key_heads=2, value_heads=4, key_dim=32, value_dim=48, tiled=1),     # a GGUF file's order
          dict(key_heads=3, value_heads=3, key_dim=128, value_dim=128, tiled=0)]   # Qwen3.5's head size


@pytest.mark.parametrize("lin", SHAPES, ids=["grouped-tails", "tiled", "full-size"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 3, 7])
def test_native_pass_equals_eager(lin, dtype, num_tokens):
    layer = make_layer(lin, dtype)
    widths = [num_tokens, max(num_tokens - 2, 1), 1]                     # rows 1, 2: padding after theirs
    proj = inputs(lin, dtype, 3, num_tokens)
    (eager, eager_rec, _), (fast, fast_rec, _) = (run(lin, layer, dtype, proj, widths, n) for n in (False, True))
    # fp32 differs by the order of sums; bf16 by that rounded to bf16 at the eager path's rounding points
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for b, width in enumerate(widths):
        assert torch.allclose(fast[b, :width].float(), eager[b, :width].float(), **tol), b
        e, f = eager_rec[b], fast_rec[b]
        assert (e.start, e.width) == (f.start, f.width)
        assert torch.equal(e.conv_inputs[0], f.conv_inputs[0])             # copies, no arithmetic
        assert torch.allclose(f.finals[0], e.finals[0], **tol)
        for name, x, y in zip(("q", "k", "v", "decay", "beta"), e.steps[0], f.steps[0]):
            assert x.shape == y.shape and torch.allclose(y, x, **tol), name


@pytest.mark.parametrize("lin", SHAPES[:2], ids=["grouped-tails", "tiled"])
def test_rows_and_pass_length_change_no_bits(lin):
    """A row's output, state and steps are the same bits alone or beside other rows, and its first
    tokens the same in a longer pass."""
    dtype = torch.bfloat16
    layer = make_layer(lin, dtype)
    proj = inputs(lin, dtype, 3, 5)
    out, rec, _ = run(lin, layer, dtype, proj, [5, 3, 1], True)
    alone, alone_rec, _ = run(lin, layer, dtype, proj[:1, :3], [3], True)
    assert torch.equal(out[0, :3], alone[0])
    assert torch.equal(rec[0].steps[0][0][:3], alone_rec[0].steps[0][0])
    _, short, _ = run(lin, layer, dtype, proj[:2, :3], [3, 3], True)
    assert torch.equal(rec[1].finals[0], short[1].finals[0])              # padding left row 1's state alone


@pytest.mark.parametrize("lin", SHAPES, ids=["grouped-tails", "tiled", "full-size"])
def test_replay_is_the_bits_of_a_pass(lin):
    """HybridCache.truncate to a length inside a pass replays its steps with the native delta rule:
    the state a pass of just those tokens computes, bit for bit; near the eager replay's."""
    dtype = torch.float32
    layer = make_layer(lin, dtype)
    proj = inputs(lin, dtype, 1, 6)
    _, rec, cache = run(lin, layer, dtype, proj, [6], True)
    start_state = cache.ssm[0][0]
    for kept in (1, 4, 6):
        _, short, _ = run(lin, layer, dtype, proj[:, :kept], [kept], True)
        replayed = native.replay(start_state, rec[0].steps[0], kept)
        assert torch.equal(replayed, short[0].finals[0]), kept
        assert torch.allclose(replayed, _replay(start_state, rec[0].steps[0], kept), atol=1e-5, rtol=1e-4)
    cache.truncate(0, 10 + 4)
    assert torch.equal(cache.ssm[0][0], native.replay(start_state, rec[0].steps[0], 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_ops_equal_the_eager_ones(dtype):
    """fast/rowops.py against the torch ops models/qwen3_5.py runs without it: fp32 norms (over a
    fused projection's strided heads, with partial RoPE), the residual add + norm, SwiGLU, the gate."""
    from specdecode.fast.rowops import row_ops
    from specdecode.models.gemma import fp32_rms_norm
    from specdecode.models.transformer import apply_rope
    ops = row_ops()
    g = torch.Generator().manual_seed(3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    batch, num_tokens, heads, hd, rot, eps = 2, 3, 4, 40, 10, 1e-6
    weight = 1 + 0.3 * torch.randn(hd, generator=g)
    fused = torch.randn(batch, num_tokens, heads * 2 * hd + 24, generator=g).to(dtype)
    q = fused[..., :heads * 2 * hd].view(batch, num_tokens, heads, 2 * hd)[..., hd:]     # strided heads
    angles = torch.randn(batch * num_tokens, rot // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)                          # [B*T, rot]
    eager = apply_rope(fp32_rms_norm(q, weight, eps).transpose(1, 2), cos.view(batch, 1, num_tokens, rot),
                       sin.view(batch, 1, num_tokens, rot)).transpose(1, 2)
    assert torch.allclose(ops.rms_norm(q, weight, eps, cos, sin).float(), eager.float(), **tol)
    one = q[:, :1]                                                                     # T = 1: any stride
    assert torch.allclose(ops.rms_norm(one, weight, eps).float(), fp32_rms_norm(one, weight, eps).float(), **tol)
    hidden, delta = (torch.randn(batch, num_tokens, 48, generator=g).to(dtype) for _ in range(2))
    w48 = 1 + 0.3 * torch.randn(48, generator=g)
    total, normed = ops.add_rms_norm(hidden, delta, w48, eps)
    assert torch.equal(total, hidden + delta)
    assert torch.allclose(normed.float(), fp32_rms_norm(hidden + delta, w48, eps).float(), **tol)
    gate_up = torch.randn(batch, num_tokens, 2 * 72, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(ops.silu_mul(gate_up).float(), (torch.nn.functional.silu(gate) * up).float(), **tol)
    attn = torch.randn(batch, num_tokens, heads, hd, generator=g).to(dtype)
    assert torch.allclose(ops.sigmoid_gate(attn, q).float(), (attn * torch.sigmoid(q)).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chain_attention_equals_sdpa_over_the_cache(dtype):
    """The native attention of a short chain pass (rows at different lengths, paged blocks) against
    the eager cache write + scaled_dot_product_attention with the chain's causal mask."""
    from specdecode.fast.rowops import row_ops
    ops = row_ops()
    g = torch.Generator().manual_seed(4)
    batch, num_tokens, heads, kv_heads, hd, starts = 2, 3, 4, 2, 32, [21, 5]
    caches = [HybridCache(1, 1, 8, KERNEL, 1, 16, 16, batch, kv_heads, hd, 64, 16, 16, dtype) for _ in range(2)]
    for cache in caches:
        for row, start in enumerate(starts):
            cache.reserve(row, 40)
            cache.truncate(row, start)
    history = torch.randn(2, batch, kv_heads, max(starts), hd, generator=g).to(dtype)
    for cache in caches:                                 # the same earlier keys and values in both
        for row, start in enumerate(starts):
            cache.write(0, torch.tensor([row]), 0, history[0, row:row + 1, :, :start],
                        history[1, row:row + 1, :, :start])
    q = torch.randn(batch, num_tokens, heads, hd, generator=g).to(dtype)
    k, v = (torch.randn(batch, num_tokens, kv_heads, hd, generator=g).to(dtype) for _ in range(2))
    layout = caches[0].layout([0, 1], starts, num_tokens)
    fast = ops.chain_attention(q, k, v, layout, 0, starts, hd ** -0.5)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for row, start in enumerate(starts):
        keys, values = caches[1].write(0, torch.tensor([row]), start, k[row:row + 1].transpose(1, 2),
                                       v[row:row + 1].transpose(1, 2))
        mask = torch.arange(keys.shape[2])[None, :] <= start + torch.arange(num_tokens)[:, None]
        eager = torch.nn.functional.scaled_dot_product_attention(q[row:row + 1].transpose(1, 2), keys, values,
                                                                 attn_mask=mask, enable_gqa=True)
        assert torch.allclose(fast[row].float(), eager[0].transpose(0, 1).float(), **tol), row
        stored = layout.keys[0].view(-1, kv_heads, hd)
        slot = int(layout.tables[row, (start + 1) // 16]) * 16 + (start + 1) % 16
        assert torch.equal(stored[slot], k[row, 1])                     # the pass's keys are written
