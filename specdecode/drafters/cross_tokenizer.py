"""A draft model with another tokenizer than the target's: drafts go through text.

Each step the draft model (its own KV cache of ITS tokens of the row's text: per-row state of this
drafter, never the target's cache) greedily generates a few tokens; they become text, and the text
becomes target tokens through the target's tokenizer. The drafts are point masses (`probs` None):
the verifier accepts each with the target's own probability (`verify_point_mass`), so greedy and
seeded sampled outputs are those of plain decoding whatever the draft says (Timor et al., ICML 2025,
"string-level exact match"; transformers' universal assisted generation and llama.cpp's server
draft across vocabularies the same way).

Text of a row. The target's tokens are decoded incrementally, special tokens included (a chat
template's markers are text the draft reads too: the draft sees the target's rendering of the
conversation, not its own template's); a token that ends inside a character (byte-level pieces of
one character) waits for the rest, and the row drafts nothing until it comes.

Boundaries. The draft text is tokenized after a window of the last committed target tokens
(WINDOW): where the re-tokenized window equals them, the target tokens after it are the drafts
(merges across the boundary then show up as a misaligned window, and the draft text is tokenized
alone). The last draft token is look-ahead only: a target token is proposed only when it ends
where an earlier draft token ends, since text the next draft token adds could extend or re-split
it (byte-pair merges, whitespace runs). A draft end-of-sequence token ends the text, so nothing
after it is look-ahead.

Rollback by characters. After verification the draft cache keeps the draft tokens whose text lies
wholly inside the committed text (and ends on a character); the committed text past them is
re-encoded with the draft's tokenizer and fed at the next proposal (catch-up), as model.py does
for a shared tokenizer. A row's prompt is fed when the engine has prefilled it (`prefill`).

Bounded context. The draft reads at most `draft_context` of its tokens of a row's text when it
starts on it (the prompt): the text before them is dropped from the row's state. Reading a long
prompt costs the draft a prefill the target does not wait for less of (the target reuses cached
prefixes, the draft reads at its own prefill speed), and a small draft predicts the next words
from the recent text; copies from further back are the lookup drafters' part (cascade). Any
context is lossless: the target verifies every draft.

The draft's cache holds CONTEXT_RATIO times the target positions it is prepared for (tokenizers
differ in how many tokens a text takes); a row whose draft tokens would not fit stops drafting.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from ..forward import ForwardBatch
from .base import ContiguousState, Drafter, DrafterCapabilities, DrafterError, DraftProposal, row_state
from .registry import register
from .vocab_rank import draft_cost, reduced_head

WINDOW = 4              # committed target tokens re-tokenized with the draft text (boundary merges)
ANCHOR = 4              # tokens decoded before new ones, so that a decoder's start-of-text rules do not apply
CONTEXT_RATIO = 1.5     # draft cache positions per target position (plus SLACK)
SLACK = 64
PREFILL_CHUNK = 512     # prompt tokens per draft pass in `prefill`
DRAFT_CONTEXT = 128     # draft tokens of a row's text the draft reads when it starts on the row
PARTIAL = "\ufffd"      # what a decoder gives for bytes that end inside a character


def shared_vocabulary(a, b) -> int:
    """Tokens both tokenizers' vocabularies hold: the same text (each token decoded on its own, special
    tokens as their text), or for a piece of a character (a byte) the same token string."""
    def texts(tok) -> set:
        pieces = tok.backend.decode_batch([[i] for i in range(tok.vocab_size)], skip_special_tokens=False)
        return {p if p and PARTIAL not in p else ("piece", tok.id_to_token(i)) for i, p in enumerate(pieces)}
    return len(texts(a) & texts(b))


@dataclass
class RowText:
    """One row's committed text and what the draft cache holds of it."""
    request: object = None                          # the request this state belongs to
    text: str = ""                                  # committed text (decoded target tokens, whole characters)
    read: int = 0                                   # target tokens `text` holds
    ids: list[int] = field(default_factory=list)    # draft tokens in the draft cache (its row's length)
    ends: list[int] = field(default_factory=list)   # per draft token: chars of text up to its end (-1: inside one)
    dtext: str = ""                                 # the text of `ids`
    full: bool = False                              # its draft tokens outgrew the cache: drafts nothing more


class TextState(ContiguousState):
    """The draft cache and each row's text (reset with the row)."""

    def __init__(self, cache, rows: list[RowText]) -> None:
        super().__init__(cache)
        self.rows = rows

    def reset(self, row: int) -> None:
        super().reset(row)
        self.rows[row] = RowText()


@register("text-model")
class TextModelDrafter(Drafter):
    capabilities = DrafterCapabilities(has_state=True, relative_cost=1.0)    # refined per instance

    def __init__(self, target, draft=None, draft_confidence: float = 0.4, draft_context: int = DRAFT_CONTEXT,
                 head_vocab: int = 0, head_rank: str = "freq", **_: object) -> None:
        if draft is None:
            raise DrafterError("method 'text-model' needs a draft model (--draft PATH / LLM(draft=...))")
        if not isinstance(draft_confidence, (int, float)) or not 0.0 <= draft_confidence < 1.0:
            raise DrafterError(f"draft_confidence must be a number in [0, 1), got {draft_confidence!r}")
        if isinstance(draft_context, bool) or not isinstance(draft_context, int) or draft_context < 8:
            raise DrafterError(f"draft_context must be an integer >= 8 (draft tokens of a row's text the draft "
                               f"reads), got {draft_context!r}")
        self.draft_context = draft_context
        # a row stops drafting after a draft token whose probability under the draft is below this (that
        # token is then look-ahead only): as model.py's early stop
        self.draft_confidence = float(draft_confidence)
        self.draft, self.model = draft, draft.model
        self.tok, self.dtok = target.tokenizer, draft.tokenizer
        self.draft_eos = set(draft.eos_token_ids)
        # head_vocab: the draft's LM head over that many of ITS token ids only (0 = all), the ones its
        # tokenizer uses most (drafters/vocab_rank.py); a draft with a large vocabulary (Gemma 3's
        # 262,144) reads more head than layers per token. Greedy drafts from fewer ids: still lossless.
        vocab = self.dtok.vocab_size
        self.head_rows = reduced_head(draft, head_vocab, head_rank, vocab, keep=tuple(self.draft_eos))
        if draft.native and target.native:     # relative cost: one draft pass reads all its weights
            cost = draft_cost(draft.model, target.model, self.head_rows, vocab)
            self.capabilities = replace(TextModelDrafter.capabilities, relative_cost=cost)

    def prepare(self, batch_size: int, max_len: int) -> TextState:
        capacity = min(self.model.max_len, int(max_len * CONTEXT_RATIO) + SLACK)
        return TextState(self.model.new_cache(batch_size, capacity), [RowText() for _ in range(batch_size)])

    # ------------------------------------------------------------------ text
    def _row(self, state: TextState, s) -> RowText:
        """The row's state (made anew for another request), its text synced to s.token_ids: whole
        characters only, so `read` stays short of the tokens while one ends inside a character."""
        st = state.rows[s.row]
        if st.request is not s.request or st.read > len(s.token_ids):
            state.cache.truncate(s.row, 0)
            st = state.rows[s.row] = RowText(request=s.request)
        ids, n = s.token_ids, len(s.token_ids)
        if st.read == n:
            return st
        anchor = max(0, st.read - ANCHOR)
        before = self.tok.decode(ids[anchor:st.read], skip_special=False)
        for end in range(n, max(st.read, n - 4), -1):     # a character spans at most 4 byte tokens
            now = self.tok.decode(ids[anchor:end], skip_special=False)
            if not now.endswith(PARTIAL):
                break
        else:
            return st
        if now.startswith(before):
            st.text += now[len(before):]
        else:                                             # a decoder that rewrites earlier text: decode it all
            st.text = self.tok.decode(ids[:end], skip_special=False)
        st.read = end
        return st

    def _cut(self, state: TextState, row: int, st: RowText, keep: int) -> None:
        """Keep the first `keep` cached draft tokens (the last of them ending on a character)."""
        del st.ids[keep:], st.ends[keep:]
        st.dtext = st.dtext[:st.ends[-1]] if st.ends else ""
        state.cache.truncate(row, keep)

    def _rollback(self, state: TextState, row: int, st: RowText) -> None:
        """Keep the cached draft tokens whose text lies wholly inside the committed text."""
        common = len(os.path.commonprefix([st.dtext, st.text]))
        keep = len(st.ids)
        while keep and not 0 <= st.ends[keep - 1] <= common:
            keep -= 1
        if keep < len(st.ids) or len(st.dtext) > common:
            self._cut(state, row, st, keep)

    def _catch_up(self, state: TextState, row: int, st: RowText) -> list[int]:
        """The draft tokens of the committed text past the cached ones (appended to st.ids, the cache
        still without them); when there are none, the last cached token, cut from the cache to be fed
        again (its logits draft the next)."""
        new: list[int] = []
        if not st.ids:
            bos = self.dtok.token_id(self.dtok.bos_token)
            if self.dtok.add_bos and bos is not None:
                new.append(bos)
                st.ends.append(0)
        rest = st.text[len(st.dtext):]
        if rest:
            enc = self.dtok.backend.encode(rest, add_special_tokens=False)
            if not st.dtext and len(enc.ids) > self.draft_context:     # a fresh row: its recent text only
                cut = enc.offsets[len(enc.ids) - self.draft_context][0]
                st.text = rest = st.text[cut:]
                enc = self.dtok.backend.encode(rest, add_special_tokens=False)
            base, offsets = len(st.dtext), enc.offsets
            for j, token in enumerate(enc.ids):
                inside = j + 1 < len(offsets) and offsets[j + 1][0] < offsets[j][1]
                new.append(token)
                st.ends.append(-1 if inside else base + offsets[j][1])
            st.dtext = st.text
        st.ids += new
        if not new and st.ids:
            state.cache.truncate(row, len(st.ids) - 1)
            return [st.ids[-1]]
        return new

    def _targets(self, s, st: RowText, text: str, ends: list[int], final: bool) -> list[int]:
        """Target tokens of the generated draft `text` (`ends`: per draft token, chars of text up to its
        end, -1 inside a character): those ending where an earlier draft token ends (all when `final`:
        the draft ended its text), after the committed tokens' window where it re-tokenizes to them."""
        usable = max((e for e in (ends if final else ends[:-1]) if e >= 0), default=0)
        if usable == 0:
            return []
        ids = s.token_ids
        for w in (min(WINDOW, len(ids)), 0):
            window = self.tok.decode(ids[len(ids) - w:], skip_special=False) if w else ""
            if w and not st.text.endswith(window):
                continue
            enc = self.tok.backend.encode(window + text, add_special_tokens=False)
            if w and (enc.ids[:w] != ids[len(ids) - w:] or len(enc.ids) <= w or enc.offsets[w][0] != len(window)):
                continue                     # the boundary re-splits the committed tokens: the draft text alone
            limit = len(window) + usable
            return [t for t, (_, end) in zip(enc.ids[w:], enc.offsets[w:]) if end <= limit]
        return []

    # ------------------------------------------------------------------ passes
    def _pass(self, state: TextState, rows: list[int], feed: list[list[int]],
              ) -> torch.Tensor:      # -> [B, draft vocab] float32
        """Write each row's `feed` at its cache end; the logits after its last token."""
        device = self.model.device
        width = max(len(f) for f in feed)
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feed], dtype=torch.long, device=device)
        starts = [state.cache.lengths[r] for r in rows]
        last = torch.tensor([[len(f) - 1] for f in feed], device=device)
        fb = ForwardBatch.chain(tokens, torch.tensor(starts, device=device), torch.tensor(rows, device=device), last)
        logits = self.model.logits(self.model.run(fb, state.cache), last, self.head_rows)   # [B, 1, head / vocab]
        for r, f, start in zip(rows, feed, starts):
            state.cache.truncate(r, start + len(f))
        if self.head_rows is not None:                  # [B, 1, head rows] -> the draft's vocabulary
            full = torch.full((len(rows), 1, self.dtok.vocab_size), float("-inf"), device=device)
            logits = full.index_copy_(2, self.head_rows.ids.to(device), logits.float())
        return logits[:, 0].float()

    def _fits(self, state: TextState, row: int, st: RowText, more: int) -> bool:
        """Whether `more` draft tokens fit the row's cache; a row that outgrew it drafts no more."""
        st.full = st.full or len(st.ids) + more > state.cache.max_len
        return not st.full

    @torch.inference_mode()
    def prefill(self, seqs) -> None:
        """Feed each row's prompt text into the draft cache (the engine has prefilled the target's)."""
        if not seqs:
            return
        state = row_state(seqs)
        for s in seqs:
            st = self._row(state, s)
            self._rollback(state, s.row, st)
            if st.read < len(s.token_ids) or st.full:
                continue
            start = len(st.ids)
            feed = self._catch_up(state, s.row, st)
            if not self._fits(state, s.row, st, SLACK):
                self._cut(state, s.row, st, start)
                continue
            for i in range(0, len(feed), PREFILL_CHUNK):
                self._pass(state, [s.row], [feed[i:i + PREFILL_CHUNK]])

    @torch.inference_mode()
    def propose(self, seqs, sizes):
        state = row_state(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        active, feed = [], []                # batch indices still drafting, and what each feeds next
        for b, s in enumerate(seqs):
            st = self._row(state, s)
            self._rollback(state, s.row, st)
            if sizes[b] <= 0 or st.read < len(s.token_ids) or st.full:
                continue
            start = len(st.ids)
            new = self._catch_up(state, s.row, st)
            if new and self._fits(state, s.row, st, 2 * sizes[b] + 4):
                active.append(b)
                feed.append(new)
            else:                            # back to what the cache holds
                self._cut(state, s.row, st, start)
        base = {b: len(state.rows[seqs[b].row].ids) for b in active}   # cached tokens before the drafts
        anchor = {b: state.rows[seqs[b].row].ids[-ANCHOR:] for b in active}
        before = {b: self.dtok.decode(anchor[b], skip_special=False) for b in active}
        gen: dict[int, list[int]] = {b: [] for b in active}
        ends: dict[int, list[int]] = {b: [] for b in active}
        text = {b: "" for b in active}
        unsure = dict.fromkeys(active, False)
        steps = {b: sizes[b] + 2 + sizes[b] // 2 for b in active}       # draft tokens a row may generate
        while active:
            logits = self._pass(state, [seqs[b].row for b in active], feed)[:, :self.dtok.vocab_size]
            probs = logits.softmax(-1)                   # (rows past the tokenizer's: embedding padding)
            best = probs.max(-1)
            still, next_feed = [], []
            for b, token, confidence in zip(active, best.indices.tolist(), best.values.tolist()):
                gen[b].append(token)
                now = self.dtok.decode(anchor[b] + gen[b], skip_special=False)
                clean = now.startswith(before[b]) and not now.endswith(PARTIAL)
                if clean:
                    text[b] = now[len(before[b]):]
                ends[b].append(len(text[b]) if clean else -1)
                final = token in self.draft_eos
                drafts[b] = self._targets(seqs[b], state.rows[seqs[b].row], text[b], ends[b], final)[:sizes[b]]
                if not (final or unsure[b] or len(drafts[b]) >= sizes[b] or len(gen[b]) >= steps[b]):
                    unsure[b] = confidence < self.draft_confidence    # then one more token, as look-ahead
                    still.append(b)
                    next_feed.append([token])
            active, feed = still, next_feed
        for b in gen:                        # every draft token but the last was fed: the cache holds them
            row = seqs[b].row
            st = state.rows[row]
            fed = len(gen[b]) - 1
            st.ids += gen[b][:fed]
            st.ends += [-1 if e < 0 else len(st.dtext) + e for e in ends[b][:fed]]
            st.dtext += text[b]
            keep = len(st.ids)
            while keep > base[b] and st.ends[keep - 1] < 0:
                keep -= 1
            self._cut(state, row, st, keep)
        return DraftProposal.from_lists(drafts)

    def commit(self, seqs, proposal, num_accepted):
        """Rollback by characters: each row's cache keeps the draft tokens inside its committed text."""
        if not seqs:
            return
        state = row_state(seqs)
        for s in seqs:
            self._rollback(state, s.row, self._row(state, s))
