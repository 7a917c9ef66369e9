"""User-facing parameter dataclasses, validated on construction.

Every invalid value raises `ParamError` naming the parameter and its limit, so the
CLI and (later) the server can show one clear line instead of a traceback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


class ParamError(ValueError):
    """A user-supplied parameter is out of range; the message names it and its limit."""

    @property
    def sampling_field(self) -> str | None:
        """The SamplingParams field the message opens with (`logit_bias[5] must ...`: logit_bias), or
        None: what the server names as the error's `param` and the CLI as its option."""
        words = str(self).split()
        head = words[0].split("[")[0] if words else ""
        return head if head in SAMPLING_FIELDS else None


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logit_bias", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos")
MAX_STOP_TOKEN_IDS = 64


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ParamError(message)


def _finite(name: str, value: float) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
           f"{name} must be a finite number, got {value!r}")


@dataclass
class SamplingParams:
    """How tokens are chosen. The same transform is applied to drafter and target logits,
    so speculation is lossless under every combination of these.

    Order of the logits transform (see `specdecode.sampling`): logit_bias, repetition
    penalty (prompt + output tokens), presence and frequency penalties (output tokens),
    temperature, top_k, top_p, min_p. temperature == 0 means greedy: argmax of the
    biased and penalized logits (top_k / top_p / min_p are then irrelevant).
    """

    temperature: float = 0.0
    top_k: int = 0                  # 0 = disabled
    top_p: float = 1.0              # 1 = disabled
    min_p: float = 0.0              # 0 = disabled
    repetition_penalty: float = 1.0  # 1 = disabled; >1 discourages repeats (CTRL-style, prompt + output)
    presence_penalty: float = 0.0   # OpenAI-style, output tokens only
    frequency_penalty: float = 0.0  # OpenAI-style, output tokens only
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)   # end the output like EOS (kept with ignore_eos)
    ignore_eos: bool = False
    structured: object = None       # specdecode.structured.Structured: the output follows a grammar
    logprobs: int | None = None     # report each emitted token's log-probability and the top N (0..20)
    prompt_logprobs: int | None = None   # ... and each prompt token's (but the first), from the model's raw
                                         # logits, with the top N (0..20); the prompt is then not read from
                                         # the prefix cache (its positions must be computed)
    prediction: str | None = None   # OpenAI's Predicted Outputs: text the answer is expected to mostly repeat
                                    # (e.g. the file being edited); drafts follow it, the answer is the target's

    def __post_init__(self) -> None:
        _finite("temperature", self.temperature)
        _check(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
               f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        _finite("top_p", self.top_p)
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _finite("min_p", self.min_p)
        _check(0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}")
        _finite("repetition_penalty", self.repetition_penalty)
        _check(0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        _check(isinstance(self.logit_bias, dict), "logit_bias must be a mapping {token_id: bias}")
        clean: dict[int, float] = {}
        for token, bias in self.logit_bias.items():
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                raise ParamError(f"logit_bias keys must be token ids (integers), got {token!r}") from None
            _check(token_id >= 0, f"logit_bias token ids must be >= 0, got {token_id}")
            _finite(f"logit_bias[{token_id}]", bias)
            _check(-100.0 <= bias <= 100.0, f"logit_bias[{token_id}] must be in [-100, 100], got {bias}")
            clean[token_id] = float(bias)
        self.logit_bias = clean
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2^63) or None, got {self.seed!r}")
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        _check(len(self.stop) <= 16, f"stop accepts at most 16 strings, got {len(self.stop)}")
        _check(isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
               and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0), "
               f"got {self.stop_token_ids!r:.80}")
        self.stop_token_ids = list(self.stop_token_ids)

        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                         and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in [0, 20] (top alternatives per token) or None, got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be an integer in [0, 20] (top alternatives per prompt token) or None, "
               f"got {self.prompt_logprobs!r}")
        _check(self.prediction is None or (isinstance(self.prediction, str) and self.prediction != ""),
               f"prediction must be a non-empty string or None, got {self.prediction!r:.80}")
        _check(self.structured is None or callable(getattr(self.structured, "grammar", None)),
               f"structured must be a specdecode.structured.Structured, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def with_stop_ids(self, ids) -> SamplingParams:
        """A copy that also stops at `ids` (a fill-in-the-middle format's end tokens), each id once."""
        return replace(self, stop_token_ids=list(dict.fromkeys([*self.stop_token_ids, *ids])))

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks that depend on the model: logit_bias ids must exist in the vocabulary."""
        for token_id in self.logit_bias:
            _check(token_id < vocab_size,
                   f"logit_bias token id {token_id} is outside the vocabulary (size {vocab_size})")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, f"stop_token_ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
