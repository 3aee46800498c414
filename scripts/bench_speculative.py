"""Decode tok/s with and without speculative decoding: same target model, same prompt, one process.

Modes, run alternately (plain, lookup, draft, self-draft, plain, ...), medians compared with plain decoding:

- ``plain``: DirectEngine, no speculation (the baseline).
- ``lookup``: prompt-lookup drafting (n-gram match over prompt + output; no second model) on the engine step, as
  ``mlxkv generate --prompt-lookup`` runs it (the scheduler's verification rows, adaptive draft length).
- ``lookup-rounds``: the same drafter in :class:`SpeculativeEngine`'s rounds (a fixed draft length; what
  ``--prompt-lookup`` runs over recurrent layers).
- ``draft``: a draft model: ``--draft-model`` (same vocabulary as the target), or with ``--model random`` a
  smaller random llama. Random weights agree with nothing: expect near-zero acceptance there; that measures
  what speculation costs when it fails.
- ``self-draft``: the target drafts for itself: acceptance is 100% (the upper bound) but every draft token
  costs a full target forward, so this measures the verify/rewind machinery, not a realistic speed-up.

The prompt is a repeated block of tokens. A trained model (the reference model, the demo model) tends to
continue such a repetition, which prompt lookup then predicts well: the high-acceptance regime (what a trained
model reaches on repetitive text such as code edits or quoting), not a typical acceptance. Random-weight
models do not copy the repetition; with mlx-lm's initialisation a random llama decodes one token over and over
(the distinct-token count is printed), which prompt lookup predicts perfectly and a different random draft
sometimes matches. ``--spread-init`` re-draws random weights as the test models do (gain 2): outputs stop
repeating and acceptance drops to about zero, which shows what failed speculation costs. Every mode's greedy
output is checked to equal plain decoding's.

    python scripts/bench_speculative.py                          # the reference model (lookup + self-draft)
    python scripts/bench_speculative.py --model demo             # the embedded demo model
    python scripts/bench_speculative.py --model random           # random llama ~100M target, ~10M draft
    python scripts/bench_speculative.py --model random --spread-init   # the same, non-repeating outputs
"""

from __future__ import annotations

import argparse
import statistics

from bench_common import (
    add_model_args,
    bench_model,
    default_model,
    describe,
    ensure_openblas,
    load_bench_model,
    print_header,
    random_loaded,
    timed_tokens,
)


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, random_shape="hidden 768, 12 layers, ~100M parameters")
    parser.add_argument("--draft-model", default=None, metavar="SPEC",
                        help="a draft model for the 'draft' mode (what --model takes, but not 'random'); with "
                             "--model random the draft is a random llama (--draft-hidden, --draft-layers)")
    parser.add_argument("--draft-hidden", type=int, default=256, help="--model random only")
    parser.add_argument("--draft-layers", type=int, default=2, help="--model random only")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--ngram-size", type=int, default=3)
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens in the repeated prompt block")
    parser.add_argument("--repeats", type=int, default=4, help="times the block is repeated in the prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spread-init", action="store_true", help="--model random only: re-draw the random "
                                                                   "weights with gain 2")
    return parser, parser.parse_args()


def load_models(parser, args):
    """``(target LoadedModel, draft LoadedModel or None)`` as the options ask."""
    is_random = (args.model or default_model()) == "random"
    if args.draft_model == "random" or (is_random and args.draft_model is not None):
        parser.error("--draft-model takes a real model (a random target gets a random draft by itself)")
    if not is_random and args.spread_init:
        parser.error("--spread-init re-draws random weights: it needs --model random")
    target, _ = bench_model(parser, args, hidden=768, layers=12, peer=False)
    if is_random:
        draft = random_loaded(args.draft_hidden, args.draft_layers, target.config["vocab_size"], heads=4,
                              kv_heads=2, seed=1)
        if args.spread_init:
            spread(target.model, draft.model)
        return target, draft
    if args.draft_model is None:
        return target, None
    draft, _ = load_bench_model(args.draft_model, dequantize=not args.keep_quantized, peer=False)
    if draft.config["vocab_size"] != target.config["vocab_size"]:
        parser.error(f"the draft's vocabulary ({draft.config['vocab_size']}) is not the target's "
                     f"({target.config['vocab_size']})")
    return target, draft


def spread(*models) -> None:
    """Re-draw the models' weights as the test models are drawn (gain 2)."""
    import mlx.core as mx
    from testkit.archs import _init_weights

    for seed, m in enumerate(models):
        _init_weights(m, seed)
        mx.eval(m.parameters())


def make_engines(model, draft, k: int, ngram: int) -> dict:
    """Every mode's engine over the target (``draft`` adds the 'draft' mode)."""
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.drafters import DraftModelDrafter, PromptLookupDrafter
    from mlxkv.engine.speculation import Speculation
    from mlxkv.engine.speculative import SpeculativeEngine

    engines = {"plain": DirectEngine(model, tokenizer=None),  # no tokenizer: no EOS stop
               "lookup": DirectEngine(model, None, speculation=Speculation(num_draft_tokens=k, ngram_size=ngram)),
               "lookup-rounds": SpeculativeEngine(model, None, PromptLookupDrafter(ngram), num_draft_tokens=k)}
    if draft is not None:
        engines["draft"] = SpeculativeEngine(model, None, DraftModelDrafter(draft), num_draft_tokens=k)
    engines["self-draft"] = SpeculativeEngine(model, None, DraftModelDrafter(model), num_draft_tokens=k)
    return engines


def main() -> None:
    parser, args = parse_args()
    blas = ensure_openblas()  # first: it may re-exec the script
    target, draft = load_models(parser, args)
    print_header(blas, describe(target))
    if draft is not None:
        print(f"draft: {describe(draft)}")
    from mlxkv.engine.sampling import SamplingParams

    vocab = target.config["vocab_size"]
    block = [(31 * i + 7) % (vocab - 10) + 5 for i in range(args.block_tokens)]
    prompt = block * args.repeats
    params = SamplingParams(max_tokens=args.new_tokens)
    k = args.num_draft_tokens
    engines = make_engines(target.model, draft.model if draft else None, k, args.ngram_size)

    outputs = {name: list(e.generate_tokens(prompt, params)) for name, e in engines.items()}  # warm-up
    same = all(out == outputs["plain"] for out in outputs.values())
    results: dict[str, list] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            results[name].append(timed_tokens(engine.generate_tokens(prompt, params), args.new_tokens))

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
        print(f"  {name:13s} decode {decode:7.2f} tok/s   x{decode / base:5.2f} vs plain{extra}")


if __name__ == "__main__":
    main()
