"""Per-request state: token ids, sampling parameters, random generator, stop checks, stats."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ..params import SamplingParams


@dataclass
class SpecStats:
    """Counters of one request (or of a whole run when merged).

    steps: target verification passes. drafted: draft tokens proposed. accepted: draft
    tokens kept. emitted: tokens appended (accepted + one recovered/bonus per step, fewer
    when a stop cut the step short). Mean accepted length = emitted / steps and so
    includes the bonus token, as in vLLM and Spec-Bench."""

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
    cached_tokens: int = 0      # prompt tokens taken from earlier calls' cached blocks (not prefilled)

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

    def merge(self, other: "SpecStats") -> None:
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


def attach_prediction(s: "Sequence", tokenizer) -> None:
    """Tokenize the request's predicted output (SamplingParams.prediction) for the drafters."""
    if s.params.prediction is not None:
        from ..drafters.prediction import PredictionIndex
        s.prediction = PredictionIndex(tokenizer.encode(s.params.prediction, add_special=False))


class Sequence:
    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], row: int, device: torch.device | str = "cpu") -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)          # prompt + output, grows as tokens are committed
        self.params = params
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.row = row                             # cache row in target and draft caches
        self.constraint = None                     # structured output's grammar state (structured.py)
        self.prediction = None                     # drafters/prediction.py PredictionIndex of params.prediction
        self.forced_now = False                    # True while a stream callback gets jump-forward tokens
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []   # per output token, if asked:
                                                   # (token, its logprob, the top N (token, logprob))
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.seed = seed                           # position-keyed uniforms (sampling.position_uniforms)
        self.generator = torch.Generator(device=device).manual_seed(seed)   # draft-distribution draws
        self.finish_reason: str | None = None     # "stop" (eos or stop string) or "length"
        self.stop_text_index: int | None = None   # where a stop string starts in the decoded output
        self.stats = SpecStats()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
