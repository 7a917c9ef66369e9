"""Who may call the server: --api-key (401 in OpenAI's shape without `Authorization: Bearer KEY`,
/health and the dashboard page open, the unchanged openai client works with the key), the request
body limit (413), and the warning for a server exposed without a key."""
from __future__ import annotations

import httpx
import openai
import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.auth import exposed_without_key
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=128, block_size=8, prefill_chunk=32,
                                         served_model_name="tiny"))
    with BackgroundServer(create_app(state, api_key=KEY, max_body_bytes=4096)) as srv:
        yield srv


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                                         ("GET", "/api/stats")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "Basic " + KEY, KEY])
def test_every_endpoint_needs_the_key(server, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(method, server.url + path, headers=headers, json={"model": "tiny", "prompt": "hi"}, timeout=30)
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert KEY not in r.text and r.headers["www-authenticate"] == "Bearer"


def test_health_and_the_dashboard_page_stay_open(server):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and "static/auth.js" in page.text
    assert httpx.get(server.url + "/static/auth.js", timeout=30).status_code == 200


def test_the_openai_client_with_and_without_the_key(server):
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in ok.models.list().data] == ["tiny"]
    out = ok.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=6, temperature=0)
    assert out.usage.completion_tokens == 6
    streamed = ok.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, stream=True)
    assert sum(1 for _ in streamed) >= 1
    assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer " + KEY}, timeout=30).status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_request_body_limit(server):
    headers = {"Authorization": "Bearer " + KEY}
    big = {"model": "tiny", "prompt": "x" * 5000, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=big, headers=headers, timeout=30)
    assert r.status_code == 413 and "--max-body-bytes 4096" in r.json()["error"]["message"]

    def chunks():                        # no Content-Length: counted while read
        for _ in range(6):
            yield b" " * 1000
    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=headers, timeout=30)
    assert r.status_code == 413
    small = httpx.post(server.url + "/v1/completions", headers=headers, timeout=30,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert small.status_code == 200                    # the server still serves


def test_exposed_without_key_warning():
    assert exposed_without_key("0.0.0.0", None) and exposed_without_key("::", None)
    assert exposed_without_key("10.1.2.3", None) and exposed_without_key("myhost.example", None)
    assert not exposed_without_key("127.0.0.1", None) and not exposed_without_key("::1", None)
    assert not exposed_without_key("localhost", None) and not exposed_without_key("0.0.0.0", KEY)
