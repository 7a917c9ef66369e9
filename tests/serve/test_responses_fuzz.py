"""Fuzzing /v1/responses with schemathesis against OpenAI's published API description: the Responses
operations the server answers (create, retrieve, delete, cancel), cut from OpenAI's openapi.json
(tests/serve/data/openai_responses.openapi.json, scripts/setup/cut_openapi_responses.py). Bodies and
parameters that follow it and that break it (positive and negative modes), a bounded number of each:
never a 5xx, an error always in OpenAI's shape, never a traceback in the server's log. `model` is
the served name, `input` is required (without it a body is one 400) and `max_output_tokens` a few
tokens, so that an example runs in milliseconds (a
model that is not served is one 404, and the clamp to the context has its own test)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import schemathesis
from conftest import FUZZ_KEY as KEY
from hypothesis import HealthCheck, settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
EXAMPLES = 40                     # per operation and mode
SPEC = Path(__file__).parent / "data" / "openai_responses.openapi.json"
STATUSES: dict[tuple[str, str], list[int]] = {}     # (method, path) -> the statuses answered


def openapi() -> dict:
    """The cut description, the server's own: `/v1` paths, its model name, a few output tokens."""
    doc = copy.deepcopy(json.loads(SPEC.read_text()))
    doc["servers"] = []
    doc["paths"] = {"/v1" + path: item for path, item in doc["paths"].items()}
    schemas = doc["components"]["schemas"]
    schemas["ResponseProperties"]["properties"]["model"] = {"const": "m"}
    inline = next(part for part in schemas["CreateResponse"]["allOf"] if "max_output_tokens" in
                  part.get("properties", {}))
    inline["properties"]["max_output_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
    inline["required"] = ["input", "max_output_tokens"]      # (optional in the API: without input, a 400)
    return doc


schema = schemathesis.openapi.from_dict(openapi())
schema.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES, deterministic=True)
schema.config.phases.update(phases=["fuzzing"])


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_no_traceback(case, fuzz_served):
    server, records = fuzz_served
    response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    STATUSES.setdefault((case.method, case.operation.path), []).append(response.status_code)
    assert response.status_code < 500, (case.method, case.path, response.text)
    if response.status_code >= 400:
        if response.status_code != 405:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (case.path, error)
    elif response.headers["content-type"][0].startswith("text/event-stream"):
        names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
        assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete"), names
    elif case.method == "POST" and case.path == "/v1/responses":
        assert response.json()["object"] == "response"
    assert not records.tracebacks, records.tracebacks[0]


def test_the_fuzzing_reached_answers_and_refusals():
    """The sweep is worth something: bodies the server answered and bodies it refused, on create."""
    if not STATUSES:
        pytest.skip("runs after the fuzzing above (the same module)")
    create = STATUSES[("POST", "/v1/responses")]
    print({key: {s: v.count(s) for s in sorted(set(v))} for key, v in STATUSES.items()})
    assert create.count(200) >= 5 and sum(s == 400 for s in create) >= 5, create
