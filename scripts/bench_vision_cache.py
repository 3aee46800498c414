"""Second question about the same image: cached image tokens and time to first token, through `mlxkv serve`.

Builds a random-weight VLM (tests/testkit/vlm.py): ``--family gemma3``, whose images take ``--tokens`` tokens (a SigLIP
tower over ``--image-size`` pixels in 14-pixel patches), or ``qwen2_vl`` / ``qwen2_5_vl`` (M-RoPE positions), whose
image processor resizes each 400 x 300 picture to about ``--tokens`` tokens (2 x 2 merged 14-pixel patches each);
serves it on loopback, and for each of ``--rounds`` fresh images asks
a first question, then a second one about the same image, through the official openai client (streamed: the time to
the first content chunk). Prints each pair's TTFT, the second answer's cached prompt tokens, and the median ratio.

    .venv/bin/python scripts/bench_vision_cache.py --tokens 256 --image-size 448 --rounds 3
    .venv/bin/python scripts/bench_vision_cache.py --family qwen2_vl --tokens 256 --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def png(seed: int) -> str:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((300, 400, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def ttft(client, image: str, question: str) -> tuple[float, int]:
    """Seconds to the first streamed content chunk, and the answer's cached prompt tokens."""
    began = time.perf_counter()
    first, cached = None, -1
    stream = client.chat.completions.create(
        model="m", max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                               {"type": "text", "text": question}]}])
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - began
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=("gemma3", "qwen2_vl", "qwen2_5_vl"), default="gemma3")
    ap.add_argument("--tokens", type=int, default=256, help="image tokens (gemma3: a square number; qwen: about)")
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--vision-hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from testkit.run_config import run_config
    from testkit.serve_thread import openai_client, serve_in_thread
    from testkit.vlm import write_gemma3_vlm, write_qwen_vl

    from mlxkv.config import EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        if args.family == "gemma3":
            path = write_gemma3_vlm(Path(tmp) / "vlm", image_size=args.image_size, patch_size=14,
                                    tokens_per_image=args.tokens, vision_layers=args.vision_layers,
                                    vision_hidden=args.vision_hidden)
        else:
            path = write_qwen_vl(Path(tmp) / "vlm", model_type=args.family, patch_size=14, min_tokens=args.tokens,
                                 max_tokens=args.tokens, vision_layers=args.vision_layers,
                                 vision_hidden=args.vision_hidden)
        with serve_in_thread(run_config(str(path), engine=EngineConfig(max_sequences=2), kv_backend="paged")) as srv:
            client = openai_client(srv.url)
            ttft(client, png(999), "Warm up.")
            ratios = []
            for r in range(args.rounds):
                image = png(r)
                cold, _ = ttft(client, image, "What is in this picture?")
                warm, cached = ttft(client, image, "What colour is the top left corner?")
                ratios.append(cold / warm)
                print(f"round {r}: first question TTFT {cold * 1000:.1f} ms, second {warm * 1000:.1f} ms "
                      f"({cold / warm:.1f}x), second's cached prompt tokens {cached}")
            print(f"{args.family}: median TTFT ratio {statistics.median(ratios):.1f}x at {args.tokens} image tokens; "
                  f"stats: {srv.parts.engine.stats()['vision']}")


if __name__ == "__main__":
    main()
