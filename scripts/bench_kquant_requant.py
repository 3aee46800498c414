"""How far ``MLXKV_GGUF_REQUANTIZE``'s 8-bit form of Q6_K (or Q2_K) tensors moves a real model from its own weights.

The GGUF's weights (dequantized to float32) have every matrix whose rows are a multiple of 256 quantized to
``--kind`` by the tests' K-quant quantizer (llama.cpp's layout; SmolLM2-135M: the 30 ``ffn_down``, the other
matrices are 576 wide). Three versions of those matrices are compared on greedy chat answers and first-step logits:
the K-quant weights exactly (what mlxkv loads by default: float), the same re-quantized at 8 bits in groups of 32
(``MLXKV_GGUF_REQUANTIZE=1``), and the exact weights rounded to float16 (what a GPU's float copy holds). Reported:
RMS weight error of the 8-bit form (% of the weights' RMS), the K-quant's own error against the float weights, and
per prompt the tokens each version keeps on the exact version's greedy path and its logit error.

    python scripts/bench_kquant_requant.py                        # SmolLM2-135M (the reference GGUF), Q6_K
    python scripts/bench_kquant_requant.py --kind Q2_K --tokens 32
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import default_model, ensure_openblas

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a Python list is.",
           "Give three tips for sleeping well.", "What is 12 times 7?", "Tell me a short story about a robot."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the reference SmolLM2 GGUF)")
    parser.add_argument("--kind", default="Q6_K", choices=["Q6_K", "Q2_K"])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    args = parser.parse_args()
    print(f"BLAS: {ensure_openblas()}")
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load as mlx_lm_load
    from testkit.kquant_quantize import quantize

    from mlxkv.gguf.kquants import decode, requantize

    model_path = args.model or default_model()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "float"
        subprocess.run([sys.executable, "-m", "mlxkv", "convert", "--dequantize", model_path, str(folder)], check=True,
                       capture_output=True)
        model, tokenizer = mlx_lm_load(str(folder))
    versions: dict[str, dict] = {"exact": {}, "8-bit": {}, "float16": {}}
    errors = []
    for name, w in nn.utils.tree_flatten(model.parameters()):
        if w.ndim != 2 or w.shape[1] % 256 or "embed" in name:
            continue
        a = np.array(w)
        exact = decode(args.kind, quantize(a, args.kind), *a.shape).dequantize()
        packed, scales, biases, bits = requantize(mx.array(exact), 8)
        eight = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=32, bits=bits))
        versions["exact"][name], versions["8-bit"][name] = mx.array(exact), mx.array(eight)
        versions["float16"][name] = mx.array(exact.astype(np.float16).astype(np.float32))
        errors.append((np.sqrt(((eight - exact) ** 2).mean()) / exact.std(), np.sqrt(((exact - a) ** 2).mean()) / a.std()))
    print(f"model {model_path}: {len(errors)} matrices as {args.kind}; 8-bit form's RMS error "
          f"{np.mean([e for e, _ in errors]) * 100:.3f}% of the weights' RMS; {args.kind}'s own error against the "
          f"float weights {np.mean([o for _, o in errors]) * 100:.2f}%")
    runs = {}
    for label, weights in versions.items():
        model.update(nn.utils.tree_unflatten(list(weights.items())))
        runs[label] = []
        for p in PROMPTS:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=args.tokens)]
            runs[label].append((tokens, model(mx.array([prompt]))[0]))
    for label in ("8-bit", "float16"):
        for p, (want, want_logits), (got, logits) in zip(PROMPTS, runs["exact"], runs[label]):
            kept = next((k for k, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
            top = (mx.abs(logits - want_logits).max() / mx.abs(want_logits).max()).item()
            rms = (mx.sqrt(((logits - want_logits) ** 2).mean()) / mx.sqrt((want_logits ** 2).mean())).item()
            print(f"{label:8s} {p[:34]!r:38s} greedy path kept {kept:3d}/{len(want)}  logit error: largest "
                  f"{top * 100:.3f}% of the largest logit, RMS {rms * 100:.3f}%")


if __name__ == "__main__":
    main()
