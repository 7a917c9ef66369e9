"""A request's row: its tokens, sampling parameters, random generator, stop checks, speculation
state and stats; the request as submitted to the engine core, and the events it gets back."""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..drafters.prediction import prediction_usage
from ..params import ParamError, SamplingParams
from .rowspec import AUTO, ON, RowSpec

_ids = itertools.count(1)


@dataclass
class SpecStats:
    """Counters of one request (or of a whole run when merged).

    steps: target verification passes. drafted: draft tokens proposed (a tree's depth). accepted:
    draft tokens kept. emitted: tokens appended (accepted + one recovered/bonus per step, fewer when
    a stop cut the step short). Mean accepted length = emitted / steps and so includes the bonus
    token, as in vLLM and Spec-Bench."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    nodes: int = 0              # draft tree nodes verified (= drafted for chains)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    cached_tokens: int = 0      # prompt tokens taken from earlier requests' cached blocks (not prefilled)

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int, nodes: int | None = None) -> None:
        """num_drafted: the draft's depth (a chain's length; acceptance is counted per depth);
        nodes: tree nodes verified (default num_drafted)."""
        self.steps += 1
        self.drafted += num_drafted
        self.nodes += num_drafted if nodes is None else nodes
        self.accepted += num_accepted
        self.emitted += num_emitted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        for name in ("steps", "drafted", "accepted", "emitted", "nodes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i in range(len(other.drafted_per_position)):
            if i >= len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            self.drafted_per_position[i] += other.drafted_per_position[i]
            self.accepted_per_position[i] += other.accepted_per_position[i]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self, num_tokens: int) -> dict:
        seconds = self.total_seconds
        return {
            "num_tokens": num_tokens,
            "steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tree_nodes_mean": round(self.nodes / self.steps, 4) if self.steps else 0.0,
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "cached_tokens": self.cached_tokens,
            "prefill_s": round(self.prefill_seconds, 4),
            "draft_s": round(self.draft_seconds, 4),
            "verify_s": round(self.verify_seconds, 4),
            "total_s": round(seconds, 4),
            "tokens_per_s": round(num_tokens / seconds, 2) if seconds > 0 else 0.0,
        }


# ---------------------------------------------------------------------- requests and their events
@dataclass
class Tokens:
    """Tokens a step appended to one request, each with its kind: "accepted" (a draft the target
    kept), "recovered" / "bonus" (the target's own token after a rejection / after every draft was
    kept), "forced" (the only token a grammar allows)."""
    ids: list[int]
    kinds: list[str]
    logprobs: list | None = None   # per id (token, logprob, [(token, logprob)] top N) when asked
    sequence: object = field(default=None, repr=False, compare=False)   # the row (Sequence) they were appended to

    def copy(self) -> Tokens:
        return Tokens(list(self.ids), list(self.kinds), None if self.logprobs is None else list(self.logprobs),
                      self.sequence)

    def extend(self, later: Tokens) -> None:
        """Append a later event's tokens of the same choice (several steps as one)."""
        self.ids += later.ids
        self.kinds += later.kinds
        if self.logprobs is not None:
            self.logprobs += later.logprobs or []


@dataclass
class Finished:
    reason: str               # "stop" | "length"
    stop_text_index: int | None
    usage: dict
    speculation: dict
    sequence: object = field(default=None, repr=False, compare=False)   # the finished Sequence


@dataclass
class Failed:
    status: int
    message: str


class QueueFull(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    """The engine is stopping (`EngineCore.drain`): new requests are refused."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[object], None]    # gets each event (Tokens, Finished, Failed) on the engine's thread
    speculate: bool | None = None     # None: the controller decides; True: k every step; False: never
    num_speculative_tokens: int | None = None   # the request's own k (then also its longest draft)
    internal: bool = False            # health checks: not counted in request metrics, never queued out
    after: str | None = None          # admitted once this request (the first choice of the same prompt)
                                      # has been prefilled, so that its prompt blocks are shared
    id: str | int = field(default_factory=lambda: f"req-{next(_ids)}")   # LLM.generate: the prompt's index
    arrival: float = field(default_factory=time.perf_counter)
    prefix_memo: dict = field(default_factory=dict)   # the prompt's block hashes per cache (admission)


class Sequence:
    def __init__(self, request: Request, eos_token_ids: tuple[int, ...], row: int, spec: RowSpec,
                 device: torch.device | str = "cpu") -> None:
        params = request.params
        self.request = request
        self.prompt_ids = list(request.prompt_ids)
        self.token_ids = list(request.prompt_ids)  # prompt + output, grows as tokens are committed
        self.params = params
        self.eos_token_ids = (() if params.ignore_eos else tuple(eos_token_ids)) + tuple(params.stop_token_ids)
        self.row = row                             # cache row in target and draft caches
        self.spec = spec                           # speculation state (controller.py)
        self.constraint = None                     # structured output's grammar state (structured.py)
        self.prediction = None                     # drafters/prediction.py PredictionIndex of params.prediction
        self.drafter_state = None                  # the drafter's per-row state of the engine running this row
                                                   # (what its prepare / use_draft_cache returned to that engine's
                                                   # runner): a drafter reads its rows' state here, not on itself
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []   # per output token, if asked:
                                                   # (token, its logprob, the top N (token, logprob))
        self.prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []   # prompt tokens 1.., if asked
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.seed = seed                           # position-keyed uniforms (sampling.position_uniforms)
        self.generator = torch.Generator(device=device).manual_seed(seed)   # draft-distribution draws
        self.finish_reason: str | None = None     # "stop" (eos or stop string) or "length"
        self.stop_text_index: int | None = None   # where a stop string starts in the decoded output
        self.stats = SpecStats()
        self.prefilled = 0                         # prompt tokens in the target cache
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def request_id(self) -> str | int:
        return self.request.id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens prefill writes: the prompt but its last token, the first step's pending token."""
        return len(self.prompt_ids) - 1

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_room(self, size: int, context: int) -> int:
        """At most `size` drafts, so that the output never passes max_tokens (the step always adds a
        token of its own) and the cache never passes the context."""
        left = min(self.params.max_tokens - self.num_output - 1, context - len(self.token_ids))
        return max(0, min(size, left))

    def append(self, tokens: list[int], decode=None) -> int:
        """Append emitted tokens, stopping at EOS, max_tokens or a stop string.
        Returns how many were appended."""
        for count, token in enumerate(tokens, start=1):
            self.token_ids.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
                return count
            if self.params.stop and decode is not None:
                text = decode(self.output_ids)
                hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
                if hits:
                    self.finish_reason, self.stop_text_index = "stop", min(hits)
                    return count
            if self.num_output >= self.params.max_tokens:
                self.finish_reason = "length"
                return count
        return len(tokens)

    def finished_event(self) -> Finished:
        """The event that ends a request that stopped or reached its length: usage and speculation."""
        st, spec = self.stats, self.spec
        prediction = self.prediction.ids if self.prediction is not None else []
        return Finished(self.finish_reason or "length", self.stop_text_index,
                        {"prompt_tokens": self.prompt_len, "completion_tokens": self.num_output,
                         "total_tokens": self.prompt_len + self.num_output,
                         "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
                         "completion_tokens_details": prediction_usage(prediction, self.output_ids)},
                        {"mode": spec.mode, "num_speculative_tokens": spec.k,
                         "on_at_end": spec.mode == ON or (spec.mode == AUTO and spec.size > 0),
                         "steps": st.steps, "drafted_tokens": st.drafted, "accepted_tokens": st.accepted,
                         "acceptance_rate": round(st.acceptance_rate, 4),
                         "mean_accepted_length": round(st.mean_accepted_length, 4)}, self)

    def record_logprobs(self, tokens: list[int], logprobs: torch.Tensor) -> None:   # [len >= len(tokens), vocab]
        """Each emitted token's log-probability and the top N alternatives, at the position it was
        drawn at (the same values with speculation on or off: rows are computed alike)."""
        n = self.params.logprobs
        rows = logprobs[:len(tokens)].cpu()
        chosen = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        top = rows.topk(n, dim=-1) if n else None
        for j, t in enumerate(tokens):
            alternatives = list(zip(top.indices[j].tolist(), top.values[j].tolist())) if n else []
            self.logprobs.append((t, chosen[j], alternatives))


def check_room(prompt_tokens: int, max_tokens: int, context: int, name: str = "max_tokens") -> None:
    """ParamError unless the prompt and `name` (the max-tokens parameter as the caller spells it) fit the context."""
    if prompt_tokens + max_tokens > context:
        raise ParamError(f"prompt ({prompt_tokens} tokens) + {name} ({max_tokens}) exceeds the model's context of "
                         f"{context} tokens")


def check_prompt_ids(i: int, prompt: list[int], params: SamplingParams, context: int, vocab: int) -> None:
    """ParamError naming prompt `i` unless it is non-empty, its token ids are in the vocabulary, it
    fits the context with its max_tokens, and the SamplingParams' token ids are in the vocabulary."""
    if not prompt:
        raise ParamError(f"prompt {i} is empty: at least one token is required")
    check_room(len(prompt), params.max_tokens, context)
    kinds = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
    if kinds:
        raise ParamError(f"prompt {i} must be text, a list of token ids (int) or chat messages; it holds "
                         f"{type(kinds[0]).__name__} {kinds[0]!r:.40}")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ParamError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    params.validate_vocab(vocab)
