"""Greedy replay of an agentic run's reference replies (``benchmarks/agentic.py``'s ``turns.jsonl``):
each drafter proposes at every step, in the order the run served the turns (so a drafter that
learns from earlier requests sees what it would have), and the accepted drafts are the longest
tree path the reply continues (exactly what greedy verification accepts), at a fixed budget. τ per
drafter configuration, without running the model; the reply's tokens are the chat template's
rendering of it (an approximation of the generated ones).

    python benchmarks/agentic_replay.py RUN_DIR [BUDGET] [METHOD:KEY=VALUE;...]...
"""
import json
import sys
from types import SimpleNamespace

import torch

import specwise
from specwise.drafters.base import METHODS
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import DraftContext, StepFeedback

run = sys.argv[1]
budget = int(sys.argv[2]) if len(sys.argv) > 2 else 4
tok = specwise.load_target("qwen2.5-coder-1.5b-instruct", engine="llamacpp")
convs = {c["id"]: c for c in json.load(open(f"{run}/conversations.json"))}
rows = [json.loads(line) for line in open(f"{run}/turns.jsonl")]
refs = {}
for r in rows:
    if "reply" in r:
        refs[(r["conversation"], r["turn"])] = r["reply"]

# each turn as (prompt ids, reply ids), in served order
turns = []
for cid, conv in convs.items():
    if cid == "warm-up":
        continue
    msgs = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
    for i, t in enumerate(conv["turns"]):
        if (cid, i) not in refs:
            break
        msgs.append({"role": "tool", "content": t["tool_result"], "tool_call_id": "call_0"} if "tool_result" in t
                    else {"role": "user", "content": t["user"]})
        prompt = tok.encode_chat(msgs, tools=conv.get("tools")).tolist()
        reply = refs[(cid, i)]
        full = tok.encode_chat(msgs + [reply], tools=conv.get("tools")).tolist()
        # the reply's tokens: what the template renders for it after the prompt (approximation)
        out = full[len(prompt):]
        turns.append((conv["kind"], t["turn"], prompt, out))
        msgs.append(reply)

fake = SimpleNamespace(eos_token_ids=tok.eos_token_ids, max_context=tok.max_context, device=torch.device("cpu"),
                       name="replay")

def accept(proposal, rest):
    toks = proposal.tokens.tolist()
    if not toks:
        return 0
    parents = proposal.parents.tolist() if proposal.parents is not None else list(range(len(toks)))
    best = 0
    depth = {0: 0}
    ok = {0: True}
    for i, (t, p) in enumerate(zip(toks, parents)):
        node = i + 1
        d = depth[p] + 1
        depth[node] = d
        ok[node] = ok[p] and d <= len(rest) and rest[d - 1] == t
        if ok[node]:
            best = max(best, d)
    return best

def run_config(spec):
    name, options = spec
    # a fresh target object per config: the shared index lives on it
    target = SimpleNamespace(**vars(fake))
    drafter = METHODS.get(name).factory(target, METHODS.get(name).make_config(**options))
    per_kind = {}
    for kind, turn_kind, prompt, out in turns:
        ctx_ids = torch.tensor(prompt + out[:1])
        state = drafter.start(DraftContext(ctx_ids, 0, SamplingConfig(), None, len(prompt)))
        i, steps = 1, 1
        while i < len(out):
            ids = torch.tensor(prompt + out[:i])
            p = drafter.propose(state, DraftContext(ids, min(budget, len(out) - i - 1) if len(out) - i - 1 > 0 else 0,
                                                    SamplingConfig(), None, len(ids) - 1))
            a = accept(p, out[i:]) if len(out) - i - 1 > 0 else 0
            i += a + 1
            steps += 1
            drafter.observe(state, StepFeedback(torch.tensor(prompt + out[:i]), len(p.tokens), a, len(prompt) + i - 1))
        drafter.finish(state)
        drafter.learn(torch.tensor(prompt + out), len(prompt))
        k = per_kind.setdefault(turn_kind, [0, 0])
        k[0] += len(out)
        k[1] += steps
    tot = [sum(v[0] for v in per_kind.values()), sum(v[1] for v in per_kind.values())]
    return tot[0] / tot[1], {k: round(v[0] / v[1], 2) for k, v in per_kind.items()}

configs = [("pld", {}), ("suffix", {"across_requests": False}), ("suffix", {})]
for extra in sys.argv[3:]:
    n, _, o = extra.partition(":")
    configs.append((n, dict(kv.split("=") for kv in o.split(";")) if o else {}))
for spec in configs:
    opts = {k: (float(v) if "." in str(v) else int(v) if str(v).isdigit() else (v == "True") if v in ("True", "False") else v) for k, v in spec[1].items()}
    tau, kinds = run_config((spec[0], opts))
    print(f"{spec[0]} {spec[1]}: tau {tau:.3f} {kinds}", flush=True)
