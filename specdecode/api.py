"""Python API: `LLM(model=..., draft=..., method=..., num_speculative_tokens=5).generate(...)`."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .drafters.base import Drafter, DrafterError
from .drafters.prediction import prediction_usage
from .drafters.registry import build_drafter, check_drafter_options, method_names
from .engine.config import MAX_CHAIN, EngineConfig
from .engine.core import EngineCore
from .engine.offline import StreamCallback, offline_core, run
from .engine.threads import usable_cpus
from .models.dtypes import canonical_dtype
from .models.gemma4_assistant import MODEL_TYPE, assistant_dir
from .models.loader import LoadedModel, default_draft_dtype, load_model
from .params import ParamError, SamplingParams
from .tree import MAX_TREE_NODES

PREFIX_CACHE_BYTES = 512 * 2**20     # LLM's default bound on cached prefix blocks (prefix_cache=True)


@dataclass
class RequestOutput:
    prompt: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)   # acceptance_rate, mean_accepted_length, tokens_per_s, ...
    logprobs: list | None = None    # with SamplingParams(logprobs=N): per output token (token id, its
                                    # log-probability, the top N [(token id, log-probability)])
    prompt_logprobs: list | None = None   # with SamplingParams(prompt_logprobs=N): the same per prompt token,
                                          # None for the first (nothing comes before it)


def default_method(draft: object | None, target: LoadedModel | str | None = None,
                   drafter_path: str | None = None) -> str:
    """assistant with Gemma 4's assistant as the draft (a gemma4_assistant directory, drafters/assistant.py:
    it reads the target's features and keys); cascade with another draft model (suffix-index lookup
    where the text repeats at length, the draft model elsewhere, through text when its tokenizer is
    not the target's (cross_tokenizer.py): a lookup path costs nothing to draft, so where the text
    repeats it beats the draft model's tokens;
    docs/drafters.md, "What was tried"); with a trained drafter directory:
    medusa for Medusa heads, cascade (EAGLE head + n-gram) for an EAGLE head; mtp for a target whose
    checkpoint ships a multi-token-prediction head (Qwen3.5's, trained with the model: the drafter
    vLLM and llama.cpp run for it); else ngram. `target`: the loaded target, or the model
    as named before loading (a local directory is looked into; anything else counts as no head).

    The EAGLE drafter shipped for the embedded model is not the default: every extra token of a
    verify pass costs a fraction of a decode step on a CPU, and the head's acceptance does not win
    that back against n-gram drafting (docs/drafters.md, "Trained drafters"); use it with
    `method="eagle"` or `"cascade"`."""
    if draft is not None:
        return "assistant" if assistant_dir(draft) is not None else "cascade"
    if drafter_path is not None:
        from .drafters.format import read_meta
        kind = read_meta(Path(drafter_path)).get("kind")
        return "medusa" if kind == "medusa" else "cascade"
    if target is not None:
        from .drafters.mtp import has_mtp_head
        if has_mtp_head(target):
            return "mtp"
    return "ngram"


def check_assistant(method: str | None, draft: object | None, assistant: Path | None, draft_dtype=None) -> None:
    """DrafterError for a draft and a method that do not go together: Gemma 4's assistant (`assistant`,
    the directory the draft names when it is one) drafts with method "assistant" only, and that
    method with nothing else; it computes in the target's dtype (no draft_dtype). Checked before
    anything is loaded."""
    if assistant is not None and draft_dtype is not None:
        raise DrafterError(f"draft_dtype {draft_dtype}: draft {draft} is Gemma 4's assistant, which computes in the "
                           f"target's dtype; leave draft_dtype out")
    if assistant is not None and method not in (None, "assistant"):
        raise DrafterError(f"draft {draft} is Gemma 4's assistant (model_type {MODEL_TYPE}), which drafts with "
                           f"method 'assistant' (its default), not {method!r}")
    if method == "assistant" and draft is not None and assistant is None:
        raise DrafterError(f"method 'assistant' needs Gemma 4's assistant, and draft {draft} is not one (its "
                           f"config.json model_type is not {MODEL_TYPE})")


def check_num_speculative_tokens(k: object, drafter: Drafter | None) -> None:
    """ParamError unless k is a valid draft size for this drafter: tokens of a chain (<= MAX_CHAIN)
    or nodes of a tree (<= MAX_TREE_NODES)."""
    trees = drafter is not None and drafter.capabilities.drafts_trees
    limit = MAX_TREE_NODES if trees else MAX_CHAIN
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= limit:
        what = "draft tree nodes" if trees else "draft tokens"
        raise ParamError(f"num_speculative_tokens (-k: {what} per step) must be an integer in [0, {limit}] for "
                         f"{'a tree' if trees else 'a chain'} drafter ({drafter.name if drafter else 'none'}), "
                         f"got {k!r}")


def check_prompt(prompt) -> None:
    """ParamError unless `prompt` is text (valid Unicode) or a list of chat messages
    ({"role": str, "content": str})."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:       # lone surrogates: bytes that were not UTF-8
            raise ParamError(f"prompt is not valid UTF-8 text (at character {exc.start}: "
                             f"{prompt[exc.start:exc.start + 1]!r})") from None
        return
    if not isinstance(prompt, list):
        raise ParamError(f"a prompt must be a string, a list of chat messages or a list of token ids, "
                         f"got {type(prompt).__name__}")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ParamError(f"chat message {i} must be {{'role': str, 'content': str}}, got {message!r:.80}")
        check_prompt(message["content"])


class LLM:
    """A target model plus (optionally) a drafter.

    model: None (the embedded SmolLM2-135M-Instruct), a .gguf file, an HF directory or a Hugging Face id
    (ORG/NAME, ORG/NAME:QUANT, ORG/NAME/FILE.gguf; models/hub.py).
    draft: a draft model, named as model is (method "model"; "text-model" when its tokenizer differs;
    "assistant" for Gemma 4's assistant, a gemma4_assistant directory);
    method: "cascade", "eagle", "ngram", "model", "text-model", "assistant", "none" or
    any drafter registered with `specdecode.drafters.registry.register` or the `specdecode.drafters`
    entry-point group (default: see default_method); drafter_path: a trained drafter directory (methods "eagle",
    "cascade").
    num_speculative_tokens: draft length k; 0 means plain decoding.
    dtype: None (a GGUF file computes on its own quantized weights, anything else in bf16), "auto"
    (the checkpoint's own: a GGUF file's quantized weights, an HF directory's torch_dtype), or dense
    "bfloat16"/"bf16", "float32"/"fp32"/"float", "float16"/"fp16"/"half" (any case, or a torch dtype;
    a GGUF file is dequantized; models/dtypes.py); weights: "auto", "native" or "dense" (see load_model);
    draft_dtype: the draft's dtype if not the target's, or "int8" (weights quantized per channel)
    or "q4_0" (re-quantized to 4-bit blocks of 32: a cheaper draft, still lossless).
    adaptive: choose each step's draft size up to num_speculative_tokens from measured costs and
    acceptance (engine/controller.py), plain decoding when drafts do not pay; None = on; False:
    every step drafts num_speculative_tokens (a draft model's early stop, draft_confidence, off
    unless given).
    prefix_cache: keep the keys and values of every call's sequences (prompts and answers) so that a
    later prompt that starts the same way (a chat's next turn) is prefilled only after that start
    (bitwise the same answers); True: up to PREFIX_CACHE_BYTES, an int: up to that many bytes,
    False/0: off. Off for the transformers adapter and eager runs (whose passes are not batch
    invariant) and for drafters that read the target's hidden states.

    Every call runs on the engine core (engine/core.py), as the server does: continuous batching of
    its prompts over paged KV caches, one speculation controller, one prefix cache.
    """

    def __init__(self, model: str | None = None, draft: str | None = None, method: str | None = None,
                 num_speculative_tokens: int = 5, dtype: str | None = None, device: str | None = "cpu",
                 threads: int | None = None, fast: bool = True, progress: bool = True,
                 weights: str = "auto", draft_dtype: str | None = None, adaptive: bool | None = None,
                 prefix_cache: bool | int = True, **drafter_options) -> None:
        if threads is not None:
            if not isinstance(threads, int) or threads < 1:
                raise ParamError(f"threads must be an integer >= 1, got {threads!r}")
            usable = usable_cpus()
            if threads > usable:
                print(f"note: threads={threads} is more than the {usable} CPUs this process may use: every pass "
                      f"waits for threads without a CPU (64 threads on 2 CPUs decoded ~50x slower)", file=sys.stderr)
            torch.set_num_threads(threads)
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
            check_num_speculative_tokens(num_speculative_tokens, None)   # the upper limit is the drafter's: below
        dtype = canonical_dtype(dtype, "dtype", allow_int8=True)          # bad names fail before any load
        draft_dtype = canonical_dtype(draft_dtype, "draft_dtype", allow_int8=True)
        assistant = assistant_dir(draft) if draft is not None else None    # read by its drafter, not loaded here
        check_assistant(method, draft, assistant, draft_dtype)
        self.target: LoadedModel = load_model(model, dtype, device, progress=progress, fast=fast, weights=weights)
        self.draft: LoadedModel | None = None
        if draft is not None and assistant is None:
            if draft_dtype is None and dtype is None and weights == "auto":   # a cheaper copy where it pays
                draft_dtype = default_draft_dtype(draft, device, fast)
            self.draft = load_model(draft, draft_dtype or dtype, device, progress=progress, fast=fast,
                                    weights=weights, dtype_param="draft_dtype" if draft_dtype else "dtype")
        self.method = method or default_method(draft, self.target, drafter_options.get("drafter_path"))
        check_drafter_options(self.method, {k: v for k, v in drafter_options.items() if k != "drafter_path"})
        self.num_speculative_tokens = num_speculative_tokens
        self.drafter: Drafter | None = None
        if self.method != "none" and num_speculative_tokens > 0:
            self.drafter = build_drafter(self.method, self.target, adaptive=adaptive,
                                         draft=self.draft if assistant is None else assistant, **drafter_options)
        elif self.method != "none" and self.method not in method_names():
            raise DrafterError(f"method must be one of {', '.join(sorted([*method_names(), 'none']))}, "
                               f"got {self.method!r}")
        check_num_speculative_tokens(num_speculative_tokens, self.drafter)
        self.adaptive = adaptive
        self.tokenizer = self.target.tokenizer
        self.core_options = (self.num_speculative_tokens, adaptive is not False, self._prefix_bytes(prefix_cache))
        self.core = offline_core(self.target, self.drafter, *self.core_options)

    def serve_core(self, config: EngineConfig) -> EngineCore:
        """This LLM's one engine core re-made at a server's `config` (its rows, blocks, flags, at full
        size: serve/server.py `build_state`) and returned. The server runs on it, and `generate`
        calls from then on join its batch (the same rows, blocks and prefix cache); the core used
        so far (and its cached prefixes) is dropped, and so is this one at the first call after
        its server stopped. Call it before the core serves."""
        self.core = offline_core(self.target, self.drafter, self.num_speculative_tokens, config=config)
        return self.core

    def _prefix_bytes(self, prefix_cache) -> int:
        """The prefix cache's bound in bytes (0: off; see the class docstring)."""
        if isinstance(prefix_cache, bool):
            size = PREFIX_CACHE_BYTES if prefix_cache else 0
        elif isinstance(prefix_cache, int) and prefix_cache >= 0:
            size = prefix_cache
        else:
            raise ParamError(f"prefix_cache must be True, False or a number of bytes >= 0, got {prefix_cache!r}")
        batch_invariant = self.target.native and getattr(self.target.model, "fused", None) is not None
        return size if batch_invariant else 0

    def encode(self, prompt: str | list[dict[str, str]], chat: bool) -> list[int]:
        check_prompt(prompt)
        if isinstance(prompt, list):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt), add_special=False)
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special=False)
        return self.tokenizer.encode(prompt)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False, num_speculative_tokens: int | None = None,
                 on_tokens: StreamCallback | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (run as one batch). A prompt is a string, a
        list of chat messages, or a list of token ids."""
        if not isinstance(prompts, (str, list, tuple)):
            raise ParamError(f"prompts must be a string, a list of chat messages, a list of token ids or a list of "
                             f"those, got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                                              and isinstance(prompts[0], (dict, int)))   # chat or token ids
        prompt_list = [prompts] if single else list(prompts)
        if not prompt_list:
            raise ParamError("prompts must hold at least one prompt")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompt_list)
        if not all(isinstance(p, SamplingParams) for p in params):
            bad = next(p for p in params if not isinstance(p, SamplingParams))
            raise ParamError(f"sampling_params must be a SamplingParams or a list of them, got {type(bad).__name__} "
                             f"(e.g. SamplingParams(max_tokens=64))")
        if len(params) != len(prompt_list):
            raise ParamError(f"got {len(params)} sampling_params for {len(prompt_list)} prompts")
        if num_speculative_tokens and self.drafter is None:
            raise ParamError(f"num_speculative_tokens={num_speculative_tokens!r} needs a drafter, and this LLM has "
                             f"none (made with method={self.method!r}, num_speculative_tokens="
                             f"{self.num_speculative_tokens}): make it with a method and num_speculative_tokens > 0")
        if num_speculative_tokens is not None:
            check_num_speculative_tokens(num_speculative_tokens, self.drafter)
        if on_tokens is not None and not callable(on_tokens):
            raise ParamError(f"on_tokens must be a callable (seq, new_token_ids) or None, "
                             f"got {type(on_tokens).__name__}")
        ids = [list(p) if isinstance(p, (list, tuple)) and (not p or isinstance(p[0], int)) else self.encode(p, chat)
               for p in prompt_list]   # an empty list is an empty prompt (ParamError), not an empty chat
        if self.core.scheduler.closed and not self.core.looping:    # the server it ran has stopped
            self.core = offline_core(self.target, self.drafter, *self.core_options)
        seqs = run(self.core, ids, params, num_speculative_tokens, on_tokens)
        outputs = []
        for prompt, s in zip(prompt_list, seqs):
            stats = s.stats.as_dict(s.num_output)
            if s.prediction is not None:         # OpenAI's accepted / rejected prediction tokens
                stats.update(prediction_usage(s.prediction.ids, s.output_ids))
            text = self.tokenizer.decode(s.output_ids)
            if s.stop_text_index is not None:
                text = text[:s.stop_text_index]
            outputs.append(RequestOutput(prompt=prompt if isinstance(prompt, str) else str(prompt), text=text,
                                         token_ids=s.output_ids, prompt_token_ids=s.prompt_ids,
                                         finish_reason=s.finish_reason or "length",
                                         stats=stats,
                                         logprobs=s.logprobs[:s.num_output] if s.params.logprobs is not None else None,
                                         prompt_logprobs=[None] + s.prompt_logprobs
                                         if s.params.prompt_logprobs is not None else None))
        return outputs


    def infill(self, prefix: str, suffix: str, sampling_params: SamplingParams | None = None,
               extra: list[tuple[str, str]] | None = None, filename: str = "") -> RequestOutput:
        """Fill in the middle: the code between `prefix` and `suffix` (an editor's cursor), in the
        format the model was trained with (specdecode/fim.py); `extra`: (file name, text) of other
        files as context. A model whose vocabulary has no FIM tokens is a ParamError naming it."""
        ids, stop_ids = self.fim_prompt(prefix, suffix, extra or [], filename)
        params = sampling_params or SamplingParams()
        params = params.with_stop_ids(stop_ids)
        out = self.generate(ids, params)[0]
        out.prompt = prefix
        return out

    def fim_prompt(self, prefix: str, suffix: str, extra: list[tuple[str, str]] = (),
                   filename: str = "") -> tuple[list[int], list[int]]:
        """(prompt token ids, the token ids that end the middle) for fill-in-the-middle."""
        from . import fim
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            raise ParamError("prefix and suffix must be strings")
        fmt = fim.detect(self.tokenizer, self.target.eos_token_ids)
        if fmt is None:
            raise ParamError(f"suffix: {self.target.name} has no fill-in-the-middle tokens in its vocabulary "
                             f"(code models such as Qwen2.5-Coder, StarCoder2, CodeLlama, DeepSeek-Coder and "
                             f"Codestral have them)")
        bos = self.tokenizer.token_id(self.tokenizer.bos_token) if self.tokenizer.add_bos else None
        ids = fmt.prompt_ids(self.tokenizer, prefix, suffix, extra, filename, bos=bos)
        return ids, list(fmt.stop_token_ids)
