"""OpenAI request parsing and validation, and the error shape.

Every bad field is an `ApiError` naming the field and its limit; the app turns it into
OpenAI's error JSON `{"error": {"message", "type", "param", "code"}}`. Extra request fields
(vLLM's names where vLLM has them): `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
OpenAI's `prediction` (Predicted Outputs),
`speculate`, `num_speculative_tokens`, `return_token_kinds`, `return_token_ids`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..params import ParamError, SamplingParams
from .errors import ERROR_TYPES, ApiError, error_body, stream_error  # noqa: F401 -- the API's names

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_K = 64            # draft tree nodes per step (tree drafters); a chain drafter's limit is 32
MAX_N = 16            # choices per request (`n`)
MAX_CHOICES = 128     # choices per request: prompts (a list) times n
DEFAULT_MAX_TOKENS = 2048   # max_tokens of a request that gives none (EngineConfig.max_tokens_default)


@dataclass
class ServeContext:
    """What parsing needs to know about the server."""
    tokenizer: object
    vocab_size: int
    max_model_len: int
    model_names: tuple[str, ...]     # the first is the one /v1/models lists
    has_drafter: bool
    max_k: int = MAX_K               # the drafter's limit: draft tokens of a chain, nodes of a tree
    eos_token_ids: tuple[int, ...] = ()      # the target's (a grammar's end)
    max_tokens_default: int = DEFAULT_MAX_TOKENS   # max_tokens of a request that gives none (capped by the context)
    drafts_predictions: bool = False # the drafter follows a request's `prediction` (Predicted Outputs)

    def tool_format(self):
        """The model's tool-call format (serve/tools/formats.py), detected on first use."""
        from ..structured import grammar_tokenizer_for
        from .tools import format_of
        return format_of(self.tokenizer, lambda token: grammar_tokenizer_for(
            self.tokenizer, self.vocab_size, self.eos_token_ids).is_special(token))


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    speculate: bool | None           # None = automatic
    num_speculative_tokens: int | None
    stream: bool
    include_usage: bool
    return_token_kinds: bool
    return_token_ids: bool
    model: str
    chat: bool
    n: int = 1                       # choices: n sequences of the prompt (choice i seeded seed + i)
    tools: object = None             # serve/tools/ ToolSpec (chat with tools), or None
    prompts: list = dataclasses.field(default_factory=list)   # completions: every prompt's ids (a list: a batch)
    echo: bool = False               # completions: the prompt's text (and logprobs) before the answer's
    echo_only: bool = False          # echo with max_tokens 0: the prompt alone (one token is run, not sent)
    prompt_logprobs: bool = False    # vLLM's `prompt_logprobs` field was asked for
    thinking_budget: int | None = None   # the most reasoning tokens (Anthropic's thinking.budget_tokens)


def _bad(name: str, message: str) -> ApiError:
    return ApiError(400, f"{name} {message}", param=name)


def _bool(body: dict, name: str, default=False):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}")
    return value


def _int(body: dict, name: str, low: int, high: int | None = None):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"must be in [{low}, {high}]" if high is not None else f"must be >= {low}"
        raise _bad(name, f"{bound}, got {value}")
    return value


def _number(body: dict, name: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"must be a finite number, got {value!r}")
    return float(value)


def _unsupported(body: dict) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _bad("best_of", f"must be 1, got {best_of!r}")
    if body.get("functions"):
        raise _bad("functions", "is the legacy form: send tools")


def _sampling(body: dict, max_tokens: int | None, default_max_tokens: int, chat: bool) -> SamplingParams:
    values: dict = {"temperature": 1.0}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value is not None:
            values[name] = value
    top_k = _int(body, "top_k", -1)
    if top_k is not None:
        values["top_k"] = max(top_k, 0)          # -1 (vLLM) or 0 disable it
    seed = _int(body, "seed", 0, 2**63 - 1)
    if seed is not None:
        values["seed"] = seed
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias", f"must be an object {{token_id: bias}}, got {bias!r}")
        values["logit_bias"] = bias
    stop = body.get("stop")
    if stop is not None:
        values["stop"] = stop
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        values["stop_token_ids"] = stop_ids
    values["ignore_eos"] = _bool(body, "ignore_eos")
    values["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    values["logprobs"] = _logprobs(body, chat)
    from ..structured import structured_from_body
    try:
        values["structured"], _ = structured_from_body(body)
    except ParamError as exc:
        field = str(exc).split(":")[0].split()[0]
        raise ApiError(400, str(exc), param=field if field in ("response_format", "guided_json", "guided_regex",
                                                             "guided_choice", "guided_grammar") else None) from None
    try:
        return SamplingParams(**values)
    except ParamError as exc:
        message = str(exc)
        raise ApiError(400, message, param=exc.sampling_field) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives per token to report, or None: chat `logprobs: true` +
    `top_logprobs: N`; completions `logprobs: N` (OpenAI's legacy field)."""
    chat_style = isinstance(body.get("logprobs"), bool)
    if chat and body.get("logprobs") is not None and not chat_style:
        raise _bad("logprobs", f"must be true or false on /v1/chat/completions (the number of alternatives "
                               f"goes in top_logprobs, 0..20), got {body['logprobs']!r}")
    if chat_style or "top_logprobs" in body:
        if not _bool(body, "logprobs"):
            if body.get("top_logprobs") not in (None, 0):
                raise _bad("top_logprobs", "needs logprobs: true")
            return None
        top = _int(body, "top_logprobs", 0, 20)
        return 0 if top is None else top
    return _int(body, "logprobs", 0, 20)


def _chat_ids(body: dict, ctx: ServeContext, tools=None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", f"must be an object with role one of {', '.join(ROLES)}")
        content = _joined(m.get("content"), f"messages[{i}].content", f"messages[{i}].content")
        if content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"must be a string or a list of text parts, got {content!r}")
        entry = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):     # tool turns, as the template knows them
            if m.get(key) is not None:
                entry[key] = m[key]
        if m.get("tool_calls") is not None:
            _check_calls(m["tool_calls"], m["role"], f"messages[{i}].tool_calls")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None and m["role"] == "assistant":   # an earlier answer's reasoning, sent back
            if not isinstance(reasoning, str):
                raise _bad(f"messages[{i}].reasoning_content", f"must be a string, got {reasoning!r:.80}")
            entry["reasoning_content"] = entry["thinking"] = reasoning    # Qwen3's name, gpt-oss's
        clean.append(entry)
    from .tools import with_tools
    clean, template_tools = with_tools(clean, tools, ctx.tokenizer, ctx.tool_format)
    from jinja2.exceptions import TemplateError

    from ..models.config import ModelError
    try:
        text = ctx.tokenizer.apply_chat_template(clean, tools=template_tools, variables=_template_kwargs(body))
    except ModelError:
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages") from None
    except TemplateError as exc:
        raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from None
    ids = ctx.tokenizer.encode(text, add_special=False)
    if not ids:
        raise _bad("messages", "encode to no tokens")
    return ids


TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")   # set by the server


def _template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (vLLM's field): more names for the chat template, e.g.
    `{"enable_thinking": false}`."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("chat_template_kwargs", f"must be an object of names for the chat template, got {value!r:.80}")
    taken = [name for name in value if name in TEMPLATE_NAMES]
    if taken:
        raise _bad("chat_template_kwargs", f"cannot set {', '.join(taken)} (the server sets "
                                           f"{', '.join(TEMPLATE_NAMES)})")
    return value


def _joined(content, param: str, field: str):
    """Content given as text parts ([{'type': 'text', 'text': str}, ...]) joined; any other as given."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{field} parts must be {{'type': 'text', 'text': str}} (text only)", param=param)
        content = "".join(p["text"] for p in content)
    return content


def _check_calls(calls, role: str, name: str) -> None:
    """An earlier assistant turn's tool_calls: [{"id", "type": "function", "function": {"name": str,
    "arguments": a JSON string (or object)}}]."""
    if role != "assistant":
        raise _bad(name, f"are for assistant messages, not {role}")
    if not isinstance(calls, list):
        raise _bad(name, f"must be a list of calls, got {calls!r:.80}")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"] \
                or not isinstance(function.get("arguments", "{}"), (str, dict)):
            raise _bad(f"{name}[{j}]", "must be {'id': str, 'type': 'function', 'function': {'name': str, "
                                       f"'arguments': a JSON string}}}}, got {call!r:.80}")


def _prediction(body: dict, ctx: ServeContext, chat: bool) -> str | None:
    """OpenAI's Predicted Outputs: `prediction: {"type": "content", "content": str | text parts}`."""
    value = body.get("prediction")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise _bad("prediction", f"must be {{'type': 'content', 'content': TEXT}}, got {value!r:.80}")
    content = _joined(value.get("content"), "prediction", "prediction content")
    if not isinstance(content, str) or not content:
        raise _bad("prediction", f"content must be a non-empty string or list of text parts, got {content!r:.80}")
    if not ctx.has_drafter or not ctx.drafts_predictions:
        raise _bad("prediction", "needs a server whose drafter follows predictions (methods ngram, suffix, cascade; "
                                 "this one was started with " + ("no drafter" if not ctx.has_drafter else
                                                                 "another method") + ")")
    return content


def parse(body, ctx: ServeContext, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = ctx.model_names[0]
    if not isinstance(model, str) or model not in ctx.model_names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{ctx.model_names[0]}`",
                       param="model", code="model_not_found")
    _unsupported(body)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", f"must be an object, got {options!r}")
    if options is not None and not stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    include_usage = _bool(options or {}, "include_usage")
    from .tools import parse_tools
    try:
        tools = parse_tools(body, ctx.tool_format() if body.get("tools") is not None else None) if chat else None
    except ParamError as exc:
        raise ApiError(400, str(exc), param=str(exc).split()[0].split("[")[0]) from None
    if not chat and body.get("tools") is not None:
        raise _bad("tools", "are for /v1/chat/completions")
    from .prompts import completion_prompts
    prompts, fim_stops = ([_chat_ids(body, ctx, tools)], []) if chat else completion_prompts(body, ctx)
    ids = max(prompts, key=len)                  # the limits hold for the longest
    echo = not chat and _bool(body, "echo")
    if chat and body.get("echo"):
        raise _bad("echo", "is for /v1/completions")
    if not chat and body.get("chat_template_kwargs") is not None:
        raise _bad("chat_template_kwargs", "is for /v1/chat/completions")
    name = "max_tokens"          # chat: max_completion_tokens (OpenAI's current name) wins over max_tokens
    max_tokens = _int(body, "max_tokens", 0 if echo else 1)
    echo_only = max_tokens == 0                  # the prompt alone: one token is run and dropped
    max_tokens = 1 if echo_only else max_tokens
    if chat and body.get("max_completion_tokens") is not None:
        name, max_tokens = "max_completion_tokens", _int(body, "max_completion_tokens", 1)
    room = ctx.max_model_len - len(ids)
    if room < 1:
        raise ApiError(400, f"prompt ({len(ids)} tokens) leaves no room in the maximum context of "
                            f"{ctx.max_model_len} tokens", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    default = min(ctx.max_tokens_default, room) if chat else min(16, ctx.max_tokens_default, room)
    params = _sampling(body, max_tokens, default, chat)
    asked = _int(body, "prompt_logprobs", 0, 20)
    if chat and asked is not None:
        raise _bad("prompt_logprobs", "is for /v1/completions")
    top = asked if asked is not None else (params.logprobs if echo else None)
    if fim_stops or top is not None:
        params = dataclasses.replace(params.with_stop_ids(fim_stops), prompt_logprobs=top)
    if echo and stream and params.logprobs is not None:
        raise _bad("echo", "with logprobs is answered whole: send stream: false")
    forced_call = tools.structured() if tools is not None else None
    if forced_call is not None:                      # tool_choice required / a named function
        if params.structured is not None:
            raise _bad("tool_choice", "cannot be combined with response_format / guided_* constraints")
        from ..structured import check_grammar
        try:
            check_grammar(forced_call)
        except ParamError as exc:
            raise ApiError(400, f"the tools' schemas make no valid call grammar: {exc}", param="tools") from None
        params = dataclasses.replace(params, structured=forced_call)
    if len(ids) + params.max_tokens > ctx.max_model_len:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + {name} ({params.max_tokens}) = "
                            f"{len(ids) + params.max_tokens} tokens exceeds the maximum context of "
                            f"{ctx.max_model_len} tokens", param=name, code="context_length_exceeded")
    try:
        params.validate_vocab(ctx.vocab_size)
    except ParamError as exc:
        raise ApiError(400, str(exc), param=exc.sampling_field or "logit_bias") from None
    speculate = body.get("speculate")
    if speculate is not None and not isinstance(speculate, bool):
        raise _bad("speculate", f"must be true, false or absent (automatic), got {speculate!r}")
    k = _int(body, "num_speculative_tokens", 0, ctx.max_k)
    if (speculate or k) and not ctx.has_drafter:
        raise ApiError(400, "this server has no drafter (started with --method none or -k 0): "
                            "speculate / num_speculative_tokens cannot turn speculation on",
                       param="speculate" if speculate else "num_speculative_tokens")
    n = _int(body, "n", 1, MAX_N)
    prediction = _prediction(body, ctx, chat)
    if prediction is not None:
        for bad, what in ((n not in (None, 1), "n > 1"), (params.logprobs is not None, "logprobs"),
                          (tools is not None and tools.active, "tools")):
            if bad:
                raise _bad("prediction", f"cannot be combined with {what} (as in OpenAI's API)")
        params = dataclasses.replace(params, prediction=prediction)
    if len(prompts) * (n or 1) > MAX_CHOICES:
        raise _bad("n", f"({n or 1}) times {len(prompts)} prompts is more than {MAX_CHOICES} choices in one request")
    return ParsedRequest(prompts[0], params, speculate, k, stream, include_usage, _bool(body, "return_token_kinds"),
                         _bool(body, "return_token_ids"), model, chat, 1 if n is None else n,
                         tools if tools is not None and tools.active else None, prompts, echo, echo_only,
                         asked is not None)
