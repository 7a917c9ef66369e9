"""`specdecode serve --replicas N [--ray-address ADDR]`: checks the options, starts or joins Ray,
deploys the application (ray_app.py) and waits for Ctrl-C."""
from __future__ import annotations

import argparse
import signal
import sys
import threading


def ray_spec(args: argparse.Namespace) -> dict:
    """The application's spec from the command line (CliError on inconsistent options)."""
    from ..cli_common import CliError
    from ..engine.config import EngineConfig
    from .server import serve_options
    low, high = args.min_replicas, args.max_replicas
    if low is not None and high is not None and low > high:
        raise CliError(f"--min-replicas ({low}) must be <= --max-replicas ({high})")
    if (low is not None and args.replicas < low) or (high is not None and args.replicas > high):
        raise CliError(f"--replicas ({args.replicas}) must be within --min-replicas ({low or 1}) and "
                       f"--max-replicas ({high if high is not None else 'unbounded'})")
    if args.device not in (None, "cpu"):
        raise CliError(f"--replicas runs CPU engine replicas; --device {args.device} is not supported with Ray")
    config, llm = serve_options(args)
    EngineConfig(**config)                         # ParamError here rather than in every replica
    llm["device"] = "cpu"
    return {"llm": llm, "config": config, "replicas": args.replicas, "min_replicas": low, "max_replicas": high,
            "shutdown_timeout": args.shutdown_timeout,
            "imbalance": args.route_imbalance if args.route_imbalance is not None else args.max_batch_size,
            "retries": args.replica_retries, "api_key": args.api_key, "max_body_bytes": args.max_body_bytes,
            "reasoning_format": args.reasoning_format}


def plural(count: int, word: str) -> str:
    """`1 thread`, `2 threads`."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def deploy_error(exc: Exception) -> str:
    """The replica's own error (a bad model path, a memory budget) out of Ray's report: the last
    `SomeError: message` line, without the traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    own = [line for line in lines if line.split(":", 1)[0].rsplit(".", 1)[-1].endswith("Error")
           and "Traceback" not in line and not line.startswith(("ray.", "RayTaskError", "RuntimeError"))]
    if own:
        return own[-1].split(": ", 1)[-1]
    return lines[-1] if lines else type(exc).__name__


def serve_on_ray(args: argparse.Namespace) -> int:
    from ..cli_common import CliError
    from .auth import warn_if_exposed
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise CliError("--replicas / --ray-address need Ray Serve: pip install -e '.[ray]' in the specdecode "
                       "repository (scripts/setup/setup.sh installs it)") from None
    from . import ray_app
    spec = ray_spec(args)
    stop, hurry = threading.Event(), threading.Event()
    started = False

    def on_signal(signum, frame) -> None:
        if not started:                          # still deploying: give up the start
            raise KeyboardInterrupt
        if stop.is_set():                        # a second signal: no more waiting
            hurry.set()
            return
        print(f"specdecode serve: {signal.Signals(signum).name}: stopping the replicas (requests in flight "
              f"have up to {args.shutdown_timeout:g} s; a second signal stops at once) and Ray",
              file=sys.stderr, flush=True)
        stop.set()

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    try:
        spec = ray_app.start(spec, args.host, args.port, args.ray_address, after_init=install)
    except KeyboardInterrupt:
        # Ray Serve answers requests a few seconds before it reports the application running: what is
        # in flight then gets its time too (a second signal: none)
        started = True
        stop.set()
        serving = drain(args.shutdown_timeout, hurry, quiet=True)
        leave(args.ray_address)
        print("specdecode serve: stopped" if serving else "specdecode serve: stopped before the replicas were up",
              file=sys.stderr)
        return 0
    except ConnectionError as exc:
        raise CliError(f"--ray-address {args.ray_address}: cannot join the Ray cluster ({exc}); a cluster with "
                       f"token authentication needs RAY_AUTH_MODE=token and its token (~/.ray/auth_token or "
                       f"RAY_AUTH_TOKEN)") from None
    except Exception as exc:  # noqa: BLE001 -- a replica failed to start: its own message, no traceback
        leave(args.ray_address)
        raise CliError(f"the engine replicas did not start: {deploy_error(exc)}") from None
    where = f"Ray cluster {args.ray_address}" if args.ray_address else "a local Ray instance"
    scaling = (f"autoscaling {spec['min_replicas'] or 1}..{spec['max_replicas'] or 'unbounded'}"
               if spec["min_replicas"] is not None or spec["max_replicas"] is not None else "fixed")
    model = args.served_model_name or args.model or "the default model"
    print(f"specdecode serve: {plural(spec['replicas'], 'replica')} ({scaling}) of {model}, "
          f"{plural(spec['llm']['threads'], 'thread')} each, on {where}; http://{args.host}:{args.port}/",
          file=sys.stderr)
    warn_if_exposed(args.host, args.api_key)
    started = True
    try:
        while not stop.wait(3600):
            pass
        drain(args.shutdown_timeout, hurry)
    finally:
        leave(args.ray_address)
    print("specdecode serve: stopped", file=sys.stderr)
    return 0


def drain(timeout: float, hurry: threading.Event, quiet: bool = False) -> bool:
    """New requests get 503 at the ingress; those in flight get up to `timeout` seconds to finish
    (`hurry`: a second signal) before the application goes; False when the ingress did not answer
    (not deployed yet). Ray Serve's own shutdown closes its HTTP proxy first, which would cut every
    stream in flight."""
    import time

    from ray import serve

    from .ray_app import APP_NAME
    try:
        ingress = serve.get_app_handle(APP_NAME)
        left = ingress.drain.remote().result(timeout_s=10)
    except Exception as exc:  # noqa: BLE001 -- the application is going anyway: say so, do not trace
        if not quiet:
            print(f"specdecode serve: could not reach the ingress to wait for the requests in flight "
                  f"({type(exc).__name__})", file=sys.stderr)
        return False
    deadline = time.monotonic() + timeout
    try:
        while left and not hurry.is_set() and time.monotonic() < deadline:
            hurry.wait(0.2)
            left = ingress.drain.remote().result(timeout_s=10)
    except Exception as exc:  # noqa: BLE001
        print(f"specdecode serve: lost the ingress while waiting for the requests in flight ({type(exc).__name__})",
              file=sys.stderr)
        return True
    if left:
        print(f"specdecode serve: {left} request(s) still in flight after {timeout:g} s: stopping anyway",
              file=sys.stderr)
    return True


def leave(ray_address: str | None) -> None:
    """Remove the application (its replicas shut down gracefully), then leave Ray: a joined
    cluster keeps Serve and its other applications; the local Ray instance stops with its Serve
    controller. (serve.shutdown() there made Ray print that the controller's graceful_shutdown
    task failed, the controller having killed itself.)"""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from .ray_app import APP_NAME
    if not ray.is_initialized():                 # stopped before Ray was up (Serve would start it again)
        return
    try:
        serve.delete(APP_NAME)
    except RayServeException:                    # stopped before Serve was up: nothing to remove
        pass
    except Exception as exc:  # noqa: BLE001 -- e.g. a replica slow to go: leave anyway, say so
        print(f"specdecode serve: could not remove the application ({type(exc).__name__}: {exc})", file=sys.stderr)
    ray.shutdown()
