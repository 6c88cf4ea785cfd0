"""``specwise serve``: load a target, build the methods requests may use, serve them with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from specwise.drafters import METHODS
from specwise.drafters.building import engine_for, spec_and_config
from specwise.drafters.spec import parse_option_value
from specwise.errors import ConfigError
from specwise.targets.aliases import KNOWN_TARGETS
from specwise.targets.engine_choice import ENGINE_HELP, ENGINES
from specwise.targets.loading import load_target
from specwise.targets.native.weights import WEIGHTS, WEIGHTS_HELP

try:  # the [serve] extra; without it every other command still works
    import uvicorn

    from specwise.serve.app import ServerConfig, create_app
except ImportError as exc:
    _MISSING: str | None = exc.name
else:
    _MISSING = None

#: methods every server can offer without weights (besides the default)
_ALWAYS = ("ar", "pld")


def add_serve_args(p: argparse.ArgumentParser, default_target: str) -> None:
    p.add_argument("--target", default=default_target, help=f"alias or path (default {default_target})")
    p.add_argument("--method", default=None,
                   help="the default method (default: auto, which picks per request from what it measured "
                        "here; with --drafter, the target's fastest measured method)")
    p.add_argument("--methods", default=None, metavar="LIST",
                   help="comma-separated methods a request may choose with speculative.method "
                        "(default: the default method, ar and pld)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the default method, e.g. num_draft_tokens=8 (repeatable)")
    p.add_argument("--drafter", default=None, metavar="PATH",
                   help="the default method's drafter: a directory in specwise's or a public format "
                        "(speculators, SpecForge, z-lab DFlash, Medusa; docs/interop.md), or a draft-model alias")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; repeat for several keys, each a tenant "
                        "whose requests draft only from its own earlier text")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; beyond, 503 (default 64)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="generations running at once on the llama.cpp engine, batched in each forward "
                        "(default 8; 1: one at a time; the torch engine runs one at a time)")
    p.add_argument("--max-tokens-cap", type=int, default=2048, help="most new tokens per request (default 2048)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the context)")
    p.add_argument("--draft-budget", default="measured", choices=["measured", "fixed"],
                   help="a lone generation's drafts per step: measured (the cost model, default) or fixed "
                        "(what the method proposes); generations in a batch always follow the cost model")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds a generation may run (default 600)")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds open responses get to end before the process exits "
                        "(default 5; running generations stop at their next step)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "float64"],
                   help="the target's dtype (default bfloat16)")
    p.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    p.add_argument("--engine", default="auto", choices=["auto", *ENGINES],
                   help=ENGINE_HELP + " (default auto; docs/llamacpp.md)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def default_method(method: str | None, drafter: str | None, target: str) -> str:
    """The server's default method: the one named, else ``auto``; with a ``--drafter`` to serve
    (``auto`` takes none), the target's fastest measured method, or ``ar`` for an unknown target."""
    if method:
        return method
    if drafter is None:
        return "auto"
    known = KNOWN_TARGETS.get(target)
    return known.best_method if known else "ar"


def cmd_serve(args: argparse.Namespace) -> int:
    if _MISSING is not None:
        raise ConfigError(f"specwise serve needs the [serve] extra ({_MISSING} is missing): "
                          "pip install 'specwise[serve]'.")
    known = KNOWN_TARGETS.get(args.target)
    default, methods, options = _checked_methods(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    engine = engine_for(args.engine, default, spec_and_config(default, **options)[1], args.target)
    target = load_target(args.target, dtype=args.dtype, device=args.device, weights=args.weights,
                         progress=lambda m: print(m, file=sys.stderr, flush=True), engine=engine)
    config = ServerConfig(model=args.model_name or (args.target if known else Path(args.target).name), default_method=default,
                          methods=tuple(dict.fromkeys(methods)), api_key=tuple(args.api_key) if args.api_key else None, max_queue=args.max_queue,
                          max_batch=args.max_batch, max_tokens_cap=args.max_tokens_cap, max_prompt_tokens=args.max_prompt_tokens,
                          time_limit_s=args.time_limit, default_options=options, draft_budget=args.draft_budget)
    app = create_app(target, config, worker_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=args.shutdown_grace))
    worker = app.state.worker

    def serve_http() -> None:
        try:
            server.run()
        finally:
            worker.shutdown()  # ends worker.run() below

    http = threading.Thread(target=serve_http, name="specwise-http")
    http.start()
    print(f"specwise: serving {config.model} with {default} (also: {', '.join(config.methods[1:]) or 'none'}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    shutdown = GracefulShutdown(worker, server, args.shutdown_grace)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, shutdown.on_signal)
    try:
        worker.run()  # generations on the main thread: torch's CPU forwards are slower on any other
    finally:
        server.should_exit = True
        http.join(timeout=args.shutdown_grace + 2)
    if not server.started:
        raise ConfigError(f"could not serve on {args.host}:{args.port} (is the port in use?).")
    return 0


class GracefulShutdown:
    """What SIGTERM and Ctrl-C do: the worker refuses waiting requests (503) and stops the running
    generation at its next step, so every open stream ends with an error event and ``[DONE]``;
    uvicorn stops accepting connections and gives open responses ``grace`` seconds to end. A
    second signal stops waiting for them (the exit code stays 0); a process still alive five seconds past the grace
    (a single forward longer than that) exits regardless.

    Args:
        worker: the :class:`~specwise.serve.worker.GenerationWorker`. server: the ``uvicorn.Server``.
        grace: seconds (``--shutdown-grace``).
    """

    def __init__(self, worker, server, grace: float) -> None:
        self.worker, self.server, self.grace = worker, server, grace
        self.requested = threading.Event()

    def on_signal(self, signum, _frame) -> None:
        """The signal handler (runs on the main thread, between two of the worker's steps)."""
        if self.requested.is_set():
            self.server.force_exit = True  # a second signal: uvicorn stops waiting for open responses
            return
        self.requested.set()
        print(f"specwise: {signal.Signals(signum).name}: shutting down (open responses get "
              f"{self.grace:g} s)", file=sys.stderr, flush=True)
        # not on this thread: the handler may have interrupted the worker holding its lock
        threading.Thread(target=self._shut_down, name="specwise-shutdown", daemon=True).start()

    def _shut_down(self) -> None:
        self.worker.shutdown()
        self.server.should_exit = True
        time.sleep(self.grace + 5)
        print("specwise: open responses did not end in time; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def _checked_methods(args: argparse.Namespace) -> tuple[str, list[str], dict]:
    """The default method, the methods requests may choose and the default's options, with every
    flag checked before the model load.

    Raises:
        ConfigError, DrafterError: an unknown method, a bad option or limit, a missing drafter.
    """
    default = default_method(args.method, args.drafter, args.target)
    methods = [default, *(_split(args.methods) if args.methods else _ALWAYS)]
    for method in methods:
        METHODS.get(method)
    for name, value in (("--port", args.port), ("--max-queue", args.max_queue), ("--max-tokens-cap", args.max_tokens_cap),
                        ("--max-batch", args.max_batch)):
        if value < (0 if name == "--max-queue" else 1):
            raise ConfigError(f"{name} must be a positive integer, got {value}.")
    for name, value in (("--time-limit", args.time_limit), ("--shutdown-grace", args.shutdown_grace)):
        if not value > 0 or value == float("inf"):
            raise ConfigError(f"{name} must be a positive number of seconds, got {value}.")
    options = {}
    for item in args.option:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--option takes KEY=VALUE, got {item!r}.")
        options[key.strip()] = parse_option_value(value.strip())
    if args.drafter is not None:
        if not Path(args.drafter).exists() and args.drafter not in KNOWN_TARGETS:
            raise ConfigError(f"the drafter {args.drafter} does not exist.")
        options["drafter_path"] = args.drafter
    METHODS.get(default).make_config(**options)
    return default, methods, options


def _split(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]
