"""A drafter that the controller keeps off costs nothing per step (issue 60): a drafter with state
whose drafts are never accepted hears nothing of its row (no target features, no commit) except
while it drafts and in the LISTEN steps before each probe; its probes come after waits that
double; every draft reads the features of the step just before it. Counted, not timed."""
from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import Drafter, DrafterCapabilities, DraftProposal
from specdecode.engine import offline
from specdecode.engine.core import EngineCore
from specdecode.engine.probes import LISTEN, MAX_PROBE_EVERY, PROBE_EVERY
from specdecode.engine.sequence import Request, Tokens

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "the quick brown fox jumps over the lazy dog"


class RowState:
    """The spy's per-row state (what the engine accounts for and resets)."""

    def nbytes(self) -> int:
        return 0

    def used_bytes(self) -> int:
        return 0

    def reset(self, row: int) -> None:
        pass

    def truncate(self, row: int, length: int) -> None:
        pass


class WrongHead(Drafter):
    """Reads the target's features like an EAGLE head; drafts tokens the target never emits (it
    knows the plain answer); records in which engine steps it heard of its row."""
    name = "wrong-head"
    capabilities = DrafterCapabilities(needs_target_hidden=True, has_state=True)

    def __init__(self, answer: list[int], prompt_len: int, vocab: int) -> None:
        self.answer, self.prompt_len, self.vocab = answer, prompt_len, vocab
        self.step = 0                       # the engine's steps so far (EngineCore.step wrapped below)
        self.heard: set[int] = set()        # steps in which observe or commit got the row
        self.proposed: list[int] = []       # steps in which it drafted
        self.last_observed = -1
        self.stale = 0                      # drafts made without the features of the step before

    def prepare(self, batch_size, max_len):
        return RowState()

    def observe(self, seqs, starts, hidden):
        self.heard.add(self.step)
        self.last_observed = self.step

    def propose(self, seqs, sizes):
        self.proposed.append(self.step)
        self.stale += self.last_observed != self.step - 1
        wrong = [(self.answer[len(s.token_ids) - self.prompt_len] + 1) % self.vocab for s in seqs]
        proposal = DraftProposal.from_lists([[w] * n for w, n in zip(wrong, sizes)])
        proposal.step_state = [len(s.token_ids) for s in seqs]
        return proposal

    def commit(self, seqs, proposal, num_accepted):
        assert sum(num_accepted) == 0
        self.heard.add(self.step)


def most_probes(steps: int) -> int:
    """The most probes in a run of `steps` steps after a row's first tries: the waits between two
    probes double from 2 * PROBE_EVERY up to MAX_PROBE_EVERY (probes.py), at their shortest
    here; one more where the run starts just before a probe."""
    count, interval, used = 1, 2 * PROBE_EVERY, 0
    while used + interval + 1 <= steps:
        used += interval + 1
        count += 1
        interval = min(2 * interval, MAX_PROBE_EVERY)
    return count


def test_a_drafter_kept_off_hears_nothing_between_its_bounded_probes(tiny_models, monkeypatch):
    llm = LLM(model=str(tiny_models["llama"]), dtype="fp32", progress=False, method="none")
    ids = llm.tokenizer.encode(PROMPT)
    max_tokens = 256 - len(ids) - 8
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    answer = llm.generate([ids], params)[0].token_ids
    spy = WrongHead(answer, len(ids), llm.target.model.vocab_size)
    step = EngineCore.step

    def counted(self, seqs):
        spy.step += 1
        return step(self, seqs)
    monkeypatch.setattr(EngineCore, "step", counted)
    core = offline.offline_core(llm.target, spy, 4)
    offline.prepare(core, 1, max_tokens + len(ids))
    out: list[int] = []
    core.submit(Request(ids, params, lambda e: out.extend(e.ids) if isinstance(e, Tokens) else None, id="r"))
    core.run_until_idle()

    assert out == answer and spy.step == max_tokens       # lossless; every draft rejected: one token a step
    assert spy.proposed and spy.stale == 0
    # heard of while not drafting: only in the LISTEN steps before a probe (a probe drafts once)
    late = spy.step // 2                                   # the first tries are over by then
    idle = [s for s in spy.heard - set(spy.proposed) if s > late]
    probes = [s for s in spy.proposed if s > late]
    assert len(probes) <= most_probes(spy.step - late)
    assert all(b - a > 1 for a, b in zip(probes, probes[1:]))     # a probe is one step that drafts
    assert len(idle) <= LISTEN * (len(probes) + 1)
    assert len(spy.heard) < spy.step // 2
