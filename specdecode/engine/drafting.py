"""Drafting: one step's drafts for every decoding row, from each of their sources, and the one
place that tells the drafter what was accepted.

Sources, in the order a step takes them:
  forced  -- a grammar's forced tokens (structured output, jump-forward): they have probability 1
             under the masked target distribution, so they are committed before the pass, which
             writes them as pending tokens; the row's draft room shrinks by them;
  drafter -- the drafter's proposal for the rows the controller planned at a size > 0 (a grammar
             trims point-mass drafts the target could never accept);
  free    -- drafts that cost nothing to make (a cascade's lookups) for rows planned plain, where
             the controller predicts that verifying them pays;
  shadow  -- a stateless drafter's drafts for rows planned plain, never verified: scored against
             what the rows then emit (free measurements for the controller, `RowSpec.shadow`).
The verified sources are merged into one proposal over the batch (`StepDrafts.proposal`, what
the target scores and the verifier reads); each is committed back with its own proposal (its
`step_state`) by `Drafting.commit`, once per step. Which rows take which source is the
controller's choice (controller.py: `plan`, `shadow_rows`, `free_rows`, `free_draft_pays`);
this module carries it out and measures it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..drafters.base import Drafter, DrafterError, DraftProposal
from ..structured import FORCED_MAX, trim_drafts
from ..tree import depths
from .config import SPAN
from .controller import OFF, SpeculationController
from .sequence import Sequence

DRAFTER, FREE = "drafter", "free"


@dataclass
class SourceDrafts:
    """One source's proposal for some rows of the batch."""
    source: str                  # DRAFTER or FREE
    rows: list[int]              # the batch indices it drafts for
    proposal: DraftProposal      # [len(rows), k]: the proposal the drafter's commit gets (its step_state)


@dataclass
class StepDrafts:
    """One step's drafting, as scoring, verification, commit and the report read it."""
    proposal: DraftProposal      # [batch, k]: every row's verified drafts (rows without any: 0 of them)
    sources: list[str | None]    # per row: DRAFTER, FREE or None (no drafts)
    parts: list[SourceDrafts]    # the per-source proposals, each committed once
    forced: list[list[int]]      # per row: the grammar's forced tokens committed before the pass

    @staticmethod
    def none(batch: int) -> StepDrafts:
        return StepDrafts(DraftProposal.empty(batch), [None] * batch, [], [[] for _ in range(batch)])

    def depths(self) -> list[int]:
        """Each row's draft depth (a chain's length): the draft positions acceptance is counted at."""
        proposal = self.proposal
        if not proposal.is_tree or proposal.k == 0:
            return proposal.num_tokens.tolist()
        live = torch.arange(proposal.k)[None, :] < proposal.num_tokens.cpu()[:, None]
        return torch.where(live, depths(proposal.parents), 0).max(dim=1).values.tolist()

    def priced(self, values: list[int]) -> list[int]:
        """`values` (per row) with the free rows' set to 0: the controller prices a free chain's pass
        rows, not its drafting, and a free row's gains stay plain ones."""
        return [0 if source == FREE else v for source, v in zip(self.sources, values)]


class Drafting:
    def __init__(self, drafter: Drafter | None, controller: SpeculationController, context: int,
                 max_k: int) -> None:
        self.drafter = drafter
        self.controller = controller
        self.context = context                    # a row's positions (its draft room ends there)
        self.max_k = max_k                        # the most drafts a row may carry (chain tokens or tree nodes)

    def draft(self, seqs: list[Sequence], sizes: list[int], pending: list[int]) -> StepDrafts:
        """The step's drafts; `sizes`: the controller's plan (lowered here by forced tokens);
        `pending`: each row's tokens the pass takes besides drafts."""
        if self.drafter is None:
            return StepDrafts.none(len(seqs))
        forced = self._jump_forward(seqs, sizes)
        self._shadow(seqs, sizes)
        free = self._free_drafts(seqs, sizes, pending)
        active = [i for i, k in enumerate(sizes) if k > 0]
        parts = []
        sub = None
        if active:
            sub = self._propose([seqs[i] for i in active], [sizes[i] for i in active])
            if sub.parents is not None:
                free = {}                         # free chains join chain proposals only
            parts.append(SourceDrafts(DRAFTER, active, sub))
        if free:
            parts.append(SourceDrafts(FREE, list(free), DraftProposal.from_lists(list(free.values()))))
        sources: list[str | None] = [None] * len(seqs)
        for part in parts:
            for i in part.rows:
                sources[i] = part.source
        if sub is not None and len(active) == len(seqs):
            return StepDrafts(sub, sources, parts, forced)
        if sub is None:
            merged = DraftProposal.from_lists([free.get(b, []) for b in range(len(seqs))]) if free \
                else DraftProposal.empty(len(seqs))
            return StepDrafts(merged, sources, parts, forced)
        merged = sub.scatter(active, len(seqs), max([sub.k] + [len(d) for d in free.values()])).put_chains(free)
        merged.step_state = sub.step_state       # observe_topk reads the drafter's own step state
        return StepDrafts(merged, sources, parts, forced)

    def commit(self, seqs: list[Sequence], drafts: StepDrafts, accepted: list[int]) -> None:
        """Tell the drafter each row's accepted drafts (`accepted[b]` of them; seqs[b].token_ids
        already holds them and the recovered or bonus token): each source's rows with its own
        proposal, the other rows it hears of (`RowSpec.listening`) with an empty one, and a row
        that finished. Rows that never draft (speculation off) never reach the drafter; rows the
        controller keeps off reach it only as they finish."""
        if self.drafter is None:
            return
        told = set()
        for part in drafts.parts:
            self.drafter.commit([seqs[i] for i in part.rows], part.proposal, [accepted[i] for i in part.rows])
            told.update(part.rows)
        idle = [i for i, s in enumerate(seqs)
                if i not in told and s.spec.mode != OFF and (s.spec.listening or s.finished)]
        if idle:
            self.drafter.commit([seqs[i] for i in idle], DraftProposal.empty(len(idle)), [0] * len(idle))

    # ------------------------------------------------------------------ the sources
    def _jump_forward(self, seqs: list[Sequence], sizes: list[int]) -> list[list[int]]:
        """Structured output: the tokens a row's grammar allows alone, committed now (not for rows
        with stop strings: a stop string may cut them; never an end of sequence, never past
        max_tokens - 1). Returns each row's tokens; lowers its draft room."""
        out: list[list[int]] = [[] for _ in seqs]
        for b, s in enumerate(seqs):
            if s.constraint is None or s.params.stop:
                continue
            forced = s.constraint.forced(s.draft_room(FORCED_MAX, self.context))   # no end of sequence
            if not forced:
                continue
            appended = s.append(forced)
            s.constraint.consume(forced[:appended])
            if s.params.logprobs is not None:     # probability 1 under the masked distribution
                s.logprobs += [(t, 0.0, [(t, 0.0)][:s.params.logprobs]) for t in forced[:appended]]
            s.stats.emitted += appended
            out[b] = forced[:appended]
            sizes[b] = s.draft_room(sizes[b], self.context)
        return out

    def _propose(self, rows: list[Sequence], sizes: list[int]) -> DraftProposal:
        """The drafter's proposal for `rows` (checked, simplified, trimmed by a grammar)."""
        sub = self.drafter.propose(rows, sizes)
        if not isinstance(sub, DraftProposal) or sub.tokens.shape[0] != len(rows):
            raise DrafterError(f"drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)!r}: propose "
                               f"must return a DraftProposal of {len(rows)} rows (one per sequence), got "
                               f"{type(sub).__name__}" + (f" of {sub.tokens.shape[0]} rows"
                                                          if isinstance(sub, DraftProposal) else ""))
        sub = sub.simplified()
        caps = self.drafter.capabilities
        if sub.probs is None and not caps.has_state and not caps.commit_reads_nodes \
                and any(s.constraint is not None for s in rows):
            sub = trim_drafts(rows, sub)          # drafts the grammar forbids: the target could never accept them
        return sub

    def _free_drafts(self, seqs: list[Sequence], sizes: list[int], pending: list[int]) -> dict[int, list[int]]:
        """{row index: chain} of the drafts that cost nothing to make, for the rows the controller
        offers them to, kept where it predicts verifying them pays."""
        if not self.drafter.capabilities.free_drafts:
            return {}
        idle = self.controller.free_rows([s.spec for s in seqs], sizes, [s.constraint is not None for s in seqs])
        if not idle:
            return {}
        rows = sum(pending) + sum(sizes)
        rooms = [seqs[i].draft_room(min(max(SPAN, seqs[i].spec.k), self.max_k), self.context) for i in idle]
        chains = self.drafter.free_drafts([seqs[i] for i in idle], rooms,
                                          lambda n, a: self.controller.free_draft_pays(rows, len(seqs), n, a))
        return {i: list(c[:room]) for i, c, room in zip(idle, chains, rooms) if c and room}

    def _shadow(self, seqs: list[Sequence], sizes: list[int]) -> None:
        """Shadow drafts for the rows the controller names (a stateless drafter's only), one call."""
        if not self.controller.shadowed:
            return
        rooms = [s.draft_room(s.spec.k, self.context) for s in seqs]
        idle = self.controller.shadow_rows([s.spec for s in seqs], sizes, rooms,
                                           [s.params.greedy for s in seqs])
        if not idle:
            return
        started = time.perf_counter()
        rows = [seqs[i] for i in idle]
        proposal = self.drafter.propose(rows, [rooms[i] for i in idle])
        drafted = time.perf_counter()
        counts = proposal.num_tokens.tolist()
        for s, (nodes, path), count in zip(rows, proposal.main_paths(), counts):
            if nodes:
                s.spec.shadow = (len(s.token_ids), path, None if proposal.parents is None else nodes, count)
        self.controller.observe_shadows(time.perf_counter() - started, drafted - started, len(rows), sum(counts))
