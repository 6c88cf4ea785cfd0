"""The ``specwise`` command line (docs/usage.md).

Each subcommand lives in the module that does its work and is imported only when it runs, so
``specwise --help`` imports no model code and ``specwise generate`` none of the lab's. Bad input is
reported as one sentence on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from typing import Sequence

from specwise.errors import SpecwiseError

DEFAULT_TARGET = "gemma-3-270m"


#: subcommand -> (module, function adding its flags (and ``func``), function running it when the
#: adder sets no ``func``, one-line help)
COMMANDS: dict[str, tuple[str, str, str | None, str]] = {
    "generate": ("specwise.commands.generate", "add_generate_args", None, "generate text with one method"),
    "targets": ("specwise.commands.targets", "add_targets_args", None,
                "list the target aliases: installed or not, size, cache state"),
    "demo": ("specwise.lab.demo", "add_demo_args", None,
             "run ar, pld, lookahead, draft, eagle, medusa and dflash on the default target with a few "
             "built-in prompts, side by side"),
    "bench": ("specwise.lab.bench.cli", "add_bench_args", None,
              "benchmark methods and Hugging Face peers, interleaved in one process"),
    "analyze": ("specwise.lab.analysis.cli", "add_analyze_args", "cmd_analyze",
                "speedup model: calibrate costs on this machine, plot, check against a bench run"),
    "data": ("specwise.training.cli", "add_data_args", None, "build training corpora for drafters"),
    "train": ("specwise.training.cli", "add_train_args", None, "train a drafter for a target (self-distillation)"),
    "serve": ("specwise.serve.cli", "add_serve_args", "cmd_serve",
              "an OpenAI-compatible server (completions, chat, streaming, Predicted Outputs)"),
    "export": ("specwise.training.cli", "add_drafter_export_args", None,
               "write a trained drafter for vLLM, SGLang or llama.cpp"),
    "export-hf": ("specwise.training.cli", "add_export_args", None,
                  "write a draft LM as a plain Hugging Face causal LM"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the flags of ``command`` only (its module imported), or of every subcommand
    when ``command`` is ``None``."""
    parser = argparse.ArgumentParser(prog="specwise",
                                     description="Lossless speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, add, run, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary)
        if command is None or name == command:
            loaded = importlib.import_module(module)
            getattr(loaded, add)(p, DEFAULT_TARGET)
            if run is not None:
                p.set_defaults(func=getattr(loaded, run))
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not a flag), if it names one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else ""


def _quiet_transformers() -> None:
    """The CLI prints its own progress: silence transformers' load bars and advisory warnings
    (when the command loaded it)."""
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def _terminated(signum, frame) -> None:
    # SIGTERM ends the process as an exception would, so what it started (a benchmark's llama-server
    # peers) is stopped by its exit handlers; the default action would skip them
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _command(argv) != "serve" and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)  # the server handles its own signals
    args = build_parser(_command(argv)).parse_args(argv)
    _quiet_transformers()
    try:
        return args.func(args)
    except SpecwiseError as exc:
        print(f"specwise: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
