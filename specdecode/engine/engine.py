"""The speculative decoding loop: one `step` is four calls: draft, score + verify, commit, stats.

Plain decoding is the same loop with an empty draft (k = 0), so both paths share every line of
sampling code. The engine is composed as nano-vllm's is: this loop, a scheduler that decides
which rows run and how many drafts each may carry (scheduler.py; the server has its own), and a
model runner that owns the KV caches and runs the target's passes (runner.py). `generate` runs
a fixed batch offline; the server drives `step` itself over a changing set of rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..drafters.base import DraftProposal, Drafter, DrafterError
from ..params import ParamError, SamplingParams
from ..tree import MAX_TREE_NODES, depths
from ..sampling import position_uniforms
from ..verify_tree import verify_greedy_lists, verify_point_mass, verify_tree
from .runner import ModelRunner
from .budget import PRIOR_ACCEPTANCE, DraftBudget
from .costs import measure_cost_curve
from .shadows import ShadowDrafts
from .scheduler import StaticBatch, draft_room
from .threads import ThreadTuner
from .sequence import Sequence, attach_prediction
from ..structured import FORCED_MAX, grammar_tokenizer, trim_drafts

StreamCallback = Callable[[Sequence, list[int]], None]


@dataclass
class StepReport:
    """What one step drafted and kept, and what it cost (the adaptive draft size reads it)."""
    num_nodes: list[int]              # drafts (chain tokens / tree nodes) per sequence
    accepted_nodes: list[list[int]]   # per sequence the accepted path, node indices by depth
    draft_seconds: float
    verify_seconds: float
    node_tokens: list[list[int]] | None = None    # per sequence its draft's tokens (num_nodes of them)
    node_parents: list[list[int]] | None = None   # per sequence each node's parent (-1: the root)
    emitted: list[list[int]] | None = None        # per sequence the tokens this step appended
MAX_CHAIN = 32          # draft tokens per row of a chain drafter
SPAN = 32               # the longest draft of a copying drafter's step (a long copy: an edit, a quote)


def check_num_speculative_tokens(k: object, drafter: Drafter | None) -> None:
    """ParamError unless k is a valid draft size for this drafter: tokens of a chain (<= MAX_CHAIN)
    or nodes of a tree (<= MAX_TREE_NODES)."""
    trees = drafter is not None and drafter.capabilities.drafts_trees
    limit = MAX_TREE_NODES if trees else MAX_CHAIN
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= limit:
        what = "draft tree nodes" if trees else "draft tokens"
        raise ParamError(f"num_speculative_tokens (-k: {what} per step) must be an integer in [0, {limit}] for "
                         f"{'a tree' if trees else 'a chain'} drafter ({drafter.name if drafter else 'none'}), "
                         f"got {k!r}")


def tree_depth(proposal: DraftProposal) -> list[int]:
    """Depth of each row's draft (a chain's length): the draft positions acceptance is counted at."""
    if not proposal.is_tree or proposal.k == 0:
        return proposal.num_tokens.tolist()
    live = torch.arange(proposal.k)[None, :] < proposal.num_tokens.cpu()[:, None]
    return torch.where(live, depths(proposal.parents), 0).max(dim=1).values.tolist()


def record_logprobs(s: Sequence, tokens: list[int],
                    logprobs: torch.Tensor) -> None:                  # [len >= len(tokens), vocab]
    """Each emitted token's log-probability and the top N alternatives, at the position it was
    drawn at (the same values with speculation on or off: rows are computed alike)."""
    n = s.params.logprobs
    rows = logprobs[:len(tokens)].cpu()
    chosen = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    top = rows.topk(n, dim=-1) if n else None
    for j, t in enumerate(tokens):
        alternatives = list(zip(top.indices[j].tolist(), top.values[j].tolist())) if n else []
        s.logprobs.append((t, chosen[j], alternatives))


def check_room(prompt_tokens: int, max_tokens: int, context: int, name: str = "max_tokens") -> None:
    """ParamError unless the prompt and `name` (the max-tokens parameter as the caller spells it) fit the context."""
    if prompt_tokens + max_tokens > context:
        raise ParamError(f"prompt ({prompt_tokens} tokens) + {name} ({max_tokens}) exceeds the model's context of "
                         f"{context} tokens")


def check_requests(prompts: list[list[int]], params: list[SamplingParams], model) -> None:
    """ParamError naming the prompt unless each is non-empty, its token ids are in the model's
    vocabulary and it fits the context with its max_tokens, and each SamplingParams' token ids
    (logit bias, ...) are in the vocabulary. Every offline call's requests pass here (the fixed
    batch's and the scheduler's, serve/offline.py)."""
    context, vocab = model.max_len, model.vocab_size
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if not prompt:
            raise ParamError(f"prompt {i} is empty: at least one token is required")
        check_room(len(prompt), p.max_tokens, context)
        kinds = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
        if kinds:
            raise ParamError(f"prompt {i} must be text, a list of token ids (int) or chat messages; it holds "
                             f"{type(kinds[0]).__name__} {kinds[0]!r:.40}")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ParamError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        p.validate_vocab(vocab)


class SpecEngine:
    def __init__(self, target, drafter: Drafter | None = None, num_speculative_tokens: int = 5,
                 runner: ModelRunner | None = None, adaptive: bool | None = None,
                 cost_curve: dict[int, float] | None = None, prefix_store=None,
                 threads: ThreadTuner | None = None, batch_curves: dict | None = None,
                 budgets: dict | None = None) -> None:
        check_num_speculative_tokens(num_speculative_tokens, drafter)
        trees = drafter is not None and drafter.capabilities.drafts_trees
        if trees and not target.model.supports_trees:
            raise DrafterError(f"drafter {type(drafter).__name__} drafts trees, which this target model "
                               f"cannot verify (the transformers adapter runs chains only)")
        if drafter is not None and drafter.capabilities.needs_target_hidden and not target.model.has_features:
            raise DrafterError(f"drafter {type(drafter).__name__} reads the target's hidden states, which this "
                               f"target model does not return (the transformers adapter): load a native target")
        self.target = target                      # LoadedModel
        self.model = target.model
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.k = num_speculative_tokens if drafter is not None else 0
        self.runner = runner if runner is not None else ModelRunner(target, self.drafter)
        # adaptive draft size (budget.py; default on): k is then the most a step may draft, except
        # that a copying drafter (lookups) grows past it, up to SPAN, while its drafts are accepted whole
        self.adaptive = (True if adaptive is None else adaptive) and self.k > 0
        copies = self.adaptive and self.drafter.capabilities.copies
        self.span = max(self.k, SPAN) if copies else self.k
        self.slack = self.span + 2                # cache room for padded writes past a row's end
        self.cost_curve = cost_curve              # forward seconds against rows (measured on first use)
        self.batch_curves: dict[int, dict[int, float]] = batch_curves if batch_curves is not None else {}
        self.budget: DraftBudget | None = None    # the last generate's (its chosen sizes, gains)
        self.budgets: dict[int, DraftBudget] = budgets if budgets is not None else {}   # k -> the last
                                                  # call's budget, where the next call starts (carry)
        self.prefix_store = prefix_store          # earlier calls' blocks (prefix_store.py), or None
        self.threads = threads                    # threads per pass from measured step times (threads.py)

    # ------------------------------------------------------------------ public
    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_tokens: StreamCallback | None = None) -> list[Sequence]:
        """Run every prompt to completion as one batch; returns the finished sequences."""
        check_requests(prompts, params, self.model)
        device = self.model.device
        seqs = [Sequence(i, prompt, p, self.target.eos_token_ids, row=i, device=device)
                for i, (prompt, p) in enumerate(zip(prompts, params))]
        for s in seqs:
            if s.params.structured is not None:
                s.constraint = grammar_tokenizer(self.target).constraint(s.params.structured)
            attach_prediction(s, self.target.tokenizer)
        max_len = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs) + self.slack
        batch = StaticBatch(seqs, self.k, max_len - self.slack)
        self.runner.allocate(len(seqs), max_len)
        budget = None
        # sizes follow measured times, and a sampled row's random draws follow its sizes: a seeded
        # sampled request drafts k every step so that its seed reproduces its output
        adaptive = self.adaptive and all(p.greedy or p.seed is None for p in params)
        if adaptive:
            self.prepare_cost_curve(max_len, allocate=False)     # before the clock starts
            curve = self.batch_curve(len(seqs))
        started = time.perf_counter()
        if self.prefix_store is not None:       # earlier calls' blocks this prompt starts with
            for s in seqs:
                s.stats.cached_tokens = self.prefix_store.load(self.runner.cache, s.row, s.prompt_ids)
        self.runner.prefill(seqs)
        # a draft model reads the prompts (prefill time, not drafting); under a draft budget, only
        # before the first step that drafts: a request it never drafts for never pays for it (the
        # 1.5B / 0.5B pair's 0.5B read a 56-token prompt in ~40 ms, 9% of an 18-token answer)
        drafter_read = self.drafter is None or not (adaptive and self.drafter.capabilities.prefill_when_drafting)
        if self.drafter is not None and drafter_read:
            self.drafter.prefill(seqs)
        if adaptive:                            # after the drafter's prefill, which may refine its cost
            caps = self.drafter.capabilities
            predicted = any(p.prediction is not None for p in params)
            draft_cost = caps.relative_cost * self.cost_curve[1] if caps.has_state else None
            budget = self.budget = DraftBudget(self.k, curve, draft_cost=draft_cost, shadowed=not caps.has_state,
                                               chains=not caps.drafts_trees,
                                               opens=caps.has_state or predicted,
                                               span=self.span if self.span > self.k else 0,
                                               prior_acceptance=PRIOR_ACCEPTANCE if caps.prior_acceptance is None
                                               else caps.prior_acceptance)
            if not predicted:                   # a prediction is news: the prior
                budget.carry(self.budgets.get(self.k))
            self.budgets[self.k] = budget
        shadows = ShadowDrafts() if budget is not None and not self.drafter.capabilities.has_state else None
        prefill_done = time.perf_counter()
        for s in seqs:
            s.stats.prefill_seconds = prefill_done - started
        try:
            while running := batch.running():
                if budget is None:
                    self.step(running, batch.room(running), on_tokens)
                    continue
                size = budget.next_size()
                if size > 0 and not drafter_read:               # the first step that drafts: the prompts first
                    self._late_prefill(running)
                    drafter_read = True
                if size == 0 and shadows is not None and budget.shadow_due():   # plain step: a free
                    shadows.propose(self.drafter, running, self.k)              # drafter drafts aside
                pending = sum(len(s.token_ids) - self.runner.cache.lengths[s.row] for s in running) / len(running)
                report = self.step(running, [draft_room(s, size, batch.context) for s in running], on_tokens)
                budget.observe(size, report.num_nodes, report.accepted_nodes, report.verify_seconds,
                               report.draft_seconds, pending)
                if shadows is not None:
                    shadows.score(running, budget)
        finally:
            if self.drafter is not None:
                self.drafter.close()
        if self.prefix_store is not None:
            for s in seqs:
                self.prefix_store.save(self.runner.cache, s.row, s.token_ids)
        total = time.perf_counter() - started
        for s in seqs:
            s.stats.total_seconds = total
        return seqs

    def _late_prefill(self, seqs: list[Sequence]) -> None:
        """The drafter's prefill, deferred to the first step that drafts (`prefill_when_drafting`):
        timed as prefill, so the draft budget sees only drafting in the steps."""
        started = time.perf_counter()
        self.drafter.prefill(seqs)
        for s in seqs:
            s.stats.prefill_seconds += time.perf_counter() - started

    def prepare_cost_curve(self, max_len: int, allocate: bool = True) -> None:
        """Measure the target's forward cost against rows (up to k + 1) unless known."""
        rows = min(self.k + 1, max_len)
        if self.cost_curve is not None and max(self.cost_curve) >= rows:
            return
        if allocate:
            self.runner.allocate(1, max_len + self.slack)
        self.cost_curve = measure_cost_curve(self.model, self.runner.cache, rows)

    def batch_curve(self, batch: int) -> dict[int, float]:
        """The cost curve per sequence of a batch of `batch` sequences (measure_cost_curve; batch 1:
        cost_curve), measured once per batch size on the runner's cache (its rows are the batch's)."""
        if batch == 1:
            return self.cost_curve
        if batch not in self.batch_curves:
            self.batch_curves[batch] = measure_cost_curve(self.model, self.runner.cache, max(self.cost_curve),
                                                          repeats=2, batch=batch)
        return self.batch_curves[batch]

    # ------------------------------------------------------------------ one step
    def _jump_forward(self, seqs: list[Sequence], room: list[int], on_tokens: StreamCallback | None) -> list[int]:
        """Commit each constrained row's forced tokens (at most FORCED_MAX, never the last token
        of its budget, never an end-of-sequence or past a stop string: those end it in the
        ordinary way); returns the rows' draft room after them."""
        for b, s in enumerate(seqs):
            if s.constraint is None or s.params.stop:
                continue
            forced = s.constraint.forced(draft_room(s, FORCED_MAX, self.model.max_len))   # no end of sequence
            if not forced:
                continue
            appended = s.append(forced)
            s.constraint.consume(forced[:appended])
            if s.params.logprobs is not None:    # probability 1 under the masked distribution
                s.logprobs += [(t, 0.0, [(t, 0.0)][:s.params.logprobs]) for t in forced[:appended]]
            s.stats.emitted += appended
            if on_tokens is not None:
                s.forced_now = True                  # the stream labels these tokens "forced"
                on_tokens(s, forced[:appended])
                s.forced_now = False
            room[b] = min(room[b], draft_room(s, room[b], self.model.max_len))
        return room

    def _trims_drafts(self, seqs: list[Sequence]) -> bool:
        """Does a grammar trim this step's drafts (structured.trim_drafts)? Only a stateless
        drafter's whose commit does not read its own nodes."""
        caps = self.drafter.capabilities
        return (not caps.has_state and not caps.commit_reads_nodes
                and any(s.constraint is not None for s in seqs))

    def step(self, seqs: list[Sequence], room: list[int], on_tokens: StreamCallback | None = None) -> "StepReport":
        """One step over `seqs` (rows of the runner's caches); room[b]: drafts row b may carry."""
        # 0. jump forward (speculating, structured output): tokens a row's grammar allows alone
        #    have probability 1 under the masked target distribution, whatever the logits: they are
        #    committed now, written by this step's pass as pending tokens, and the drafts follow them
        if self.threads is not None:
            self.threads.before()
        t0 = time.perf_counter()
        if self.k > 0 and any(s.constraint is not None for s in seqs):
            room = self._jump_forward(seqs, room, on_tokens)
        # 1. draft (a grammar trims point-mass drafts it forbids: rows the target could never accept)
        if self.drafter is not None and max(room) > 0:
            proposal = self.drafter.propose(seqs, room).simplified()
            if proposal.probs is None and self._trims_drafts(seqs):
                proposal = trim_drafts(seqs, proposal)
        else:
            proposal = DraftProposal.empty(len(seqs))
        t1 = time.perf_counter()
        # 2. score all drafts in one target pass, then verify
        target_probs, target_tokens, target_logprobs = self.runner.score(seqs, proposal)
        num_drafted, drafts = proposal.num_tokens.tolist(), proposal.tokens.tolist()
        links = proposal.parents.tolist() if proposal.is_tree else None
        if target_probs is None:                # every row greedy: the target's argmax is all it reads
            paths, emitted_rows = verify_greedy_lists(drafts, links, num_drafted, target_tokens.tolist())
        else:
            device = target_probs.device        # drafts may come from the host (n-gram lookup)
            greedy = torch.tensor([s.params.greedy for s in seqs], device=device)
            if proposal.probs is None:          # point masses: each token sampled as plain decoding samples it
                width = proposal.tokens.shape[1] + 1             # a greedy row reads no uniform
                depth_uniforms = torch.tensor([[0.0] * width if s.params.greedy else
                                               position_uniforms(s.seed, len(s.token_ids), width) for s in seqs],
                                              dtype=torch.float64).reshape(len(seqs), width)
                result = verify_point_mass(proposal.tokens.cpu(), proposal.parents, proposal.num_tokens.cpu(),
                                           target_probs, greedy, depth_uniforms)
            else:
                result = verify_tree(proposal.tokens.to(device), proposal.parents, proposal.num_tokens.to(device),
                                     proposal.probs, target_probs, greedy, [s.generator for s in seqs])
            emitted_rows = result.tokens.tolist()      # read as the greedy path's lists
            paths = [result.accepted_nodes[row, :n].tolist() for row, n in enumerate(result.num_accepted.tolist())]
        t2 = time.perf_counter()
        if self.threads is not None:
            self.threads.after(t2 - t0, len(seqs) + sum(num_drafted))
        # 3. commit: append tokens, move a tree's accepted path to consecutive slots, roll the
        #    target cache back to the accepted prefix
        num_accepted = [len(path) for path in paths]
        depth = tree_depth(proposal) if proposal.is_tree else num_drafted
        appended_rows = []
        for row, s in enumerate(seqs):
            emitted = emitted_rows[row][:num_accepted[row] + 1]
            old_len = len(s.token_ids)
            appended = s.append(emitted, self.target.tokenizer.decode if s.params.stop else None)
            appended_rows.append(emitted[:appended])
            if s.params.logprobs is not None:    # position of emitted token j: 0, then after accepted node j-1
                record_logprobs(s, emitted[:appended], target_logprobs[row, [0] + [n + 1 for n in paths[row]]])
            if s.constraint is not None:
                s.constraint.consume(emitted[:appended])
            if proposal.is_tree and num_accepted[row]:
                self.runner.compact(s.row, old_len, paths[row])
            self.runner.keep(s.row, old_len + num_accepted[row])
            # 4. stats
            s.stats.record_step(depth[row], min(num_accepted[row], appended), appended, nodes=num_drafted[row])
            s.stats.draft_seconds += t1 - t0
            s.stats.verify_seconds += t2 - t1
            if on_tokens is not None:
                on_tokens(s, emitted[:appended])
        if self.drafter is not None:
            self.drafter.commit(seqs, proposal, num_accepted)
        parents = links if links is not None else [list(range(-1, n - 1)) for n in num_drafted]   # a chain's
        return StepReport(num_drafted, paths, t1 - t0, t2 - t1,
                          [t[:n] for t, n in zip(drafts, num_drafted)], [p[:n] for p, n in zip(parents, num_drafted)],
                          appended_rows)
