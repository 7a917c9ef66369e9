"""Medusa heads: lossless trees from untrained heads (batched and alone, several budgets), the
feature each step drafts from is the target's own at the right position (tree steps included),
`distill --kind medusa` end to end with the labels at the right offsets, bad options."""
import json

import pytest
import torch
from conftest import assert_drafts_accepted_and_exact, run_engine

from specdecode import LLM, SamplingParams
from specdecode.cli import main
from specdecode.drafters.base import DrafterError
from specdecode.drafters.format import save_medusa
from specdecode.drafters.medusa import MedusaConfig, MedusaHeads
from specdecode.drafters.registry import build_drafter
from specdecode.forward import ForwardBatch
from specdecode.models.loader import load_model
from specdecode.tree import depths, validate

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
           "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8", "x"]
HEADS = 3


def untrained_heads(target, out, scale: float = 0.1):
    """Random heads (a small W_i: each head is nearly the target's own LM head) on a reduced
    draft vocabulary, saved in the drafter format."""
    c = target.model.config
    torch.manual_seed(0)
    vocab = torch.arange(c.vocab_size // 3, c.vocab_size)
    heads = MedusaHeads(MedusaConfig(c.hidden_size, HEADS, vocab.numel(), c.vocab_size), vocab)
    with torch.no_grad():
        heads.weight.normal_(0, scale / c.hidden_size ** 0.5)
    return save_medusa(heads, out, target, {"note": "untrained"})


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory, one_thread):
    return {arch: untrained_heads(load_model(str(tiny_models[arch]), "fp32", progress=False),
                                  tmp_path_factory.mktemp(f"medusa_{arch}"))
            for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_medusa_greedy_equals_plain(tiny_models, heads, arch):
    llm = LLM(model=str(tiny_models[arch]), method="medusa", drafter_path=str(heads[arch]), dtype="fp32",
              progress=False, adaptive=False, tree_topk=3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    for k in (1, 4, 12, 40):
        spec = llm.generate(PROMPTS, params, num_speculative_tokens=k)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], k
        alone = llm.generate([PROMPTS[1]], params, num_speculative_tokens=k)[0]
        assert alone.token_ids == plain[1].token_ids
        assert spec[0].stats["steps"] < 30     # it drafted and the loop advanced
    caps = llm.drafter.capabilities
    assert caps.drafts_trees and caps.needs_target_hidden and caps.has_state


def test_medusa_heads_directory_picks_the_medusa_method(tiny_models, heads):
    llm = LLM(model=str(tiny_models["llama"]), drafter_path=str(heads["llama"]), dtype="fp32", progress=False)
    assert llm.method == "medusa"


def test_medusa_sampled_rows_run_seeded(tiny_models, heads):
    llm = LLM(model=str(tiny_models["llama"]), method="medusa", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True)
    a = llm.generate(PROMPTS[:2], params, num_speculative_tokens=6)
    b = llm.generate(PROMPTS[:2], params, num_speculative_tokens=6)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(len(x.token_ids) == 20 for x in a)


def test_medusa_trees_and_features(tiny_models, heads):
    """Every proposal is a valid tree within its budget and HEADS deep, siblings distinct, depth d
    drawn from head d-1's top-k; and the feature it drafts from is the target's own hidden state at
    position len(token_ids) - 2, recomputed from scratch (after tree steps with accepted drafts)."""
    target = load_model(str(tiny_models["llama"]), "fp32", progress=False)
    drafter = build_drafter("medusa", target, drafter_path=str(heads["llama"]), tree_topk=3)
    seen = []
    original = drafter.propose

    def spy(seqs, max_tokens):
        proposal = original(seqs, max_tokens)
        for b, s in enumerate(seqs):
            p = len(s.token_ids) - 2
            if p >= 0 and max_tokens[b] > 0:
                seen.append((list(s.token_ids), s.drafter_state.features[s.row, p].clone(),
                             proposal, b, max_tokens[b]))
        return proposal
    drafter.propose = spy
    ids = [target.tokenizer.encode(p, add_special=False) for p in PROMPTS[:3]]
    out = run_engine(target, drafter, 10, ids, [SamplingParams(max_tokens=24, ignore_eos=True)] * 3, adaptive=False)
    assert sum(s.stats.accepted for s in out) > 0 and any(s.stats.steps < 20 for s in out)
    assert len(seen) > 10
    model = target.model
    for token_ids, feature, proposal, b, budget in seen:
        n = int(proposal.num_tokens[b])
        assert 0 < n <= budget
        parents = proposal.parents[b:b + 1, :n]
        validate(parents, proposal.num_tokens[b:b + 1])
        node_depths = depths(parents)[0]
        assert int(node_depths.max()) <= HEADS
        pairs = list(zip(parents[0].tolist(), proposal.tokens[b, :n].tolist()))
        assert len(set(pairs)) == len(pairs)
        tokens = torch.tensor([token_ids[:-1]])
        hidden = model.run(ForwardBatch.chain(tokens, 0), model.new_cache(1, tokens.shape[1]))[0, -1]
        torch.testing.assert_close(feature, hidden, rtol=1e-4, atol=1e-4)
        log_probs = drafter.head_log_probs(hidden[None])[0]                              # [HEADS, V_draft]
        top = drafter.draft_vocab[log_probs.topk(3, dim=-1).indices]                      # [HEADS, 3]
        for token, d in zip(proposal.tokens[b, :n].tolist(), node_depths.tolist()):
            assert token in top[d - 1].tolist()


def test_medusa_bad_options_and_kinds(tiny_models, heads, tmp_path):
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="none")
    path = str(heads["llama"])
    for bad, match in (({"tree_topk": 0}, "tree_topk"), ({"tree_topk": 17}, "tree_topk"),
                       ({"tree_depth": HEADS + 1}, rf"tree_depth must be an integer in \[1, {HEADS}\]"),
                       ({"tree_depth": 1.5}, "tree_depth")):
        with pytest.raises(DrafterError, match=match):
            build_drafter("medusa", llm.target, drafter_path=path, **bad)
    with pytest.raises(DrafterError, match="holds a 'medusa' drafter, not 'eagle'"):
        build_drafter("eagle", llm.target, drafter_path=path)
    with pytest.raises(DrafterError, match="no Medusa heads"):
        build_drafter("medusa", llm.target)
    meta = json.loads((heads["llama"] / "drafter.json").read_text())
    meta["config"]["version"] = 99
    (tmp_path / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match="newer than this specdecode"):
        build_drafter("medusa", llm.target, drafter_path=str(tmp_path))


# ---------------------------------------------------------------------------------- distill
@pytest.fixture(scope="module")
def distilled(tiny_models, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("distill_medusa")
    code = main(["distill", "--kind", "medusa", "--heads", "3", "--target", str(tiny_models["llama"]),
                 "--out", str(out), "--max-prompts", "20", "--max-new-tokens", "40", "--minutes", "0.1",
                 "--eval-every", "0.05", "--draft-vocab", "128", "--batch-tokens", "256", "--epochs", "10000",
                 "--eval-prompts", "1", "--dtype", "fp32"])
    assert code == 0
    return out


def test_distill_medusa_outputs(tiny_models, distilled):
    drafter = distilled / "drafter"
    meta = json.loads((drafter / "drafter.json").read_text())
    assert meta["kind"] == "medusa" and meta["version"] == 1 and meta["config"]["version"] == 1
    assert meta["config"]["num_heads"] == 3 and meta["config"]["draft_vocab_size"] == 128
    curve = json.loads((distilled / "curve.json").read_text())
    assert curve[0]["step"] == 0 and len(curve) >= 2
    assert curve[-1]["loss"] < curve[1]["loss"], curve           # the training loss went down
    last = curve[-1]
    assert len(last["head_top1"]) == 3 and len(last["mean_accepted_length"]) == 8
    assert last["mean_accepted_length"][2] == last["mean_accepted_length"][7]   # a chain is 3 deep
    assert json.loads((distilled / "eval.json").read_text())["mean_accepted_length"] >= 1.0
    llm = LLM(model=str(tiny_models["llama"]), method="medusa", drafter_path=str(drafter), dtype="fp32",
              progress=False)
    assert llm.drafter.matches_target
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for chat in (False, True):
        plain = llm.generate(PROMPTS[:2], params, num_speculative_tokens=0, chat=chat)
        spec = llm.generate(PROMPTS[:2], params, num_speculative_tokens=8, chat=chat)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


def test_distill_medusa_labels_at_the_right_offsets(tiny_models, distilled):
    """Head i at position p is trained on the corpus token at p+2+i (answer tokens only)."""
    from specdecode.distill.features import FeatureSet
    from specdecode.distill.medusa import MedusaTrainConfig, MedusaTrainer
    target = load_model(str(tiny_models["llama"]), "fp32", progress=False)
    data = FeatureSet.load(distilled / "features.pt")
    trainer = MedusaTrainer(target, data, MedusaTrainConfig(heads=3, draft_vocab_size=data.num_tokens), distilled)
    checked = 0
    for s in range(min(4, data.num_sequences)):
        a, n, prompt = int(data.offsets[s]), data.length(s), int(data.prompt_lens[s])
        features, labels = trainer._positions([s])
        start = max(0, prompt - 1 - 3)                      # the first position any head has an answer token for
        torch.testing.assert_close(features[0], data.features[a + start].float())
        tokens = data.tokens[a:a + n].tolist()
        for row in range(labels.shape[0]):
            p = start + row
            for i in range(3):
                q = p + 2 + i                                # the token head i predicts
                if prompt <= q < n:
                    assert int(trainer.head.draft_vocab[labels[row, i]]) == tokens[q]
                    checked += 1
                elif q < prompt:
                    assert int(labels[row, i]) == -100       # prompt tokens are not trained on
    assert checked > 50


def test_distill_medusa_resume_and_bad_options(tiny_models, distilled, capsys):
    base = ["distill", "--kind", "medusa", "--target", str(tiny_models["llama"]), "--out", str(distilled),
            "--max-prompts", "20", "--max-new-tokens", "40", "--draft-vocab", "128", "--eval-prompts", "0",
            "--dtype", "fp32"]
    assert main(base + ["--heads", "3", "--minutes", "0.15", "--resume"]) == 0
    assert "resumed at step" in capsys.readouterr().err
    assert main(base + ["--heads", "4", "--minutes", "0.2", "--resume"]) == 2
    assert "has 3 heads, --heads is 4" in capsys.readouterr().err
    assert main(base + ["--heads", "17"]) == 2
    assert "--heads must be in [1, 16], got 17" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(base + ["--heads", "0"])
    assert exit_info.value.code == 2
    assert "--heads must be >= 1, got 0" in capsys.readouterr().err


def test_medusa_in_the_server_stays_lossless_with_mixed_and_switching_rows(tiny_models, heads):
    """In the server (paged target cache, chunked prefill, rows with speculation off, automatic
    switching) the heads' per-row features stay right: greedy outputs equal plain decoding, and
    the feature state is accounted and freed when requests end."""
    from conftest import mixed_rows_through_server
    llm = LLM(model=str(tiny_models["llama"]), method="medusa", drafter_path=str(heads["llama"]), dtype="fp32",
              progress=False)
    jobs, wants, outs, _, stats = mixed_rows_through_server(llm, PROMPTS[:3])
    assert [o["choices"][0]["token_ids"] for o in outs] == wants
    assert sum(o["speculation"]["accepted_tokens"] for o in outs) > 0
    assert all(o["speculation"]["drafted_tokens"] == 0 for o, job in zip(outs, jobs) if job[1] == {"speculate": False})
    assert stats["memory"]["kv_bytes_capacity"]["draft"] > 0 and stats["memory"]["kv_bytes_used"]["draft"] == 0


def test_shipped_medusa_heads_for_the_embedded_model(smollm2):
    """The heads shipped in the package are found by the embedded target's fingerprint, their
    tree drafts are accepted, and greedy output stays the target's."""
    from specdecode.drafters.format import shipped_drafter
    assert shipped_drafter(smollm2, "medusa") is not None
    drafter = build_drafter("medusa", smollm2)
    assert drafter.matches_target and drafter.config.num_heads == 4
    assert_drafts_accepted_and_exact(smollm2, drafter, "Explain how photosynthesis works.", 48)
