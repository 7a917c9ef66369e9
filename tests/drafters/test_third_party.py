"""A drafter written outside the package runs everywhere a built-in one does, with no change
inside specdecode/: registered with `register(name)` or found through the `specdecode.drafters`
entry-point group, it runs in `LLM(...).generate`, in `specdecode generate --method NAME` and in
the server, which accounts for its per-request state and resets a row's state when its request
ends. It declares its capabilities and passes its per-step state from propose to commit in the
proposal, as the built-in drafters do."""
from __future__ import annotations

import asyncio
import importlib.metadata
import json

import httpx
import pytest
import torch
from conftest import post_completions

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import Drafter, DrafterCapabilities, DraftProposal
from specdecode.drafters.registry import ENTRY_POINT_GROUP, method_names, register, unregister

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
         "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4",
         "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"]


class BigramTable:
    """Per-row state: for each token, the token that last followed it in the row's text."""

    def __init__(self, rows: int, vocab: int) -> None:
        self.follow = torch.full((rows, vocab), -1, dtype=torch.long)     # [rows, vocab]
        self.seen = [0] * rows            # tokens of the row's text learned so far
        self.resets = 0

    def nbytes(self) -> int:
        return self.follow.numel() * self.follow.element_size()

    def used_bytes(self) -> int:
        return self.nbytes() * sum(1 for n in self.seen if n) // len(self.seen)

    def reset(self, row: int) -> None:
        self.follow[row] = -1
        self.seen[row] = 0
        self.resets += 1

    def truncate(self, row: int, length: int) -> None:
        self.seen[row] = min(self.seen[row], length)


class BigramDrafter(Drafter):
    """Drafts by chaining, from the last token, the token that followed each one last time."""

    capabilities = DrafterCapabilities(has_state=True, relative_cost=0.01)

    def __init__(self, target, **_) -> None:
        self.vocab = target.model.vocab_size
        self.table: BigramTable | None = None
        self.commits = 0

    def prepare(self, batch_size: int, max_len: int) -> BigramTable:
        self.table = BigramTable(batch_size, self.vocab)
        return self.table

    def propose(self, seqs, max_tokens):
        drafts = []
        for s, k in zip(seqs, max_tokens):
            ids, row = s.token_ids, s.row
            for a, b in zip(ids[max(self.table.seen[row] - 1, 0):-1], ids[max(self.table.seen[row], 1):]):
                self.table.follow[row, a] = b                 # catch up on the text since the last step
            self.table.seen[row] = len(ids)
            draft, token = [], ids[-1]
            while len(draft) < k and (token := int(self.table.follow[row, token])) >= 0:
                draft.append(token)
            drafts.append(draft)
        proposal = DraftProposal.from_lists(drafts)
        proposal.step_state = [s.request_id for s in seqs]    # handed back to commit
        return proposal

    def commit(self, seqs, proposal, num_accepted):
        if proposal.step_state is not None:
            assert proposal.step_state == [s.request_id for s in seqs]
            self.commits += 1


@pytest.fixture
def bigram():
    register("bigram")(BigramDrafter)
    yield "bigram"
    unregister("bigram")


@pytest.fixture
def bigram_entry_point(monkeypatch):
    """`BigramDrafter` as if an installed distribution declared it in the entry-point group."""
    point = importlib.metadata.EntryPoint("bigram-ep", f"{__name__}:BigramDrafter", ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points

    def entry_points(**select):
        if select.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints([point])
        return real(**select)
    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    yield "bigram-ep"
    unregister("bigram-ep")


def plain_outputs(llm, texts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [llm.generate([llm.tokenizer.encode(t)], params, num_speculative_tokens=0)[0].token_ids for t in texts]


@pytest.mark.parametrize("source", ["bigram", "bigram_entry_point"])
def test_generate_with_a_drafter_from_outside(tiny_models, request, source):
    method = request.getfixturevalue(source)
    assert method in method_names()
    llm = LLM(model=str(tiny_models["llama"]), method=method, num_speculative_tokens=4, dtype="fp32",
              progress=False)
    assert isinstance(llm.drafter, BigramDrafter) and llm.drafter.name == method
    outs = llm.generate([llm.tokenizer.encode(t) for t in TEXTS], SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_outputs(llm, TEXTS, 24)
    assert sum(o.stats["drafted_tokens"] for o in outs) > 0 and llm.drafter.commits > 0


@pytest.mark.parametrize("source", ["bigram", "bigram_entry_point"])
def test_cli_offers_and_runs_a_drafter_from_outside(tiny_models, request, source, capsys):
    from specdecode.bench.cli import methods as bench_methods
    from specdecode.cli import build_parser, main
    method = request.getfixturevalue(source)
    assert method in bench_methods()
    assert build_parser().parse_args(["generate", "hi", "--method", method]).method == method
    code = main(["generate", TEXTS[0], "--method", method, "--model", str(tiny_models["llama"]), "--no-chat",
                 "--json", "--max-tokens", "16", "--ignore-eos", "--dtype", "fp32", "-k", "3"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["method"] == method
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False)
    assert out["tokens"] == plain_outputs(llm, TEXTS[:1], 16)[0]


def test_server_runs_and_accounts_a_drafter_from_outside(tiny_models, bigram):
    from specdecode.engine.config import EngineConfig
    from specdecode.serve.app import create_app
    from specdecode.serve.server import BackgroundServer, build_state
    llm = LLM(model=str(tiny_models["llama"]), method=bigram, num_speculative_tokens=4, dtype="fp32",
              progress=False)
    jobs = [(TEXTS[i % 3], 12 + 3 * i, {0: {}, 1: {"speculate": False}, 2: {"speculate": True}}[i % 3])
            for i in range(6)]
    wants = [plain_outputs(llm, [t], n)[0] for t, n, _ in jobs]
    state = build_state(llm, EngineConfig(max_batch_size=2, block_size=4, prefill_chunk=16, max_model_len=128,
                                         served_model_name="tiny"))
    table = llm.drafter.table                 # the state the server made the drafter prepare
    assert table is not None and state.engine.runner.drafter_state is table

    with BackgroundServer(create_app(state)) as server:
        outs = asyncio.run(post_completions(server.url, jobs))
        stats = httpx.get(server.url + "/api/stats", timeout=10).json()
    assert [o["choices"][0]["token_ids"] for o in outs] == wants
    assert sum(o["speculation"]["drafted_tokens"] for o in outs) > 0
    memory = stats["memory"]
    assert memory["kv_bytes_capacity"]["draft"] == table.nbytes() > 0
    assert memory["kv_bytes_used"]["draft"] == 0                 # every row reset as its request ended
    assert table.resets >= len(jobs) and llm.drafter.commits > 0
