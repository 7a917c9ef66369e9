"""A thinking model's reasoning taken out of its answer, in each family's own markup.

Families, read from the chat template and the vocabulary (never the model's name):

* `think` (Qwen3, Qwen3.5, QwQ, DeepSeek-R1 distills, SmolLM3): `<think>reasoning</think>answer`;
  chosen when the template writes `</think>` or the vocabulary holds `<think>` and `</think>` as
  one token each. Qwen3.5's and the R1 distills' templates open `<think>` in the generation prompt,
  so the answer starts inside the reasoning without an opening tag; Qwen3's with
  `enable_thinking: false` renders an empty block, so the answer starts after the reasoning.
* `gemma4` (Gemma 4): `<|channel>thought\\n reasoning <channel|>answer`; chosen when the template
  writes `<|channel>` or the vocabulary holds `<|channel>` and `<channel|>`.
* `harmony` (gpt-oss): messages `<|channel|>analysis<|message|>reasoning<|end|><|start|>assistant
  <|channel|>final<|message|>answer`; the `analysis` channel is the reasoning, `final` and
  `commentary` (preambles) the answer, and a message to `functions.NAME` (`<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`) a tool call, handed to the tool-call
  parser written in the request's call format; chosen when the template writes `<|channel|>` and
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

import dataclasses
import json
import weakref
from dataclasses import dataclass

from ..params import SamplingParams
from ..structured import JSON_STYLE, Structured
from .tools.formats import single_token
from .tools.schema import closed

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

    def parser(self, calls=None) -> ReasoningParser:
        """A parser of one answer; `calls`: the request's tool-call format (harmony's calls are
        written in it), or None."""
        if self.name == "harmony":
            return HarmonyParser(dict(self.kept), calls)
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

    @property
    def deciding(self) -> bool:
        """Is text held that a later delta decides (a marker's first characters)?"""
        return bool(self.pending)

    def before_answer(self, limit: int | None = None) -> str | None:
        """A Lark expression of the reasoning the answer may (or, inside an open block, must) start
        with, in the markers' own tokens, for a constraint that applies after it (`limit`: at most
        that many tokens of reasoning); None when the markers are not one token each or the prompt
        closed the reasoning."""
        ids = {text: token for token, text in self.kept.items()}
        close = ids.get(self.close)
        if close is None or self.closed_in_prompt:
            return None
        many = "*" if limit is None else f"{{0,{limit}}}"
        block = f"<[^{close}]>{many} <[{close}]> /[ \\t\\r\\n]{{0,4}}/"   # (the line breaks after it, bounded)
        if self.in_reasoning:
            return block
        head = max((text for text in ids if self.open.startswith(text)), key=len, default=None)
        if head is None:                # the opener's token, then the rest of its text (Gemma 4's "thought")
            return None
        rest = self.open[len(head):]
        return f"(<[{ids[head]}]> {json.dumps(rest) + ' ' if rest else ''}{block})?"

    def leave(self) -> None:
        """The answer starts in the content whatever the prompt opened."""
        self.in_reasoning, self.lead, self.spaces = False, True, ""

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
    `analysis` channel are reasoning; the others content. With `calls` (the request's tool-call
    format), a message to `functions.NAME` is written to the content as a call in that format, so
    the tool-call parser finds it as it finds any other."""

    def __init__(self, kept: dict[int, str] | None = None, calls=None) -> None:
        # the base's fields (not its whitespace rules: a harmony message is kept as written)
        self.open = self.close = ""
        self.kept, self.in_reasoning, self.pending, self.closed_in_prompt = kept or {}, False, "", False
        self.calls = calls           # tools/formats.py ToolFormat, or None
        self.state = "header"        # header | body
        self.header = ""
        self.primed = 0              # the header's first characters that came from the prompt
        self.channel: str | None = None
        self.call_end = ""           # written after the message of a call

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
                    if self._not_a_header(header[self.primed:]):
                        self._route(header[self.primed:], out)      # the model's text, no harmony message
                        self.header, self.state, self.primed = "", "body", 0
                    break
                self._open(header[:at], out)
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
            self._close(out)
            buf = buf[at if marker == "<|channel|>" else at + len(marker):]   # a header without <|start|>
            self.state, self.header, self.channel = "header", "", None
        self.in_reasoning = self.state == "body" and self.channel in HARMONY_REASONING
        return out[0], out[1]

    def finish(self) -> tuple[str, str]:
        out = ["", ""]
        if self.state == "body":
            self._route(self.pending, out)
            self._close(out)
        elif "<|channel|>" not in self.header:          # text that never became a header
            self._route(self.header[self.primed:], out)
        self.pending = self.header = ""
        return out[0], out[1]

    @property
    def deciding(self) -> bool:
        return bool(self.pending) or self.state == "header"

    def _analysis_first(self) -> str | None:
        """Lark of the analysis message the answer may (inside one: must) start with; None without
        the markers' tokens, or in the middle of another message."""
        ids = {text: token for token, text in self.kept.items()}
        if any(m not in ids for m in HARMONY[:4]):
            return None
        start, channel, message, end = (ids[m] for m in HARMONY[:4])
        if self.state == "body" and self.channel in HARMONY_REASONING:
            return f'<[^{end}]>* <[{end}]> <[{start}]> "assistant"'
        if self.state != "header" or self.header[self.primed:]:
            return None
        return f'(<[{channel}]> "analysis" <[{message}]> <[^{end}]>* <[{end}]> <[{start}]> "assistant")?'

    def before_answer(self) -> str | None:
        """An analysis message at most, then the final channel's header (see the base class)."""
        first = self._analysis_first()
        if first is None:
            return None
        ids = {text: token for token, text in self.kept.items()}
        return f'{first} <[{ids["<|channel|>"]}]> "final" <[{ids["<|message|>"]}]>'

    def call_grammar(self, functions: list[dict]) -> str | None:
        """Lark of a forced call in harmony's own form: an analysis message at most, then
        `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and arguments that
        follow the function's schema (`<|call|>`, an end of the answer, after them); None without
        the markers' tokens."""
        first = self._analysis_first()
        ids = {text: token for token, text in self.kept.items()}
        if first is None or "<|constrain|>" not in ids:
            return None
        channel, constrain, message = ids["<|channel|>"], ids["<|constrain|>"], ids["<|message|>"]
        rules = [f"start: {first} call", "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        for i, f in enumerate(functions):
            schema = dict(closed(f.get("parameters") or {"type": "object"}), **{"x-guidance": dict(JSON_STYLE)})
            recipient = json.dumps(f"commentary to=functions.{f['name']} ")
            rules += [f'call_{i}: <[{channel}]> {recipient} <[{constrain}]> "json" <[{message}]> args_{i}',
                      f"args_{i}: %json {json.dumps(schema)}"]
        return "\n".join(rules) + "\n"

    def leave(self) -> None:
        if self.state == "body":
            self.channel, self.in_reasoning = None, False

    def _not_a_header(self, own: str) -> bool:
        """The answer's first header (its role came with the prompt) opens with <|channel|>; text
        that cannot is the model's answer without harmony markup, as is a long run without one."""
        if self.primed and own and not own.startswith("<|channel|>") and not "<|channel|>".startswith(own):
            return True
        return len(own) > MAX_HEADER and "<|channel|>" not in own

    def _open(self, header: str, out: list[str]) -> None:
        """A message's header read: its channel (the word after <|channel|>), its recipient (to=)."""
        words = header.replace("<|constrain|>", " ").replace("<|channel|>", " <|channel|> ").split()
        at = words.index("<|channel|>") if "<|channel|>" in words else -1
        self.channel = words[at + 1] if 0 <= at < len(words) - 1 else None
        recipient = next((w[3:] for w in words if w.startswith("to=")), "")
        self.state, self.header, self.primed = "body", "", 0
        if self.calls is not None and recipient.startswith("functions.") and len(recipient) > len("functions."):
            fmt = self.calls
            head = (fmt.start.text if fmt.start else "") + fmt.gap_start + ("[" if fmt.listed else "")
            out[1] += head + '{"name": ' + json.dumps(recipient[len("functions."):]) + ', "' + fmt.args_key + '": '
            self.call_end = "}" + ("]" if fmt.listed else "") + fmt.gap_end + (fmt.end.text if fmt.end else "")
            self.channel = "call"

    def _close(self, out: list[str]) -> None:
        out[1] += self.call_end
        self.call_end = ""

    def _route(self, piece: str, out: list[str]) -> None:
        out[0 if self.channel in HARMONY_REASONING else 1] += piece


def reasoning_parser(state, parsed) -> ReasoningParser | None:
    """The parser of one choice of a chat request (`state`: serve/server.ServeState; `parsed`:
    protocol.ParsedRequest), or None: the model has no known thinking markup, the server runs with
    `--reasoning-format none`, or the request is not a chat. A prompt that closed the reasoning
    (`enable_thinking: false`: Qwen3's and Gemma 4's templates render an empty block) still gets a
    parser, starting in the content: Gemma 4 opens a thought channel even then, whose markup would
    otherwise end up in the content."""
    if getattr(state, "reasoning_format", "auto") == "none" or not parsed.chat:
        return None
    fmt = thinking_format(state.tokenizer)
    if fmt is None:
        return None
    parser = fmt.parser(parsed.tools.fmt if parsed.tools is not None else None)
    parser.prime(state.tokenizer.decode(parsed.prompt_ids[-PROMPT_TAIL:], skip_special=False))
    if parser.in_reasoning and shapes_the_answer(parsed) and parser.before_answer() is None:
        parser.leave()
    return parser


def reasoned_params(parser: ReasoningParser | None, parsed, params: SamplingParams) -> SamplingParams:
    """A choice's sampling parameters, the request's constraint (response_format, guided_json /
    regex / choice, a forced tool call) applying after the reasoning: the model thinks first, as
    vLLM's and llama.cpp's servers let it (parser: the choice's; None: as they are)."""
    if parser is None or not shapes_the_answer(parsed):
        return params
    tools = parsed.tools
    if isinstance(parser, HarmonyParser) and tools is not None and tools.choice not in ("auto", "none"):
        chosen = [f for f in tools.functions() if tools.choice == "required" or f["name"] == tools.choice]
        call = parser.call_grammar(chosen)        # gpt-oss's own call, which the parser hands on as any call
        if call is not None:
            return dataclasses.replace(params, structured=Structured("grammar", call))
    after = parser.before_answer()
    if after is None:
        return params
    return dataclasses.replace(params, structured=dataclasses.replace(params.structured, after=after))


def shapes_the_answer(parsed) -> bool:
    """Does the request's constraint write the answer (response_format, guided_json / regex /
    choice, a forced tool call)? It applies after the reasoning (`reasoned_params`); where it cannot
    (markers of several tokens) the model has no room to think and what it writes is the content,
    even after a generation prompt that opened the reasoning (Qwen3.5: a forced call would otherwise
    be reasoning text). A grammar of the request's own (guided_grammar) may write the reasoning's
    markup itself, and is read as any answer."""
    structured = parsed.params.structured
    forced_call = parsed.tools is not None and parsed.tools.choice not in ("auto", "none")
    return structured is not None and (forced_call or structured.kind != "grammar")


def reasoning_tokens(parser: ReasoningParser, token_texts: list[str]) -> int:
    """How many of an answer's tokens (each one's text, in order) belong to its reasoning, markers
    included; `parser`: a fresh one, primed as the answer's was."""
    count = held = 0
    for text in token_texts:
        was = parser.in_reasoning
        reasoning, _ = parser.feed(text)
        held += 1
        if not was and parser.deciding:     # a marker's first tokens, a header: they go with what they open
            continue
        if was or parser.in_reasoning or reasoning:     # (a token read in the reasoning: it, or its end marker)
            count += held
        held = 0
    return count


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
