"""One row's speculation state (`RowSpec`): its gains per draft size, measured from verified steps
and shadow drafts, and where its exploration and probes stand; the controller (controller.py)
reads and plans them. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field

AUTO, ON, OFF = "auto", "on", "off"
DECAY = 0.7             # weight of the past in a size's moving averages (~3 steps)
SHADOW_DECAY = 0.9      # ... when a shadow draft updates it: shadows cost nothing, ~10 of them are averaged
CARRIED_WEIGHT = 0.1    # a gain carried from another row (or a prior) against this row's first step at that size
PROBE_EVERY = 16        # plain steps before a row's first probe (probes.py)
EVIDENT = 0.5           # a size whose measured tokens per step reach 1 + EVIDENT * size (half its drafts
                        # accepted, on average) is kept whatever the timings say (`RowSpec.kept`)


def expected_tokens(acceptance: float, size: int) -> float:
    """Tokens a chain step of `size` drafts emits when each is accepted with probability `acceptance`
    (1 + a + ... + a^size, the bonus token included)."""
    return sum(acceptance ** i for i in range(size + 1))


@dataclass
class RowSpec:
    """One row's speculation state: its gains per size and where its exploration stands."""
    k: int                                       # drafts per step asked for (0: never drafts)
    mode: str = AUTO
    levels: tuple[int, ...] = (0,)               # sizes this row may draft: up to k, or its span
    pinned: bool = False
    gain: dict[int, float] = field(default_factory=lambda: {0: 1.0})   # size -> tokens per step
    nodes: dict[int, float] = field(default_factory=lambda: {0: 0.0})  # size -> nodes proposed per step
    carried: set[int] = field(default_factory=set)   # sizes whose gain is a prior or another row's
    size: int = 0                                # the size of the step planned last
    previous: int = 0                            # the size of the step before it
    steps: int = 0
    all_accepted: bool = False                   # the last step accepted every node it drafted
    untried: bool = False                        # started from the template; no draft accepted yet
    probe_interval: int = PROBE_EVERY
    probe_wait: int = PROBE_EVERY
    probing: bool = False                        # this step is a probe (after plain steps)
    probed: bool = False                         # the last step was one
    shadow: tuple | None = None                  # (tokens when drafted, main path, its node indices, proposed)
    version: int = 0                             # bumped whenever a gain changes
    kept: int = 0                                # the size the row's counted acceptance keeps it drafting at
    listening: bool = True                       # the drafter hears of this row this step (its target features,
                                                 # its commit); False while speculation is kept off (probes.py)

    def update(self, size: int, emitted: float, proposed: float, decay: float = DECAY,
               prior: float | None = None) -> None:
        """Moving averages of a size's tokens and nodes. A first observation at a size is blended
        with `prior` (as if a step had measured it; default: what the smaller sizes emit), so one
        unlucky step does not rule a size out and one lucky one does not choose it."""
        self.version += 1
        if size not in self.gain:
            self.gain[size] = prior if prior is not None else max(g for s, g in self.gain.items() if s < size)
            self.nodes[size] = float(proposed)
        elif size in self.carried:
            self.carried.discard(size)
            decay = CARRIED_WEIGHT
        self.gain[size] = decay * self.gain[size] + (1 - decay) * emitted
        self.nodes[size] = decay * self.nodes[size] + (1 - decay) * proposed

    def observe(self, size: int, proposed: int, path: list[int], chains: bool, prior=None) -> None:
        """A verified step at `size`: `proposed` nodes, `path` the accepted node indices by depth.
        `prior(nodes)`: the gain a first observation of that many nodes is blended with (None: what
        the smaller sizes emit)."""
        self.all_accepted = size > 0 and proposed > 0 and len(path) == proposed
        self.untried = self.untried and not path
        decided = proposed < size or (chains and len(path) < proposed)
        for s in self.levels:
            if s == 0 or (s > size and not (decided and s in self.gain)):
                continue
            emitted = 1 + sum(1 for node in path if node < s)
            nodes = min(proposed, s) if proposed < size or s <= size else s
            self.update(s, emitted, nodes, prior=None if s in self.gain or prior is None else prior(nodes))
        self.keep()

    def observe_shadow(self, proposed: int, matched: int, nodes: list[int] | None) -> None:
        """A shadow draft of `proposed` nodes whose main path's first `matched` tokens came true;
        `nodes`: the path's node indices (a tree's; None: a chain). A size of s nodes is credited
        with the matched path nodes below s only (a tree's first nodes are mostly siblings)."""
        for s in self.levels[1:]:
            hits = matched if nodes is None else sum(1 for node in nodes[:matched] if node < s)
            self.update(s, 1.0 + min(hits, s), float(min(proposed, s)), SHADOW_DECAY)
        self.keep()

    def keep(self) -> None:
        """Evidence before timings: the size, among those measured (verified or shadow drafts, not
        priors) whose tokens per step show at least EVIDENT of their drafts accepted, that emits the
        most; 0 when none does. The controller never plans such a row below it (`plan`)."""
        best = 0
        for s, g in self.gain.items():
            if s and s not in self.carried and g >= 1.0 + EVIDENT * s and g > self.gain.get(best, 1.0):
                best = s
        self.kept = best

    def score_shadow(self, tokens: list[int], finished: bool) -> bool:
        """Score the pending shadow draft if its outcome is known (a mismatch, its whole length
        emitted, or the row finished); True if it was scored."""
        start, path, nodes, proposed = self.shadow
        out = tokens[start:]
        matched = next((i for i, (a, b) in enumerate(zip(path, out)) if a != b), min(len(path), len(out)))
        if matched < len(out) or len(out) >= len(path) or finished:
            self.observe_shadow(proposed, matched, nodes)
            self.shadow = None
            return True
        return False
