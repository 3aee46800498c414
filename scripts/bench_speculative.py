"""Decode tok/s with and without speculative decoding: same target model, same prompt, one process.

Modes, run alternately (plain, lookup, draft, self-draft, plain, ...), medians compared with plain decoding:

- ``plain``: DirectEngine, no speculation (the baseline).
- ``lookup``: prompt-lookup drafting (n-gram match over prompt + output; no second model).
- ``draft``: a smaller random llama as draft model. Random weights agree with nothing: expect near-zero
  acceptance; this measures what speculation costs when it fails.
- ``self-draft``: the target drafts for itself: acceptance is 100% (the upper bound) but every draft token
  costs a full target forward, so this measures the verify/rewind machinery, not a realistic speed-up.

The prompt is a repeated block of tokens. Random-weight models do not continue a repetition by copying
it. With mlx-lm's initialisation a random llama decodes one token over and over (the distinct-token count
is printed), which prompt lookup predicts perfectly and a different random draft sometimes matches: that
run shows the high-acceptance regime (what a trained model reaches on repetitive text such as code edits
or quoting), not a typical acceptance. ``--spread-init`` re-draws the weights as the test models do (gain
2): outputs stop repeating and acceptance drops to about zero, which shows what failed speculation costs.
Every mode's greedy output is checked to equal plain decoding's.

    python scripts/bench_speculative.py                   # random llama ~100M target, ~10M draft
    python scripts/bench_speculative.py --spread-init     # the same, non-repeating outputs
    python scripts/bench_speculative.py --model demo      # the embedded demo model (lookup + self-draft)
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
    parser.add_argument("--draft-hidden", type=int, default=256)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--ngram-size", type=int, default=3)
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens in the repeated prompt block")
    parser.add_argument("--repeats", type=int, default=4, help="times the block is repeated in the prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spread-init", action="store_true", help="re-draw random weights with gain 2")
    args = parser.parse_args()
    blas = ensure_openblas()

    import mlx.core as mx

    from mlxkv.cache.hook import install_attention_hook
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.drafters import DraftModelDrafter, PromptLookupDrafter
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.speculative import SpeculativeEngine
    from mlxkv.models import load

    draft = None
    if args.model is None:
        vocab = 32000
        model, n_params = random_llama(args.hidden, args.layers, vocab)
        draft, d_params = random_llama(args.draft_hidden, args.draft_layers, vocab, heads=4, kv_heads=2, seed=1)
        label = (f"random-weight llama float32, hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.0f}M "
                 f"params; draft hidden {args.draft_hidden}, {args.draft_layers} layers, {d_params / 1e6:.0f}M")
        if args.spread_init:
            from mlxkv.testing.archs import _init_weights

            for seed, m in enumerate((model, draft)):
                _init_weights(m, seed)
                mx.eval(m.parameters())
            label += "; weights re-drawn with gain 2 (--spread-init)"
    else:
        loaded = load(None if args.model == "demo" else args.model, progress=True)
        model, vocab = loaded.model, loaded.config["vocab_size"]
        label = f"{loaded.name} ({loaded.model_type}); no separate draft model"
    for m in (model, draft):
        if m is not None:
            install_attention_hook(m)  # what mlxkv.models.load does
    block = [(31 * i + 7) % (vocab - 10) + 5 for i in range(args.block_tokens)]
    prompt = block * args.repeats
    params = SamplingParams(max_tokens=args.new_tokens)
    k = args.num_draft_tokens
    engines = {"plain": DirectEngine(model, tokenizer=None),
               "lookup": SpeculativeEngine(model, None, PromptLookupDrafter(args.ngram_size), num_draft_tokens=k)}
    if draft is not None:
        engines["draft"] = SpeculativeEngine(model, None, DraftModelDrafter(draft), num_draft_tokens=k)
    engines["self-draft"] = SpeculativeEngine(model, None, DraftModelDrafter(model), num_draft_tokens=k)

    outputs = {name: list(e.generate_tokens(prompt, params)) for name, e in engines.items()}  # warm-up
    same = all(out == outputs["plain"] for out in outputs.values())
    results: dict[str, list] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            results[name].append(timed_tokens(engine.generate_tokens(prompt, params), args.new_tokens))

    print(f"model: {label}")
    print(f"BLAS: {blas}; MLX {mx.__version__}, device {mx.default_device()}")
    print(f"prompt {len(prompt)} tokens ({args.repeats} x {args.block_tokens}-token block), {args.new_tokens} new "
          f"tokens, {k} draft tokens, n-gram {args.ngram_size}, {args.rounds} alternating rounds (median), greedy")
    print(f"greedy output identical to plain decoding in every mode: {'yes' if same else 'NO'}; "
          f"{len(set(outputs['plain']))} distinct tokens in {args.new_tokens}")
    base = statistics.median(r[1] for r in results["plain"])
    for name, engine in engines.items():
        decode = statistics.median(r[1] for r in results[name])
        stats = engine.last_stats
        extra = ""
        if name != "plain":
            extra = (f"   drafted {stats.drafted_tokens:3d}, accepted {stats.acceptance_rate:5.1%}, "
                     f"{stats.tokens_per_forward:4.2f} tokens/target forward")
        print(f"  {name:10s} decode {decode:7.2f} tok/s   x{decode / base:5.2f} vs plain{extra}")


if __name__ == "__main__":
    main()
