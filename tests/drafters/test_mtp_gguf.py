"""Qwen3.5's MTP head read from llama.cpp's GGUF layout (models/qwen3_5_gguf.py): the tiny random
Qwen3.5 with a random head (conftest.make_qwen35) written as llama.cpp's converter writes it
(gguf_writer.write_qwen35_gguf with `mtp`: one more block, blk.N.nextn.* for the head's own tensors,
norms + 1) gives back the checkpoint's `mtp.*` tensors, the same drafts and draft distributions as
its Hugging Face directory, and greedy speculation identical to plain decoding on its Q8_0 blocks."""
from __future__ import annotations

import pytest
import torch
from conftest import QWEN35_PROMPTS as PROMPTS
from conftest import make_qwen35
from gguf_writer import write_qwen35_gguf

from specdecode import LLM, SamplingParams
from specdecode.fast import linear as fast_linear

OPTS = dict(dtype="fp32", progress=False)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model, the head's mtp.* tensors): the tiny Qwen3.5 with its MTP head."""
    from safetensors.torch import load_file
    folder = tmp_path_factory.mktemp("qwen3_5_mtp_gguf")
    model = make_qwen35(folder, mtp=True)
    head = {n: t for n, t in load_file(str(folder / "model.safetensors")).items() if n.startswith("mtp.")}
    return folder, model, head


@pytest.fixture(scope="module")
def files(checkpoint, tmp_path_factory):
    folder, model, head = checkpoint
    out = tmp_path_factory.mktemp("qwen35_mtp_files")
    written = {q: write_qwen35_gguf(out / f"tiny-mtp-{q}.gguf", model, folder / "tokenizer.json", "<|im_end|>",
                                    qtype=q, mtp=head) for q in ("F32", "Q8_0")}
    written["none"] = write_qwen35_gguf(out / "tiny-no-mtp.gguf", model, folder / "tokenizer.json", "<|im_end|>")
    return written


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path_factory.getbasetemp() / "qwen35_mtp_cache"))


def test_file_holds_the_head_as_the_converter_writes_it(files):
    from gguf import GGUFReader
    reader = GGUFReader(str(files["F32"]))
    names = {t.name for t in reader.tensors}
    assert int(reader.fields["qwen35.block_count"].contents()) == 5
    assert int(reader.fields["qwen35.nextn_predict_layers"].contents()) == 1
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight",
            "blk.4.nextn.shared_head_norm.weight", "blk.4.attn_q.weight", "blk.4.post_attention_norm.weight",
            "blk.4.ffn_down.weight"} <= names
    assert not any("nextn.embed_tokens" in n or "nextn.shared_head_head" in n for n in names)   # shared


def test_native_weights_give_back_the_checkpoints_head(checkpoint, files):
    """Every mtp.* tensor read back under its own name, its norms' + 1 undone (fc kept as stored blocks
    where the file quantized it)."""
    from specdecode.fast.quant import QuantWeight
    from specdecode.models.gguf import native_weights
    head = checkpoint[2]
    config, weights = native_weights(files["F32"], torch.float32, torch.device("cpu"))
    assert config.num_layers == 4
    got = {n: t for n, t in weights.items() if n.startswith("mtp.")}
    assert sorted(got) == sorted(head)
    for name, tensor in head.items():
        assert torch.allclose(got[name], tensor, atol=1e-6), name
    _, quantized = native_weights(files["Q8_0"], torch.float32, torch.device("cpu"))
    if fast_linear._load()["lib"] is not None:
        assert isinstance(quantized["mtp.fc.weight"], QuantWeight)


def test_default_method_is_mtp_for_a_file_with_the_head(files):
    from specdecode.api import default_method
    from specdecode.drafters.mtp import has_mtp_head
    assert has_mtp_head(str(files["F32"])) and has_mtp_head(files["Q8_0"])
    assert not has_mtp_head(str(files["none"]))
    assert default_method(None, str(files["F32"])) == "mtp"
    assert default_method(None, str(files["none"])) == "ngram"


def recorded(llm, prompts, params, k):
    """The outputs and every proposal (sequences' tokens, proposal) of one generation."""
    drafter, seen = llm.drafter, []
    propose = drafter.propose

    def record(seqs, sizes):
        proposal = propose(seqs, sizes)
        seen.append(([list(s.token_ids) for s in seqs], proposal))
        return proposal
    drafter.propose = record
    try:
        return llm.generate(prompts, params, num_speculative_tokens=k), seen
    finally:
        drafter.propose = propose


def test_drafts_equal_the_directorys(checkpoint, files):
    """The GGUF file (dense fp32) and the Hugging Face directory draft the same tokens with the same
    distributions, greedy and seeded sampled, alone and in a batch: the head read back is the head."""
    from_dir = LLM(model=str(checkpoint[0]), method="mtp", adaptive=False, **OPTS)
    from_file = LLM(model=str(files["F32"]), method="mtp", adaptive=False, **OPTS)
    assert from_file.method == "mtp" and from_file.target.model.mtp is not None
    for params in (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)):
        for prompts, k in ((PROMPTS[0], 3), (PROMPTS, 4)):
            want, want_seen = recorded(from_dir, prompts, params, k)
            got, got_seen = recorded(from_file, prompts, params, k)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            assert sum(o.stats["drafted_tokens"] for o in got) > 0
            assert len(got_seen) == len(want_seen)
            for (rows, proposal), (want_rows, want_proposal) in zip(got_seen, want_seen):
                assert rows == want_rows
                assert torch.equal(proposal.num_tokens, want_proposal.num_tokens)
                assert torch.equal(proposal.tokens, want_proposal.tokens)
                if want_proposal.probs is not None:
                    assert torch.allclose(proposal.probs, want_proposal.probs, atol=1e-5)


def test_native_q8_0_greedy_speculation_equals_plain(files):
    """On the file's own Q8_0 blocks (the head's fc and layer too): greedy speculation with the head
    identical to plain decoding, alone and batched, with drafts accepted."""
    if fast_linear._load()["lib"] is None:
        pytest.skip("native quantized weights need the native kernels")
    llm = LLM(model=str(files["Q8_0"]), adaptive=False, progress=False)
    assert llm.method == "mtp" and llm.target.weights_kind == "native Q8_0"
    assert hasattr(llm.target.model.mtp["fc"], "weight_q")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    for k in (1, 4):
        batch = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [o.token_ids for o in batch] == [o.token_ids for o in plain], k
        alone = llm.generate(PROMPTS[0], params, num_speculative_tokens=k)[0]
        assert alone.token_ids == plain[0].token_ids
        assert alone.stats["drafted_tokens"] > 0
    assert sum(o.stats["accepted_tokens"] for o in batch) > 0
