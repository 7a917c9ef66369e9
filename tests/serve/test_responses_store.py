"""Stored responses beyond GET: DELETE /v1/responses/{id} (OpenAI's answer, then the response is gone
for GET and previous_response_id alike) and POST /v1/responses/{id}/cancel (OpenAI's 400 for a
response not made in background mode, which is every response here), through the openai client
on a tiny random model."""
from __future__ import annotations

import httpx
import openai
import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=256, block_size=8, served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as srv:
        yield srv.url, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_a_deleted_response_is_gone(served):
    url, client = served
    made = client.responses.create(model="tiny", input="hello", max_output_tokens=3)
    assert client.responses.retrieve(made.id).id == made.id
    r = httpx.delete(f"{url}/v1/responses/{made.id}", timeout=60)
    assert r.status_code == 200 and r.json() == {"id": made.id, "object": "response", "deleted": True}, r.text
    for call in (lambda: client.responses.retrieve(made.id),
                 lambda: client.responses.create(model="tiny", previous_response_id=made.id, input="hi",
                                                 max_output_tokens=3)):
        with pytest.raises(openai.NotFoundError):
            call()
    again = httpx.delete(f"{url}/v1/responses/{made.id}", timeout=60)
    assert again.status_code == 404 and again.json()["error"]["param"] == "response_id"
    other = client.responses.create(model="tiny", input="hello", max_output_tokens=3)
    client.responses.delete(other.id)                            # the SDK's own call
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(other.id)


def test_cancel_answers_as_openai_does_for_a_foreground_response(served):
    url, client = served
    made = client.responses.create(model="tiny", input="hello", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(made.id)
    assert "background=true" in caught.value.message and caught.value.body["param"] == "response_id"
    assert client.responses.retrieve(made.id).status == made.status            # unchanged
    r = httpx.post(f"{url}/v1/responses/resp_unknown/cancel", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.put(f"{url}/v1/responses/{made.id}", timeout=60).status_code == 405
