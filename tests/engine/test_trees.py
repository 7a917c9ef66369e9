"""Trees through the whole engine: a drafter that knows the right continuation but hides it among
decoys (the true token is never the first child) makes every step accept a path that is not the
first branch, so compaction runs at every step. Greedy output stays identical to plain decoding
(also with a repetition penalty, which is counted along each node's own path), native and eager."""
import pytest

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import Drafter, DrafterCapabilities, DraftProposal
from specdecode.drafters.registry import register, unregister
from specdecode.params import ParamError

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
           "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8"]
ORACLE: dict[tuple, list[int]] = {}       # prompt ids -> the plain greedy output


class DecoyTree(Drafter):
    """Per level: a decoy child first, then the true token (from ORACLE), whose own children
    continue the pattern; a second decoy hangs under the first decoy."""
    capabilities = DrafterCapabilities(drafts_trees=True)

    def __init__(self, target, **_) -> None:
        self.vocab = target.model.vocab_size

    def propose(self, seqs, max_tokens):
        trees = []
        for s, budget in zip(seqs, max_tokens):
            truth = ORACLE.get(tuple(s.prompt_ids), [])[s.num_output:]
            nodes, parent = [], -1
            for depth, token in enumerate(truth):
                if len(nodes) + 2 > budget:
                    break
                decoy = (token + 1 + depth) % self.vocab
                nodes.append((decoy, parent))
                if depth % 2 == 0 and len(nodes) + 2 <= budget:
                    nodes.append(((decoy + 7) % self.vocab, len(nodes) - 1))
                nodes.append((token, parent))
                parent = len(nodes) - 1
            trees.append(nodes)
        return DraftProposal.from_trees(trees)


@pytest.fixture(scope="module", autouse=True)
def decoy_method():
    register("test-decoy-tree")(DecoyTree)
    yield
    unregister("test-decoy-tree")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_tree_greedy_equals_plain(tiny_models, arch, fast, penalty):
    llm = LLM(model=str(tiny_models[arch]), method="test-decoy-tree", dtype="fp32", progress=False, fast=fast,
              num_speculative_tokens=12, adaptive=False)
    params = SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=penalty)
    plain = llm.generate(PROMPTS, params, num_speculative_tokens=0)
    ORACLE.clear()
    ORACLE.update({tuple(p.prompt_token_ids): p.token_ids for p in plain})
    spec = llm.generate(PROMPTS, params)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert s.stats["mean_accepted_length"] > 3.0          # the true path, below decoys, is accepted
        assert s.stats["tree_nodes_mean"] > s.stats["mean_accepted_length"]
    llm.adaptive = True                                       # sizes chosen per step: same tokens
    adaptive = llm.generate(PROMPTS, params)
    assert [s.token_ids for s in adaptive] == [p.token_ids for p in plain]
    ORACLE.clear()                                            # no oracle: only decoys, still identical
    alone = llm.generate(PROMPTS[:1], params)[0]
    assert alone.token_ids == plain[0].token_ids


def test_tree_budget_is_checked(tiny_models):
    with pytest.raises(ParamError, match=r"num_speculative_tokens \(-k: draft tree nodes per step\).*\[0, 64\]"):
        LLM(model=str(tiny_models["llama"]), method="test-decoy-tree", dtype="fp32", progress=False,
            num_speculative_tokens=65)
    with pytest.raises(ParamError, match=r"draft tokens per step.*\[0, 32\]"):
        LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False, num_speculative_tokens=40)
