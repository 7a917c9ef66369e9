"""`specdecode serve`: options and the command (heavy imports happen only when it runs)."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import sys


def add_serve_parser(sub) -> None:
    from ..cli_common import add_model_options, number, positive_int
    from ..engine.config import STREAM_INTERVAL_MS
    from .auth import DEFAULT_MAX_BODY_BYTES
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching, per-request "
                                     "speculation, Prometheus metrics and a live dashboard at /")
    add_model_options(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=positive_int("--port", 0, 65535), default=8000, help="default 8000")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: --model as given; smollm2 "
                        "for the embedded model)")
    g.add_argument("--max-batch-size", type=positive_int("--max-batch-size", 1, 1024), default=16,
                   help="requests decoded together (default 16)")
    g.add_argument("--max-queue", type=positive_int("--max-queue", 1), default=64,
                   help="requests waiting for a row in the batch; more get HTTP 429 (default 64)")
    g.add_argument("--max-model-len", type=positive_int("--max-model-len", 2), default=None,
                   help="prompt + max_tokens limit per request (default: the model's context)")
    g.add_argument("--max-tokens-default", type=positive_int("--max-tokens-default", 1), default=2048,
                   help="max_tokens of a request that gives none, at most the rest of the context (default 2048; "
                        "completions: 16 as OpenAI's); a request's own max_tokens may go up to the context")
    g.add_argument("--block-size", type=positive_int("--block-size", 1, 1024), default=16,
                   help="tokens per KV cache block (default 16)")
    g.add_argument("--num-blocks", type=positive_int("--num-blocks", 2), default=0,
                   help="KV blocks per model (default: a full batch at --max-model-len, at most --kv-cache-gb)")
    g.add_argument("--kv-cache-gb", type=number("--kv-cache-gb"), default=4.0,
                   help="the default KV pool's bound, target and draft together (default 4; requests reserve "
                        "their prompt + max_tokens, so the full batch of ordinary requests still fits)")
    g.add_argument("--prefill-chunk", type=positive_int("--prefill-chunk", 1), default=256,
                   help="most prompt tokens prefilled between two decode steps (default 256)")
    g.add_argument("--prefill-stall-ms", type=number("--prefill-stall-ms"), default=100.0,
                   help="while requests decode, prefill chunks are sized from their measured cost to stall "
                        "them about this long (default 100; 0: always --prefill-chunk tokens)")
    g.add_argument("--stream-interval-ms", type=number("--stream-interval-ms"), default=STREAM_INTERVAL_MS,
                   help=f"a stream's tokens are sent at most this often, merged (default {STREAM_INTERVAL_MS:g}; its "
                        f"first tokens at once; 0: a chunk per engine step)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not reuse the KV cache of earlier requests' prompts (on by default: a prompt that "
                        "starts like an earlier one, e.g. a chat's next turn, is prefilled only after that start)")
    g.add_argument("--prefix-cache-blocks", type=positive_int("--prefix-cache-blocks", 0), default=None,
                   help="most KV blocks kept for cached prefixes while no request uses them (default: whatever "
                        "the pool has free; they are evicted least recently used first when requests need room)")
    g.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="keep hot cached prefixes (prompts reused by later requests, and at a graceful stop all "
                        "the cache holds) on disk in DIR and load them at start-up, so a restart does not "
                        "prefill them again; files are checked against the model and damaged ones skipped")
    g.add_argument("--prefix-cache-dir-size", type=number("--prefix-cache-dir-size"), default=4.0, metavar="GB",
                   help="most GB kept in --prefix-cache-dir, least recently used files removed first (default 4)")
    g.add_argument("--spec-max-batch-size", type=positive_int("--spec-max-batch-size", 1), default=None,
                   help="switch speculation off while more requests run (default: only the measured policy)")
    g.add_argument("--health-timeout", type=number("--health-timeout"), default=10.0,
                   help="seconds /health waits for its one-token generation (default 10)")
    g.add_argument("--shutdown-timeout", type=number("--shutdown-timeout"), default=30.0,
                   help="on SIGTERM / SIGINT: new requests get 503 and those in flight have this many seconds to "
                        "finish before they end with an error (default 30; a second signal stops at once)")
    g.add_argument("--reasoning-format", choices=["auto", "none"], default="auto",
                   help="auto: a thinking model's reasoning (Qwen3 / 3.5 and DeepSeek-R1 <think>, gpt-oss's analysis "
                        "channel, Gemma 4's thought channel, read from its chat template) goes in reasoning_content "
                        "beside content; none: all of it in content (default auto)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every endpoint but /health and the dashboard page "
                        "(default: env SPECDECODE_API_KEY, else none)")
    g.add_argument("--max-body-bytes", type=positive_int("--max-body-bytes", 1), default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    r = p.add_argument_group("scale-out on Ray Serve (installed by scripts/setup/setup.sh; docs/ray.md)")
    r.add_argument("--replicas", type=positive_int("--replicas", 1, 4096), default=1,
                   help="engine replicas behind one OpenAI API (default 1: this process, no Ray); each uses "
                        "--threads cores (default: the cores / the replicas)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this running Ray cluster (e.g. 10.0.0.5:6379 or auto); default: start a local Ray")
    r.add_argument("--min-replicas", type=positive_int("--min-replicas", 1, 4096), default=None,
                   help="autoscale on queue length between --min-replicas and --max-replicas")
    r.add_argument("--max-replicas", type=positive_int("--max-replicas", 1, 4096), default=None,
                   help="see --min-replicas")
    r.add_argument("--route-imbalance", type=positive_int("--route-imbalance", 0), default=None,
                   help="a conversation stays on its replica while that one has at most this many requests in "
                        "flight above the least-loaded one (default: --max-batch-size)")
    r.add_argument("--replica-retries", type=positive_int("--replica-retries", 0, 100), default=2,
                   help="times a request is sent to another replica when its replica dies before answering "
                        "(default 2)")
    p.set_defaults(run=cmd_serve)


def uses_ray(args: argparse.Namespace) -> bool:
    return (args.replicas > 1 or args.ray_address is not None or args.min_replicas is not None
            or args.max_replicas is not None)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..api import LLM
    from ..cli_common import CliError
    from ..engine.config import EngineConfig
    from .app import create_app
    from .auth import warn_if_exposed
    from .memory import weights_bytes
    from .server import bind_port, build_state, serve_forever, serve_options
    if args.method == "model" and args.draft is None:
        raise CliError("--method model needs a draft model: add --draft PATH")
    if not 0 <= args.shutdown_timeout <= 86400:
        raise CliError(f"--shutdown-timeout must be a number of seconds in [0, 86400], got {args.shutdown_timeout:g}")
    if args.prefix_cache_dir is not None and not args.prefix_cache:
        raise CliError("--prefix-cache-dir needs the prefix cache: drop --no-prefix-cache")
    if not 0 <= args.prefix_cache_dir_size <= 1e6:
        raise CliError(f"--prefix-cache-dir-size must be a number of GB in [0, 1e6], "
                       f"got {args.prefix_cache_dir_size:g}")
    try:                                    # the port before the model: a port in use is said at once
        sock = bind_port(args.host, args.port)
    except OSError as exc:
        raise CliError(f"--host {args.host} --port {args.port}: cannot listen there: {exc.strerror or exc}"
                       + (" (another server runs on it? stop it or choose another --port)"
                          if exc.errno == errno.EADDRINUSE else "")) from None
    if uses_ray(args):
        sock.close()                        # Ray Serve's proxy binds it
        if args.prefix_cache_dir is not None:
            raise CliError("--prefix-cache-dir applies to one server; with --replicas each replica keeps its own "
                           "cache in memory")
        from .ray_cli import serve_on_ray
        return serve_on_ray(args)
    args.port = sock.getsockname()[1]       # --port 0: the free port it bound
    fields, llm_args = serve_options(args)
    config = EngineConfig(**fields, prefix_cache_dir=args.prefix_cache_dir,
                          prefix_cache_dir_bytes=int(args.prefix_cache_dir_size * 2**30))
    try:
        llm = LLM(**llm_args)
        state = build_state(llm, config)
    except BaseException:                   # a model or memory error: main() says it
        sock.close()
        raise
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = state.engine
    drafting = engine.drafter is not None        # no k where nothing drafts
    print(f"specdecode serve: {state.ctx.model_names[0]} ({engine.metrics.method}"
          f"{f', k={config.num_speculative_tokens}' if drafting else ''}), "
          f"batch {config.max_batch_size}, context {state.ctx.max_model_len}, KV "
          f"{engine.runner.cache.nbytes() / 2**20:.0f} MiB target + "
          f"{(engine.runner.draft_cache.nbytes() if engine.runner.draft_cache else 0) / 2**20:.0f} MiB draft, "
          f"weights {weights_bytes(llm.target.model) / 2**20:.0f} MiB; http://{args.host}:{args.port}/",
          file=sys.stderr)
    cache = engine.runner.cache
    print(f"specdecode serve: prefix cache {'on' if cache.prefix_caching else 'off'}"
          + (f" ({engine.runner.prefix_note})" if engine.runner.prefix_note else "")
          + "".join(f"; {d.loaded} blocks loaded from {d.dir}" for d in engine.disks), file=sys.stderr)
    state.reasoning_format = args.reasoning_format
    if args.reasoning_format == "auto":
        from .reasoning import thinking_format
        thinking = thinking_format(state.tokenizer)
        if thinking is not None:
            print(f"specdecode serve: thinking markup {thinking.name}: chat answers carry the reasoning in "
                  f"reasoning_content (--reasoning-format none: in content)", file=sys.stderr)
    warn_if_exposed(args.host, args.api_key)
    app = create_app(state, api_key=args.api_key, max_body_bytes=args.max_body_bytes, engine_thread=False)
    return serve_forever(state, app, args.host, args.port, args.log_level, args.shutdown_timeout, sock=sock)
