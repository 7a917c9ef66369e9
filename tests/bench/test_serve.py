"""`specdecode bench serve` against a real `specdecode serve` on a tiny random Llama (n-gram
drafter): request counts, percentiles recomputed from requests.jsonl, speculation on vs off,
failures counted when the server answers errors, memory samples, the files written, the
server it starts itself, and option errors."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from specdecode.bench.serve_load import Record
from specdecode.bench.serve_report import summarize
from specdecode.bench.serve_server import LocalServer
from specdecode.cli import build_parser, main

MAX_TOKENS = 10


def server_args(tiny_models) -> list[str]:
    return ["--model", str(tiny_models["llama"]), "--method", "ngram", "-k", "4", "--dtype", "fp32", "--threads", "1"]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with LocalServer(server_args(tiny_models), tmp_path_factory.mktemp("bs") / "server.log",
                     startup_timeout_s=120) as srv:
        yield srv


def bench(out, *args: str) -> int:
    return main(["bench", "serve", "--tasks", "qa", "--max-tokens", str(MAX_TOKENS), "--warmup", "1",
                 "--sample-interval", "0.25", "--out", str(out), *args])


def read(out) -> tuple[dict, list[dict]]:
    results = json.loads((out / "results.json").read_text())
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return results, requests


@pytest.fixture(scope="module")
def compared(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bs") / "compare"
    assert bench(out, "--url", server.url, "--server-pid", str(server.pid), "--concurrency", "1,3",
                 "--num-requests", "6", "--compare-speculation") == 0
    return out


def test_counts_and_files(compared):
    results, requests = read(compared)
    assert [lv["load"] for lv in results["levels"]] == ["concurrency 1", "concurrency 3"]
    assert len(requests) == 2 * 2 * 6                # levels x arms x requests
    for level in results["levels"]:
        assert set(level["arms"]) == {"on", "off"}
        for s in level["arms"].values():
            assert (s["requests"], s["completed"], s["failed"]) == (6, 6, 0), s
            assert s["output_tokens"] > 0 and s["request_throughput"] > 0 and s["goodput"] == s["request_throughput"]
        # interleaved: on,off then off,on, 3 requests per round
        assert [(r["round"], r["arm"], r["requests"]) for r in level["rounds"]] == \
               [(0, "on", 3), (0, "off", 3), (1, "off", 3), (1, "on", 3)]
    for r in requests:
        assert r["ok"] and r["status"] == 200 and r["error"] is None
        assert 1 <= r["output_tokens"] <= MAX_TOKENS and r["finish_reason"] in ("length", "stop")
        assert 0 < r["ttft"] <= r["e2e"]
        assert sum(r["kinds"].values()) == r["output_tokens"]
    report = (compared / "report.md").read_text()
    assert "| concurrency 3 | off | 6 | 0 |" in report and "TPOT ratio off/on" in report


def test_automatic_policy_arm(server, tmp_path):
    """--compare-auto adds an arm that sends no speculate field (the server's policy decides),
    interleaved with on/off and compared with off."""
    out = tmp_path / "auto"
    assert bench(out, "--url", server.url, "--concurrency", "2", "--num-requests", "4", "--rounds", "2",
                 "--compare-speculation", "--compare-auto") == 0
    results, requests = read(out)
    level = results["levels"][0]
    assert set(level["arms"]) == {"on", "off", "server"}
    assert [r["arm"] for r in level["rounds"]] == ["on", "off", "server", "server", "off", "on"]
    assert all(level["arms"][a]["completed"] == 4 for a in ("on", "off", "server"))
    auto = level["comparison_auto"]
    assert auto["output_tokens_per_s_ratio_on_over_off"] == pytest.approx(
        level["arms"]["server"]["output_tokens_per_s"] / level["arms"]["off"]["output_tokens_per_s"], rel=1e-3)
    assert "Automatic policy" in (out / "report.md").read_text()


def test_percentiles_match_the_requests(compared):
    results, requests = read(compared)
    level = results["levels"][1]
    for arm, s in level["arms"].items():
        mine = [r for r in requests[12:] if r["arm"] == arm]        # requests.jsonl is in level order
        assert len(mine) == 6
        ttft = np.array([r["ttft"] for r in mine]) * 1000
        itl = np.array([x for r in mine for x in r["itl"]]) * 1000
        assert s["ttft_ms"]["p50"] == pytest.approx(np.percentile(ttft, 50), abs=0.01)
        assert s["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttft, 99), abs=0.01)
        assert s["itl_ms"]["n"] == itl.size and s["itl_ms"]["p50"] == pytest.approx(np.percentile(itl, 50), abs=0.01)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"], (key, s[key])
        assert s["e2e_ms"]["p50"] >= s["ttft_ms"]["p50"]
        tokens = sum(r["output_tokens"] for r in mine)
        assert s["output_tokens"] == tokens
        assert s["output_tokens_per_s"] == pytest.approx(tokens / s["duration_s"], rel=0.01)


def test_speculation_arms_differ(compared):
    results, requests = read(compared)
    assert all(r["kinds"].get("accepted", 0) == 0 for r in requests if r["arm"] == "off")
    assert sum(r["kinds"].get("accepted", 0) for r in requests if r["arm"] == "on") > 0
    for level in results["levels"]:
        assert level["arms"]["off"]["tokens_per_step"] == 1.0
        assert level["arms"]["on"]["tokens_per_step"] > 1.0
        ratio = level["comparison"]["tpot_p50_ratio_off_over_on"]
        assert ratio == pytest.approx(level["arms"]["off"]["tpot_ms"]["p50"] / level["arms"]["on"]["tpot_ms"]["p50"],
                                      rel=1e-3)


def test_memory_sampled(compared, server):
    results, _ = read(compared)
    assert results["server"] == {"url": server.url, "local": False, "model": results["server"]["model"],
                                 "args": None, "rss_sampled": True}
    for level in results["levels"]:
        memory = level["memory"]
        assert memory["samples"] >= 2 and len(memory["series"]) == memory["samples"]
        rss = memory["rss_bytes"]
        assert 0 < rss["start"] <= rss["peak"] and rss["end"] <= rss["peak"]
        assert rss["growth"] == rss["end"] - rss["after_warmup"]
        assert all(s["kv_bytes_used"] is not None for s in memory["series"])


def test_server_errors_are_counted(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"text": "the quick brown fox", "chat": False}, {"text": "1 2 3 4", "chat": False},
            {"text": "the lazy dog " * 200, "chat": False}]      # longer than the 256-token context: 400
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "errors"
    assert bench(out, "--url", server.url, "--concurrency", "2", "--num-requests", "9", "--warmup", "0",
                 "--prompts-file", str(prompts)) == 0
    results, requests = read(out)
    s = results["levels"][0]["arms"]["server"]
    assert (s["requests"], s["completed"], s["failed"]) == (9, 6, 3), s
    assert s["failures_by_status"] == {"400": 3}
    assert all(r["error"].startswith("HTTP 400: ") for r in requests if not r["ok"])
    assert {r["ok"] for r in requests if r["prompt_id"] == "3"} == {False}
    assert "## Failures" in (out / "report.md").read_text()
    # a bad parameter on every request: all fail, the run still writes its results
    out = tmp_path / "bad"
    assert bench(out, "--url", server.url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
                 "--extra-body", '{"top_p": 7}') == 0
    s = read(out)[0]["levels"][0]["arms"]["server"]
    assert (s["completed"], s["failed"], s["goodput"]) == (0, 4, 0) and "top_p" in next(iter(s["failures"]))
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200     # still serving


def test_own_server_with_poisson_arrivals(tiny_models, tmp_path):
    out = tmp_path / "own"
    assert bench(out, *server_args(tiny_models), "--rate", "20", "--duration", "1", "--speculate", "on",
                 "--slo-ttft", "0.001") == 0
    results, requests = read(out)
    assert results["server"]["local"] and results["server"]["rss_sampled"]
    level = results["levels"][0]
    s = level["arms"]["on"]
    assert level["load"] == "rate 20/s" and s["requests"] == s["completed"] == len(requests) >= 5   # ~20 expected
    assert max(r["start"] for r in requests) < 1.5       # arrivals stop after --duration 1 (+ scheduling slack)
    assert 0.5 < level["rounds"][0]["duration_s"] < 30     # ends when the last arrival has its answer
    assert s["goodput_requests"] == 0                           # nobody meets a 1 µs TTFT
    assert level["memory"]["rss_bytes"]["peak"] > 0
    assert (out / "server.log").exists()
    with pytest.raises(httpx.HTTPError):                          # stopped at the end of the run
        httpx.get(results["server"]["url"] + "/health", timeout=2)


def test_goodput_uses_both_slos():
    def rec(ttft, tpot, ok=True):
        return Record("qa", "1", "on", 0, ok=ok, ttft=ttft, tpot=tpot, e2e=1.0, output_tokens=5)
    records = [rec(0.05, 0.01), rec(0.2, 0.01), rec(0.05, 0.05), rec(0.05, None), rec(0.01, 0.01, ok=False)]
    assert summarize(records, 2.0, slo_ttft_ms=100, slo_tpot_ms=20)["goodput_requests"] == 2
    assert summarize(records, 2.0, slo_ttft_ms=100)["goodput_requests"] == 3
    s = summarize(records, 2.0)
    assert (s["goodput_requests"], s["goodput"], s["failed"]) == (4, 2.0, 1)


def test_options(capsys, server):
    args = build_parser().parse_args(["bench", "--quick", "--tasks", "qa"])     # plain `bench` as before
    assert (args.run.__name__, args.mode, args.tasks, args.bench_command) == ("cmd_bench", "quick", ["qa"], None)
    for bad, words in ((["--concurrency", "0"], "--concurrency values must be in [1, 1024]"),
                       (["--rate", "0"], "--rate values must be in (0, 10000]"),
                       (["--concurrency", "1", "--rate", "2"], "not allowed with argument")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "serve", *bad])
        assert exc.value.code == 2 and words in capsys.readouterr().err
    for bad, words in ((["--url", server.url, "--model", "x"], "--model applies only when bench serve starts"),
                       (["--url", "localhost:1"], "--url must start with http://"),
                       (["--url", server.url, "--extra-body", "[1]"], "--extra-body must be a JSON object"),
                       (["--url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9")):
        assert main(["bench", "serve", *bad]) == 2
        assert words in capsys.readouterr().err


def test_own_server_that_fails_to_start(tmp_path, capsys):
    assert main(["bench", "serve", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "the local server exited with code 2 before it was ready" in err and "missing" in err
    assert "Traceback" not in err and (tmp_path / "out" / "server.log").exists()
