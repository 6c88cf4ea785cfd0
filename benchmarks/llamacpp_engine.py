#!/usr/bin/env python3
"""Real-model check of the llama.cpp engine: Gemma-3-270M GGUF, greedy, every method that needs no
hidden states against the engine's own ar; then tok/s of ar (llama.cpp engine) vs ar (torch native)
and pld/lookahead on each, interleaved over held-out-like prompts."""
import json
import statistics
import sys

import torch

import specwise

torch.set_num_threads(2)
NEW = int(sys.argv[1]) if len(sys.argv) > 1 else 128
prompts = [
    "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
    "The Industrial Revolution began in Britain in the late 18th century. Its causes included",
    "Question: What is the capital of Australia, and why was it chosen?\nAnswer:",
    "Translate to French: The weather is nice today and we are going to the beach.\nFrench:",
]
lt = specwise.load_target("gemma-3-270m", engine="llamacpp")
tt = specwise.load_target("gemma-3-270m")
print("llama.cpp repack:", lt.repack, "threads:", lt.threads, "torch weights:", tt.weights, flush=True)
rows = []
for p in prompts:
    ids = tt.encode(p).tolist()
    assert lt.encode(p).tolist() == ids
    for r in range(2):
        for name, target, method in [("llamacpp-ar", lt, "ar"), ("torch-ar", tt, "ar"), ("llamacpp-pld", lt, "pld"),
                                     ("torch-pld", tt, "pld"), ("llamacpp-lookahead", lt, "lookahead")]:
            res = specwise.generate(target, ids, method=method, max_new_tokens=NEW)
            rows.append(dict(prompt=p[:30], round=r, contender=name, tokens=res.token_ids,
                             tok_s=len(res.token_ids) / res.stats.wall_time_s, tau=res.stats.mean_accepted_length))
    ref = next(x["tokens"] for x in rows if x["prompt"] == p[:30] and x["contender"] == "llamacpp-ar")
    for x in rows:
        if x["prompt"] == p[:30] and x["contender"].startswith("llamacpp"):
            same = x["tokens"] == ref
            first = next((i for i, (a, b) in enumerate(zip(x["tokens"], ref)) if a != b), None)
            print(f"{p[:30]!r:35} {x['contender']:20} same-as-llamacpp-ar={same} first-diff={first} tok/s={x['tok_s']:.1f} tau={x['tau']:.2f}", flush=True)
summary = {}
for c in sorted({x["contender"] for x in rows}):
    summary[c] = statistics.median(x["tok_s"] for x in rows if x["contender"] == c)
print(json.dumps(summary, indent=1))
pairs = {}
for p in prompts:
    for r in range(2):
        get = lambda c: next(x["tok_s"] for x in rows if x["prompt"] == p[:30] and x["round"] == r and x["contender"] == c)
        pairs.setdefault("llamacpp-ar / torch-ar", []).append(get("llamacpp-ar") / get("torch-ar"))
        pairs.setdefault("llamacpp-pld / torch-pld", []).append(get("llamacpp-pld") / get("torch-pld"))
        pairs.setdefault("llamacpp-pld / llamacpp-ar", []).append(get("llamacpp-pld") / get("llamacpp-ar"))
print({k: round(statistics.median(v), 3) for k, v in pairs.items()})
json.dump(dict(rows=[{k: v for k, v in x.items() if k != "tokens"} for x in rows], summary=summary,
               paired_medians={k: statistics.median(v) for k, v in pairs.items()}), open(sys.argv[2] if len(sys.argv) > 2 else "llamacpp-engine-results.json", "w"), indent=1)
# the logit gap at every divergence from the engine's own ar (one-token steps)
for x in rows:
    if not x["contender"].startswith("llamacpp") or x["contender"] == "llamacpp-ar" or x["round"]:
        continue
    ref = next(y["tokens"] for y in rows if y["prompt"] == x["prompt"] and y["contender"] == "llamacpp-ar")
    first = next((i for i, (a, b) in enumerate(zip(x["tokens"], ref)) if a != b), None)
    if first is None:
        continue
    p = next(q for q in prompts if q[:30] == x["prompt"])
    ids = lt.encode(p).tolist() + ref[:first]
    logits = lt.forward(torch.tensor(ids), lt.new_cache(), num_logits=1).logits[-1]
    top = torch.topk(logits, 2)
    print(f"divergence {x['contender']} {x['prompt']!r} at {first}: ar chose {ref[first]}, spec chose {x['tokens'][first]}; "
          f"top-2 {top.indices.tolist()} gap {float(top.values[0] - top.values[1]):.4f}", flush=True)
