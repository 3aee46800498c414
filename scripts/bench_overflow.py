"""Quality of the --kv-overflow policies against the full cache: perplexity, greedy agreement, a retrieval probe.

The text is the prose that ships with Python (``pydoc_data/topics.py``, the help topics, concatenated) cut to
``--context`` tokens. Three facts are stated at its start and asked for at its end (teacher-forced: the probe
score is the share of answer tokens the model predicts as its top choice, and the answers' mean NLL). Every
policy runs the same text in chunks of ``--chunk`` tokens through the same model (the policy acts between
chunks: a chunk attends the budget's rows plus itself), at budgets that are shares of the context (``--budgets``,
default 25% and 50%). Reported per run:

- ppl: perplexity over every predicted token of the text (probe included), and its change against the full cache;
- agree: share of positions whose top token equals the full cache's;
- probe: answer tokens predicted right / all answer tokens, and the answers' mean NLL;
- evicted / restored: rows per layer, averaged over layers (offload: how many came back from host memory).

    python scripts/bench_overflow.py                        # SmolLM2-135M, 4096 tokens, budgets 25% and 50%
    python scripts/bench_overflow.py --context 1024 --chunk 64 --model demo   # a quick check of the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    add_model_args,
    bench_model,
    describe,
    ensure_openblas,
    print_header,
)

FACTS = [("The secret passphrase is", " violet harbor 7391."),
         ("The name of the captain's cat is", " Professor Marmalade."),
         ("The vault in the basement opens with the code", " 4 8 1 5 2.")]
POLICIES = ("window", "h2o", "offload")


def prose() -> str:
    """The help-topic prose that ships with Python, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def build_text(tokenizer, context: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``context`` tokens: the facts, prose, then the questions with their answers; and the ``(start, end)`` token
    ranges of the answers (the probe's targets)."""
    intro = "Remember these facts.\n" + "".join(f"{q}{a}\n" for q, a in FACTS) + "\n"
    head = tokenizer.encode(intro)
    tail, spans = [], []
    for q, a in FACTS:
        tail += tokenizer.encode(f"\nQuestion: {q.lower()}?\nAnswer: {q}", add_special_tokens=False)
        ans = tokenizer.encode(a, add_special_tokens=False)
        spans.append((len(tail), len(tail) + len(ans)))
        tail += ans
    body = tokenizer.encode(prose(), add_special_tokens=False)
    room = context - len(head) - len(tail)
    assert room > 0 and len(body) >= room, "--context too small for the probe, or the prose too short"
    start = len(head) + room
    return head + body[:room] + tail, [(start + a, start + b) for a, b in spans]


def evaluate(model, caches, tokens: list[int], chunk: int):
    """Next-token NLL ``(n - 1,)`` and top tokens ``(n - 1,)`` over ``tokens``, fed ``chunk`` tokens at a time."""
    import mlx.core as mx
    import numpy as np

    nll, top = [], []
    for a in range(0, len(tokens) - 1, chunk):
        b = min(a + chunk, len(tokens) - 1)
        logits = model(mx.array(tokens[a:b])[None], cache=caches)[0].astype(mx.float32)  # (L, vocab)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = mx.array(tokens[a + 1:b + 1])[:, None]  # (L, 1)
        step_nll = -mx.take_along_axis(logp, target, axis=-1)[:, 0]  # (L,)
        step_top = mx.argmax(logits, axis=-1)  # (L,)
        mx.eval(step_nll, step_top)
        nll.append(np.array(step_nll))
        top.append(np.array(step_top))
    return np.concatenate(nll), np.concatenate(top)


def main() -> None:
    blas = ensure_openblas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, "hidden 256, 4 layers")
    parser.add_argument("--context", type=int, default=4096, help="tokens of text (default 4096)")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per forward (default 64)")
    parser.add_argument("--budgets", default="0.25,0.5", help="budgets as shares of --context (default 0.25,0.5)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="policies to run (default: all three)")
    args = parser.parse_args()
    loaded, _ = bench_model(parser, args, hidden=256, layers=4, peer=False)
    import numpy as np

    from mlxkv.config import KvOverflowConfig
    from mlxkv.kv import each_layer_cache, make_caches

    print_header(blas, describe(loaded))
    tokens, spans = build_text(loaded.tokenizer, args.context)
    answer = np.concatenate([np.arange(a - 1, b - 1) for a, b in spans])  # predictions of the answer tokens
    shares = [float(s) for s in args.budgets.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    print(f"text: {len(tokens)} tokens of pydoc_data/topics.py prose, {len(FACTS)} facts at the start, asked at the "
          f"end ({answer.size} answer tokens); chunks of {args.chunk}\n")

    def run(overflow):
        caches = make_caches(loaded.model, overflow=overflow)
        start = time.perf_counter()
        nll, top = evaluate(loaded.model, caches, tokens, args.chunk)
        layers = [c for c in each_layer_cache(caches) if hasattr(c, "evicted")]
        moved = (np.mean([c.evicted for c in layers]), np.mean([c.restored for c in layers])) if layers else None
        return nll, top, time.perf_counter() - start, moved

    ref_nll, ref_top, ref_s, _ = run(None)
    ref_ppl = float(np.exp(ref_nll.mean()))
    rows = [("full cache", "-", ref_ppl, 0.0, 1.0, ref_top, ref_nll, ref_s, None)]
    for share in shares:
        budget = int(args.context * share)
        for policy in policies:
            nll, top, secs, moved = run(KvOverflowConfig(policy=policy, budget=budget))
            ppl = float(np.exp(nll.mean()))
            rows.append((policy, f"{budget} ({share:.0%})", ppl, ppl / ref_ppl - 1, float((top == ref_top).mean()),
                         top, nll, secs, moved))
            print(f"  done: {policy} at {budget} in {secs:.0f} s", file=sys.stderr)
    print("| policy | budget | ppl | vs full | greedy agree | probe right | probe NLL | evicted / restored | s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    targets = np.array(tokens[1:])[answer]
    for policy, budget, ppl, delta, agree, top, nll, secs, moved in rows:
        right = int((top[answer] == targets).sum())
        moves = "-" if moved is None else f"{moved[0]:.0f} / {moved[1]:.0f}"
        print(f"| {policy} | {budget} | {ppl:.3f} | {delta:+.2%} | {agree:.1%} | {right}/{answer.size} | "
              f"{nll[answer].mean():.2f} | {moves} | {secs:.0f} |")


if __name__ == "__main__":
    main()
