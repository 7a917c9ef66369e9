"""The drafter interface: declared capabilities, the per-request state contract, the proposal.

A drafter proposes up to k tokens per running sequence. It never touches the target's
KV cache (one that declares `reads_target_cache` reads it through a `TargetCacheView`, which
cannot write); it gets the sequences (token ids, sampling params, generators) and keeps any
state of its own (a draft model's cache) keyed by the sequence's cache row.

* `DrafterCapabilities` -- what a drafter class declares (the engine and the server read it,
  they never probe a drafter's attributes).
* `DrafterState` -- what per-request state must answer (bytes held / in use, reset a row,
  compact a row); `ContiguousState` implements it for preallocated per-row tensors.
* `DraftProposal` -- the whole contract between drafting and verification, plus the drafter's
  own per-step state (`step_state`), handed back to its `commit`: nothing is stashed on the
  drafter between `propose` and `commit`.

Drafters are found by name through the registry (registry.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..tree import chain_parents, validate_lists

if TYPE_CHECKING:
    from ..engine.sequence import Sequence


@dataclass
class DraftProposal:
    """Draft tokens of a batch: per row a chain or a tree of up to n nodes (see specdecode/tree.py).

    Node i of row b is `tokens[b, i]`, valid for i < num_tokens[b]. `parents` None means a chain
    (node i's parent is node i - 1, node 0 follows the row's last committed token); otherwise
    parents[b, i] is the parent node (-1: the root, i.e. the last committed token), nodes in
    topological order, and siblings carry distinct tokens. `probs[b, i]` is the distribution node
    i was drawn from (the drafter's distribution after its parent; siblings share it and were
    drawn from it without replacement); None means point masses (lookup drafts, trees grown from
    tables)."""

    tokens: torch.Tensor          # [batch, n] int64 draft tokens; row b valid in [:num_tokens[b]], padding 0
    num_tokens: torch.Tensor      # [batch] int64, 0..n
    probs: torch.Tensor | None    # [batch, n, vocab] float32 distributions the drafts were sampled from
                                  # (after the shared logits transform); None = point mass (lookup drafts)
    step_state: Any = None        # the drafter's own state of this step, handed back to its commit
                                  # (opaque to everyone else; None: nothing to commit)
    parents: torch.Tensor | None = None   # [batch, n] int64 parent node index (-1 = root); None = chain

    @property
    def k(self) -> int:
        """Nodes per row (the padded width): the chain length of a chain."""
        return self.tokens.shape[1]

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def tree_parents(self) -> torch.Tensor:
        """[batch, n] parents, a chain's too."""
        return self.parents if self.parents is not None else chain_parents(self.tokens.shape[0], self.k)

    def simplified(self) -> DraftProposal:
        """This proposal with `parents` dropped when every row's tree is in fact a chain (the chain
        path is cheaper: no tree masks, no compaction)."""
        if self.parents is None or self.k == 0:
            return self
        live = torch.arange(self.k)[None, :] < self.num_tokens.cpu()[:, None]             # [batch, n]
        chain = chain_parents(self.tokens.shape[0], self.k)
        if bool(((self.parents.cpu() == chain) | ~live).all()):
            return DraftProposal(self.tokens, self.num_tokens, self.probs, self.step_state)
        return self

    def main_path(self, row: int) -> list[int]:
        """Tokens of row `row` along its first branch (node 0, then each node's first child): a
        chain's whole draft."""
        tokens = self.tokens[row, :int(self.num_tokens[row])].tolist()
        return [tokens[i] for i in self.main_path_nodes(row)]

    def main_path_nodes(self, row: int) -> list[int]:
        """Node indices of row `row`'s first branch (a chain: 0, 1, ...). A tree's first s nodes hold
        only the branch's nodes below s: what a tree of s nodes could accept along it."""
        n = int(self.num_tokens[row])
        return first_branch(None if self.parents is None else self.parents[row, :n].tolist(), n)

    def main_paths(self) -> list[tuple[list[int], list[int]]]:
        """Per row (main_path_nodes, main_path), converting each tensor once (shadow drafts read
        every row's path at plain steps, where tensor reads per row add up: specdecode/engine/README.md,
        "Rules the code keeps")."""
        counts, tokens = self.num_tokens.tolist(), self.tokens.tolist()
        parents = self.parents.tolist() if self.parents is not None else None
        paths = []
        for row, n in enumerate(counts):
            nodes = first_branch(None if parents is None else parents[row][:n], n)
            paths.append((nodes, [tokens[row][i] for i in nodes]))
        return paths

    @staticmethod
    def empty(batch: int) -> DraftProposal:
        return DraftProposal(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long), None)

    def scatter(self, rows: list[int], batch: int, k: int | None = None) -> DraftProposal:
        """This proposal (made for a subset of a batch) placed at `rows` of a batch of `batch`
        rows, k columns (default self.k); the other rows get no drafts."""
        k = self.k if k is None else k
        index = torch.tensor(rows, dtype=torch.long)
        tokens = torch.zeros(batch, k, dtype=torch.long)                              # [batch, k]
        tokens[index, :self.k] = self.tokens.cpu()
        num_tokens = torch.zeros(batch, dtype=torch.long)                             # [batch]
        num_tokens[index] = self.num_tokens.cpu()
        probs = None
        if self.probs is not None:
            probs = self.probs.new_zeros(batch, k, self.probs.shape[-1])             # [batch, k, vocab]
            probs[index.to(probs.device), :self.k] = self.probs
        parents = None
        if self.parents is not None:
            parents = chain_parents(batch, k)                                        # [batch, k]
            parents[index, :self.k] = self.parents.cpu()
        return DraftProposal(tokens, num_tokens, probs, parents=parents)

    def put_chains(self, chains: dict[int, list[int]]) -> DraftProposal:
        """Point-mass chains written into rows of this chain proposal (wide enough for them); with
        draft distributions, a one-hot one per token: the exact distribution the chain came from."""
        for b, chain in chains.items():
            self.tokens[b, :len(chain)] = torch.tensor(chain, dtype=torch.long)
            self.num_tokens[b] = len(chain)
            if self.probs is not None:
                self.probs[b, :len(chain)] = 0.0
                self.probs[b, torch.arange(len(chain)), self.tokens[b, :len(chain)].to(self.probs.device)] = 1.0
        return self

    @staticmethod
    def from_lists(drafts: list[list[int]]) -> DraftProposal:
        """Point-mass chain proposal from per-row token lists (ragged)."""
        k = max((len(d) for d in drafts), default=0)
        # two tensors built from lists: a lookup drafter proposes at every step, shadows included,
        # where a tensor per row (and a copy into a zeroed one) would cost more than the drafting
        tokens = torch.tensor([list(d) + [0] * (k - len(d)) for d in drafts], dtype=torch.long).reshape(len(drafts), k)
        return DraftProposal(tokens, torch.tensor([len(d) for d in drafts], dtype=torch.long), None)

    @staticmethod
    def from_trees(trees: list[list[tuple[int, int]]]) -> DraftProposal:
        """Point-mass tree proposal from per-row lists of (token, parent) nodes in topological
        order (parent -1: the root). Raises ValueError on a malformed tree. Where every row's tree
        is a chain (a prediction's draft, a lookup's one continuation), a chain proposal: the
        verifier's cheaper path, without `simplified`'s tensor test (dear at every step of a
        lookup drafter)."""
        if all(p == i - 1 for nodes in trees for i, (_, p) in enumerate(nodes)):
            return DraftProposal.from_lists([[t for t, _ in nodes] for nodes in trees])
        n = max((len(t) for t in trees), default=0)
        validate_lists([[p for _, p in nodes] for nodes in trees])
        # padding: token 0, chain parents (as chain_parents)
        tokens = [[t for t, _ in nodes] + [0] * (n - len(nodes)) for nodes in trees]
        parents = [[p for _, p in nodes] + list(range(len(nodes) - 1, n - 1)) for nodes in trees]
        return DraftProposal(torch.tensor(tokens, dtype=torch.long).reshape(len(trees), n),
                             torch.tensor([len(t) for t in trees], dtype=torch.long), None,
                             parents=torch.tensor(parents, dtype=torch.long).reshape(len(trees), n))


def first_branch(parents: list[int] | None, n: int) -> list[int]:
    """Node indices of a row's first branch among its n nodes (node 0, then each node's first
    child), from the row's parents (None: a chain, 0 .. n-1)."""
    if parents is None:
        return list(range(n))
    path, last = [], -1
    for i, p in enumerate(parents[:n]):
        if p == last:
            path.append(i)
            last = i
    return path


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a drafter class declares about itself (a class attribute `capabilities`; a drafter
    whose figures depend on its models may set a refined copy on the instance in __init__)."""

    needs_target_hidden: bool = False   # observe() gets the target's hidden states after every target pass
    drafts_trees: bool = False          # may propose trees (`DraftProposal.parents`), not only chains
    needs_target_topk: int = 0          # observe_topk() gets the target's top-n tokens at every scored
                                        # position of every target pass (0: not called)
    relative_cost: float = 0.01         # prior of drafting one token / one plain target step (the server's
                                        # speculation policy starts from it, then measures)
    prior_acceptance: float | None = None   # per-position acceptance the draft budget assumes before it has
                                        # measured any (None: its PRIOR_ACCEPTANCE; a trained head: from its
                                        # held-out evaluation, format.prior_acceptance)
    has_state: bool = False             # keeps per-request state: prepare() returns a DrafterState, and a
                                        # propose() must be followed by its commit(); False: propose is pure
                                        # (the server may draft for a row without committing)
    copies: bool = False                # drafts continue earlier text (lookups, a predicted output): when a
                                        # step's drafts are all accepted the next may draft past k (SPAN)
    drafts_predictions: bool = False    # drafts from a request's predicted output (SamplingParams.prediction)
    commit_reads_nodes: bool = False    # commit() reads node indices of the proposal its propose() returned,
                                        # so the engine may not renumber them (a grammar trimming forbidden
                                        # drafts, structured.trim_drafts); drafters with state never are
    reads_target_cache: bool = False    # reads the target's committed keys and values: the engine hands it a
                                        # read-only view of the target's KV cache (use_target_cache)
    free_drafts: bool = False           # offers drafts that cost nothing to make (a cascade's lookups) for
                                        # rows the controller planned plain (Drafter.free_drafts)


class DrafterState(Protocol):
    """Per-request state a drafter keeps between steps, by cache row (a draft KV cache, an EAGLE
    head's cache and features, ...). The server accounts for it and resets a row when its request ends."""

    def nbytes(self) -> int:
        """Bytes held (capacity)."""

    def used_bytes(self) -> int:
        """Bytes holding positions of live rows."""

    def reset(self, row: int) -> None:
        """The row's request ended: the next request on this row starts from nothing."""

    def truncate(self, row: int, length: int) -> None:
        """Compact a row: keep its first `length` positions, drop (or free) the rest."""


def row_state(seqs: list[Sequence]):
    """The drafter state of the engine these rows run in (`Sequence.drafter_state`, set at admission
    to what the drafter's `prepare` / `use_draft_cache` returned to that engine): a drafter with
    state reads and writes its rows' state there, never on itself, so two engines (or two calls)
    sharing one drafter never see each other's rows."""
    state = seqs[0].drafter_state if seqs else None
    if state is None:
        raise DrafterError("these rows carry no drafter state: a drafter with state runs on rows an engine "
                           "admitted (Sequence.drafter_state, from the drafter's prepare or use_draft_cache)")
    return state


class ContiguousState:
    """`DrafterState` of a position-addressed cache (`lengths`, `batch_size`, `max_len`, `nbytes()`,
    `truncate()`: a `KVCache`) plus preallocated per-row tensors shaped [rows, max_len, ...]
    indexed the same way (e.g. features): bytes in use = the share of positions held."""

    def __init__(self, cache, *tensors: torch.Tensor) -> None:
        self.cache = cache
        self.tensors = tensors

    def nbytes(self) -> int:
        return self.cache.nbytes() + sum(t.numel() * t.element_size() for t in self.tensors)

    def used_bytes(self) -> int:
        c = self.cache
        return int(self.nbytes() * sum(c.lengths) / (c.batch_size * c.max_len))

    def reset(self, row: int) -> None:
        self.cache.truncate(row, 0)

    def truncate(self, row: int, length: int) -> None:
        self.cache.truncate(row, min(length, self.cache.lengths[row]))


class TargetCacheView:
    """The target's KV cache as a drafter that declares `reads_target_cache` sees it: each row's
    committed length and copies of its keys and values at committed positions. It has no way to
    write, so the rule that drafters never touch the target's cache holds (Gemma 4's assistant
    attends to the target's keys, drafters/assistant.py)."""

    def __init__(self, cache) -> None:      # a KVCache or PagedKVCache
        self._cache = cache

    def length(self, row: int) -> int:
        """Positions the row holds (token_ids[:length] of its sequence)."""
        return self._cache.lengths[row]

    def read(self, layer: int, rows: list[int], positions: torch.Tensor,   # [B, L] int64, each < its row's length
             ) -> tuple[torch.Tensor, torch.Tensor]:     # -> keys, values [B, kv_heads, L, head_dim] (copies)
        return self._cache.read(layer, rows, positions)


class Drafter(ABC):
    """Two required methods and a feedback hook, in the spirit of HF's CandidateGenerator."""

    name: ClassVar[str]
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities()

    def draft_model(self):
        """The draft model (a LoadedModel) whose KV cache is this drafter's whole state, or None.
        With one, the engine keeps that cache beside the target's (paged for a native model),
        hands it over (`use_draft_cache`) and prefills prompts into it; without, the drafter's
        state (if any) comes from `prepare`."""
        return None

    def prepare(self, batch_size: int, max_len: int) -> DrafterState | None:
        """Allocate per-row state for rows 0..batch_size-1 of up to max_len positions; return it
        (None: no state). Called when the engine is built or grows, every row idle."""
        return None

    def use_draft_cache(self, cache) -> DrafterState:
        """Instead of `prepare`, for a drafter with a `draft_model()`: use `cache` (made by the
        caller for that model, e.g. paged) as the draft KV cache; return it as the state."""
        raise NotImplementedError(f"drafter {type(self).__name__} declares no draft model")

    def use_target_cache(self, view: TargetCacheView) -> None:
        """Called (only when capabilities.reads_target_cache) when the engine makes the target's KV
        cache, and again whenever it re-makes it: the view to read it through."""

    def prefill(self, seqs: list[Sequence]) -> None:
        """Called once per sequence when its prompt is in the target's cache (and in the draft
        model's, which the engine prefills itself): per-request set-up (an index of the prompt).
        Each row's last prompt token is still to come."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], sizes: list[int]) -> DraftProposal:
        """Up to sizes[b] draft tokens for each sequence (0 allowed). State the matching
        commit needs goes in the proposal's `step_state`."""

    def free_drafts(self, seqs: list[Sequence], rooms: list[int],
                    pays: Callable[[int, float], bool]) -> list[list[int]]:
        """Only where capabilities.free_drafts: for rows the controller planned plain this step, chains
        that cost nothing to make (lookups; point masses), each at most rooms[b] long, kept where
        `pays(length, acceptance per token)` says verifying them beats the plain step; [] for none.
        A row given one is committed with the proposal of these chains (step_state None)."""
        return [[] for _ in seqs]

    def commit(self, seqs: list[Sequence], proposal: DraftProposal, num_accepted: list[int]) -> None:
        """Feedback after verification of `proposal` (the one this drafter's propose returned for
        these seqs, or an empty one when the engine did not ask for drafts this step; a drafter with
        state is not told of rows whose speculation is kept off, until they finish): the first
        num_accepted[b] drafts were kept and seqs[b].token_ids already holds them plus one
        recovered/bonus token."""

    def observe(self, seqs: list[Sequence], starts: list[int],
                hidden: torch.Tensor,      # [batch, T, hidden] target states before the final norm
                ) -> None:
        """Called (only when capabilities.needs_target_hidden) after every target pass, prefill
        included: hidden[b, t] belongs to position starts[b] + t of seqs[b]. Positions past what
        the step commits (rejected drafts, padding) are overwritten by later passes. A drafter with
        state does not get the rows whose speculation the controller keeps off (it hears of them
        again some steps before it is asked to draft for them), so a row's next pass may start past
        the positions observed last: the features in between were never given."""

    def observe_topk(self, seqs: list[Sequence], proposal: DraftProposal,
                     topk_ids: torch.Tensor,   # [batch, n+1, needs_target_topk] int64
                     ) -> None:
        """Called (only when capabilities.needs_target_topk > 0) after every step's target pass,
        before its tokens are appended: topk_ids[b, 0] are the target's most likely successors of
        the row's last committed token (seqs[b].token_ids[-1]), topk_ids[b, i + 1] those of draft
        node i of `proposal` (its path from the root; valid for i < num_tokens[b]), best first,
        after the shared logits transform."""

    def close(self) -> None:
        """Free per-batch state."""

    def summary(self) -> dict:
        """What the drafter chose or learned that a user should see (e.g. the layers a layer-skip
        drafter skips); JSON-serializable, {} when nothing."""
        return {}

    def memory(self) -> object:
        """A copy of what the drafter carries from one request to the next (earlier outputs, a
        shared table), for `restore`: timing one request several times (`generate --compare`)
        must not let a run draft from the answers of the runs before it. None when nothing."""
        return None

    def restore(self, memory: object) -> None:
        """Put back what `memory()` returned."""


class DrafterError(ValueError):
    """A drafter cannot be built with these options; the message says why."""
