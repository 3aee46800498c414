"""Draft-model proposals in shared forwards vs one draft forward per row: ``mlxkv serve --draft-model``.

Three servers in this process on a random-weight llama (``--hidden``, ``--layers``): the draft model drafting every
speculating row in shared batched forwards, the same with its draft forwards run row by row, and no speculation.
The draft is the model itself (every proposal accepted) unless ``--draft-layers N`` cuts it to its first N layers.
``--clients`` concurrent greedy requests of ``--max-tokens`` tokens per round; the servers take turns for
``--rounds`` rounds; the median round's aggregate tok/s (the first round, a warm-up, left out) and the draft's
forwards and rows per forward are printed.

    python scripts/bench_draft_batching.py                 # 4 clients, 10 rounds
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from testkit.archs import build_from_config, get_config  # noqa: E402
from testkit.draft_models import first_layers  # noqa: E402
from testkit.models import write_model  # noqa: E402
from testkit.run_config import run_config  # noqa: E402
from testkit.serve_thread import openai_client, serve_in_thread  # noqa: E402

from mlxkv.config import EngineConfig  # noqa: E402


def one_round(url: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Every prompt as a concurrent request; aggregate output tok/s."""
    client = openai_client(url)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: client.completions.create(
            model="m", prompt=p, max_tokens=max_tokens, temperature=0), prompts))
    return sum(r.usage.completion_tokens for r in responses) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, help="the draft: the model's first N layers (default: itself)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    config = {**get_config("llama"), "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": 4, "num_key_value_heads": 2}
    prompts = [[a, a + 1, a + 2] * 8 for a in range(73, 73 + 37 * args.clients, 37)]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(*build_from_config(config), Path(tmp) / "model")
        draft = model if args.draft_layers is None else first_layers(model, args.draft_layers, Path(tmp) / "draft")
        engine = EngineConfig(max_sequences=args.clients)
        spec = dict(draft_model=str(draft), num_draft_tokens=args.num_draft_tokens)
        with serve_in_thread(run_config(str(model), engine=engine, kv_backend="paged", **spec)) as shared, \
                serve_in_thread(run_config(str(model), engine=engine, kv_backend="paged", **spec)) as per_row, \
                serve_in_thread(run_config(str(model), engine=engine, kv_backend="paged")) as plain:
            per_row.parts.engine.speculation.draft.batched = False
            servers = {"shared draft forwards": shared, "one draft forward per row": per_row, "no speculation": plain}
            rates: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, srv in servers.items():
                    rates[name].append(one_round(srv.url, prompts, args.max_tokens))
            print(f"random llama hidden {args.hidden}, {args.layers} layers; draft: "
                  f"{'itself' if args.draft_layers is None else f'its first {args.draft_layers} layers'}; "
                  f"{args.clients} clients x {args.max_tokens} tokens, K={args.num_draft_tokens}, {args.rounds} rounds")
            for name, srv in servers.items():
                line = f"{name:26s} {statistics.median(rates[name][1:]):7.1f} tok/s"
                spec_stats = srv.parts.engine.stats()["speculative"]
                if spec_stats["enabled"]:
                    d = spec_stats["draft_model"]
                    line += (f"  acceptance {spec_stats['acceptance_rate']:.2f}, {d['forwards']} draft forwards, "
                             f"{d['rows_per_forward']:.2f} rows per forward")
                print(line)


if __name__ == "__main__":
    main()
