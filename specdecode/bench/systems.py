"""The systems a bench run compares, behind one small interface.

A `Cell` is one configuration of one system: (system, method, k). Methods are named the
same way for every system so rows line up: "plain" (k = 0), "ngram" (prompt lookup) and
"model" (a separate draft model; transformers calls it assisted generation).

`System.run(cell, prompt_ids, max_tokens, temperature, seed)` generates once and returns a
measurement dict (see `measurement`): generated token ids (EOS included when it was
produced; generation stops at EOS or max_tokens, for every system), wall seconds
including prefill, time to first token, and, where the system exposes them, speculation
counters. Nothing here is aggregated: that is `aggregate.py`'s job.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..forward import ForwardBatch


@dataclass(frozen=True)
class Cell:
    system: str     # "specdecode", "transformers", "llama.cpp"
    method: str     # "plain", "ngram", "model"
    k: int          # draft tokens per step; 0 for plain

    @property
    def label(self) -> str:
        return f"{self.system} {self.method}" + (f" k={self.k}" if self.k else "")


def measurement(token_ids: list[int], seconds: float, first_token_s: float | None, steps: int | None = None,
                **extra) -> dict:
    """One generation's figures. decode_ms_per_token excludes the first token (prefill)."""
    n = len(token_ids)
    ttft = first_token_s if first_token_s is not None else (seconds if n else None)
    decode = (seconds - ttft) / (n - 1) * 1e3 if n > 1 and ttft is not None else None
    return {"tokens": n, "token_ids": list(token_ids), "seconds": seconds,
            "tokens_per_s": n / seconds if seconds > 0 else 0.0, "ttft_s": ttft,
            "decode_ms_per_token": decode, "steps": steps, **extra}


class System:
    """Interface: `cells(methods, ks)` lists what this system can run; `run` measures one."""

    name = "?"

    def cells(self, methods: list[str], ks: list[int]) -> list[Cell]:
        out = [Cell(self.name, "plain", 0)] if "plain" in methods else []
        return out + [Cell(self.name, m, k) for m in methods if m != "plain" and self.supports(m) for k in ks]

    def supports(self, method: str) -> bool:
        return False

    def run(self, cell: Cell, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int,
            schema: str | None = None) -> dict:
        raise NotImplementedError


def structured_for(schema: str | None, default):
    """A prompt's own JSON schema (canonical JSON text) as a Structured, else the run's default."""
    if schema is None:
        return default
    from ..structured import Structured
    return Structured("json_schema", schema)


class SpecdecodeSystem(System):
    """specdecode's own engine: one target, one drafter object per method, any k."""

    name = "specdecode"

    def __init__(self, llm, drafter_path: str | None = None, adaptive: bool | None = None,
                 json_schema: dict | None = None, drafter_options: dict | None = None) -> None:
        from ..drafters.base import DrafterError
        from ..drafters.registry import build_drafter, method_names
        from ..structured import Structured
        self.llm = llm
        self.structured = Structured("json_schema", json_schema) if json_schema is not None else None
        self.adaptive = adaptive              # None: the engine's default (adaptive)
        self.cores: dict[tuple[str, int], object] = {}        # (method, k) -> its engine core (as one LLM's calls)
        self.drafter_path = drafter_path
        self.drafter_options = dict(drafter_options or {})    # given to the drafters that take them
        self.drafters: dict[tuple[str, int], object] = {}     # (method, k) -> its own drafter
        self.skipped: dict[str, str] = {}     # method -> why it cannot run here
        self.methods = set()
        for method in method_names():     # each registered drafter that can be built for this target
            try:
                build_drafter(method, llm.target, draft=llm.draft, drafter_path=drafter_path)
                self.methods.add(method)
            except DrafterError as exc:     # e.g. eagle without a trained head, model without --draft
                self.skipped[method] = str(exc)

    def drafter(self, method: str, k: int):
        """One drafter object per cell: what a drafter learns across requests (the recycle table,
        the suffix drafter's index of finished outputs) comes from the cell's own earlier prompts,
        never from another cell's run of the same prompt."""
        from ..drafters.registry import build_drafter, drafter_option_names
        if method == "plain":
            return None
        if (method, k) not in self.drafters:
            names = drafter_option_names(method)
            options = {key: v for key, v in self.drafter_options.items() if key in names}
            self.drafters[method, k] = build_drafter(method, self.llm.target, adaptive=self.adaptive,
                                                     draft=self.llm.draft, drafter_path=self.drafter_path, **options)
        return self.drafters[method, k]

    def supports(self, method: str) -> bool:
        return method in self.methods

    def run(self, cell: Cell, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int,
            schema: str | None = None) -> dict:
        from ..engine import offline
        from ..params import SamplingParams

        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                structured=structured_for(schema, self.structured))
        core = self.cores.get((cell.method, cell.k))
        if core is None:                 # no prefix cache: every run prefills its prompt
            core = self.cores[cell.method, cell.k] = offline.offline_core(
                self.llm.target, self.drafter(cell.method, cell.k), cell.k, self.adaptive is not False)
        offline.prepare(core, 1, len(prompt_ids) + max_tokens)   # outside the timed run
        first: list[float] = []

        def on_tokens(seq, tokens) -> None:
            if not first and tokens:
                first.append(time.perf_counter())

        started = time.perf_counter()
        seq = offline.run(core, [list(prompt_ids)], [params], on_tokens=on_tokens)[0]
        seconds = time.perf_counter() - started
        st = seq.stats
        drafter = core.drafter.summary() if core.drafter is not None else {}
        return measurement(seq.output_ids, seconds, first[0] - started if first else None, steps=st.steps,
                           emitted=st.emitted, drafted=st.drafted, accepted=st.accepted, nodes=st.nodes,
                           drafted_per_position=list(st.drafted_per_position),
                           accepted_per_position=list(st.accepted_per_position),
                           draft_s=st.draft_seconds, verify_s=st.verify_seconds, prefill_s=st.prefill_seconds,
                           total_s=st.total_seconds, finish_reason=seq.finish_reason,
                           **({"drafter": drafter} if drafter else {}))

    def logit_gap(self, prompt_ids: list[int], prefix: list[int], token_a: int, token_b: int) -> dict:
        """The target's logits after prompt + prefix: how far apart the two diverging tokens are
        (a near-tie explains a reduced-precision divergence) and the top-1/top-2 gap."""
        model = self.llm.target.model
        ids = list(prompt_ids) + list(prefix)
        cache = model.new_cache(1, len(ids) + 4)
        index = torch.tensor([[len(ids) - 1]], device=model.device)
        fb = ForwardBatch.chain(torch.tensor([ids], device=model.device), 0, logit_index=index)
        logits = model.logits(model.run(fb, cache), index)                            # [1, 1, vocab]
        row = logits.reshape(-1, logits.shape[-1])[-1].float()
        top2 = torch.topk(row, 2).values.tolist()
        return {"logit_a": round(row[token_a].item(), 4), "logit_b": round(row[token_b].item(), 4),
                "gap": round(abs(row[token_a].item() - row[token_b].item()), 4),
                "top1_top2_gap": round(top2[0] - top2[1], 4)}


class _Clock:
    """A transformers streamer that only records time: `put` gets the prompt first, then
    the tokens of each decoding step (one call per step, also in assisted generation)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersSystem(System):
    """Hugging Face transformers `generate` on the same weights (the target's HF directory;
    for a GGUF target, the directory specdecode converted it into) and the same dtype."""

    name = "transformers"

    def weight_bytes(self) -> int:
        """Bytes of the target's weights a decode step reads (the input embedding only when tied to the head)."""
        embed = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings()
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if head is None or head.weight.data_ptr() != embed.data_ptr():
            total -= embed.numel() * embed.element_size()
        return total

    def __init__(self, llm, dtype: torch.dtype, notes: list[str], json_schema: dict | None = None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(str(llm.target.dense_path()), dtype=dtype).eval()
        self.draft = None
        if llm.draft is not None:
            try:
                self.draft = AutoModelForCausalLM.from_pretrained(str(llm.draft.dense_path()), dtype=dtype).eval()
            except Exception as exc:  # noqa: BLE001  (any loader failure means: no assisted generation)
                notes.append(f"transformers: draft not loadable ({type(exc).__name__}: {exc}); "
                             f"assisted generation skipped")
        self.eos = list(llm.target.eos_token_ids)
        self.target = llm.target
        self.structured = None
        if json_schema is not None:
            from ..structured import Structured
            self.structured = Structured("json_schema", json_schema)

    def supports(self, method: str) -> bool:
        return method == "ngram" or (method == "model" and self.draft is not None)

    def run(self, cell: Cell, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int,
            schema: str | None = None) -> dict:
        x = torch.tensor([list(prompt_ids)])
        clock = _Clock()
        kwargs = dict(max_new_tokens=max_tokens, eos_token_id=self.eos, pad_token_id=self.eos[0],
                      attention_mask=torch.ones_like(x), streamer=clock, do_sample=temperature > 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        structured = structured_for(schema, self.structured)
        if structured is not None:           # the same grammar, applied as a logits processor
            from transformers import LogitsProcessorList

            from ..structured import grammar_tokenizer
            constraint = grammar_tokenizer(self.target).constraint(structured)
            kwargs["logits_processor"] = LogitsProcessorList([GrammarLogitsProcessor(constraint, x.shape[1])])
        if cell.method == "ngram":
            kwargs["prompt_lookup_num_tokens"] = cell.k
        elif cell.method == "model":
            kwargs.update(assistant_model=self.draft, num_assistant_tokens=cell.k,
                          num_assistant_tokens_schedule="constant")
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, **kwargs)
        seconds = time.perf_counter() - started
        ids = out[0, x.shape[1]:].tolist()   # batch 1: no padding, every id after the prompt was generated
        return measurement(ids, seconds, None if clock.first is None else clock.first - started,
                           steps=max(clock.calls - 1, 0) or None)


class GrammarLogitsProcessor:
    """A transformers logits processor that masks what a grammar forbids after the generated
    prefix (llguidance's matcher, as transformers users plug it in). Assisted generation calls it
    at every candidate position with prefixes that may go back; the matcher follows by rollback."""

    def __init__(self, constraint, prompt_len: int) -> None:
        self.constraint, self.prompt_len = constraint, prompt_len
        self.consumed: list[int] = []          # generated tokens the matcher has taken, in order

    def __call__(self, input_ids: torch.Tensor,      # [1, prompt + generated] int64
                 scores: torch.Tensor,               # [1, vocab] float
                 ) -> torch.Tensor:                  # [1, vocab] with forbidden tokens at -inf
        prefix = input_ids[0, self.prompt_len:].tolist()
        common = 0
        while common < min(len(prefix), len(self.consumed)) and prefix[common] == self.consumed[common]:
            common += 1
        matcher = self.constraint.matcher
        if len(self.consumed) > common:
            matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        rest = prefix[common:]
        if rest and not matcher.is_stopped():
            done = matcher.try_consume_tokens(rest)
            self.consumed += rest[:done]      # a forbidden candidate stops here: its logits are not used
        allowed = self.constraint.allowed()                                   # [vocab] bool
        if allowed.shape[0] < scores.shape[-1]:
            allowed = torch.cat([allowed, allowed.new_zeros(scores.shape[-1] - allowed.shape[0])])
        return scores.masked_fill(~allowed[:scores.shape[-1]].to(scores.device), float("-inf"))
