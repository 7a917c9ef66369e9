"""vLLM's tokenizer endpoints, which clients use to count and split tokens as the server does
(lm-evaluation-harness's `local-completions` finds them by itself and then needs no tokenizer of its
own): POST /tokenize, POST /detokenize, GET /tokenizer_info."""
from __future__ import annotations

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from .errors import ApiError, read_json


async def _body(http: HttpRequest) -> dict:
    body = await read_json(http)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def tokenize(http: HttpRequest) -> Response:
    """{"prompt": str, "add_special_tokens": bool} or {"messages": [...], "add_generation_prompt": bool}
    -> {"tokens", "count", "max_model_len"}."""
    state = http.app.state.serve
    tokenizer = state.tokenizer
    try:
        body = await _body(http)
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ApiError(400, f"add_special_tokens must be true or false, got {special!r}", "add_special_tokens")
        if "messages" in body:
            from .protocol import parse
            parsed = parse({"messages": body["messages"], "max_tokens": 1}, state.ctx, chat=True)
            tokens = parsed.prompt_ids
        elif isinstance(body.get("prompt"), str):
            tokens = tokenizer.encode(body["prompt"], add_special=special)
        else:
            raise ApiError(400, "prompt must be a string (or give messages)", "prompt")
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.ctx.max_model_len})


async def detokenize(http: HttpRequest) -> Response:
    """{"tokens": [int]} -> {"prompt": str}."""
    state = http.app.state.serve
    try:
        tokens = (await _body(http)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < state.ctx.vocab_size for t in tokens):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {state.ctx.vocab_size})", "tokens")
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    return JSONResponse({"prompt": state.tokenizer.decode(tokens, skip_special=False)})


async def tokenizer_info(http: HttpRequest) -> Response:
    state = http.app.state.serve
    tokenizer = state.tokenizer
    eos_ids = state.ctx.eos_token_ids
    return JSONResponse({"eos_token": tokenizer.eos_token or (tokenizer.id_to_token(eos_ids[0]) if eos_ids else None),
                         "bos_token": tokenizer.bos_token, "pad_token": None,
                         "chat_template": tokenizer.chat_template, "model_max_length": state.ctx.max_model_len,
                         "vocab_size": state.ctx.vocab_size})
