"""A thinking model's reasoning taken out of its answer, in each family's own markup.

Families, read from the chat template and the vocabulary (never the model's name):

* `think` (Qwen3, Qwen3.5, QwQ, DeepSeek-R1 distills, SmolLM3): `<think>reasoning</think>answer`;
  chosen when the template writes `</think>` or the vocabulary holds `<think>` and `</think>` as
  one token each. Qwen3.5's and the R1 distills' templates open `<think>` in the generation prompt,
  so the answer starts inside the reasoning without an opening tag; Qwen3's with
  `enable_thinking: false` renders an empty block, which ends the reasoning before the answer.
* `gemma4` (Gemma 4): `<|channel>thought\\n reasoning <channel|>answer`; chosen when the template
  writes `<|channel>` or the vocabulary holds `<|channel>` and `<channel|>`.
* `harmony` (gpt-oss): messages `<|channel|>analysis<|message|>reasoning<|end|><|start|>assistant
  <|channel|>final<|message|>answer`; the `analysis` channel is the reasoning, `final` and
  `commentary` (preambles, calls) the answer; chosen when the template writes `<|channel|>` and
  the vocabulary holds `<|channel|>` and `<|message|>`.

The markers are often special tokens, which decoding skips: the choice's decoder writes the
family's marker tokens as their text (`Generation` in app.py), and the parser reads that text.
Where the answer starts (inside reasoning or not) is read from the rendered prompt's end: the
parser is primed with it. A marker split across deltas is held back until it is known.

What the parser passes on as content goes to the tool-call parser (tools/parser.py): a call after
the reasoning is parsed as before; a call written inside the reasoning stays reasoning text, as
vLLM's and llama.cpp's servers do (their tool parsers read only the content).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from .tools.formats import single_token

FORMATS = ("auto", "none")        # `serve --reasoning-format`
WS = " \t\r\n"
PROMPT_TAIL = 48                  # prompt tokens read for the state the answer starts in
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")          # a message's end (the last two end the answer)
HARMONY_REASONING = ("analysis",)                              # channels that are reasoning
MAX_HEADER = 256                  # characters of a harmony header without <|message|>: not a header


@dataclass(frozen=True)
class ThinkingFormat:
    name: str                              # think | gemma4 | harmony
    open: str = ""                         # opens a block of reasoning (think, gemma4)
    close: str = ""                        # ends it
    kept: tuple[tuple[int, str], ...] = ()   # marker tokens (id, text) the decoder writes as their text

    def parser(self) -> ReasoningParser:
        if self.name == "harmony":
            return HarmonyParser(dict(self.kept))
        return ReasoningParser(self.open, self.close, dict(self.kept))


def detect(tokenizer) -> ThinkingFormat | None:
    """The thinking markup of a model (its `specdecode.tokenizer.Tokenizer`), or None."""
    template = tokenizer.chat_template or ""

    def kept(*texts: str) -> tuple[tuple[int, str], ...]:
        found = ((single_token(tokenizer, t), t) for t in texts)
        return tuple((token, text) for token, text in found if token is not None)

    has = lambda text: single_token(tokenizer, text) is not None        # noqa: E731
    if "<|channel|>" in template and has("<|channel|>") and has("<|message|>"):
        return ThinkingFormat("harmony", kept=kept(*HARMONY))
    if "<|channel>" in template or (has("<|channel>") and has("<channel|>")):
        return ThinkingFormat("gemma4", "<|channel>thought", "<channel|>", kept("<|channel>", "<channel|>"))
    if "</think>" in template or (has("<think>") and has("</think>")):
        return ThinkingFormat("think", "<think>", "</think>", kept("<think>", "</think>"))
    return None


_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def thinking_format(tokenizer) -> ThinkingFormat | None:
    """`detect`, once per tokenizer."""
    if tokenizer not in _FORMATS:
        _FORMATS[tokenizer] = detect(tokenizer)
    return _FORMATS[tokenizer]


def _held(text: str, markers) -> int:
    """How many characters at the end of `text` may still begin one of `markers`."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class ReasoningParser:
    """One choice's answer split into reasoning and content as it streams (think / gemma4 markup:
    a block of reasoning between `open` and `close`). Whitespace at a block's edges is dropped (the
    newlines templates put around the markers), so the deltas do not depend on how the text was cut."""

    def __init__(self, open: str, close: str, kept: dict[int, str] | None = None) -> None:
        self.open, self.close, self.kept = open, close, kept or {}
        self.in_reasoning = False
        self.pending = ""            # text that may still be the start of a marker
        self.lead = True             # at a block's start: its leading whitespace is dropped
        self.spaces = ""             # reasoning's whitespace, held until more reasoning follows
        self.closed_in_prompt = False   # the prompt ended right after a whole block (thinking turned off)

    def prime(self, prompt_tail: str) -> None:
        """Reads the end of the rendered prompt (the generation prompt may open, or open and close, a block)."""
        self.feed(prompt_tail)
        self.pending, self.lead, self.spaces = "", True, ""
        at = prompt_tail.rfind(self.close) if self.close else -1
        self.closed_in_prompt = (not self.in_reasoning and at >= 0 and prompt_tail.find(self.open, at) < 0
                                 and not prompt_tail[at + len(self.close):].strip(WS))

    def feed(self, text: str) -> tuple[str, str]:
        """The answer's next text -> (reasoning delta, content delta)."""
        buf, out = self.pending + text, ["", ""]
        while True:
            marker = self.close if self.in_reasoning else self.open
            at = buf.find(marker)
            if at < 0:
                hold = _held(buf, (marker,))
                self._emit(buf[:len(buf) - hold], out)
                self.pending = buf[len(buf) - hold:]
                return out[0], out[1]
            self._emit(buf[:at], out)
            buf = buf[at + len(marker):]
            self.in_reasoning, self.lead, self.spaces = not self.in_reasoning, True, ""

    def finish(self) -> tuple[str, str]:
        """What was held back (a marker's first characters that no marker followed)."""
        out = ["", ""]
        self._emit(self.pending, out)
        self.pending = self.spaces = ""
        return out[0], out[1]

    def _emit(self, piece: str, out: list[str]) -> None:
        if self.lead:
            piece = piece.lstrip(WS)
            if not piece:
                return
            self.lead = False
        if not self.in_reasoning:
            out[1] += piece
            return
        words = piece.rstrip(WS)
        if not words:
            self.spaces += piece
            return
        out[0] += self.spaces + words
        self.spaces = piece[len(words):]


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages: a header (`<|channel|>NAME`, a recipient ` to=...`, `<|constrain|>`)
    up to `<|message|>`, then the message up to `<|end|>` (or the answer's end). Messages of the
    `analysis` channel are reasoning; the others content."""

    def __init__(self, kept: dict[int, str] | None = None) -> None:
        super().__init__("", "", kept)
        self.state = "header"        # header | body
        self.header = ""
        self.primed = 0              # the header's first characters that came from the prompt
        self.channel: str | None = None

    def prime(self, prompt_tail: str) -> None:
        at = prompt_tail.rfind("<|start|>")
        self.feed(prompt_tail[at:] if at >= 0 else "")
        self.pending, self.primed = "", len(self.header)

    def feed(self, text: str) -> tuple[str, str]:
        buf, out = self.pending + text, ["", ""]
        self.pending = ""
        while buf:
            if self.state == "header":
                header = self.header + buf
                at = header.find("<|message|>")
                if at < 0:
                    self.header = header
                    if len(header) - self.primed > MAX_HEADER and "<|channel|>" not in header:
                        self._route(header[self.primed:], out)      # no header after all: the model's text
                        self.header, self.state, self.primed = "", "body", 0
                    break
                self._open(header[:at])
                buf = header[at + len("<|message|>"):]
                continue
            found = [(buf.find(m), m) for m in HARMONY_ENDS + ("<|start|>", "<|channel|>")]
            found = [(at, m) for at, m in found if at >= 0]
            if not found:
                hold = _held(buf, HARMONY_ENDS + HARMONY)
                self._route(buf[:len(buf) - hold], out)
                self.pending = buf[len(buf) - hold:]
                break
            at, marker = min(found)
            self._route(buf[:at], out)
            buf = buf[at if marker == "<|channel|>" else at + len(marker):]   # a header without <|start|>
            self.state, self.header, self.channel = "header", "", None
        self.in_reasoning = self.state == "body" and self.channel in HARMONY_REASONING
        return out[0], out[1]

    def finish(self) -> tuple[str, str]:
        out = ["", ""]
        if self.state == "body":
            self._route(self.pending, out)
        elif "<|channel|>" not in self.header:          # text that never became a header
            self._route(self.header[self.primed:], out)
        self.pending = self.header = ""
        return out[0], out[1]

    def _open(self, header: str) -> None:
        """A message's header read: its channel (the word after <|channel|>)."""
        at = header.find("<|channel|>")
        words = header[at + len("<|channel|>"):].replace("<|constrain|>", " ").split() if at >= 0 else []
        self.channel = words[0] if words else None
        self.state, self.header, self.primed = "body", "", 0

    def _route(self, piece: str, out: list[str]) -> None:
        out[0 if self.channel in HARMONY_REASONING else 1] += piece


def reasoning_parser(state, parsed) -> ReasoningParser | None:
    """The parser of one choice of a chat request (`state`: serve/server.ServeState; `parsed`:
    protocol.ParsedRequest), or None: the model has no known thinking markup, the server runs with
    `--reasoning-format none`, the request is not a chat, or its prompt closed the reasoning
    (`enable_thinking: false` on Qwen3's template)."""
    if getattr(state, "reasoning_format", "auto") == "none" or not parsed.chat:
        return None
    fmt = thinking_format(state.tokenizer)
    if fmt is None:
        return None
    parser = fmt.parser()
    parser.prime(state.tokenizer.decode(parsed.prompt_ids[-PROMPT_TAIL:], skip_special=False))
    return None if parser.closed_in_prompt else parser


def marker_decoder(tokenizer, kept: dict[int, str]):
    """`decode(ids)` that skips special tokens but writes the `kept` ones as their text."""
    if not kept:
        return tokenizer.decode

    def decode(ids: list[int]) -> str:
        parts, run = [], []
        for token in ids:
            if token in kept:
                parts += [tokenizer.decode(run) if run else "", kept[token]]
                run = []
            else:
                run.append(token)
        parts.append(tokenizer.decode(run) if run else "")
        return "".join(parts)
    return decode
