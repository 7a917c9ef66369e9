"""Tool calling on a running `specdecode serve`, through the openai client, as an agent uses it:
a Person tool (name, age, city), tool_choice named / required / auto at temperature 0 and 0.7,
streamed and not; speculation on and off at temperature 0 (the same token ids); a named call
without max_tokens; the client's pydantic helpers. Exit code 1 when a call does not come back as
`tool_calls` with the Person's three fields.

    specdecode serve --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --port 8020 &
    python scripts/measure/check_tool_calls.py --base-url http://127.0.0.1:8020/v1
"""
from __future__ import annotations

import argparse
import json
import sys
import time

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
TOOLS = [{"type": "function", "function": {"name": "Person", "description": "Record a person's name, age and city",
                                           "parameters": PERSON}}]
MESSAGES = [{"role": "user", "content": "Maria Lopez is 34 years old and lives in Valencia. Record her details."}]
NAMED = {"type": "function", "function": {"name": "Person"}}


def ask(client, model: str, choice, temperature: float, stream: bool, speculate=None, max_tokens=200) -> dict:
    extra = {"return_token_ids": True}
    if speculate is not None:
        extra["speculate"] = speculate
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=temperature,
              extra_body=extra, seed=7)
    if max_tokens:
        kw["max_tokens"] = max_tokens
    started = time.perf_counter()
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        return dict(finish=c.finish_reason, content=c.message.content, ids=c.model_extra.get("token_ids") or [],
                    calls=[(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                    seconds=time.perf_counter() - started)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls: dict[int, list] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            entry = calls.setdefault(d.index, [None, ""])
            entry[0] = entry[0] or (d.function.name if d.function else None)
            entry[1] += (d.function.arguments or "") if d.function else ""
    return dict(finish=chunks[-1].choices[0].finish_reason,
                content="".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) or None,
                ids=[t for ch in chunks if ch.choices for t in (ch.choices[0].model_extra.get("token_ids") or [])],
                calls=[tuple(v) for v in calls.values()], seconds=time.perf_counter() - started)


def a_person(r: dict) -> bool:
    if r["finish"] != "tool_calls" or not r["calls"]:
        return False
    for name, arguments in r["calls"]:
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError:
            return False
        if name != "Person" or set(args) != {"name", "age", "city"} or not isinstance(args["age"], int):
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    import openai
    from pydantic import BaseModel
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", timeout=900, max_retries=0)
    model = client.models.list().data[0].id
    good = True
    for label, choice in (("named", NAMED), ("required", "required"), ("auto", "auto")):
        for temperature in (0.0, 0.7):
            for stream in (False, True):
                r = ask(client, model, choice, temperature, stream)
                ok = a_person(r)
                good &= ok
                print(f"{label:8s} T={temperature} stream={stream!s:5s} finish={r['finish']} calls={r['calls']} "
                      f"content={r['content']!r:.40} tokens={len(r['ids'])} {r['seconds']:.1f}s "
                      f"{'ok' if ok else 'FAIL'}")
    for label, choice in (("named", NAMED), ("required", "required"), ("auto", "auto")):
        on, off = (ask(client, model, choice, 0.0, False, speculate=s) for s in (True, False))
        same = on["ids"] == off["ids"] and on["calls"] == off["calls"]
        good &= same
        print(f"speculation on vs off, {label}, T=0: identical={same} ({len(on['ids'])} tokens)")
    r = ask(client, model, NAMED, 0.0, False, max_tokens=None)
    good &= a_person(r)
    print(f"named without max_tokens: finish={r['finish']} tokens={len(r['ids'])} calls={r['calls']}")

    class Person(BaseModel):
        name: str
        age: int
        city: str
    parsed = client.chat.completions.parse(model=model, messages=MESSAGES,
                                           tools=[openai.pydantic_function_tool(Person)], tool_choice=NAMED,
                                           temperature=0)
    call = parsed.choices[0].message.tool_calls[0]
    print("parse(tools=[pydantic_function_tool(Person)]):", repr(call.function.parsed_arguments))
    parsed = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Person, temperature=0)
    print("parse(response_format=Person):", repr(parsed.choices[0].message.parsed))
    print("all good" if good else "FAILED")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
