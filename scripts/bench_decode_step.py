"""Batched paged decode step time: B sequences, one decode forward per step through the batch views, as the engine
runs it (feed each row its token, build the views, forward, greedy tokens, evaluate, commit).

Each row's prompt is its own (no shared prefix) unless ``--shared`` tokens start every prompt. The figure is the
median step over ``--steps`` steps after a few warm-up steps, in wall time and in the process's CPU time (the
latter is less sensitive to other processes on a shared machine).

``--against DIR`` measures a second source tree (a checkout of mlxkv, e.g. ``git worktree add /tmp/base main``)
in the same run: each tree runs in its own worker process, model and pool loaded once, and the two alternate in
rounds of a few steps (which goes first alternating too) so machine noise hits both alike.

    python scripts/bench_decode_step.py --model random            # a random llama, hidden 256, 4 layers
    python scripts/bench_decode_step.py --against /tmp/base        # SmolLM2-135M (the reference model)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import add_model_args, bench_model, describe, ensure_openblas, print_header

ROUND = 5  # steps per tree per round


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, random_shape="hidden 256, 4 layers, 8 heads / 2 KV heads")
    parser.add_argument("--rows", type=int, default=8, help="sequences decoding together (default 8)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per row (default 256)")
    parser.add_argument("--shared", type=int, default=0, help="of which this many start every prompt (default 0)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per tree (default 40)")
    parser.add_argument("--against", type=Path, help="a second mlxkv source tree to time alternately")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser, parser.parse_args()


class Rows:
    """``rows`` paged sequences of one model, prefilled; :meth:`step` runs one batched decode step."""

    def __init__(self, model, rows: int, context: int, shared: int):
        import mlx.core as mx

        from mlxkv.config import KvCacheConfig
        from mlxkv.kv.store import CachePool

        self.mx, self.model = mx, model
        self.pool = CachePool(model, backend="paged", kv_config=KvCacheConfig(backend="paged"))
        prefix = [(13 * i) % 5000 + 100 for i in range(shared)]
        self.seqs, self.tokens = [], []
        for r in range(rows):
            prompt = prefix + [(7 * i + 31 * r) % 5000 + 100 for i in range(context - shared)]
            seq = self.pool.open(prompt=prompt)
            logits = model(mx.array(prompt[seq.num_cached:])[None], cache=seq.caches)
            mx.eval(logits)
            seq.commit()
            self.seqs.append(seq)
            self.tokens.append(int(mx.argmax(logits[0, -1]).item()))

    def step(self) -> tuple[float, float]:
        from mlxkv.kv import check_attended, make_batch_views

        mx = self.mx
        start, cpu = time.perf_counter(), time.process_time()
        for seq, t in zip(self.seqs, self.tokens):
            seq.feed([t])
        views = make_batch_views([s.caches for s in self.seqs])
        logits = self.model(mx.array(self.tokens, dtype=mx.uint32)[:, None], cache=views)[:, -1, :]  # (B, vocab)
        check_attended(views)
        tokens = mx.argmax(logits, axis=-1)  # (B,)
        mx.eval(tokens)
        for seq in self.seqs:
            seq.commit()
        self.tokens = tokens.tolist()
        return time.perf_counter() - start, time.process_time() - cpu


def worker(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Load, prefill, then answer ``run N`` lines with the N step times (JSON) until stdin closes."""
    loaded, _ = bench_model(parser, args, hidden=256, layers=4, heads=8, kv_heads=2, peer=False)
    rows = Rows(loaded.model, args.rows, args.context, args.shared)
    for _ in range(3):
        rows.step()
    import mlxkv

    print(json.dumps({"ready": describe(loaded), "mlxkv": str(Path(mlxkv.__file__).parent)}), flush=True)
    for line in sys.stdin:
        n = int(line.split()[1])
        print(json.dumps([rows.step() for _ in range(n)]), flush=True)


def start_worker(tree: Path) -> subprocess.Popen:
    argv = [a for a in sys.argv[1:] if a != "--against"]
    if "--against" in sys.argv:  # drop the option's value too
        i = sys.argv.index("--against")
        argv = sys.argv[1:i] + sys.argv[i + 2:]
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, __file__, *argv, "--worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=str(tree))
    return proc


def ask(proc: subprocess.Popen, n: int) -> list[list[float]]:
    proc.stdin.write(f"run {n}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    blas = ensure_openblas()
    parser, args = parse_args()
    if args.worker:
        return worker(parser, args)
    here = Path(__file__).resolve().parent.parent
    trees = {"this tree": here}
    if args.against is not None:
        trees = {f"against ({args.against})": args.against.resolve(), **trees}
    procs = {name: start_worker(tree) for name, tree in trees.items()}
    model_line, sources = "", []
    for proc in procs.values():
        ready = json.loads(proc.stdout.readline())
        model_line = ready["ready"]
        sources.append(ready["mlxkv"])
    print_header(blas, model_line)
    print("mlxkv from: " + ", ".join(sources))
    print(f"{args.rows} rows, {args.context}-token prompts ({args.shared} shared), {args.steps} steps per tree, "
          f"alternating rounds of {ROUND}")
    times: dict[str, list[list[float]]] = {name: [] for name in procs}  # per step: [wall, cpu] seconds
    order = list(procs)
    ratios: list[tuple[float, float]] = []  # per round, wall and CPU: this tree's median step over the other's
    while min(len(t) for t in times.values()) < args.steps:
        rounds = {}
        for name in order:
            rounds[name] = ask(procs[name], min(ROUND, args.steps - len(times[name])))
            times[name] += rounds[name]
        if len(rounds) == 2:
            ours, theirs = rounds["this tree"], next(v for k, v in rounds.items() if k != "this tree")
            ratios.append(tuple(statistics.median(s[i] for s in ours) / statistics.median(s[i] for s in theirs)
                                for i in (0, 1)))
        order.reverse()  # neither tree always goes first
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    for name, t in times.items():
        wall, cpu = sorted(s[0] for s in t), sorted(s[1] for s in t)
        print(f"{name:>40}: median step {statistics.median(wall) * 1e3:7.2f} ms wall "
              f"(p10 {wall[len(t) // 10] * 1e3:.2f}, p90 {wall[len(t) * 9 // 10] * 1e3:.2f}), "
              f"{statistics.median(cpu) * 1e3:7.2f} ms CPU")
    for i, kind in enumerate(("wall", "CPU")):
        if ratios:
            r = sorted(x[i] for x in ratios)
            print(f"{'this tree / against, ' + kind + ', by round':>40}: median {statistics.median(r):.3f}x over "
                  f"{len(r)} rounds (p25 {r[len(r) // 4]:.3f}, p75 {r[len(r) * 3 // 4]:.3f})")

if __name__ == "__main__":
    main()
