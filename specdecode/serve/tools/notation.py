"""Writing tool calls whose arguments are not JSON (Qwen3.5's / Qwen3-Coder's XML, Gemma 4's
notation): the family names, Gemma 4's string delimiter, and calls written as the model writes them
(an earlier turn's calls, the system instruction's example). Reading them is markup.py's work.
"""
from __future__ import annotations

import json

XML, GEMMA = "qwen3_coder", "gemma4"            # the families whose arguments are not JSON (markup.py)
MARKUP = (XML, GEMMA)
QUOTE = '<|"|>'                                # Gemma 4's string delimiter (one token)


def gemma_value(value) -> str:
    """A value in Gemma 4's notation (its template's format_argument, keys bare)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_value(v) for v in value) + "]"
    return json.dumps(value)


def write(fmt, calls: list[tuple[str, object]]) -> str:
    """Calls (name, arguments object or JSON text) as the model writes them."""
    out = []
    for name, args in calls:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {}
        args = args if isinstance(args, dict) else {}
        if fmt.name == GEMMA:
            out.append(f"{fmt.start.text}call:{name}{gemma_value(args)}{fmt.end.text}")
            continue
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                         f"</parameter>\n" for k, v in args.items())
        out.append(f"{fmt.start.text}\n<function={name}>\n{params}</function>\n{fmt.end.text}")
    return "\n".join(out)


def example(fmt) -> str:
    if fmt.name == GEMMA:
        return f"{fmt.start.text}call:<function name>{{<argument>:<value>,...}}{fmt.end.text}"
    return (f"{fmt.start.text}\n<function=<function name>>\n<parameter=<argument>>\n<value>\n</parameter>\n"
            f"</function>\n{fmt.end.text}")
