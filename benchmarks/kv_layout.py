"""KV cache layouts on llama.cpp's engine, side by side on one bare context: what a generation's
attention pays for the other generations' cells.

Two layouts, each with and without a Python graph evaluation callback (``cb_eval``, how the target
reads hidden states):

- ``unified``: the target's own (``specwise.targets.llamacpp``): one pool shared by every sequence
  (``kv_unified``), the sliding-window layers keeping every cell (``swa_full``), 32 sequence ids per
  generation (a draft tree's branches);
- ``streams``: llama-server's default with ``-np N``: one cache per sequence (``kv_unified`` off,
  the context split evenly), the sliding-window layers keeping their window only.

For each: N sequences of L random tokens are prefilled, then timed (medians, milliseconds): one
token for every sequence in one ``llama_decode`` (``batch``), one token for one sequence with the
others present (``lone``), and a 256-token prompt chunk for one sequence at position L (``chunk``).
The layouts take turns ``--reps`` times (this VM's speed drifts: read ratios within a repetition).

Layouts differ in more than these timings on the target: with ``kv_unified`` off, llama.cpp splits
a ``llama_decode`` into one micro-batch per run of consecutive sequence ids with equal token counts,
a sequence copy between generations copies a whole stream, and a tree's branch sequences would
each be a stream of their own. docs/benchmarks/serve-concurrency-report.md gives the server-level
measurement.

    python benchmarks/kv_layout.py [--target gemma-3-270m] [--sequences 8] [--length 1000] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from specwise.engine.clock import machine_info
from specwise.targets.files import gguf_file
from specwise.targets.llamacpp_backend import lc, load_backends

CHUNK = 256


def layouts(sequences: int, length: int) -> dict[str, dict]:
    per_seq = max(4096, 1 << (length + CHUNK + 64).bit_length())
    return {
        "unified": dict(kv_unified=True, swa_full=True, n_seq_max=256, stride=32, n_ctx=32768, cb=False),
        "unified+cb": dict(kv_unified=True, swa_full=True, n_seq_max=256, stride=32, n_ctx=32768, cb=True),
        "streams": dict(kv_unified=False, swa_full=False, n_seq_max=sequences, stride=1, n_ctx=per_seq * sequences, cb=False),
        "streams+cb": dict(kv_unified=False, swa_full=False, n_seq_max=sequences, stride=1, n_ctx=per_seq * sequences, cb=True),
    }


class Bench:
    def __init__(self, path: Path, threads: int, sequences: int, length: int) -> None:
        load_backends()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.rng = random.Random(0)
        self.token = lambda: self.rng.randrange(100, vocab - 100)
        self.prompts = [[self.token() for _ in range(length)] for _ in range(sequences)]
        self.threads, self.length = threads, length
        self.batch = lc.llama_batch_init(512, 0, 1)
        self.callback = lc.ggml_backend_sched_eval_callback(lambda tensor, ask, data: False)

    def _decode(self, ctx, tokens, positions, seqs, logits) -> float:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s, out) in enumerate(zip(tokens, positions, seqs, logits)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, out
            b.seq_id[i][0] = s
        began = time.perf_counter()
        if lc.llama_decode(ctx, b) != 0:
            raise SystemExit("llama_decode failed")
        return (time.perf_counter() - began) * 1e3

    def run(self, layout: dict) -> dict[str, float]:
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = layout["n_ctx"], 512, 512
        params.n_seq_max, params.kv_unified, params.swa_full = layout["n_seq_max"], layout["kv_unified"], layout["swa_full"]
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        if layout["cb"]:
            params.cb_eval = self.callback
        ctx = lc.llama_init_from_model(self.model, params)
        memory = lc.llama_get_memory(ctx)
        seqs = [i * layout["stride"] for i in range(len(self.prompts))]
        for seq, prompt in zip(seqs, self.prompts):
            for at in range(0, len(prompt), 512):
                part = prompt[at: at + 512]
                self._decode(ctx, part, range(at, at + len(part)), [seq] * len(part), [0] * (len(part) - 1) + [1])
        out = {}
        for name, members, rounds in (("batch", seqs, 16), ("lone", seqs[:1], 16)):
            times = [self._decode(ctx, [self.token() for _ in members], [self.length + r] * len(members), members,
                                  [1] * len(members)) for r in range(rounds)]
            for seq in members:
                lc.llama_memory_seq_rm(memory, seq, self.length, -1)
            out[name] = statistics.median(times[2:])
        times = []
        for _ in range(5):
            times.append(self._decode(ctx, [self.token() for _ in range(CHUNK)], range(self.length, self.length + CHUNK),
                                      [seqs[0]] * CHUNK, [0] * (CHUNK - 1) + [1]))
            lc.llama_memory_seq_rm(memory, seqs[0], self.length, -1)
        out["chunk"] = statistics.median(times[1:])
        lc.llama_free(ctx)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="gemma-3-270m")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=1000, help="tokens each sequence holds before the timed decodes")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = p.parse_args(argv)
    bench = Bench(gguf_file(args.target), args.threads, args.sequences, args.length)
    table = layouts(args.sequences, args.length)
    runs: dict[str, list[dict]] = {name: [] for name in table}
    for rep in range(args.reps):
        for name, layout in table.items():
            runs[name].append(bench.run(layout))
            print(f"rep {rep} {name:11s} " + "  ".join(f"{k} {v:7.2f} ms" for k, v in runs[name][-1].items()), flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print("\nmedians (ms) and against unified:")
    for name, s in summary.items():
        print(f"{name:11s} " + "  ".join(f"{k} {v:7.2f} ({v / summary['unified'][k]:.2f}x)" for k, v in s.items()))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_info(torch.device("cpu")), "args": vars(args) | {"out": str(args.out)},
                                        "runs": runs, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
