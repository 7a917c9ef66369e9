"""scripts/measure/make_random_gguf.py --arch qwen3moe / gemma4: the file it writes tensor by tensor (a small
shape here; the script's defaults are Qwen3-30B-A3B's and Gemma 4 26B-A4B's) loads natively with the
metadata and tensors of llama.cpp's qwen3moe / gemma4 layout, runs, and a wrong --layers is one error."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specdecode.models.loader import load_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure" / "make_random_gguf.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen3moe_file_loads_natively(script, tmp_path):
    shape = dict(script.QWEN3_30B_A3B, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=16, used=4,
                 expert_ff=64, ff=256, vocab=512)
    out = tmp_path / "random-qwen3moe.gguf"
    script.write_qwen3moe(out, 2, seed=0, shape=shape)
    lm = load_model(str(out), progress=False, fast=False, weights="dense", dtype="fp32")
    config = lm.model.config
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        "qwen3moe", 2, 128, 4, 2)
    assert config.moe == {"experts": 16, "used": 4, "intermediate": 64, "norm_topk": True}
    assert config.vocab_size == 512 and config.rope_theta == 1e6 and not config.tie_word_embeddings
    logits = lm.model.forward(torch.tensor([[1, 2, 3, 4]]), lm.model.new_cache(1, 8), 0)
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all() and logits.std() > 0


def test_bad_layers_is_one_error(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--arch", "qwen3moe", "--layers", "49", "--out", str(tmp_path / "x.gguf")])
    assert "--layers must be in [1, 48]" in capsys.readouterr().err


def test_info_counts_the_expert_stacks_as_native(script, tmp_path):
    """`specdecode info --model` on a qwen3moe file: each expert stack is one matrix of native blocks."""
    from specdecode.info import kernels, model_paths
    shape = dict(script.QWEN3_30B_A3B, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=16, used=4,
                 expert_ff=64, ff=256, vocab=512)
    out = tmp_path / "random-qwen3moe.gguf"
    script.write_qwen3moe(out, 1, seed=0, shape=shape)
    kern = kernels()
    groups = {g["path"]: g["tensors"] for g in model_paths(out, kern)["groups"] if g["type"] == "Q8_0"}
    if kern["isa"] == "none":
        pytest.skip("no native kernels on this CPU")
    native = sum(n for path, n in groups.items() if path.startswith("native"))
    assert native == 4 + 3 + 1        # attention q/k/v/o, the three expert stacks, the LM head


def test_q4_k_m_types_follow_llama_cpp(script):
    """Q6_K where llama.cpp's Q4_K_M puts it: its 8-layer Qwen3-30B-A3B-shaped file (llama_model_quantize) has
    attn_v and ffn_down_exps in Q6_K on layers 0, 3, 6 and 7, the output matrix Q6_K, every other matrix Q4_K."""
    more = [i for i in range(8) if script.q4_k_m_type(f"blk.{i}.ffn_down_exps.weight", 8) == script.Q6_K]
    assert more == [0, 3, 6, 7]
    assert [i for i in range(8) if script.q4_k_m_type(f"blk.{i}.attn_v.weight", 8) == script.Q6_K] == more
    assert script.q4_k_m_type("output.weight", 8) == script.Q6_K
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate_exps.weight", "blk.7.ffn_up_exps.weight"):
        assert script.q4_k_m_type(name, 8) == script.Q4_K
    assert sum(script.use_more_bits(i, 48) for i in range(48)) == 24       # 6 + 6 + every third of the 36 between


@pytest.mark.parametrize("qtype", [12, 14])
def test_random_k_blocks_have_the_asked_spread(script, qtype):
    import numpy as np
    from gguf.quants import dequantize
    rng = np.random.default_rng(0)
    for std in (0.02, 1.0):
        blocks = script.random_k_blocks(rng, qtype, 64, 1024, std)
        assert blocks.shape == (64, 4 * script.K_BLOCK_BYTES[qtype])
        weights = dequantize(blocks, qtype)
        assert np.isfinite(weights).all()
        assert abs(weights.std() / std - 1) < 0.05 and abs(weights.mean()) < 0.05 * std


def test_q4_k_m_file_loads_natively_and_decodes(script, tmp_path):
    """A --qtype Q4_K_M file (a small shape: K blocks need rows of 256 weights) has the types q4_k_m_type gives,
    F32 norms and routers, and decodes natively on its own blocks."""
    from specdecode.models.gguf import tensor_table
    shape = dict(script.QWEN3_30B_A3B, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, used=2,
                 expert_ff=256, ff=512, vocab=512)
    out = tmp_path / "random-qwen3moe-q4km.gguf"
    script.write_qwen3moe(out, 2, seed=0, shape=shape, qtype="Q4_K_M")
    _, tensors = tensor_table(out)
    types = {name: qtype for _, name, qtype, _ in tensors}
    assert types["blk.1.ffn_down_exps.weight"] == types["blk.1.attn_v.weight"] == types["output.weight"] == script.Q6_K
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.1.ffn_gate_exps.weight"] == script.Q4_K
    assert types["token_embd.weight"] == script.Q4_K
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == 0      # F32
    lm = load_model(str(out), progress=False)
    logits = lm.model.forward(torch.tensor([[1, 2, 3, 4]]), lm.model.new_cache(1, 8), 0)
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all() and logits.std() > 0


def test_gpt_oss_file_loads_natively_with_its_experts_in_place(script, tmp_path):
    """--arch gpt-oss (a small shape): llama.cpp's layout read back (window, YaRN, sinks, biases), each
    expert's MXFP4 rows a view of the mapped file, a finite forward pass; --layers past 24 is one error."""
    shape = dict(script.GPT_OSS_20B, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8, used=2, expert_ff=64,
                 vocab=512, window=4, context=256, yarn_context=64)
    out = tmp_path / "random-gpt-oss.gguf"
    script.write_gpt_oss(out, 2, seed=0, shape=shape)
    lm = load_model(str(out), progress=False)
    config = lm.model.config
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        "gpt-oss", 2, 128, 4, 2)
    assert config.sliding_layers == (True, False) and config.sliding_window == 4 and config.attention_sinks
    assert config.rope_scaling["factor"] == 32.0 and config.rope_scaling["original_max_position_embeddings"] == 64
    assert config.moe["experts"] == 8 and config.moe["used"] == 2 and config.vocab_size == 512
    if lm.model.quantized:                      # native kernels here: the file's MXFP4 rows, read in place
        assert "MXFP4" in lm.weights_kind and lm.model.layers[0]["experts_down"][5].weight_q.mapped
    logits = lm.model.forward(torch.tensor([[1, 2, 3, 4, 5, 6]]), lm.model.new_cache(1, 8), 0)
    assert logits.shape == (1, 6, 512) and torch.isfinite(logits).all() and logits.std() > 0
    with pytest.raises(SystemExit):
        script.main(["--arch", "gpt-oss", "--layers", "25", "--out", str(tmp_path / "x.gguf")])


def test_gemma4_file_loads_natively(script, tmp_path):
    """--arch gemma4 (Gemma 4 26B-A4B's layout in a small shape): windowed and global layers with their own
    head shapes, k_eq_v global layers, the last layer global, the MoE block beside every MLP, read natively."""
    shape = dict(script.GEMMA4_26B_A4B, hidden=128, heads=4, kv_heads=2, head_dim=32, global_kv_heads=1,
                 global_head_dim=64, ff=96, experts=16, used=4, expert_ff=64, vocab=512, window=16)
    out = tmp_path / "random-gemma4.gguf"
    script.write_gemma4(out, 7, seed=0, shape=shape)
    lm = load_model(str(out), progress=False, fast=False, weights="dense", dtype="fp32")
    config = lm.model.config
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads) == ("gemma4", 7, 128, 4)
    assert config.sliding_layers == (True,) * 5 + (False, False) and config.k_eq_v
    assert config.kv_geometry() == (7, (2,) * 5 + (1, 1), (32,) * 5 + (64, 64))
    assert config.moe == {"experts": 16, "used": 4, "intermediate": 64, "norm_topk": True, "router": "gemma4",
                          "activation": "gelu_tanh"}
    assert config.rope_scaling["partial_rotary_factor"] == 0.25 and config.final_logit_softcapping == 30.0
    assert config.vocab_size == 512 and config.tie_word_embeddings and config.sliding_window == 16
    logits = lm.model.forward(torch.tensor([[1, 2, 3, 4]]), lm.model.new_cache(1, 8), 0)
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all() and logits.std() > 0


def test_q4_k_m_is_for_qwen3moe(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--qtype", "Q4_K_M", "--out", str(tmp_path / "x.gguf")])
    assert "--qtype Q4_K_M is for --arch qwen3moe" in capsys.readouterr().err


def test_the_footprint_counts_the_expert_stacks_as_stored(script, tmp_path):
    """gguf_footprint (what `specdecode info` says and check_fits compares with the memory available) takes a
    qwen3moe file's expert stacks [E, out, in] at their own blocks' bytes, as the native load holds them."""
    from specdecode.fast.quant import native_reason
    from specdecode.footprint import gguf_footprint, weights_bytes
    if native_reason() is not None:
        pytest.skip(native_reason())
    shape = dict(script.QWEN3_30B_A3B, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, used=2,
                 expert_ff=256, ff=512, vocab=512)
    out = tmp_path / "random-qwen3moe-q4km.gguf"
    script.write_qwen3moe(out, 2, seed=0, shape=shape, qtype="Q4_K_M")
    said = gguf_footprint(out)["weights"]
    held = weights_bytes(load_model(str(out), progress=False).model)
    assert held <= said <= held * 1.01, (held, said)
    assert said < out.stat().st_size * 1.5


def test_gemma4_bad_layers_is_one_error(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--arch", "gemma4", "--layers", "31", "--out", str(tmp_path / "x.gguf")])
    assert "--layers must be in [1, 30] for gemma4" in capsys.readouterr().err
