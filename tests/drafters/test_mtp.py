"""Qwen3.5's MTP head as a drafter (drafters/mtp.py): on a tiny random Qwen3.5 whose safetensors
carry random `mtp.*` weights, greedy output identical to plain decoding alone and batched, the
chained head's distributions equal to a reference built from transformers' own Qwen3.5 layer,
seeded sampling that keeps the target's distribution, the default method, and clear errors."""
from __future__ import annotations

import argparse
import json

import conftest
import pytest
import torch
from conftest import check_seeded_alone_as_batched, compare_samples, make_qwen35, null_tv

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import DrafterError
from specdecode.sampling import probs_from_logits, transform_logits

PROMPTS = conftest.QWEN35_PROMPTS
OPTS = dict(dtype="fp32", progress=False)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen35_mtp(tmp_path_factory):
    """(directory, transformers model): the tiny Qwen3.5 with a random one-layer MTP head."""
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    return folder, make_qwen35(folder, mtp=True)


@pytest.fixture(scope="module")
def llms(qwen35_mtp):
    folder = str(qwen35_mtp[0])
    return {"plain": LLM(model=folder, method="none", **OPTS),
            "mtp": LLM(model=folder, method="mtp", adaptive=False, **OPTS)}


def test_default_method_is_mtp_where_the_checkpoint_has_the_head(qwen35_mtp, qwen35, tiny_models):
    from specdecode.api import default_method
    from specdecode.cli_common import CliError, drafter_options
    folder = str(qwen35_mtp[0])
    assert LLM(model=folder, **OPTS).method == "mtp"
    assert default_method(None, folder) == "mtp"                        # before loading (the CLI's check)
    assert default_method(None, str(qwen35[0])) == default_method(None, str(tiny_models["llama"])) == "ngram"
    assert default_method(folder, folder) == "cascade"                  # a draft model still wins
    args = lambda model: argparse.Namespace(model=model, method=None, draft=None, drafter=None,  # noqa: E731
                                            drafter_options=[("min_confidence", 0.3)])
    assert drafter_options(args(folder)) == {"min_confidence": 0.3}     # an option of the default, mtp
    with pytest.raises(CliError, match="min_confidence"):
        drafter_options(args(str(qwen35[0])))                            # not one of ngram's


def test_greedy_identical_to_plain_alone_and_batched(llms):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = llms["plain"].generate(PROMPTS, params)
    for k in (1, 3, 5):
        batch = llms["mtp"].generate(PROMPTS, params, num_speculative_tokens=k)
        assert [o.token_ids for o in batch] == [o.token_ids for o in plain], k
        for prompt, reference in zip(PROMPTS, plain):
            alone = llms["mtp"].generate(prompt, params, num_speculative_tokens=k)[0]
            assert alone.token_ids == reference.token_ids, (k, prompt)
            assert alone.stats["drafted_tokens"] > 0


class ReferenceHead:
    """The MTP head from its formulas, in plain torch around transformers' own Qwen3.5 decoder layer
    (the target's full-attention kind) and norms, loaded from the checkpoint's `mtp.*` tensors."""

    def __init__(self, folder, hf) -> None:
        from safetensors.torch import load_file
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
        weights = {n[4:]: t for n, t in load_file(str(folder / "model.safetensors")).items() if n.startswith("mtp.")}
        config = hf.config
        self.hf = hf
        self.layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention")).eval()
        self.layer.load_state_dict({n[len("layers.0."):]: t for n, t in weights.items() if n.startswith("layers.0.")})
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.norms[name].weight.data.copy_(weights[f"{name}.weight"])
        self.fc = weights["fc.weight"]

    @torch.no_grad()
    def chain_logits(self, ids: list[int], drafts: list[int]) -> torch.Tensor:   # -> [len(drafts), vocab]
        """Logits of each draft: slot j reads the target's final hidden state at j and token j+1;
        chained slots read the previous slot's output and the draft before."""
        model = self.hf.model
        hidden = list(model(torch.tensor([ids])).last_hidden_state[0, :-1])        # after the final norm
        tokens = ids[1:]
        out = []
        for i in range(len(drafts)):
            x = torch.cat([self.norms["pre_fc_norm_embedding"](model.embed_tokens(torch.tensor(tokens))),
                           self.norms["pre_fc_norm_hidden"](torch.stack(hidden))], dim=-1) @ self.fc.T
            positions = torch.arange(len(tokens))[None]
            causal = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
            y = self.layer(x[None], position_embeddings=model.rotary_emb(x[None], positions),
                           attention_mask=causal, position_ids=positions)
            last = self.norms["norm"](y[0, -1])
            out.append(self.hf.lm_head(last))
            hidden.append(last)
            tokens = tokens + [drafts[i]]
        return torch.stack(out)


def test_chained_head_matches_reference(qwen35_mtp, llms):
    """Every proposal of a sampled generation (temperature 1: the draft distributions are the
    head's softmax), alone and in a batch (the drafter's one-row and general passes), after
    catch-ups over accepted and rejected drafts: its distributions are the reference head's."""
    reference = ReferenceHead(*qwen35_mtp)
    drafter = llms["mtp"].drafter
    seen = []
    propose = drafter.propose

    def record(seqs, sizes):
        proposal = propose(seqs, sizes)
        seen.append(([list(s.token_ids) for s in seqs], proposal))
        return proposal
    drafter.propose = record
    try:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
        outs = llms["mtp"].generate(PROMPTS[0], params, num_speculative_tokens=3)
        outs += llms["mtp"].generate(PROMPTS[1:], params, num_speculative_tokens=4)
    finally:
        drafter.propose = propose
    assert len(seen) >= 4 and any(len(rows) == 2 for rows, _ in seen)
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0       # catch-ups over accepted drafts too
    checked = 0
    for rows, proposal in seen:
        for b, ids in enumerate(rows):
            n = int(proposal.num_tokens[b])
            drafts = proposal.tokens[b, :n].tolist()
            want = torch.softmax(reference.chain_logits(ids, drafts), dim=-1)
            assert torch.allclose(proposal.probs[b, :n], want, atol=1e-4), (ids, drafts)
            checked += n
    assert checked >= 12


def test_seeded_sampling_keeps_the_target_distribution(qwen35_mtp, llms):
    """Speculative sampling with the MTP head (temperature 0.8, top_k 2, two chained drafts) draws
    the first three tokens from the target's exact distribution (from transformers' model), as
    engine/test_e2e_sampling.py checks for the other drafters: chi-square p > 1e-3 and total
    variation within 0.01 * sqrt(10^5 / n), drafts accepted and rejected."""
    hf, llm = qwen35_mtp[1], llms["mtp"]
    prompt = llm.encode(PROMPTS[0], False)
    params = lambda seed=None: SamplingParams(temperature=0.8, top_k=2, max_tokens=3, ignore_eos=True,  # noqa: E731
                                              seed=seed)

    @torch.no_grad()
    def next_probs(prefix):
        logits = hf(torch.tensor([prompt + prefix])).logits[:, -1:].float()
        return probs_from_logits(transform_logits(logits, [params()]), [params()])[0, 0].double()
    exact = conftest.exact_joint(next_probs, 3)
    n = 6_000
    bound = 0.01 * (100_000 / n) ** 0.5
    assert len(exact) == 8 and abs(sum(exact.values()) - 1) < 1e-4
    assert null_tv(exact, n) < 0.7 * bound                  # noise alone stays well under the bound
    counts, acceptance = conftest.draw_samples(llm, prompt, params, n, 2, seed0=7_000_000)
    p_value, tv, outside = compare_samples(counts, exact)
    assert 0.1 < acceptance < 0.9, acceptance
    assert outside == 0
    assert p_value > 1e-3 and tv < bound, (p_value, tv)


def test_clear_errors_without_a_head(qwen35, tiny_models, qwen35_mtp, tmp_path):
    """--method mtp on a model without MTP weights names the model and what is missing; an
    incomplete head names the missing tensor; options the drafter does not take are refused."""
    from safetensors.torch import load_file, save_file
    for model, why in ((qwen35[0], "weights hold no MTP head"), (tiny_models["llama"], "Qwen3.5 checkpoint")):
        with pytest.raises(DrafterError, match=f"{model}.*has none.*{why}"):
            LLM(model=str(model), method="mtp", **OPTS)
    folder = tmp_path / "partial"
    folder.mkdir()
    for file in qwen35_mtp[0].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    weights = load_file(str(folder / "model.safetensors"))
    del weights["mtp.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DrafterError, match="lacks the tensor mtp.norm.weight"):
        LLM(model=str(folder), method="mtp", **OPTS)
    with pytest.raises(DrafterError, match="tree_topk.*min_confidence"):
        LLM(model=str(qwen35_mtp[0]), method="mtp", tree_topk=2, **OPTS)
    assert json.loads((qwen35_mtp[0] / "config.json").read_text())["mtp_num_hidden_layers"] == 1


def test_seeded_sampled_request_same_alone_and_in_a_batch(llms):
    """A row draws its drafts from its own generator one number per draft it keeps: a seeded sampled
    request gives the same text alone and beside a request whose draft size differs (its own shrinks
    near its max_tokens while the other's does not)."""
    llm = llms["mtp"]
    check_seeded_alone_as_batched(llm, PROMPTS)


def test_reduced_head_drafts_from_its_rows_and_stays_lossless(qwen35_mtp, llms):
    """head_vocab=N: the head drafts over N token ids only (the end of generation among them),
    greedy output stays plain decoding's; a bad head_vocab is named."""
    llm = LLM(model=str(qwen35_mtp[0]), method="mtp", adaptive=False, head_vocab=128, head_rank="id", **OPTS)
    drafter = llm.drafter
    assert torch.equal(drafter.draft_vocab[:3], torch.tensor([0, 1, 2])) and len(drafter.draft_vocab) == 128
    assert set(llm.target.eos_token_ids) <= set(drafter.draft_vocab.tolist())
    logits = drafter._logits(torch.randn(2, drafter.config.hidden_size))           # [2, 1, vocab]
    assert logits.shape[-1] == drafter.vocab and torch.isinf(logits[..., 128:]).all() \
        and torch.isfinite(logits[..., :128]).all()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = llms["plain"].generate(PROMPTS, params)
    reduced = llm.generate(PROMPTS, params, num_speculative_tokens=3)
    assert [o.token_ids for o in reduced] == [o.token_ids for o in plain]
    assert sum(o.stats["drafted_tokens"] for o in reduced) > 0
    with pytest.raises(DrafterError, match="head_vocab must be 0 .* multiple of 32"):
        LLM(model=str(qwen35_mtp[0]), method="mtp", head_vocab=100, **OPTS)
