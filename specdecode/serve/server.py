"""Putting the server together: options, model checks, memory budget, the engine core, parsing context."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from ..engine.config import MAX_CHAIN, EngineConfig
from ..engine.core import EngineCore
from ..footprint import available_bytes, kv_bytes_per_token
from ..models.config import ModelError
from .memory import check_memory, plan_memory
from .metrics import ServeMetrics
from .protocol import MAX_K, ServeContext

# EngineConfig's fields that are options of the same name
ENGINE_OPTIONS = ("max_batch_size", "max_queue", "kv_cache_gb", "max_model_len", "block_size", "num_blocks",
                  "prefill_chunk", "prefill_stall_ms", "spec_max_batch_size", "health_timeout", "served_model_name",
                  "prefix_cache", "prefix_cache_blocks", "max_tokens_default", "stream_interval_ms")


@dataclass
class ServeState:
    engine: EngineCore
    ctx: ServeContext
    tokenizer: object
    health_token: int
    created: int
    health_probe: object = None      # the /health generation in flight (an asyncio future): checks share it
    reasoning_format: str = "auto"   # --reasoning-format: auto (a thinking model's reasoning apart) | none


def build_state(llm, config: EngineConfig, check_budget: bool = True, available: int | None = None) -> ServeState:
    """Everything the app needs, from a loaded `LLM`. Refuses (ModelError / MemoryBudgetError)
    before allocating any KV cache when the models or the memory do not fit the config."""
    target = llm.target
    if not target.native:
        raise ModelError(f"serve needs a natively loaded target; {target.name} runs through the "
                         f"transformers adapter, whose cache cannot be paged")
    drafter = llm.drafter if llm.num_speculative_tokens > 0 else None
    draft_loaded = drafter.draft_model() if drafter is not None else None
    if draft_loaded is not None and not draft_loaded.native:
        raise ModelError("serve needs a native draft model (its KV cache is paged); this drafter has none")
    draft = draft_loaded.model if draft_loaded is not None else None
    context = config.max_model_len or target.model.max_len
    if context > target.model.max_len:
        raise ModelError(f"--max-model-len {context} exceeds the target's context of {target.model.max_len} tokens")
    if draft is not None and context > draft.max_len:
        raise ModelError(f"--max-model-len {context} exceeds the draft's context of {draft.max_len} tokens")
    plan = plan_memory(target.model, draft, config.blocks(context, kv_bytes_per_token(target.model)
                                                          + kv_bytes_per_token(draft)),
                       config.block_size, config.max_batch_size,
                       MAX_K if drafter is not None and drafter.capabilities.drafts_trees else MAX_CHAIN,
                       config.prefill_chunk, context)
    if check_budget:
        check_memory(plan, available if available is not None else available_bytes())
    engine = llm.serve_core(config)                 # the LLM's one core, at the server's size
    name = config.served_model_name or target.name
    engine.metrics = ServeMetrics(name, llm.method if drafter else "none",
                                  config.num_speculative_tokens if drafter else 0, plan.weights,
                                  {"target": engine.runner.cache, "draft": engine.runner.drafter_state})
    names = tuple(dict.fromkeys([name, target.name, str(target.path)]))
    ctx = ServeContext(target.tokenizer, target.model.vocab_size, context, names, drafter is not None,
                       engine.max_k, tuple(target.eos_token_ids), config.max_tokens_default,
                       drafter is not None and drafter.capabilities.drafts_predictions)
    probe = target.tokenizer.encode("ok", add_special=False) or [0]
    return ServeState(engine, ctx, target.tokenizer, probe[0], int(time.time()))


def serve_options(args: argparse.Namespace) -> tuple[dict, dict]:
    """(EngineConfig's fields, LLM's arguments) from the options: one server's, or each replica's
    (which have no disk tier)."""
    from ..cli_common import drafter_options
    config = {name: getattr(args, name) for name in ENGINE_OPTIONS} | {"num_speculative_tokens": args.k}
    llm = dict(model=args.model, draft=args.draft, method=args.method, num_speculative_tokens=args.k,
               dtype=args.dtype, device=args.device, threads=args.threads, fast=not args.eager,
               weights=args.weights, draft_dtype=args.draft_dtype, **drafter_options(args))
    return config, llm


def bind_port(host: str, port: int):
    """A socket bound to host:port for uvicorn to listen on (`serve_forever(sock=...)`), made before
    the model loads, so that a port in use is said at once; OSError (errno, strerror) when it cannot
    be bound. Not listening yet: a client that connects while the model loads is refused, not
    left waiting. Port 0 binds a free port (`sock.getsockname()[1]`)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET     # as uvicorn binds a host
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as uvicorn: a restart reuses the port
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_forever(state: ServeState, app, host: str, port: int, log_level: str = "info",
                  shutdown_timeout: float = 30.0, sock=None) -> int:
    """`specdecode serve`: uvicorn in a thread, the engine loop on this thread (the process's main
    thread: `EngineCore.start` says why). SIGTERM / SIGINT stop it gracefully: new requests get
    503, those queued or running have `shutdown_timeout` seconds to finish (then an error event /
    503), then the HTTP server closes; a second signal ends the wait at once. `sock`: the socket
    `bind_port` bound (else uvicorn binds host:port itself). Returns the exit code."""
    import signal
    import threading

    import uvicorn
    engine = state.engine
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                           timeout_graceful_shutdown=5))

    def http() -> None:
        try:
            server.run(sockets=None if sock is None else [sock])
        finally:                                # however the HTTP side ends, the engine loop ends too
            engine.stop()

    def on_signal(signum, frame) -> None:       # runs on this thread between two engine iterations
        draining = engine.drain_deadline is not None
        busy = engine.in_flight()
        if not draining and busy:
            print(f"specdecode serve: {signal.Signals(signum).name}: no new requests; waiting up to "
                  f"{shutdown_timeout:g} s for {busy} in flight (again to stop now)", file=sys.stderr, flush=True)
        engine.drain(0.0 if draining else shutdown_timeout)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="specdecode-http", daemon=True)
    thread.start()
    try:
        engine.run()
    finally:
        server.should_exit = True
        thread.join(timeout=shutdown_timeout + 10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        print(f"specdecode serve: could not start the HTTP server on {host}:{port} (see the log above)",
              file=sys.stderr)
        return 1
    print("specdecode serve: stopped", file=sys.stderr)
    return 0


class BackgroundServer:
    """The app under uvicorn in a daemon thread, on `host` and a free port (tests, notebooks):
    `with BackgroundServer(create_app(state)) as server: ... server.url ...`."""

    def __init__(self, app, host: str = "127.0.0.1", startup_timeout: float = 30.0) -> None:
        self.app, self.host, self.startup_timeout = app, host, startup_timeout
        self.server = self.thread = None
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        import socket
        import threading

        import uvicorn
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.url = f"http://{self.host}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
