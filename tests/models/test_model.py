"""The native decoder against transformers' reference implementation on tiny random models."""
import numpy as np
import pytest
import torch

from specdecode.models.gguf import _unpermute
from specdecode.models.loader import load_model


def reference(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_and_incremental_decode_match_transformers(tiny_models, arch):
    lm = load_model(str(tiny_models[arch]), dtype="fp32", progress=False)
    ref = reference(tiny_models[arch])
    tokens = torch.randint(0, lm.model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = ref(tokens).logits
    cache = lm.model.new_cache(1, 64)
    got = lm.model.forward(tokens[:, :16], cache, 0)                     # prefill 16
    torch.testing.assert_close(got, expected[:, :16], atol=1e-4, rtol=1e-4)
    for pos in range(16, 20):                                             # one token at a time
        got = lm.model.forward(tokens[:, pos:pos + 1], cache, pos)
        torch.testing.assert_close(got[:, 0], expected[:, pos], atol=1e-4, rtol=1e-4)
    got = lm.model.forward(tokens[:, 20:24], cache, 20)                   # a verify-sized block
    torch.testing.assert_close(got, expected[:, 20:24], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fast", [True, False])
def test_typed_interface_run_then_logits(tiny_models, fast):
    """run returns the hidden states of every token (before the final norm, what EAGLE reads),
    logits computes the rows asked for (repeats and any order), and forward is the two."""
    from specdecode.forward import ForwardBatch
    from specdecode.models.interface import CausalLM
    model = load_model(str(tiny_models["llama"]), dtype="fp32", progress=False, fast=fast).model
    assert isinstance(model, CausalLM) and model.has_features and model.supports_trees
    tokens = torch.randint(0, model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    hidden = model.run(ForwardBatch.chain(tokens, 0), model.new_cache(1, 32))
    assert hidden.shape == (1, 12, model.config.hidden_size) and hidden.dtype == model.dtype
    every = model.logits(hidden)
    assert every.shape == (1, 12, model.vocab_size) and every.dtype == torch.float32
    index = torch.tensor([[11, 3, 3, 0]])
    assert torch.equal(model.logits(hidden, index), every[:, [11, 3, 3, 0]])
    assert torch.equal(model.forward(tokens, model.new_cache(1, 32), 0, logit_index=index), every[:, [11, 3, 3, 0]])
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        model.logits(hidden, torch.tensor([[12]]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ragged_batch_equals_rows_alone(tiny_models, arch):
    lm = load_model(str(tiny_models[arch]), dtype="fp32", progress=False)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 11, 8]
    prompts = [torch.randint(0, 200, (n,), generator=gen) for n in lengths]
    alone = []
    for p in prompts:
        cache = lm.model.new_cache(1, 32)
        alone.append(lm.model.forward(p[None], cache, 0)[0, -1])
    cache = lm.model.new_cache(3, 32)
    width = max(lengths)
    batch = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    index = torch.tensor([[n - 1] for n in lengths])
    got = lm.model.forward(batch, cache, 0, logit_index=index)[:, 0]
    for i in range(3):
        torch.testing.assert_close(got[i], alone[i], atol=1e-4, rtol=1e-4)
    # then one more token per row at different positions (per-row starts, a subset of rows)
    nxt = torch.tensor([[7], [9]])
    rows = torch.tensor([2, 0])
    starts = torch.tensor([lengths[2], lengths[0]])
    got = lm.model.forward(nxt, cache, starts, rows=rows)[:, 0]
    for j, i in enumerate([2, 0]):
        solo = lm.model.new_cache(1, 32)
        expect = lm.model.forward(torch.cat([prompts[i], nxt[j]])[None], solo, 0)[0, -1]
        torch.testing.assert_close(got[j], expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    from conftest import make_model
    folder = make_model(tmp_path / "m", "llama", seed=5, layers=1, rope_scaling=scaling)
    lm = load_model(str(folder), dtype="fp32", progress=False)
    tokens = torch.randint(0, 200, (1, 100), generator=torch.Generator().manual_seed(2))
    got = lm.model.forward(tokens, lm.model.new_cache(1, 128), 0)
    torch.testing.assert_close(got, reference(folder)(tokens).logits, atol=1e-4, rtol=1e-4)


def test_bf16_close_to_fp32(tiny_models):
    fp32 = load_model(str(tiny_models["llama"]), dtype="fp32", progress=False)
    bf16 = load_model(str(tiny_models["llama"]), dtype="bf16", progress=False)
    tokens = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(3))
    a = fp32.model.forward(tokens, fp32.model.new_cache(1, 16), 0)
    b = bf16.model.forward(tokens, bf16.model.new_cache(1, 16), 0)
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_gguf_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's converter permutes q/k rows; loading must undo it exactly."""
    heads, head_dim, dim = 3, 8, 24
    w = np.random.default_rng(0).normal(size=(heads * head_dim, dim)).astype(np.float32)
    permuted = w.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape)  # llama.cpp permute
    np.testing.assert_array_equal(_unpermute(permuted, heads), w)


def test_kv_cache_rollback_is_a_length_change(tiny_models):
    lm = load_model(str(tiny_models["llama"]), dtype="fp32", progress=False)
    cache = lm.model.new_cache(1, 32)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    lm.model.forward(tokens, cache, 0)
    storage = cache.keys[0].data_ptr()
    cache.truncate(0, 3)                       # reject the last three
    redo = lm.model.forward(torch.tensor([[11]]), cache, 3)
    fresh = lm.model.forward(torch.tensor([[5, 6, 7, 11]]), lm.model.new_cache(1, 32), 0)
    torch.testing.assert_close(redo[0, 0], fresh[0, -1], atol=1e-5, rtol=1e-5)
    assert cache.keys[0].data_ptr() == storage
