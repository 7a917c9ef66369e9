"""The drafting component (engine/drafting.py) on synthetic proposals, without a model: every
source merged into one proposal with each row's source, one commit per source with its own
proposal, shadows drafted in one call and never verified, free chains only beside chains, the
batch-size limit, a drafter's malformed proposal named."""
import pytest

from specdecode.drafters.base import Drafter, DrafterCapabilities, DrafterError, DraftProposal
from specdecode.engine.controller import AUTO, OFF, ON, SpeculationController
from specdecode.engine.costs import StepCosts
from specdecode.engine.drafting import DRAFTER, FREE, Drafting
from specdecode.engine.sequence import Request, Sequence
from specdecode.params import SamplingParams

CONTEXT = 256


class Script(Drafter):
    """Drafts `table[prompt's first token]` (a chain, or a tree of (token, parent) nodes), records
    every call; `free`: the chains it offers as free drafts (a cascade's lookups)."""
    name = "script"

    def __init__(self, table, free=None, capabilities=None, rows=None):
        self.table, self.free, self.capabilities = table, free or {}, capabilities or DrafterCapabilities()
        self.rows = rows                      # a wrong row count to return (a broken drafter)
        self.proposed, self.committed = [], []

    def propose(self, seqs, sizes):
        self.proposed.append(([s.token_ids[0] for s in seqs], list(sizes)))
        drafts = [self.table[s.token_ids[0]] for s in seqs][:self.rows]
        if drafts and isinstance(drafts[0][0], tuple):
            return DraftProposal.from_trees([d[:n] for d, n in zip(drafts, sizes)])
        out = DraftProposal.from_lists([d[:n] for d, n in zip(drafts, sizes)])
        out.step_state = [s.token_ids[0] for s in seqs][:self.rows]
        return out

    def free_drafts(self, seqs, rooms, pays):
        return [self.free.get(s.token_ids[0], [])[:room] if pays(len(self.free.get(s.token_ids[0], [])), 0.9)
                else [] for s, room in zip(seqs, rooms)]

    def commit(self, seqs, proposal, num_accepted):
        self.committed.append(([s.token_ids[0] for s in seqs], proposal.tokens.tolist(), proposal.step_state,
                               list(num_accepted)))


def controller(drafter, max_batch=None, curve=None):
    caps = drafter.capabilities
    costs = StepCosts(curve or {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.05, 16: 1.1, 32: 1.2, 64: 1.4},
                      draft_cost=None, passes=False)
    return SpeculationController(caps, costs, True, max_batch)


def rows(ctrl, firsts, modes=None, k=4, greedy=True):
    """Sequences whose prompts start with `firsts` (the Script's keys), each with a row spec."""
    out = []
    for b, first in enumerate(firsts):
        mode = (modes or [AUTO] * len(firsts))[b]
        params = SamplingParams(max_tokens=64, temperature=0.0 if greedy else 1.0)
        request = Request([first, 7, 7], params, lambda event: None, id=f"r{b}")
        out.append(Sequence(request, (), b, ctrl.new_row(k, mode), "cpu"))
    return out


def test_sources_merge_into_one_proposal_and_each_is_committed_once_with_its_own():
    drafter = Script({1: [11, 12, 13], 2: [21, 22], 3: [31], 4: [41]}, free={2: [25, 26, 27]},
                     capabilities=DrafterCapabilities(free_drafts=True))
    ctrl = controller(drafter)
    ctrl.shadow_due = lambda seconds, young=False: False      # (a cascade's head has state: no shadows)
    seqs = rows(ctrl, [1, 2, 3, 4], modes=[AUTO, AUTO, AUTO, OFF])
    drafting = Drafting(drafter, ctrl, CONTEXT, 32)
    drafts = drafting.draft(seqs, [3, 0, 1, 0], [1, 1, 1, 1])
    assert drafts.sources == [DRAFTER, FREE, DRAFTER, None]
    assert drafts.proposal.num_tokens.tolist() == [3, 3, 1, 0]
    assert drafts.proposal.tokens.tolist()[:3] == [[11, 12, 13], [25, 26, 27], [31, 0, 0]]
    assert drafts.proposal.step_state == [1, 3]          # the drafter's own step state, for observe_topk
    assert drafts.priced([3, 3, 1, 0]) == [3, 0, 1, 0]   # the free chain's drafting is not priced
    assert drafter.proposed == [([1, 3], [3, 1])]
    drafting.commit(seqs, drafts, [2, 3, 0, 0])
    assert drafter.committed == [([1, 3], [[11, 12, 13], [31, 0, 0]], [1, 3], [2, 0]),
                                 ([2], [[25, 26, 27]], None, [3])]           # the OFF row never reaches it


def test_rows_that_may_draft_but_did_not_are_committed_with_an_empty_proposal():
    drafter = Script({1: [11, 12], 2: [21]})
    ctrl = controller(drafter)
    ctrl.shadow_due = lambda seconds, young=False: False
    seqs = rows(ctrl, [1, 2, 3], modes=[AUTO, AUTO, OFF])
    drafting = Drafting(drafter, ctrl, CONTEXT, 32)
    drafts = drafting.draft(seqs, [2, 0, 0], [1, 1, 1])
    assert drafts.sources == [DRAFTER, None, None] and drafts.parts[0].rows == [0]
    drafting.commit(seqs, drafts, [1, 0, 0])
    assert drafter.committed == [([1], [[11, 12]], [1], [1]), ([2], [[]], None, [0])]


def test_shadows_are_one_call_for_the_plain_rows_and_never_verified():
    drafter = Script({1: [11, 12, 13, 14], 2: [21, 22, 23, 24], 3: [31]})
    ctrl = controller(drafter)
    ctrl.shadow_due = lambda seconds, young=False: True
    seqs = rows(ctrl, [1, 2, 3], modes=[AUTO, AUTO, ON])
    drafts = Drafting(drafter, ctrl, CONTEXT, 32).draft(seqs, [0, 0, 1], [1, 1, 1])
    assert drafter.proposed == [([1, 2], [4, 4]), ([3], [1])]           # shadows first, in one call
    assert drafts.proposal.num_tokens.tolist() == [0, 0, 1] and drafts.sources == [None, None, DRAFTER]
    assert seqs[0].spec.shadow == (3, [11, 12, 13, 14], None, 4) and seqs[2].spec.shadow is None


def test_free_chains_join_chain_proposals_only():
    tree = [(51, -1), (52, -1), (53, 0)]
    drafter = Script({1: tree, 2: [21]}, free={2: [25, 26]},
                     capabilities=DrafterCapabilities(free_drafts=True, drafts_trees=True))
    ctrl = controller(drafter)
    seqs = rows(ctrl, [1, 2])
    drafts = Drafting(drafter, ctrl, CONTEXT, 64).draft(seqs, [3, 0], [1, 1])
    assert drafts.proposal.is_tree and drafts.sources == [DRAFTER, None]
    assert drafts.proposal.num_tokens.tolist() == [3, 0] and len(drafts.parts) == 1


def test_a_batch_over_the_limit_drafts_only_for_its_on_rows():
    drafter = Script({1: [11], 2: [21]}, free={1: [15, 16]}, capabilities=DrafterCapabilities(free_drafts=True))
    ctrl = controller(drafter, max_batch=1)
    seqs = rows(ctrl, [1, 2], modes=[AUTO, ON], k=1)
    sizes = ctrl.plan([s.spec for s in seqs], [1, 1])
    assert sizes == [0, 1]
    drafts = Drafting(drafter, ctrl, CONTEXT, 32).draft(seqs, sizes, [1, 1])
    assert drafts.sources == [None, DRAFTER]                             # no free chain either
    alone = rows(ctrl, [1], k=1)
    assert ctrl.free_rows([s.spec for s in alone], [0], [False]) == [0]


def test_forced_tokens_are_committed_first_lower_the_room_and_the_grammar_trims_drafts():
    class Forcing:
        """Forces 5 6 7, then allows any one token."""
        def forced(self, room):
            return [5, 6, 7][:room]

        def consume(self, tokens):
            self.consumed = list(tokens)

        def valid_prefix(self, path):
            return min(len(path), 1)
    drafter = Script({1: [11, 12, 13, 14]})
    ctrl = controller(drafter)
    seq = rows(ctrl, [1])[0]
    seq.params = SamplingParams(max_tokens=6)                 # room for 5 more tokens past the step's own
    seq.constraint = Forcing()
    drafts = Drafting(drafter, ctrl, CONTEXT, 32).draft([seq], [4], [1])
    assert drafts.forced == [[5, 6, 7]] and seq.output_ids == [5, 6, 7] and seq.constraint.consumed == [5, 6, 7]
    assert drafter.proposed == [([1], [2])]                   # 6 - 3 forced - 1 (the step's own token)
    assert drafts.proposal.tokens.tolist() == [[11]] and drafts.proposal.step_state == [1]   # trimmed


def test_a_drafter_that_returns_the_wrong_rows_is_named():
    drafter = Script({1: [11], 2: [21]}, rows=1)
    ctrl = controller(drafter)
    with pytest.raises(DrafterError, match="drafter 'script': propose must return a DraftProposal of 2 rows"):
        Drafting(drafter, ctrl, CONTEXT, 32).draft(rows(ctrl, [1, 2]), [1, 1], [1, 1])
