"""Structured output: a grammar decides which tokens may come next, losslessly under speculation.

The grammar engine is llguidance (Microsoft's, the one behind guidance and in vLLM / SGLang /
llama.cpp): a Rust Earley parser over the tokenizer's whole vocabulary, ~50 us per token mask on
the embedded 49k vocabulary, JSON schema / regex / Lark (and GBNF through its converter), and it
computes forced tokens itself. `Structured` says what to follow; `Constraint` follows it for one
sequence.

Lossless: the allowed-token mask is the first step of the shared logits transform
(`sampling.transform_logits(allowed=...)`), computed at every position a target pass scores:
position 0 from the committed text, position i+1 after draft node i along the node's own path (the
matcher consumes the path, then rolls back; a draft the grammar forbids has target probability 0
and is rejected like any other). The matcher advances only over committed tokens. So every
emitted token is drawn from exactly the masked target distribution plain constrained decoding
uses. Drafts themselves may ignore the mask (any draft distribution is lossless; a forbidden draft
is only a wasted node).

Forced tokens (jump-forward): where the grammar allows exactly one continuation, those tokens
(`Constraint.forced`) have probability 1 under the masked target distribution whatever the logits
(so verifying them as drafts would accept every one): a speculating engine commits them at the
start of a step (engine.py `_jump_forward`), the step's target pass writes their keys/values as
pending tokens, and the drafter drafts what follows them.
"""
from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .params import ParamError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as models (and json.dumps) write it: ", " and ": ", no other whitespace. Fixed separators make
# the keys and punctuation between values forced tokens; a schema's "x-guidance" overrides this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORCED_MAX = 16                     # forced tokens proposed per step


@dataclass(frozen=True)
class Structured:
    """kind: json_schema (value: a schema dict or JSON string), json_object (any JSON object),
    regex (a pattern string), choice (a list of strings), grammar (GBNF with `::=`, else Lark)."""
    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ParamError(f"structured kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        v = self.value
        ok = {"json_schema": isinstance(v, (dict, str)), "json_object": v is None or isinstance(v, dict),
              "regex": isinstance(v, str) and v != "", "grammar": isinstance(v, str) and v.strip() != "",
              "choice": isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(c, str) and c for c in v)}
        if not ok[self.kind]:
            want = {"json_schema": "a JSON schema (object or string)", "json_object": "nothing",
                    "regex": "a non-empty pattern", "grammar": "a non-empty GBNF or Lark grammar",
                    "choice": "a non-empty list of non-empty strings"}[self.kind]
            raise ParamError(f"structured {self.kind} needs {want}, got {v!r:.80}")

    def grammar(self) -> str:
        """The llguidance grammar (raises ParamError naming the field and the parse error)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            if self.kind == "json_schema":
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
            if self.kind == "regex":
                re.compile(self.value)
                return LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                return LLMatcher.grammar_from_regex("(" + "|".join(re.escape(c) for c in self.value) + ")")
            return LLMatcher.grammar_from_lark(any_to_lark(self.value))     # GBNF or Lark
        except Exception as exc:       # noqa: BLE001 -- llguidance raises its own kinds (GbnfToLarkError, ...)
            raise ParamError(f"invalid {self.kind}: {exc}") from None


class GrammarTokenizer:
    """The target's vocabulary as llguidance sees it (built once per tokenizer, ~1 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        from llguidance import LLTokenizer
        self.vocab_size = vocab_size
        eos = list(eos_token_ids) or [tokenizer.token_id(tokenizer.eos_token) or 0]
        self.ll = LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.eos_token_ids = tuple(eos)

    def constraint(self, structured: Structured) -> "Constraint":
        from llguidance import LLMatcher
        matcher = LLMatcher(self.ll, structured.grammar())
        if matcher.is_error():
            raise ParamError(f"invalid {structured.kind}: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self.eos_token_ids)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(target) -> GrammarTokenizer:
    """The cached GrammarTokenizer of a LoadedModel."""
    found = _TOKENIZERS.get(target.tokenizer)
    if found is None:
        found = _TOKENIZERS[target.tokenizer] = GrammarTokenizer(target.tokenizer, target.model.vocab_size,
                                                                 tuple(target.eos_token_ids))
    return found


class Constraint:
    """One sequence's grammar state: advanced by committed tokens only."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.matcher, self.vocab_size, self.eos_token_ids = matcher, vocab_size, eos_token_ids

    def allowed(self) -> torch.Tensor:                                        # [vocab] bool
        if self.matcher.is_error():                  # nothing can follow: only the end
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[list(self.eos_token_ids)] = True
            return mask
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.from_numpy(bits[:self.vocab_size].astype(bool))
        if not mask.any():                           # a finished grammar (e.g. past its end): only the end
            mask[list(self.eos_token_ids)] = True
        return mask

    def consume(self, tokens: list[int]) -> None:
        """Committed tokens (always allowed: they were drawn under the mask)."""
        if tokens and not self.matcher.is_stopped():
            self.matcher.try_consume_tokens([int(t) for t in tokens])

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (at most `limit`)."""
        if limit <= 0 or self.matcher.is_stopped() or self.matcher.is_error():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]

    def path_masks(self, paths: list[list[int]]) -> torch.Tensor:             # [1 + nodes, vocab]
        """Masks at the position after the committed text and after each draft node, whose path
        (the node's ancestors' tokens, then its own) is paths[i]."""
        masks = [self.allowed()]
        for path in paths:
            # a draft the grammar forbids (and its subtree) is rejected anyway: any mask will do there
            done = self.matcher.try_consume_tokens([int(t) for t in path]) if not self.matcher.is_stopped() else 0
            masks.append(self.allowed() if done == len(path) else masks[0])
            if done:
                self.matcher.rollback(done)
        return torch.stack(masks)


def allowed_masks(seqs, proposal, vocab: int) -> torch.Tensor | None:
    """[batch, n+1, vocab] bool allowed tokens at every scored position, or None when no row is
    constrained (unconstrained rows allow everything)."""
    if not any(getattr(s, "constraint", None) is not None for s in seqs):
        return None
    n = proposal.k
    out = torch.ones(len(seqs), n + 1, vocab, dtype=torch.bool)
    parents = proposal.tree_parents().tolist() if n else [[] for _ in seqs]
    tokens = proposal.tokens.tolist()
    for b, s in enumerate(seqs):
        if s.constraint is None:
            continue
        count = int(proposal.num_tokens[b])
        paths = []
        for i in range(count):
            path, node = [], i
            while node >= 0:
                path.append(tokens[b][node])
                node = parents[b][node]
            paths.append(path[::-1])
        masks = s.constraint.path_masks(paths)                                 # [count+1, vocab]
        out[b, :count + 1] = masks
        out[b, count + 1:] = masks[-1]               # padding positions repeat the last real one
    return out


GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_from_body(body: dict) -> tuple[Structured | None, str | None]:
    """(the constraint an OpenAI request asks for, the field that asked): `response_format`
    (json_object, json_schema) or vLLM's `guided_json` / `guided_regex` / `guided_choice` /
    `guided_grammar`; at most one. Raises ParamError naming the field, with the parse error."""
    asked = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise ParamError(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema'}}, got {fmt!r:.80}")
        if fmt["type"] == "json_object":
            asked.append(("response_format", Structured("json_object")))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ParamError("response_format.json_schema must be {'name': ..., 'schema': {...}}")
            asked.append(("response_format", Structured("json_schema", spec["schema"])))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            try:
                asked.append((name, Structured(kind, body[name])))
            except ParamError as exc:
                raise ParamError(f"{name}: {exc}") from None
    if len(asked) > 1:
        raise ParamError(f"at most one of response_format, {', '.join(GUIDED_FIELDS)} may be given, "
                         f"got {', '.join(n for n, _ in asked)}")
    if not asked:
        return None, None
    name, structured = asked[0]
    from llguidance import LLMatcher
    try:
        problem = LLMatcher.validate_grammar(structured.grammar())
    except ParamError as exc:
        raise ParamError(f"{name}: {exc}") from None
    if problem and not problem.startswith("WARNING"):
        raise ParamError(f"{name}: invalid {structured.kind}: {problem}")
    return structured, name
