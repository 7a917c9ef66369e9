"""Tool calls on /v1/chat/completions, in each model family's own format.

`formats.py`: the families' formats, detected from the chat template and vocabulary, and the
grammar of a forced call over their exact tokens; `spec.py`: the request's `tools` /
`tool_choice` and the prompt; `parser.py`: calls out of the answer as it streams; `markup.py`: the
families whose arguments are not JSON (Qwen3-Coder's XML, Gemma 4); `schema.py`: the tools' schemas
as the grammar engine compiles them.
"""
from __future__ import annotations

import weakref

from .formats import HERMES, Marker, ToolFormat, detect, takes_tools
from .markup import MarkupParser
from .parser import ToolParser, extract_calls, openai_deltas
from .schema import closed
from .spec import ToolSpec, parse_tools, with_tools

__all__ = ["HERMES", "Marker", "MarkupParser", "ToolFormat", "ToolParser", "ToolSpec", "call_parser", "closed",
           "detect", "extract_calls", "format_of", "openai_deltas", "parse_tools", "takes_tools", "with_tools"]

_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_parser(spec: ToolSpec) -> ToolParser:
    """The parser of one answer's calls to the request's tools, in their format (parallel_tool_calls
    false: the first call only)."""
    names = [f["name"] for f in spec.functions()]
    max_calls = None if spec.parallel else 1
    if spec.fmt.markup:
        return MarkupParser(spec.fmt, names, max_calls, {f["name"]: f.get("parameters") or {}
                                                         for f in spec.functions()})
    return ToolParser(spec.fmt, names, max_calls)


def format_of(tokenizer, is_special) -> ToolFormat:
    """The model's tool-call format, detected once per tokenizer. `is_special(id)`: llguidance's
    view of a token (structured.GrammarTokenizer.is_special), asked only about markers the
    vocabulary holds as one token."""
    found = _FORMATS.get(tokenizer)
    if found is None:
        found = _FORMATS[tokenizer] = detect(tokenizer, is_special)
    return found

