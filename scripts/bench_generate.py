"""Prompt and decode tok/s: mlxkv's DirectEngine vs mlx-lm's generate loop, same model, same prompt.

Runs alternate (mlx-lm, mlxkv, mlx-lm, mlxkv, ...) in one process under one BLAS; medians are compared.
mlx-lm's side is ``mlx_lm.generate.generate_step`` (the loop under ``mlx_lm.generate``) with mlx-lm's caches;
ours is ``DirectEngine.generate_tokens`` over a CachePool of mlxkv's layouts. Both greedy.

    python scripts/bench_generate.py                 # random-weight float32 llama, ~100M parameters
    python scripts/bench_generate.py --model demo    # the embedded demo model
"""

from __future__ import annotations

import argparse
import statistics

from bench_common import ensure_openblas, random_llama, timed_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="'demo', a local folder, or omitted for a random llama")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    blas = ensure_openblas()

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.models import load

    if args.model is None:
        vocab = 32000
        model, n_params = random_llama(args.hidden, args.layers, vocab)
        label = f"random-weight llama float32, hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.0f}M params"
    else:
        loaded = load(None if args.model == "demo" else args.model, progress=True)
        model = loaded.model
        vocab = loaded.config["vocab_size"]
        label = f"{loaded.name} ({loaded.model_type})"
    from mlxkv.cache.hook import install_attention_hook

    install_attention_hook(model)  # what mlxkv.models.load does; mlx-lm's caches fall through to its SDPA
    prompt = [(31 * i + 7) % (vocab - 10) + 5 for i in range(args.prompt_tokens)]
    params = SamplingParams(max_tokens=args.new_tokens)
    engine = DirectEngine(model, tokenizer=None)

    def run_mlx_lm():
        cache = make_prompt_cache(model)
        steps = generate_step(mx.array(prompt), model, max_tokens=args.new_tokens, prompt_cache=cache)
        return timed_tokens((t for t, _ in steps), args.new_tokens)

    def run_mlxkv():
        return timed_tokens(engine.generate_tokens(prompt, params), args.new_tokens)

    run_mlx_lm(), run_mlxkv()  # warm-up: compile, allocate
    results = {"mlx-lm": [], "mlxkv": []}
    for _ in range(args.rounds):
        results["mlx-lm"].append(run_mlx_lm())
        results["mlxkv"].append(run_mlxkv())

    print(f"model: {label}")
    print(f"BLAS: {blas}; MLX {mx.__version__}, device {mx.default_device()}")
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, {args.rounds} alternating rounds (median)")
    summary = {}
    for name, runs in results.items():
        ttft = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        summary[name] = (args.prompt_tokens / ttft, decode)
        print(f"  {name:7s} prompt {args.prompt_tokens / ttft:8.1f} tok/s   decode {decode:7.2f} tok/s")
    print(f"ratio mlxkv/mlx-lm: prompt {summary['mlxkv'][0] / summary['mlx-lm'][0]:.3f}x, "
          f"decode {summary['mlxkv'][1] / summary['mlx-lm'][1]:.3f}x")


if __name__ == "__main__":
    main()
