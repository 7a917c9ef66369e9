"""`specdecode bench sessions`: the shipped sessions are well-formed; conversations grow as
documented (tool calls and their results, text answers instead of calls, the current file of edit
sessions); the runner against a real `specdecode serve` on a tiny random Llama (n-gram drafter)
records every turn, finds later turns' prompts cached, gets identical greedy answers with
speculation on and off and with the prefix cache on and off, and writes its report; bad options
are one-line errors naming the flag."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdecode.bench.serve_server import LocalServer, child_env
from specdecode.bench.sessions_data import (
    KINDS,
    Conversation,
    Session,
    SessionDataError,
    Turn,
    last_code_block,
    load,
    parse_session,
)
from specdecode.bench.sessions_run import add_call_delta
from specdecode.cli import main

MAX_TOKENS = 64

# sessions small enough for the tiny models' 256-token context
TINY = [
    {"id": "e1", "kind": "edit", "file": "def add(a, b):\n    return a + b\n",
     "turns": [{"user": "{file}rename add"}, {"user": "add c"}, {"user": "the whole file"}]},
    {"id": "t1", "kind": "tools", "system": "the cat",
     "tools": [{"type": "function", "function": {"name": "mat", "parameters": {"type": "object", "properties": {}}}}],
     "turns": [{"user": "the red mat?", "call": "mat", "tool_result": "red"}, {"tool_result": "1 2 3"},
               {"user": "the dog?", "tool_result": "lazy"}]},
    {"id": "d1", "kind": "document", "document": "The cat sat on the mat. The mat was red.",
     "turns": [{"user": "{document} Summarize."}, {"user": "the mat?"}, {"user": "the cat?"}]},
    {"id": "d2", "kind": "document", "document": "the quick brown fox jumps over the lazy dog.",
     "turns": [{"user": "{document} the fox?"}, {"user": "the dog?"}]},
]


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    """The tiny Llama with 1024 positions instead of 256 (RoPE has no learned positions: same
    weights), so the tools session's system prompt with its function schemas fits."""
    import shutil
    folder = tmp_path_factory.mktemp("bss") / "llama1k"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=1024)))
    return folder


def server_args(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--method", "ngram", "-k", "4", "--dtype", "fp32", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sessions") / "tiny.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TINY))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with LocalServer(server_args(model_dir), tmp_path_factory.mktemp("bss") / "server.log",
                     startup_timeout_s=120) as srv:
        yield srv


def bench(out, *args: str) -> int:
    return main(["bench", "sessions", "--max-tokens", str(MAX_TOKENS), "--out", str(out), *args])


def read(out) -> dict:
    return json.loads((out / "results.json").read_text())


# ------------------------------------------------------------------ the shipped sessions
def test_shipped_sessions_are_well_formed():
    import jsonschema
    sessions = load()
    for kind in KINDS:
        mine = [s for s in sessions if s.kind == kind]
        assert len(mine) >= 3, kind
        assert all(5 <= len(s.turns) <= 10 for s in mine), [(s.id, len(s.turns)) for s in mine]
    assert len({s.id for s in sessions}) == len(sessions)
    for s in sessions:
        first = s.first_message()
        assert "{file}" not in first and "{document}" not in first
        if s.kind == "edit":
            assert 30 <= len(s.file.splitlines()) <= 80
            compile(s.file, s.id, "exec")                                    # valid Python
            assert f"```python\n{s.file.rstrip()}\n```" in first
            assert all(t.user for t in s.turns)
        elif s.kind == "document":
            assert 800 <= len(s.document.split()) <= 1500, (s.id, len(s.document.split()))  # ~1.3-2k tokens
            assert s.document.strip() in first and all(len(t.user) < 300 for t in s.turns[1:])
        else:
            names = {t["function"]["name"] for t in s.tools}
            for tool in s.tools:
                jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
            assert all(t.tool_result and t.call in names for t in s.turns)
            assert s.turns[0].user and any(t.user is None for t in s.turns[1:])
    # the folder ships its license; the package data pattern covers it
    folder = load.__globals__["DEFAULT_FILE"].parent
    assert "Apache" in (folder / "LICENSE").read_text() and (folder / "README.md").exists()


@pytest.mark.parametrize("row, words", [
    ({"id": "x", "kind": "chat", "turns": [{"user": "hi"}]}, "'kind' must be one of edit, tools, document"),
    ({"id": "x", "kind": "edit", "file": "x = 1", "turns": [{"user": "no placeholder"}]}, "must hold {file} once"),
    ({"id": "x", "kind": "document", "turns": [{"user": "{document}"}]}, "needs 'document'"),
    ({"id": "x", "kind": "document", "document": "d", "turns": [{"user": "{document}"}, {}]}, "turns[1] needs 'user'"),
    ({"id": "x", "kind": "tools", "tools": [{"type": "function", "function": {"name": "f"}}],
      "turns": [{"user": "q"}]}, "turns[0].tool_result must be a non-empty string"),
    ({"id": "x", "kind": "tools", "tools": [{"type": "function", "function": {"name": "f"}}],
      "turns": [{"user": "q", "call": "g", "tool_result": "r"}]}, "call 'g' is none of its tools (f)"),
    ({"id": "x", "kind": "tools", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["a"]}}}], "turns": [{"user": "q", "tool_result": "r"}]},
     "required names properties it does not define"),
    ({"id": "x", "kind": "tools", "tools": [{"function": {"name": "f"}}], "turns": [{"user": "q", "tool_result": "r"}]},
     "tools[0] must be {'type': 'function'"),
])
def test_bad_sessions_are_refused(row, words):
    with pytest.raises(SessionDataError) as exc:
        parse_session(row, "f.jsonl:1")
    assert words in str(exc.value) and "f.jsonl:1 (x)" in str(exc.value)


# ------------------------------------------------------------------ conversations
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},)


def test_tool_calls_and_text_answers_grow_the_conversation():
    s = Session("t", "tools", "t", (Turn("weather in Oslo?", "get_weather", '{"temp": 3}'),
                                    Turn(None, "get_weather", '{"temp": 5}'), Turn("and tomorrow?", None, "sunny")),
                system="be brief", tools=TOOLS)
    conv = Conversation(s)
    assert conv.next_messages(0) == [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "weather in Oslo?"}]
    server_call = {"id": "call_random123", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    conv.add_answer(0, "", [server_call])
    messages = conv.next_messages(1)          # the call, then its result; no user text on turn 2
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert messages[3:] == [{"role": "tool", "tool_call_id": "call_1_0", "content": '{"temp": 3}'}]
    conv.add_answer(1, "It is 5 degrees.", [])  # text instead of a call: its result is pasted, then the question
    messages = conv.next_messages(2)
    assert messages[4] == {"role": "assistant", "content": "It is 5 degrees."}
    assert messages[5] == {"role": "user", "content": 'Output of get_weather:\n{"temp": 5}\n\nand tomorrow?'}
    assert len(messages) == 6


def test_edit_sessions_track_the_current_file():
    s = Session("e", "edit", "e", (Turn("{file}\nrename f"), Turn("add x"), Turn("docstring")),
                file="def f():\n    pass\n")
    conv = Conversation(s, turns=2)
    assert conv.turns == 2 and conv.file == s.file
    assert conv.next_messages(0)[0]["content"] == "```python\ndef f():\n    pass\n```\n\nrename f"
    conv.add_answer(0, "Sure:\n```python\ndef g():\n    pass\n```\nand\n```python\ndef g(x):\n    pass\n```\n", [])
    assert conv.file == "def g(x):\n    pass\n"
    conv.next_messages(1)
    conv.add_answer(1, "No code this time, and an unclosed ```python\ndef h(", [])
    assert conv.file == "def g(x):\n    pass\n"                      # kept: no complete code block
    assert last_code_block("```\nplain\n```") == "plain\n" and last_code_block("none") is None


def test_streamed_tool_call_deltas_accumulate():
    calls: list[dict] = []
    add_call_delta(calls, {"index": 0, "id": "c0", "function": {"name": "get_", "arguments": ""}})
    add_call_delta(calls, {"index": 0, "function": {"name": "weather", "arguments": '{"city": '}})
    add_call_delta(calls, {"index": 0, "function": {"arguments": '"Oslo"}'}})
    add_call_delta(calls, {"index": 1, "id": "c1", "function": {"name": "f", "arguments": {"a": 1}}})
    assert calls == [{"id": "c0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                     {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]


# ------------------------------------------------------------------ against a server
@pytest.fixture(scope="module")
def compared(server, tiny_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bss") / "compare"
    assert bench(out, "--url", server.url, "--sessions-file", str(tiny_file), "--compare-speculation",
                 "--prediction", "--tool-choice", "required") == 0
    return out


def test_every_turn_recorded(compared):
    results = read(compared)
    turns = results["turns"]
    assert len(turns) == 2 * sum(len(s["turns"]) for s in TINY)              # two arms, every turn
    assert {(r["arm"], r["cache"]) for r in turns} == {("on", "server"), ("off", "server")}
    for r in turns:
        assert r["ok"] and r["status"] == 200 and r["error"] is None, r
        assert 1 <= r["output_tokens"] <= MAX_TOKENS and r["tokens_from"] == "usage"
        assert 0 < r["ttft"] <= r["e2e"] and r["prompt_tokens"] > 0 and r["answer_sha1"]
        if r["turn"] > 1:
            assert r["cached_tokens"] > 0, r                               # the conversation so far is cached
        assert r["accepted_tokens"] is not None and r["drafted_tokens"] is not None
        if r["arm"] == "off":
            assert r["accepted_tokens"] == r["drafted_tokens"] == 0
        assert (r["prediction_chars"] is not None) == (r["kind"] == "edit")
        if r["kind"] == "tools":        # tool_choice required: a call every turn (its schema forces `{}`)
            assert r["tool_calls"] == 1 and r["finish_reason"] == "tool_calls", r
        if r["decode_tok_s"] is not None:
            span = r["e2e"] - r["ttft"]                 # times are rounded to the microsecond
            assert r["decode_tok_s"] == pytest.approx((r["output_tokens"] - 1) / span, rel=max(1e-3, 4e-6 / span))
    assert sum(r["drafted_tokens"] for r in turns if r["arm"] == "on") > 0
    # per session, the prompt grows turn by turn
    for arm in ("on", "off"):
        doc = [r["prompt_tokens"] for r in turns if r["session"] == "d1" and r["arm"] == arm]
        assert doc == sorted(doc) and len(set(doc)) == 3


def test_speculation_is_lossless_and_summarized(compared):
    results = read(compared)
    spec = {c["kind"]: c for c in results["comparison"]["speculation"]}
    assert set(spec) == {"edit", "tools", "document", "all"}
    for kind, c in spec.items():
        ident = c["identity"]
        assert ident["divergences"] == [] and ident["identical_turns"] == ident["turns_compared"] > 0, (kind, ident)
        assert c["speedup_output_tok_s"] > 0
    assert spec["all"]["identity"]["turns_compared"] == sum(len(s["turns"]) for s in TINY)
    rows = {(s["kind"], s["arm"]): s for s in results["summary"]}
    doc = rows["document", "on"]
    assert (doc["sessions"], doc["turns"], doc["failed"]) == (2, 5, 0)
    later = [r for r in results["turns"] if r["kind"] == "document" and r["arm"] == "on" and r["turn"] > 1]
    assert doc["cached_share_later"] == pytest.approx(sum(r["cached_tokens"] for r in later) /
                                                      sum(r["prompt_tokens"] for r in later), abs=1e-3)
    assert 0 < doc["cached_share_later"] < 1 and doc["ttft_turn1_p50_s"] > 0
    assert rows["all", "off"]["accepted_tokens"] == 0
    assert results["machine"]["cpu"] and results["config"]["command"].startswith(
        "specdecode bench sessions --url " + results["server"]["url"])
    assert "--compare-speculation" in results["config"]["command"] and "--prediction" in results["config"]["command"]
    report = (compared / "report.md").read_text()
    assert "## Speculation on vs off" in report and "## TTFT per turn: document sessions" in report
    assert "prefix cache" in report.lower() and results["config"]["command"] in report
    transcripts = [json.loads(line) for line in (compared / "transcripts.jsonl").read_text().splitlines()]
    assert len(transcripts) == 2 * len(TINY)
    d1 = next(t for t in transcripts if t["session"] == "d1" and t["arm"] == "on")["messages"]
    assert [m["role"] for m in d1] == ["user", "assistant"] * 3
    t1 = next(t for t in transcripts if t["session"] == "t1" and t["arm"] == "off")["messages"]
    assert [m["role"] for m in t1] == ["system", "user", "assistant", "tool", "assistant", "tool", "user", "assistant"]
    assert t1[3] == {"role": "tool", "tool_call_id": "call_1_0", "content": "red"}
    assert t1[2]["tool_calls"][0]["function"] == {"name": "mat", "arguments": "{}"}


def test_interleaved_round_robin(server, tiny_file, tmp_path):
    out = tmp_path / "inter"
    assert bench(out, "--url", server.url, "--sessions-file", str(tiny_file), "--kinds", "document",
                 "--interleave", "2", "--round-robin", "--speculate", "on") == 0
    turns = read(out)["turns"]
    # lockstep: d1 t1, d2 t1, d1 t2, d2 t2, d1 t3
    assert [(r["session"], r["turn"]) for r in turns] == [("d1", 1), ("d2", 1), ("d1", 2), ("d2", 2), ("d1", 3)]
    assert all(r["ok"] and r["group"] == 0 for r in turns)
    assert all(r["start"] >= prev["start"] + prev["e2e"] - 1e-3 for prev, r in zip(turns, turns[1:]))


def test_own_servers_with_and_without_prefix_cache(model_dir, tiny_file, tmp_path):
    out = tmp_path / "own"
    assert bench(out, *server_args(model_dir), "--sessions-file", str(tiny_file), "--kinds", "document",
                 "--sessions", "1", "--compare-prefix-cache", "--speculate", "on") == 0
    results = read(out)
    runs = results["server"]["runs"]
    assert [(r["cache"], r["arms"]) for r in runs] == [("on", ["on"]), ("off", ["on"])]
    assert "--no-prefix-cache" in runs[1]["args"] and "--no-prefix-cache" not in runs[0]["args"]
    assert all((out / r["log"]).exists() for r in runs)
    turns = results["turns"]
    assert [(r["cache"], r["turn"]) for r in turns] == [(cache, turn) for cache in ("on", "off") for turn in (1, 2, 3)]
    assert all(r["ok"] for r in turns)
    assert [r["cached_tokens"] > 0 for r in turns if r["cache"] == "on"] == [False, True, True]
    assert all(r["cached_tokens"] == 0 for r in turns if r["cache"] == "off")
    cache = {c["kind"]: c for c in results["comparison"]["prefix_cache"]}
    ident = cache["document"]["identity"]
    assert ident["identical_turns"] == ident["turns_compared"] == 3 and ident["divergences"] == []
    assert "## Prefix cache on vs off" in (out / "report.md").read_text()


def test_options(capsys, server, tiny_file, tmp_path):
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"id": "x", "kind": "edit", "turns": []}\n')
    for bad, words in (
            (["--url", server.url, "--model", "x"], "--model applies only when bench sessions starts its own server"),
            (["--url", "localhost:1"], "--url must start with http://"),
            (["--url", server.url, "--compare-prefix-cache"], "--compare-prefix-cache applies only to the bench's own"),
            (["--one-server"], "--one-server applies only with --compare-speculation"),
            (["--compare-speculation", "--speculate", "on"], "--speculate applies only without --compare-speculation"),
            (["--round-robin"], "--round-robin applies only with --interleave 2 or more"),
            (["--kinds", "tools", "--prediction"], "--prediction applies to edit sessions"),
            (["--url", server.url, "--extra-body", "[1]"], "--extra-body must be a JSON object"),
            (["--sessions-file", str(bad_file)], "--sessions-file: " + str(bad_file) + ":1 (x): 'turns' must be"),
            (["--sessions-file", str(tmp_path / "missing.jsonl")], "--sessions-file: cannot read"),
            (["--url", "http://127.0.0.1:9", "--kinds", "document"], "cannot reach http://127.0.0.1:9"),
            (["--compare-prefix-cache", "--server-args=--no-prefix-cache"], "drop it from --server-args")):
        assert main(["bench", "sessions", "--out", str(tmp_path / "o"), *bad]) == 2, bad
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (bad, err)
    for bad, words in ((["--kinds", "chat"], "--kinds: unknown 'chat'"),
                       (["--interleave", "0"], "--interleave must be"),
                       (["--turns", "0"], "--turns must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "sessions", *bad])
        assert exc.value.code == 2 and words in capsys.readouterr().err
    only_docs = tmp_path / "docs.jsonl"
    only_docs.write_text(json.dumps(TINY[2]) + "\n")
    assert main(["bench", "sessions", "--sessions-file", str(only_docs), "--kinds", "edit"]) == 2
    assert "--kinds: no edit sessions in" in capsys.readouterr().err


def test_child_server_runs_this_checkout(tmp_path):
    """LocalServer's child puts the folder of the specdecode package in use first on PYTHONPATH,
    so a worktree's bench starts the worktree's server from any working directory."""
    import specdecode
    env = child_env()
    root = os.path.dirname(os.path.dirname(os.path.abspath(specdecode.__file__)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == root
    found = subprocess.run([sys.executable, "-c", "import specdecode; print(specdecode.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.abspath(found) == os.path.abspath(specdecode.__file__)


def test_report_warns_when_the_cpu_was_shared(compared):
    from specdecode.bench.sessions_report import markdown
    results = read(compared)
    assert results["machine"]["cpu"] and "cpu_family" in results["machine"]
    for loads, warned in (([0.4, 0.3], False), ([0.5, 9.0], True)):
        results["machine"].update(load_average_start=[loads[0], 1, 1], load_average_end=[loads[1], 1, 1], cores=2)
        assert ("**Shared CPU: the load average (9.0) exceeded the 2 cores" in markdown(results)) == warned
