"""`specdecode serve` through the official openai client and raw HTTP: completions and chat,
streaming and not, sampling parameters, the speculation fields, health, metrics, /api/stats,
and every bad input (status, message, the server still serving afterwards)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.memory import MemoryBudgetError, check_memory, plan_memory
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")
REPEAT = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick"


@pytest.fixture(scope="module")
def server(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=4, max_queue=2, max_model_len=128, block_size=8,
                                         prefill_chunk=32, served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as srv:
        srv.state = state
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_and_chat_with_the_openai_client(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    greedy = dict(model="tiny", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=REPEAT, **greedy)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=REPEAT, stream=True, **greedy))
    assert streamed == full.choices[0].text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": REPEAT}]
    chat = client.chat.completions.create(messages=messages, **greedy)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True},
                                                 **greedy))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 24 and chunks[0].choices[0].delta.role == "assistant"
    raw = httpx.post(str(client.base_url) + "chat/completions", timeout=60, json=dict(
        messages=messages, stream=True, stream_options={"include_usage": True}, model="tiny", max_tokens=4))
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    assert [e["usage"] for e in events[:-1]] == [None] * (len(events) - 1) and events[-1]["usage"]["total_tokens"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    newer = client.chat.completions.create(messages=messages, **dict(greedy, max_tokens=24), max_completion_tokens=3)
    assert newer.usage.completion_tokens == 3         # OpenAI's current name wins over max_tokens


def test_sampling_parameters_and_speculation_fields(client):
    sampled = dict(model="tiny", prompt=REPEAT, max_tokens=20, temperature=0.8, top_p=0.9, seed=7,
                   presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"5": -100},
                   extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    a, b = client.completions.create(**sampled), client.completions.create(**sampled)
    assert a.choices[0].text == b.choices[0].text                 # seeded: reproducible
    other = client.completions.create(**{**sampled, "seed": 8})
    assert other.usage.completion_tokens == 20
    greedy = dict(model="tiny", prompt=REPEAT, max_tokens=30, temperature=0)
    off = client.completions.create(**greedy, extra_body={"speculate": False, "ignore_eos": True})
    on = client.completions.create(**greedy, extra_body={"speculate": True, "num_speculative_tokens": 3,
                                                         "ignore_eos": True, "return_token_kinds": True})
    assert on.choices[0].text == off.choices[0].text              # lossless
    assert off.speculation["drafted_tokens"] == 0 and off.speculation["mode"] == "off"
    spec = on.speculation
    assert spec["mode"] == "on" and spec["num_speculative_tokens"] == 3 and spec["accepted_tokens"] > 0
    kinds = on.choices[0].token_kinds
    assert "".join(k["text"] for k in kinds) == on.choices[0].text and len(kinds) == 30
    assert sum(k["kind"] == "accepted" for k in kinds) == spec["accepted_tokens"]
    stop = client.completions.create(model="tiny", prompt=REPEAT, max_tokens=30, temperature=0, stop=["lazy"])
    assert "lazy" not in stop.choices[0].text
    free = client.completions.create(model="tiny", prompt=REPEAT, max_tokens=30, temperature=0).choices[0].text
    middle = len(free) // 2
    for stops in ([free[middle]], [free[middle:middle + 3]], ["\u2603", free[middle + 2:middle + 4]]):
        # streamed: the text the non-streamed request gets, never a part of a stop string
        want = client.completions.create(model="tiny", prompt=REPEAT, max_tokens=30, temperature=0, stop=stops)
        got = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=REPEAT, max_tokens=30, temperature=0, stop=stops, stream=True))
        assert got == want.choices[0].text, (stops, got)


def test_n_over_the_queue_is_a_400_naming_n(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-queue" in r.text


def test_streamed_token_kinds_follow_the_steps(server):
    body = {"model": "tiny", "prompt": REPEAT, "max_tokens": 16, "temperature": 0, "stream": True,
            "return_token_kinds": True, "return_token_ids": True, "ignore_eos": True, "speculate": True}
    kinds, ids = [], []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = json.loads(line[6:])["choices"][0]
        step = [k["kind"] for k in choice["token_kinds"]]
        kinds += step
        ids += choice["token_ids"]
        assert len(step) == len(choice["token_ids"])
        assert all(k == "accepted" for k in step[:-1])            # a step: accepted drafts, then its own token
    assert len(ids) == 16 and "accepted" in kinds and {"bonus", "recovered"} & set(kinds)


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    return body["error"]


def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(server):
    url = server.url
    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)          # noqa: E731
    err = error_of(post("/v1/completions", content=b'{"prompt": "hi", '), 400)
    assert "malformed JSON" in err["message"]
    err = error_of(post("/v1/completions", json={"prompt": "hi", "temperature": -1}), 400)
    assert err["param"] == "temperature" and "[0, 100]" in err["message"]
    assert err["code"] is None                           # OpenAI's: a string code or null, never the status
    err = error_of(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": 3}), 400)
    assert err["param"] == "logprobs" and "top_logprobs" in err["message"]
    err = error_of(post("/v1/completions", json={"prompt": "hi", "num_speculative_tokens": 33}), 400)
    assert err["param"] == "num_speculative_tokens" and "[0, 32]" in err["message"]
    err = error_of(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "speculate": "yes"}), 400)
    assert err["param"] == "speculate"
    ids = [5] * 100
    err = error_of(post("/v1/completions", json={"prompt": ids, "max_tokens": 50}), 400)
    assert "100" in err["message"] and "50" in err["message"] and "128" in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = error_of(post("/v1/completions", json={"prompt": [999999]}), 400)
    assert err["param"] == "prompt" and "[0, " in err["message"]
    err = error_of(post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
    error_of(post("/v1/completions", json={"prompt": "hi", "n": 0}), 400)
    err = error_of(post("/v1/completions", json={"prompt": "hi", "stream_options": {"include_usage": True}}), 400)
    assert err["param"] == "stream_options" and "stream" in err["message"]
    err = error_of(post("/v1/completions", json={"prompt": "hi", "stream": True,
                                                 "stream_options": {"include_usage": "no"}}), 400)
    assert err["param"] == "include_usage"
    error_of(post("/v1/chat/completions", json={"messages": []}), 400)
    err = error_of(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                      "response_format": {"type": "yaml"}}), 400)
    assert err["param"] == "response_format"
    error_of(post("/v1/nothing", json={}), 404)
    error_of(httpx.get(url + "/v1/completions"), 405)
    # an internal error fails the batch with a sanitized 500; the next request is served
    engine = server.state.engine
    original = engine.step

    def broken(*args, **kwargs):
        engine.step = original
        raise RuntimeError("secret detail at /home/someone/model.py")
    engine.step = broken
    err = error_of(post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}), 500)
    assert "secret" not in err["message"] and "RuntimeError" in err["message"]
    ok = post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_queue_full_is_429_and_health_needs_a_working_engine(server):
    pool = ThreadPoolExecutor(2)
    engine = server.state.engine
    timeout = engine.config.health_timeout
    with engine.gate:            # the engine thread stops between iterations
        engine.config.health_timeout = 0.3
        try:
            err = error_of(httpx.get(server.url + "/health", timeout=10), 503)
            assert "did not finish within 0.3 s" in err["message"]
        finally:
            engine.config.health_timeout = timeout
        # max_queue=2: two requests wait, the third is refused; the two are served after the hold
        waiting = [pool.submit(httpx.post, server.url + "/v1/completions", timeout=60,
                               json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}) for _ in range(2)]
        deadline = time.monotonic() + 10
        while len(engine.scheduler.inbox) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        err = error_of(httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30), 429)
        assert err["code"] == "queue_full" and "--max-queue" in err["message"]
    assert [f.result().json()["usage"]["completion_tokens"] for f in waiting] == [2, 2]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_health_checks_at_once_share_one_generation(server):
    """/health needs no key: checks that come while one is in flight wait for its answer, rather
    than each queueing a generation ahead of the requests."""
    engine = server.state.engine
    with ThreadPoolExecutor(10) as pool:
        with engine.gate:
            checks = [pool.submit(httpx.get, server.url + "/health", timeout=60) for _ in range(10)]
            deadline = time.monotonic() + 10
            while not engine.scheduler.inbox:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.5)                          # every check has arrived by now
            assert len(engine.scheduler.inbox) == 1
        assert [c.result().status_code for c in checks] == [200] * 10


def test_metrics_and_stats(server, client):
    client.completions.create(model="tiny", prompt=REPEAT, max_tokens=12, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", 'spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "spec_decode_mean_accepted_length", "spec_decode_draft_time_seconds_total",
                 "spec_decode_verify_time_seconds_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "num_requests_running", "num_requests_waiting",
                 "generation_tokens_total", "generation_tokens_per_second", "num_requests_speculating",
                 'memory_weights_bytes{model="target"}', 'kv_cache_used_bytes{model="target"}',
                 'kv_cache_capacity_bytes{model="draft"}', 'request_success_total{finished_reason="length"}',
                 "engine_thread_switches_total"]:
        assert "\nspecdecode:" + name in text, name
    threads = next(line for line in text.splitlines() if line.startswith("specdecode:engine_threads "))
    assert float(threads.split()[1]) >= 1          # the thread count the steps run on
    stats = httpx.get(server.url + "/api/stats", timeout=10).json()
    assert set(stats) >= {"model", "method", "uptime_s", "requests", "speculation", "throughput_tokens_per_s",
                          "memory", "history"}
    assert stats["model"] == "tiny" and stats["method"] == "ngram"
    assert set(stats["requests"]) >= {"running", "waiting", "finished", "failed", "aborted"}
    failed = next(line for line in text.splitlines() if line.startswith("specdecode:request_failed_total "))
    assert stats["requests"]["finished"] >= 1                 # failed: as many as /metrics counts (an
    assert stats["requests"]["failed"] == float(failed.split()[1])   # earlier test's injected failure, if run)
    spec = stats["speculation"]
    assert set(spec) >= {"requests_on", "batch_auto_off", "k", "acceptance_rate", "mean_accepted_length",
                         "tokens_per_step", "acceptance_per_position", "draft_s", "verify_s"}
    assert spec["k"] == 5 and 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] > 1
    memory = stats["memory"]
    assert memory["weights_bytes"]["target"] > 0 and memory["weights_bytes"]["draft"] == 0
    assert memory["kv_bytes_used"] == {"target": 0, "draft": 0} and memory["kv_bytes_capacity"]["target"] > 0
    for point in stats["history"]:
        assert set(point) == {"t", "tokens_per_s", "acceptance_rate", "mean_accepted_length", "running", "waiting"}
    assert "\nspecdecode:spec_decode_tree_nodes_per_step_bucket" in text
    assert spec["tree_nodes_mean"] > 0 and sum(spec["tree_nodes_histogram"].values()) > 0
    _check_last_tree(spec["last_tree"])


def _check_last_tree(tree):
    """The dashboard's last verified draft is a valid tree whose accepted path is a root path and
    whose accepted node tokens are the tokens the step emitted first."""
    n = len(tree["tokens"])
    assert n > 0 and len(tree["parents"]) == n == len(tree["texts"])
    assert all(-1 <= p < i for i, p in enumerate(tree["parents"]))
    parent = -1
    for node in tree["accepted"]:
        assert tree["parents"][node] == parent
        parent = node
    assert [tree["tokens"][i] for i in tree["accepted"]] == tree["emitted"][:len(tree["accepted"])]
    assert len(tree["emitted"]) in (len(tree["accepted"]), len(tree["accepted"]) + 1)


@pytest.mark.parametrize("method", ["recycle", "lookahead"])
def test_tree_drafter_metrics_and_last_tree(tiny_models, method):
    """A tree drafter through the server: trees of several nodes per step in /metrics and
    /api/stats, the last tree well formed, greedy output identical to plain decoding."""
    llm = LLM(model=str(tiny_models["llama"]), method=method, num_speculative_tokens=12, adaptive=False,
              dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=128, block_size=8, prefill_chunk=32,
                                         served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as srv:
        body = dict(model="tiny", prompt=REPEAT, max_tokens=24, temperature=0, ignore_eos=True)
        spec = httpx.post(srv.url + "/v1/completions", json=dict(body, speculate=True), timeout=60).json()
        stats = httpx.get(srv.url + "/api/stats", timeout=10).json()["speculation"]
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        plain = httpx.post(srv.url + "/v1/completions", json=dict(body, speculate=False), timeout=60).json()
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert stats["tree_nodes_mean"] > 1                       # recycle drafts trees of several nodes
    _check_last_tree(stats["last_tree"])
    assert 'spec_decode_tree_nodes_per_step_bucket{le="12.0"}' in text


def test_memory_budget_refuses_at_start_up(tiny_models, capsys):
    from specdecode.cli import main
    from specdecode.models.loader import load_model
    model = load_model(str(tiny_models["llama"]), dtype="fp32", progress=False).model
    plan = plan_memory(model, None, num_blocks=1000, block_size=16, max_batch_size=4, max_k=32,
                       prefill_chunk=64, context=256)
    assert plan.kv["target"] == 1000 * 16 * 2 * 3 * 2 * 16 * 4 and plan.kv["draft"] == 0
    check_memory(plan, available=plan.total)
    with pytest.raises(MemoryBudgetError, match="lower --max-batch-size"):
        check_memory(plan, available=plan.kv["target"] // 2)
    code = main(["serve", "--model", str(tiny_models["llama"]), "--dtype", "fp32", "--block-size", "1024",
                 "--num-blocks", "50000000", "--port", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("specdecode: error: memory budget exceeded") and "GB" in err[-1]
