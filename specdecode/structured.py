"""Structured output: a grammar decides which tokens may come next, losslessly under speculation.

The grammar engine is llguidance (Microsoft's, the one behind guidance and in vLLM / SGLang /
llama.cpp): a Rust Earley parser over the tokenizer's whole vocabulary, fast enough to mask every
scored position of a step (docs/structured-output.md, "How it stays lossless, and fast"), JSON
schema / regex / Lark (and GBNF through its converter), and it computes forced tokens itself.
`Structured` says what to follow; `Constraint` follows it for one sequence.

Lossless: the allowed-token mask is the first step of the shared logits transform
(`sampling.transform_logits(allowed=...)`), computed at every position a target pass scores:
position 0 from the committed text, position i+1 after draft node i along the node's own path (the
matcher consumes the path, then rolls back; a draft the grammar forbids has target probability 0
and is rejected like any other). The matcher advances only over committed tokens. So every
emitted token is drawn from exactly the masked target distribution plain constrained decoding
uses. Drafts themselves may ignore the mask (any draft distribution is lossless; a forbidden draft
is only a wasted node).

Greedy rows need no whole masks: the masked argmax is the unmasked argmax whenever the grammar
allows that token (the mask only sets others to -inf, first, and every later step of the transform
is per token), so `mask_greedy` checks the argmax at each scored position (one parser step) and
computes the mask (a walk over the whole vocabulary, far dearer) only where the grammar forbids it.
Rows that report log-probabilities or sample get every mask.

Forced tokens (jump-forward): where the grammar allows exactly one continuation, those tokens
(`Constraint.forced`) have probability 1 under the masked target distribution whatever the logits
(so verifying them as drafts would accept every one): a speculating engine commits them at the
start of a step (engine/drafting.py `_jump_forward`), the step's target pass writes their keys/values as
pending tokens, and the drafter drafts what follows them.
"""
from __future__ import annotations

import contextlib
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
    regex (a pattern string), choice (a list of strings), grammar (GBNF with `::=`, else Lark).
    after: a Lark expression the answer starts with before the constraint applies (a thinking
    model's reasoning: serve/reasoning.py), or None."""
    kind: str
    value: Any = None
    after: str | None = None

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
                return self._preceded(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE))
            if self.kind == "json_object":
                return self._preceded(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE))
            if self.kind == "regex":
                re.compile(self.value)
                return self._preceded(LLMatcher.grammar_from_regex(self.value))
            if self.kind == "choice":
                return self._preceded(LLMatcher.grammar_from_regex("(" + "|".join(re.escape(c) for c in self.value)
                                                                + ")"))
            return self._preceded(LLMatcher.grammar_from_lark(any_to_lark(self.value)))     # GBNF or Lark
        except Exception as exc:       # noqa: BLE001 -- llguidance raises its own kinds (GbnfToLarkError, ...)
            raise ParamError(f"invalid {self.kind}: {exc}") from None

    def _preceded(self, grammar: str) -> str:
        """`grammar` (llguidance's JSON, or Lark) preceded by `after`: a grammar whose start is `after`, then
        the constraint's own grammar as a sub-grammar."""
        if self.after is None:
            return grammar
        top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
        top["grammars"][0]["name"] = "answer"
        top["grammars"].insert(0, {"lark_grammar": f"start: {self.after} @answer\n"})
        return json.dumps(top)


class GrammarTokenizer:
    """The target's vocabulary as llguidance sees it (built once per tokenizer: it reads every token)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        from llguidance import LLTokenizer
        self.vocab_size = vocab_size
        eos = list(eos_token_ids) or [tokenizer.token_id(tokenizer.eos_token) or 0]
        self.ll = LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.eos_token_ids = tuple(eos)

    def is_special(self, token: int) -> bool:
        """Is `token` special to llguidance (a grammar names it `<[id]>`; its text does not match it)?"""
        return bool(self.ll.is_special_token(int(token)))

    def constraint(self, structured: Structured) -> Constraint:
        from llguidance import LLMatcher
        matcher = LLMatcher(self.ll, structured.grammar())
        if matcher.is_error():
            raise ParamError(f"invalid {structured.kind}: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self.eos_token_ids)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(target) -> GrammarTokenizer:
    """The cached GrammarTokenizer of a LoadedModel."""
    return grammar_tokenizer_for(target.tokenizer, target.model.vocab_size, tuple(target.eos_token_ids))


def grammar_tokenizer_for(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarTokenizer:
    """The cached GrammarTokenizer of a tokenizer (built on first use)."""
    found = _TOKENIZERS.get(tokenizer)
    if found is None:
        found = _TOKENIZERS[tokenizer] = GrammarTokenizer(tokenizer, vocab_size, tuple(eos_token_ids))
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
        """Tokens the grammar allows as the only continuation from here (at most `limit`, never an
        end of sequence)."""
        return self.forced_after([], limit)

    @contextlib.contextmanager
    def _after(self, path: list[int]):
        """The matcher advanced by `path` (as far as the grammar allows it) for the block: yields how
        many of its tokens were taken, then rolls them back."""
        m = self.matcher
        done = m.try_consume_tokens([int(t) for t in path]) if path and not m.is_stopped() else 0
        try:
            yield done
        finally:
            if done:
                m.rollback(done)

    def mask_allows(self, path: list[int], token: int) -> bool | None:
        """Would the mask after the committed text and `path` allow `token` -- answered without
        computing the mask where that is exact, else None. The mask llguidance computes is: only
        the first forced token when the grammar forces tokens; tokens extending the forced bytes
        when it forces bytes it cannot yet tokenize (None here); else every token the parser
        accepts, and the end of sequence when the grammar may end. A path the grammar forbids
        answers True (no token after it is ever compared: its node is rejected)."""
        m = self.matcher
        if m.is_stopped() or m.is_error():
            return None
        with self._after(path) as done:
            if done < len(path):
                return True
            if m.is_stopped():
                return None
            if m.compute_ff_bytes():     # (cheap; the dearer forced tokens only where bytes are forced)
                forced = m.compute_ff_tokens()
                return int(token) == forced[0] if forced else None
            if token in self.eos_token_ids:
                return bool(m.is_accepting())
            if m.try_consume_tokens([int(token)]) == 1:
                m.rollback(1)
                return True
            return False

    def valid_prefix(self, path: list[int]) -> int:
        """How many leading tokens of `path` the grammar allows after the committed text."""
        with self._after(path) as done:
            return done

    def mask_after(self, path: list[int]) -> torch.Tensor:                     # [vocab] bool
        """The mask after the committed text and then `path` (all allowed tokens)."""
        with self._after(path):
            return self.allowed()

    def forced_after(self, path: list[int], limit: int) -> list[int]:
        """The forced tokens after the committed text and then `path` (a path the grammar
        allows), at most `limit`, never an end of sequence. llguidance tokenizes forced bytes
        only up to where the next token could merge them with what follows; once those tokens
        are consumed it may force more (`, "` then `city":`), so it is asked again."""
        m = self.matcher
        if limit <= 0 or m.is_stopped() or m.is_error():
            return []
        with self._after(path) as done:
            if done < len(path):
                return []
            forced: list[int] = []
            try:
                while len(forced) < limit and not m.is_stopped() and m.compute_ff_bytes():
                    more = [int(t) for t in m.compute_ff_tokens()[:limit - len(forced)]]
                    more = more[:next((i for i, t in enumerate(more) if t in self.eos_token_ids), len(more))]
                    took = m.try_consume_tokens(more) if more else 0
                    forced += more[:took]
                    if took < len(more) or not took:
                        break
                return forced
            finally:
                if forced:
                    m.rollback(len(forced))

    def path_masks(self, paths: list[list[int]]) -> torch.Tensor:             # [1 + nodes, vocab]
        """Masks at the position after the committed text and after each draft node, whose path
        (the node's ancestors' tokens, then its own) is paths[i]."""
        masks = [self.allowed()]
        for path in paths:
            # a draft the grammar forbids (and its subtree) is rejected anyway: any mask will do there
            with self._after(path) as done:
                masks.append(self.allowed() if done == len(path) else masks[0])
        return torch.stack(masks)


def node_paths(proposal, row: int) -> list[list[int]]:
    """Per draft node of `row`, its path: its ancestors' tokens, then its own."""
    count = int(proposal.num_tokens[row])
    if not count:
        return []
    tokens = proposal.tokens[row, :count].tolist()
    if proposal.parents is None:
        return [tokens[:i + 1] for i in range(count)]
    parents = proposal.parents[row, :count].tolist()
    paths: list[list[int]] = []
    for i in range(count):
        paths.append((paths[parents[i]] if parents[i] >= 0 else []) + [tokens[i]])
    return paths


def trim_drafts(seqs, proposal):
    """The proposal without the draft nodes a row's grammar forbids (and their subtrees): their
    target probability is 0 under the masked distribution, so they would only cost rows of the
    pass. Point-mass drafts only (a sampled draft's distribution covers its siblings too)."""
    from .drafters.base import DraftProposal
    rows, changed = [], False
    for b, s in enumerate(seqs):
        count = int(proposal.num_tokens[b])
        tokens = proposal.tokens[b, :count].tolist()
        parents = proposal.parents[b, :count].tolist() if proposal.parents is not None else list(range(-1, count - 1))
        nodes = list(zip(tokens, parents))
        if s.constraint is not None and count:
            kept, where = [], {}                      # node -> its index among the kept ones
            for i, ((token, parent), path) in enumerate(zip(nodes, node_paths(proposal, b))):
                if (parent < 0 or parent in where) and s.constraint.valid_prefix(path) == len(path):
                    where[i] = len(kept)
                    kept.append((token, where[parent] if parent >= 0 else -1))
            changed = changed or len(kept) < count
            nodes = kept
        rows.append(nodes)
    if not changed:
        return proposal
    trimmed = DraftProposal.from_trees(rows)
    trimmed.step_state = proposal.step_state          # the drafter's own commit gets it back
    return trimmed.simplified()


def lazy_rows(seqs) -> list[bool]:
    """Per row: is it constrained and greedy without log-probabilities, so that its masks can
    wait for the argmax (`mask_greedy`)?"""
    return [getattr(s, "constraint", None) is not None and s.params.greedy and s.params.logprobs is None
            for s in seqs]


def allowed_masks(seqs, proposal, vocab: int, skip: list[bool] | None = None) -> torch.Tensor | None:
    """[batch, n+1, vocab] bool allowed tokens at every scored position, or None when no row is
    constrained (unconstrained rows, and rows marked in `skip`, allow everything)."""
    rows = [b for b, s in enumerate(seqs)
            if getattr(s, "constraint", None) is not None and not (skip is not None and skip[b])]
    if not rows:
        return None
    n = proposal.k
    out = torch.ones(len(seqs), n + 1, vocab, dtype=torch.bool)
    for b in rows:
        s = seqs[b]
        count = int(proposal.num_tokens[b])
        masks = s.constraint.path_masks(node_paths(proposal, b))               # [count+1, vocab]
        out[b, :count + 1] = masks
        out[b, count + 1:] = masks[-1]               # padding positions repeat the last real one
    return out


def mask_greedy(seqs, proposal, rows: list[bool],
                transformed: torch.Tensor,                        # [batch, n+1, vocab] float32, in place
                best: torch.Tensor | None = None,                 # [batch, n+1] its argmax, updated in place
                ) -> None:
    """Give the marked greedy rows of `transformed` (logits transformed without their grammar's
    mask) the argmax the masked logits would have: at each scored position whose argmax the grammar
    forbids, apply that position's mask. Positions past a row's drafts repeat its last one."""
    for b, s in enumerate(seqs):
        if not rows[b]:
            continue
        count = int(proposal.num_tokens[b])
        paths = [[]] + node_paths(proposal, b)
        row_best = (best[b] if best is not None else transformed[b].max(dim=-1).indices).tolist()
        for i, path in enumerate(paths):
            if not s.constraint.mask_allows(path, row_best[i]):
                transformed[b, i].masked_fill_(~s.constraint.mask_after(path), float("-inf"))
                if best is not None:
                    best[b, i] = transformed[b, i].max(dim=-1).indices
        if count + 1 < transformed.shape[1]:
            transformed[b, count + 1:] = transformed[b, count]
            if best is not None:
                best[b, count + 1:] = best[b, count]


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
            raise ParamError(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema'}}, "
                             f"got {fmt!r:.80}")
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
    try:
        check_grammar(structured)
    except ParamError as exc:
        raise ParamError(f"{name}: {exc}") from None
    return structured, name


def check_grammar(structured: Structured) -> None:
    """ParamError (`invalid <kind>: <llguidance's problem>`) unless llguidance accepts the
    grammar; its warnings pass."""
    from llguidance import LLMatcher
    problem = LLMatcher.validate_grammar(structured.grammar())
    if problem and not problem.startswith("WARNING"):
        raise ParamError(f"invalid {structured.kind}: {problem}")
