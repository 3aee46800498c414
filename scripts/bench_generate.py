"""Prompt and decode tok/s: mlxkv's DirectEngine vs mlx-lm's generate loop, same weights, same prompt.

Runs alternate (mlx-lm, mlxkv, mlx-lm, mlxkv, ...) in one process under one BLAS; medians are compared.
mlx-lm's side is ``mlx_lm.generate.generate_step`` (the loop under ``mlx_lm.generate``) with mlx-lm's caches, on
the model ``mlx_lm.utils.load`` builds from the folder bench_common prepares (for a GGUF: the float32 folder
``mlxkv.gguf.convert(..., dequantize=True)`` writes); ours is ``DirectEngine.generate_tokens`` over a CachePool
of mlxkv's layouts, on the model ``mlxkv.models.load`` builds. Both greedy, both exactly ``--new-tokens`` steps
(no EOS stop); the warm-up checks that both produce the same tokens.

    python scripts/bench_generate.py                         # the reference model, SmolLM2-135M-Instruct
    python scripts/bench_generate.py --model demo            # the embedded demo model
    python scripts/bench_generate.py --model random --hidden 512 --layers 8   # a random-weight float32 llama
"""

from __future__ import annotations

import argparse
import statistics

from bench_common import (
    add_model_args,
    bench_model,
    describe,
    ensure_openblas,
    load_peer_model,
    print_header,
    timed_tokens,
)


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, random_shape="hidden 768, 12 layers, ~100M parameters")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    return parser, parser.parse_args()


def sides(ours, theirs, prompt: list[int], new_tokens: int) -> dict:
    """Both sides as ``name -> (tokens generator factory)``; each call starts a fresh generation."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens)
    engine = DirectEngine(ours, tokenizer=None)  # no tokenizer: no EOS stop, every run decodes new_tokens

    def mlx_lm_tokens():
        steps = generate_step(mx.array(prompt), theirs, max_tokens=new_tokens, prompt_cache=make_prompt_cache(theirs))
        return (int(t) for t, _ in steps)

    return {"mlx-lm": mlx_lm_tokens, "mlxkv": lambda: engine.generate_tokens(prompt, params)}


def main() -> None:
    parser, args = parse_args()
    blas = ensure_openblas()  # first: it may re-exec the script
    loaded, folder = bench_model(parser, args, hidden=768, layers=12)
    theirs = load_peer_model(folder, loaded.model)
    print_header(blas, describe(loaded), folder or "the same model object (random weights)")
    vocab = loaded.config["vocab_size"]
    prompt = [(31 * i + 7) % (vocab - 10) + 5 for i in range(args.prompt_tokens)]
    runs = sides(loaded.model, theirs, prompt, args.new_tokens)

    warm = {name: list(make()) for name, make in runs.items()}  # warm-up: compile, allocate
    same = warm["mlx-lm"] == warm["mlxkv"]
    print(f"greedy tokens identical on both sides: {'yes' if same else 'NO (the figures compare different work)'}")
    results = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, make in runs.items():
            results[name].append(timed_tokens(make(), args.new_tokens))

    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, {args.rounds} alternating rounds "
          "(median)")
    summary = {}
    for name, rs in results.items():
        ttft = statistics.median(r[0] for r in rs)
        decode = statistics.median(r[1] for r in rs)
        summary[name] = (args.prompt_tokens / ttft, decode)
        print(f"  {name:7s} prompt {args.prompt_tokens / ttft:8.1f} tok/s   decode {decode:7.2f} tok/s")
    print(f"ratio mlxkv/mlx-lm: prompt {summary['mlxkv'][0] / summary['mlx-lm'][0]:.3f}x, "
          f"decode {summary['mlxkv'][1] / summary['mlx-lm'][1]:.3f}x")


if __name__ == "__main__":
    main()
