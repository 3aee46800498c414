"""MLA cache bytes per token and decode tok/s: mlx-lm as built vs absorbed MLA (MLXKV_MLA_ABSORBED=1).

One random-weight float32 DeepSeek model (DeepSeek-V2-Lite attention shapes: 16 heads, kv_lora_rank 512,
qk_nope 128, qk_rope 64, v_head 128; 4 layers, hidden 512, dense MLP, so it runs in minutes on 2 CPU cores).
``apply_mla`` builds the absorbed attention modules over the *same* weights; the bench points the layers
at mlx-lm's modules (on mlx-lm's caches) or the absorbed ones (on latent caches, with and without split-KV)
and alternates the variants round by round. Also times a 4-token speculative verification step (then
trimmed back), the multi-token case where mlx-lm re-expands K/V over the whole cache. ``--model`` is refused:
the real and demo models are llamas, without the MLA attention measured here.

    python scripts/bench_mla.py                          # deepseek_v2, contexts 1024 and 4096
    python scripts/bench_mla.py --arch deepseek_v3 --contexts 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_common import (
    check_refused_model,
    describe_model,
    ensure_openblas,
    print_header,
    refuse_model_arg,
)

# V2-Lite attention shapes; a small hidden size and a dense MLP (no experts) keep the weights every step
# reads small, so the step time shows the attention and its cache rather than the feed-forward.
SHAPE = dict(hidden_size=512, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=1024,
             n_routed_experts=None, vocab_size=4096, max_position_embeddings=16384)
VARIANTS = ("mlx-lm", "absorbed", "absorbed+split")
NO_MODEL = ("this benchmark builds a random DeepSeek model with V2-Lite attention shapes (--arch, --layers); "
            "the reference model and the demo model are llamas, without MLA")


def prefill(model, caches, n_tokens, chunk=512):
    import mlx.core as mx

    tokens = [(31 * i + 7) % 4000 + 5 for i in range(n_tokens)]
    for start in range(0, n_tokens, chunk):  # chunked so mlx-lm's score matrix stays small
        logits = model(mx.array([tokens[start:start + chunk]]), cache=caches)
        mx.eval(logits)
    return int(mx.argmax(logits[0, -1]).item())


def decode_rate(model, caches, token, steps, warmup=2):
    """Greedy decode; tokens per second over ``steps`` after ``warmup`` steps."""
    import mlx.core as mx

    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        logits = model(mx.array([[token]]), cache=caches)
        token = int(mx.argmax(logits[0, -1]).item())
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return steps / sum(times)


def verify_ms(model, caches, rounds=3):
    """Median ms of a 4-token verification call, each followed by trim(4) (a fully rejected draft)."""
    import mlx.core as mx

    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        mx.eval(model(mx.array([[11, 12, 13, 14]]), cache=caches))
        times.append(time.perf_counter() - start)
        for c in caches:
            assert c.trim(4) == 4
    return statistics.median(times[1:]) * 1e3


def use(model, variant, originals, swapped):
    """Point every layer at the attention module of ``variant`` (the weights are shared by both)."""
    for layer, orig, mla in zip(model.layers, originals, swapped):
        layer.self_attn = orig if variant == "mlx-lm" else mla
        mla.split_kv = variant == "absorbed+split"


def measure(model, contexts, steps, rounds, originals, swapped):
    """Per context: prefill once per variant, then alternate variants ``rounds`` times; medians."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.mla import make_mla_caches

    results = {name: {} for name in VARIANTS}
    for ctx in contexts:
        state = {}
        for name, factory in (("mlx-lm", make_prompt_cache), ("absorbed", make_mla_caches)):
            use(model, name, originals, swapped)
            caches = factory(model)
            token = prefill(model, caches, ctx)
            state[name] = (caches, token, sum(c.nbytes for c in caches) / ctx)  # ctx: whole 256-row steps
        state["absorbed+split"] = state["absorbed"]  # the same latent cache; only the attention differs
        runs = {name: [] for name in VARIANTS}
        for _ in range(rounds):
            for name in VARIANTS:
                use(model, name, originals, swapped)
                caches, token, _ = state[name]
                rate = decode_rate(model, caches, token, steps)
                for c in caches:
                    c.trim(c.offset - ctx)
                runs[name].append((rate, verify_ms(model, caches)))
        for name in VARIANTS:
            results[name][ctx] = dict(bytes=state[name][2], tok_s=statistics.median(r[0] for r in runs[name]),
                                      verify_ms=statistics.median(r[1] for r in runs[name]))
        del state
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="deepseek_v2", choices=["deepseek_v2", "deepseek_v3"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    refuse_model_arg(parser, NO_MODEL)
    args = parser.parse_args()
    check_refused_model(parser, args, NO_MODEL)
    if any(c % 256 for c in args.contexts):
        parser.error("contexts must be multiples of 256")
    blas = ensure_openblas()

    from testkit.deepseek import build_deepseek

    from mlxkv.mla import apply_mla

    model, config = build_deepseek(args.arch, num_hidden_layers=args.layers, **SHAPE)
    R, dr = config["kv_lora_rank"], config["qk_rope_head_dim"]
    H, dn, dv = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    print_header(blas, describe_model(model, f"random-weight {args.arch} ({args.layers} layers, H={H} "
                                             f"kv_lora_rank={R} qk_nope={dn} qk_rope={dr} v_head={dv})"))
    originals = [layer.self_attn for layer in model.layers]
    os.environ["MLXKV_MLA_ABSORBED"] = "1"  # what a user sets; env.py reads it in apply_mla
    assert apply_mla(model) == list(range(args.layers))
    swapped = [layer.self_attn for layer in model.layers]
    print(f"{args.steps} decode steps x {args.rounds} alternating rounds (medians); split chunk "
          f"{swapped[0].split_chunk} keys", flush=True)
    results = measure(model, args.contexts, args.steps, args.rounds, originals, swapped)

    print(f"expected bytes/token/layer: latent (R+dr)x4 = {(R + dr) * 4}, per-head K/V Hx(dn+dr+dv)x4 = "
          f"{H * (dn + dr + dv) * 4}")
    for name, rows in results.items():
        for ctx, r in rows.items():
            print(f"  {name:15s} ctx {ctx:5d}: {r['bytes'] / args.layers:8.0f} B/token/layer  "
                  f"decode {r['tok_s']:7.2f} tok/s  verify(4) {r['verify_ms']:7.1f} ms")
    base = results["mlx-lm"]
    for name in ("absorbed", "absorbed+split"):
        for ctx in args.contexts:
            r = results[name][ctx]
            print(f"ratio {name}/mlx-lm ctx {ctx}: memory {r['bytes'] / base[ctx]['bytes']:.3f}x, decode "
                  f"{r['tok_s'] / base[ctx]['tok_s']:.2f}x, verify(4) speedup "
                  f"{base[ctx]['verify_ms'] / r['verify_ms']:.2f}x")


if __name__ == "__main__":
    main()
