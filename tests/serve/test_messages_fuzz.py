"""Fuzzing /v1/messages and /v1/messages/count_tokens with schemathesis against Anthropic's API
description: the request schemas of the official anthropic SDK's types (generated from Anthropic's
OpenAPI description), put in an OpenAPI document here. Bodies that follow it and bodies that break it
(schemathesis' positive and negative modes), a bounded number of each: never a 5xx, an error always in
Anthropic's shape, never a traceback in the server's log. `model` is the served name (any other is one
404), `max_tokens` at most a few tokens, so that an example runs in milliseconds (the clamp to the
context has its own test in test_messages.py), and the content blocks are those the server takes: an
image, document or server tool's result block is a 400 (tested in test_messages.py), and with them in
the schema few bodies reached the engine."""
from __future__ import annotations

import pytest
import schemathesis
from anthropic.types.message_count_tokens_params import MessageCountTokensParams
from anthropic.types.message_create_params import MessageCreateParamsNonStreaming
from conftest import FUZZ_KEY as KEY
from hypothesis import HealthCheck, settings
from pydantic import TypeAdapter

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
TAKEN_BLOCKS = ("TextBlockParam", "ToolUseBlockParam", "ToolResultBlockParam", "ThinkingBlockParam",
                "RedactedThinkingBlockParam")
EXAMPLES = 50                     # per operation and mode


def request_schemas() -> tuple[dict, dict, dict]:
    """(messages body schema, count_tokens body schema, shared definitions) from the SDK's types."""
    ref = "#/components/schemas/{model}"
    create = TypeAdapter(MessageCreateParamsNonStreaming).json_schema(ref_template=ref)
    count = TypeAdapter(MessageCountTokensParams).json_schema(ref_template=ref)
    defs = {**create.pop("$defs", {}), **count.pop("$defs", {})}
    for name in defs:                  # content blocks a text model refuses: none generated
        if name.endswith("BlockParam") and name not in TAKEN_BLOCKS:
            defs[name] = {"not": {}}
    create["properties"]["stream"] = {"type": "boolean"}
    for body in (create, count):
        body["properties"]["model"] = {"const": "m"}
    create["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
    return create, count, defs


def openapi() -> dict:
    create, count, defs = request_schemas()

    def post(body: dict) -> dict:
        return {"post": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {"200": {"description": "the answer"}}}}
    return {"openapi": "3.1.0", "info": {"title": "Anthropic Messages (from the anthropic SDK's types)",
                                         "version": "1"},
            "paths": {"/v1/messages": post(create), "/v1/messages/count_tokens": post(count)},
            "components": {"schemas": defs}}


schema = schemathesis.openapi.from_dict(openapi())
schema.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES, deterministic=True)
schema.config.phases.update(phases=["fuzzing"])     # the coverage phase's boundary cases: ~15k requests


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_no_traceback(case, fuzz_served):
    server, records = fuzz_served
    response = case.call(base_url=server.url, headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert body.get("type") == "error" and body["error"]["type"] and body["error"]["message"], (case.path, body)
    elif response.headers["content-type"][0].startswith("text/event-stream"):     # (a header's values)
        names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] == "message_stop" and "error" not in names, names
    else:
        body = response.json()
        assert ("input_tokens" in body) if case.path.endswith("count_tokens") else body["type"] == "message"
    assert not records.tracebacks, records.tracebacks[0]
