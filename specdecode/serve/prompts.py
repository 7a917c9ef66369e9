"""What /v1/completions and llama.cpp's /infill take as the prompt: a string, token ids, a list of
either (a batch: one row per prompt, choices indexed prompt by prompt), code before and after the
cursor (fill-in-the-middle: `suffix`, or /infill's `input_prefix` / `input_suffix` /
`input_extra`), and `echo`'s prompt text and log-probabilities in the answer (OpenAI's legacy form:
the first token's log-probability null, as vLLM and OpenAI give it)."""
from __future__ import annotations

from ..fim import check_extra, detect
from ..params import ParamError
from .errors import ApiError

MAX_PROMPTS = 64          # prompts in one /v1/completions request


def _bad(name: str, message: str) -> ApiError:
    return ApiError(400, f"{name} {message}", param=name)


def completion_prompts(body: dict, ctx) -> tuple[list[list[int]], list[int]]:
    """(the token ids of each prompt, token ids that end the answer besides EOS: a FIM format's)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt                                  # a list of prompts (a string or token ids each)
        if len(prompts) > MAX_PROMPTS:
            raise _bad("prompt", f"holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    else:
        prompts = [prompt]
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise _bad("suffix", f"must be a string, got {type(suffix).__name__}")
    if suffix:
        if not all(isinstance(p, str) for p in prompts):
            raise _bad("suffix", "needs the prompt as text (the code before the cursor), not token ids")
        fmt = fim_format(ctx, "suffix")
        return [fmt.prompt_ids(ctx.tokenizer, p, suffix) for p in prompts], list(fmt.stop_token_ids)
    return [_one(p, ctx, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)], []


def _one(prompt, ctx, name: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad(name, "must not be empty")
        ids = ctx.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < ctx.vocab_size]
        if bad:
            raise _bad(name, f"token ids must be in [0, {ctx.vocab_size}), got {bad[:5]}")
        ids = list(prompt)
    else:
        raise _bad(name, f"must be a non-empty string or list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise _bad(name, "encodes to no tokens")
    return ids


def fim_format(ctx, param: str):
    """The served model's FIM format, or a 400 naming the model."""
    fmt = detect(ctx.tokenizer, ctx.eos_token_ids)
    if fmt is None:
        raise ApiError(400, f"{param}: model {ctx.model_names[0]} has no fill-in-the-middle tokens in its "
                            f"vocabulary (code models such as Qwen2.5-Coder, StarCoder2, CodeLlama, DeepSeek-Coder "
                            f"and Codestral have them)", param=param)
    return fmt


# ---------------------------------------------------------------- llama.cpp's /infill
INFILL_FIELDS = {"n_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "seed": "seed", "stop": "stop", "stream": "stream",
                 "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "model": "model"}


def infill_body(body, ctx) -> dict:
    """llama.cpp's /infill request as a /v1/completions one: the prompt laid out in the model's FIM
    format (other files first), `prompt` after the middle marker, its sampling fields renamed;
    llama.cpp's defaults where it gives none (temperature 0.8, n_predict -1: until the end)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in ("input_prefix", "input_suffix", "prompt"):
        if not isinstance(body.get(name, ""), str):
            raise _bad(name, f"must be a string, got {type(body[name]).__name__}")
    try:
        extra = check_extra(body.get("input_extra"))
    except ParamError as exc:
        raise ApiError(400, str(exc), param="input_extra") from None
    fmt = fim_format(ctx, "input_suffix")
    ids = fmt.prompt_ids(ctx.tokenizer, body.get("input_prefix", ""), body.get("input_suffix", ""), extra)
    if body.get("prompt"):
        ids += ctx.tokenizer.encode(body["prompt"], add_special=False)
    out = {"prompt": ids, "temperature": 0.8, "stop_token_ids": list(fmt.stop_token_ids)}
    for theirs, ours in INFILL_FIELDS.items():
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    if out.get("stream") is True:
        out["stream_options"] = {"include_usage": True}        # the last event's token counts
    if out.get("max_tokens") is not None and isinstance(out["max_tokens"], int) and out["max_tokens"] < 0:
        del out["max_tokens"]                            # -1: until the end (the server's default bound)
    return out


def infill_answer(openai: dict, prompt_tokens: int) -> dict:
    """A /v1/completions answer in llama.cpp's /infill (/completion) shape."""
    choice, usage = openai["choices"][0], openai.get("usage") or {}
    stop_type = {"stop": "eos", "length": "limit"}.get(choice.get("finish_reason"), "none")
    return {"content": choice["text"], "stop": True, "stop_type": stop_type, "model": openai["model"],
            "tokens_predicted": usage.get("completion_tokens", 0), "tokens_evaluated": prompt_tokens,
            "truncated": False}


# ---------------------------------------------------------------- echo
def echo_logprobs(decode, prompt_ids: list[int], prompt_lps: list, answer: dict | None, text_len: int) -> dict:
    """OpenAI's legacy logprobs of the prompt (the first token null), then the answer's (`answer`:
    the choice's logprobs object or None; its text offsets moved past the prompt's `text_len`)."""
    texts = [decode([t]) for t in prompt_ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops: list = [None]
    for token, value, top in prompt_lps:
        alternatives = {decode([a]): w for a, w in top}
        alternatives.setdefault(decode([token]), value)
        tops.append(alternatives)
    out = {"tokens": texts, "token_logprobs": [None] + [v for _, v, _ in prompt_lps], "top_logprobs": tops,
           "text_offset": offsets}
    if answer:
        out["tokens"] += answer["tokens"]
        out["token_logprobs"] += answer["token_logprobs"]
        out["top_logprobs"] += answer["top_logprobs"]
        out["text_offset"] += [text_len + o for o in answer["text_offset"]]
    return out


def vllm_prompt_logprobs(decode, prompt_lps: list) -> list:
    """vLLM's `prompt_logprobs`: per prompt token null (the first), else {token id: {logprob,
    rank?, decoded_token}} for the prompt's token and the top alternatives."""
    out: list = [None]
    for token, value, top in prompt_lps:
        entry = {str(a): {"logprob": w, "rank": r + 1, "decoded_token": decode([a])} for r, (a, w) in enumerate(top)}
        entry.setdefault(str(token), {"logprob": value, "decoded_token": decode([token])})
        out.append(entry)
    return out
