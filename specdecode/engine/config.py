"""The engine core's settings, validated on construction (the server's flags and LLM's arguments)."""
from __future__ import annotations

from dataclasses import dataclass

from ..params import ParamError
from ..tree import MAX_TREE_NODES

MAX_CHAIN = 32          # draft tokens per step of a chain drafter (tree drafters: MAX_TREE_NODES nodes)
SPAN = 32               # the longest draft of a copying drafter's row (a long copy: an edit, a quote)
SLACK = 66              # cache positions past a row's context that a padded pass may write (a tree of 64 + 2)
STREAM_INTERVAL_MS = 20.0   # a streamed choice's tokens go out at most this often, merged (its first at once): on
                            # few cores each chunk's server and client work takes the engine's core, so a chunk
                            # per step slows the stream (docs/serving.md, "What was tried")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ParamError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_number(name: str, value: object, low: float, high: float, unit: str, bounds: str) -> None:
    """ParamError unless value is a number in (low, high] ("(" in bounds) or [low, high]."""
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if bad or not (low < value <= high if bounds.startswith("(") else low <= value <= high):
        raise ParamError(f"{name} must be a number of {unit} in {bounds}, got {value!r}")


@dataclass
class EngineConfig:
    max_batch_size: int = 16             # rows decoding at once
    max_queue: int = 64                  # requests waiting for a row
    max_model_len: int | None = None     # None: the target's context
    block_size: int = 16
    num_blocks: int = 0                  # 0: max_batch_size rows of max_model_len tokens, at most kv_cache_gb
    kv_cache_gb: float = 4.0             # the default pool's bound (target + draft)
    prefill_chunk: int = 256
    prefill_stall_ms: float = 100.0      # a prefill pass stalls decoding rows about this long (0: prefill_chunk)
    num_speculative_tokens: int = 5      # a request's k unless it asks for its own
    adaptive: bool = True                # the controller chooses sizes; False: k every step
    spec_max_batch_size: int | None = None   # no drafts for a batch of more rows than this
    health_timeout: float = 10.0
    served_model_name: str | None = None
    prefix_cache: bool = True            # reuse earlier requests' blocks (cache/blocks.py)
    prefix_cache_blocks: int | None = None   # most idle cached blocks kept (None: what the pool has free)
    prefix_cache_dir: str | None = None      # hot prefixes kept on disk across restarts (cache/disk.py)
    prefix_cache_dir_bytes: int = 4 * 2**30  # the directory's size bound
    max_tokens_default: int = 2048       # max_tokens of a request that gives none (at most the rest of the context)
    stream_interval_ms: float = STREAM_INTERVAL_MS

    def __post_init__(self) -> None:
        for name, low, high in (("max_batch_size", 1, 1024), ("max_queue", 1, 1_000_000), ("block_size", 1, 1024),
                                ("prefill_chunk", 1, 1_000_000), ("num_speculative_tokens", 0, MAX_TREE_NODES),
                                ("num_blocks", 0, 100_000_000), ("max_tokens_default", 1, 100_000_000),
                                ("prefix_cache_dir_bytes", 0, 2**62)):
            _check_int(name, getattr(self, name), low, high)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2, 2**31)
        if self.spec_max_batch_size is not None:
            _check_int("spec_max_batch_size", self.spec_max_batch_size, 1, 1024)
        if self.prefix_cache_blocks is not None:
            _check_int("prefix_cache_blocks", self.prefix_cache_blocks, 0, 2**62)
        if self.prefix_cache_dir is not None and not self.prefix_cache:
            raise ParamError("prefix_cache_dir needs the prefix cache (prefix_cache=True)")
        _check_number("prefill_stall_ms", self.prefill_stall_ms, 0, 60_000, "milliseconds", "[0, 60000]")
        _check_number("stream_interval_ms", self.stream_interval_ms, 0, 10_000, "milliseconds", "[0, 10000]")
        _check_number("kv_cache_gb", self.kv_cache_gb, 0, 1e6, "GB", "(0, 1e6]")
        _check_number("health_timeout", self.health_timeout, 0, 1e6, "seconds", "(0, 1e6]")

    def blocks(self, context: int, token_bytes: int = 0) -> int:
        """KV blocks per cache: num_blocks, or enough for a full batch at the full context, but no
        more than kv_cache_gb holds at `token_bytes` per token (target + draft), and at least one
        request of the whole context (plus the scratch block). Requests reserve their prompt and
        max_tokens, so a pool smaller than the full batch at the full context still runs the full
        batch of ordinary requests."""
        per_row = -(-(context + 1) // self.block_size)
        if self.num_blocks:
            return self.num_blocks
        full = self.max_batch_size * per_row
        if token_bytes:
            full = min(full, max(per_row, int(self.kv_cache_gb * 2**30 // (token_bytes * self.block_size))))
        return full + 1
