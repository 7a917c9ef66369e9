"""Start-up memory budget: weights of both models + both KV block pools + working memory,
checked against the memory this process can still get, so the server refuses at once with
one clear line instead of running out of memory under load."""
from __future__ import annotations

from dataclasses import dataclass

from ..footprint import kv_bytes_per_token, weights_bytes
from ..params import ParamError

GB = 1024 ** 3


class MemoryBudgetError(ParamError):
    """The configured batch and context do not fit in the available memory (the CLI shows one
    line and exits with code 2, like any bad parameter)."""


@dataclass
class MemoryPlan:
    weights: dict[str, int]          # "target", "draft"
    kv: dict[str, int]               # "target", "draft": block pool bytes
    working: int                     # logits/probabilities of a step and activations of a prefill chunk

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + sum(self.kv.values()) + self.working


def plan_memory(target, draft, num_blocks: int, block_size: int, max_batch_size: int, max_k: int,
                prefill_chunk: int, context: int) -> MemoryPlan:
    tokens = num_blocks * block_size
    c = target.config
    step_logits = max_batch_size * (max_k + 1) * c.vocab_size * 4 * 4        # logits, transformed, probs, draft probs
    prefill = prefill_chunk * (c.hidden_size * 4 + c.intermediate_size * 3) * 4
    attention = 2 * max_batch_size * (context + max_k + 2) * kv_bytes_per_token(target) // max(c.num_layers, 1)
    return MemoryPlan(weights={"target": weights_bytes(target), "draft": weights_bytes(draft)},
                      kv={"target": tokens * kv_bytes_per_token(target), "draft": tokens * kv_bytes_per_token(draft)},
                      working=step_logits + prefill + attention)


def check_memory(plan: MemoryPlan, available: int | None, weights_loaded: bool = True) -> None:
    """Refuse when what is still to be allocated exceeds what is available. With the weights
    already loaded they are part of the budget but no longer part of what must be found."""
    if available is None:
        return
    to_allocate = plan.total - (sum(plan.weights.values()) if weights_loaded else 0)
    if to_allocate <= available:
        return
    w, kv = plan.weights, plan.kv
    raise MemoryBudgetError(
        f"memory budget exceeded: weights {w['target'] / GB:.2f} GB (target) + {w['draft'] / GB:.2f} GB (draft), "
        f"KV cache {kv['target'] / GB:.2f} GB (target) + {kv['draft'] / GB:.2f} GB (draft), working "
        f"{plan.working / GB:.2f} GB: {to_allocate / GB:.2f} GB still to allocate but {available / GB:.2f} GB "
        f"available; lower --max-batch-size, --max-model-len or --num-blocks")
