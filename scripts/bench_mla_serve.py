"""MLA KV bytes per token under ``mlxkv serve``: absorbed latent pages (MLXKV_MLA_ABSORBED=1) vs the standard paged
layout (mlx-lm's own DeepSeek attention and cache), on one random-weight DeepSeek model with V2-Lite attention shapes
(16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128; ``--layers`` layers, as scripts/bench_mla.py).

Each variant is one ``mlxkv serve`` subprocess with the same ``--kv-cache-budget``. Reported from its
/v1/cache/stats: the tokens the budget holds (``kv_blocks.capacity_tokens``),
the sequences of ``--context`` tokens that fit; the bytes a token takes (``kv_blocks.bytes_per_block`` over
``block_size``); then ``--clients`` concurrent greedy completions sharing a prompt
prefix (their aggregate decode tok/s, batched steps, prefix-hit tokens), and whether both variants answer the
same text. ``--model`` is refused: the reference and demo models are llamas, without MLA.

    python scripts/bench_mla_serve.py                             # deepseek_v2, 4 layers, 64 MiB budget
    python scripts/bench_mla_serve.py --arch deepseek_v3 --budget-mib 32 --clients 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import check_refused_model, ensure_openblas, print_header, refuse_model_arg
from bench_mla import SHAPE
from bench_serve import free_port, start_server, stop_server

VARIANTS = {"standard paged": "0", "absorbed latent pages": "1"}
NO_MODEL = ("this benchmark builds a random DeepSeek model with V2-Lite attention shapes (--arch, --layers); "
            "the reference model and the demo model are llamas, without MLA")
SHARED = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun " * 4


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def run_variant(folder: Path, flag: str, args: argparse.Namespace) -> dict:
    """One server under ``MLXKV_MLA_ABSORBED=flag``: its capacity, then the concurrent completions."""
    import httpx

    os.environ["MLXKV_MLA_ABSORBED"] = flag
    port = free_port()
    proc = start_server("mlxkv", str(folder), port, args.clients, kv_budget=args.budget_mib << 20)
    url = f"http://127.0.0.1:{port}"
    try:
        blocks = httpx.get(url + "/v1/cache/stats", timeout=30).json()["kv_blocks"]
        complete(url, SHARED, 1)  # warm-up: caches the shared prefix
        prompts = [SHARED + f"question {i} is" for i in range(args.clients)]
        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            answers = list(pool.map(lambda p: complete(url, p, args.max_tokens), prompts))
        seconds = time.perf_counter() - start
        stats = httpx.get(url + "/v1/cache/stats", timeout=30).json()
    finally:
        stop_server(proc)
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return dict(capacity=blocks["capacity_tokens"], per_token=blocks["bytes_per_block"] / blocks["block_size"],
                tok_s=tokens / seconds,
                texts=[a["choices"][0]["text"] for a in answers], batched=stats["batched_steps_total"],
                hits=sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers),
                prompt_tokens=sum(a["usage"]["prompt_tokens"] for a in answers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="deepseek_v2", choices=["deepseek_v2", "deepseek_v3"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget-mib", type=int, default=64, help="--kv-cache-budget of both servers, in MiB")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence for the 'sequences fit' row")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    refuse_model_arg(parser, NO_MODEL)
    args = parser.parse_args()
    check_refused_model(parser, args, NO_MODEL)
    blas = ensure_openblas()

    from testkit.archs import TEST_VOCAB_SIZE
    from testkit.deepseek import build_deepseek
    from testkit.models import write_model

    # The test tokenizer's vocabulary (every sampled id decodes); dense MLPs in every layer through
    # first_k_dense_replace, as n_routed_experts=None does in bench_mla.py (a saved config must keep it an int).
    shape = {**SHAPE, "vocab_size": TEST_VOCAB_SIZE, "n_routed_experts": 4, "first_k_dense_replace": args.layers}
    model, config = build_deepseek(args.arch, num_hidden_layers=args.layers, **shape)
    R, dr = config["kv_lora_rank"], config["qk_rope_head_dim"]
    H, dn, dv = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    print_header(blas, f"random-weight {args.arch} ({args.layers} layers, H={H} kv_lora_rank={R} qk_nope={dn} "
                       f"qk_rope={dr} v_head={dv}), float32")
    print(f"expected B/token/layer: latent (R+dr)x4 = {(R + dr) * 4}, per-head K/V Hx(dn+dr+dv)x4 = "
          f"{H * (dn + dr + dv) * 4}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(model, config, Path(tmp) / args.arch)
        del model
        for name, flag in VARIANTS.items():
            results[name] = run_variant(folder, flag, args)
    print(f"--kv-cache-budget {args.budget_mib} MiB, {args.clients} concurrent clients x {args.max_tokens} tokens "
          "(shared prefix, greedy)")
    for name, r in results.items():
        per_token = r["per_token"]
        print(f"  {name:22s}: {per_token:8.0f} B/token ({per_token / args.layers:6.0f} per layer)  "
              f"{r['capacity']:7d} tokens  {r['capacity'] // args.context:4d} sequences of {args.context}  "
              f"decode {r['tok_s']:6.1f} tok/s  batched steps {r['batched']}  "
              f"prefix hits {r['hits']}/{r['prompt_tokens']} prompt tokens")
    std, lat = results["standard paged"], results["absorbed latent pages"]
    print(f"ratio absorbed/standard: {lat['per_token'] / std['per_token']:.3f}x the bytes per token, "
          f"{lat['capacity'] / std['capacity']:.2f}x the tokens per budget; same greedy text: "
          f"{lat['texts'] == std['texts']}")


if __name__ == "__main__":
    main()
