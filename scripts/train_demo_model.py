"""Train the small demo model shipped in ``mlxkv/demo_model/`` (offline, CPU, minutes).

A Llama-architecture model (mlx-lm's ``llama`` class) trained from scratch with MLX on the English
prose of ``pydoc_data.topics`` (the Python language reference that ships with every Python install),
with its own byte-level BPE tokenizer from ``testkit.tokenizer``. Whole topics are held out
for validation. Training stops at ``--steps`` or ``--minutes``, whichever comes first; the learning
rate follows a cosine over whichever budget is closer to running out. The checkpoint with the best
validation loss is written in float16 with config.json, tokenizer files, training.json and
TRAINING.md.

    python scripts/train_demo_model.py --minutes 24 --out mlxkv/demo_model
    python scripts/train_demo_model.py --probe                 # time 12 steps, print tokens/s

On Linux the mlx[cpu] wheel links the reference (netlib) BLAS: ~1 GFLOP/s for float32 matmuls on
the build machine. Preloading the system OpenBLAS made them ~25x faster there:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=2 python scripts/...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "mlxkv" / "demo_model")
    p.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget for training")
    p.add_argument("--steps", type=int, default=100_000, help="maximum optimizer steps")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ff", type=int, default=512, help="MLP intermediate size")
    p.add_argument("--context", type=int, default=256, help="training sequence length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--val-every-nth-topic", type=int, default=10, help="every n-th topic is held out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe", action="store_true", help="time 12 steps, print tokens/s, write nothing")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="run the step uncompiled")
    return p.parse_args(argv)


def model_config(args) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.ff,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4 * args.context,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float16",
    }


def token_streams(args):
    """(train ids, val ids): each topic is ``<s> text </s>``; every n-th topic (sorted keys) is val."""
    import numpy as np
    from testkit.tokenizer import corpus_documents, train_tokenizer

    tok = train_tokenizer(args.vocab)
    train, val = [], []
    for i, doc in enumerate(corpus_documents()):
        ids = tok.encode(doc).ids + [2]  # the post-processor puts <s> first
        (val if i % args.val_every_nth_topic == 0 else train).extend(ids)
    return np.array(train, dtype=np.int32), np.array(val, dtype=np.int32)


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    args = parse_args(argv)
    t_start = time.time()
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)

    train_ids, val_ids = token_streams(args)
    print(f"tokens: train {len(train_ids)}, val {len(val_ids)} (vocab {args.vocab})", flush=True)

    config = model_config(args)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"parameters: {n_params / 1e6:.2f} M", flush=True)

    T, B = args.context, args.batch

    def batch_at(stream, starts):
        x = np.stack([stream[s : s + T + 1] for s in starts])  # (B, T+1)
        return mx.array(x[:, :-1]), mx.array(x[:, 1:])

    def loss_fn(model, x, y):
        logits = model(x)  # (B, T, V)
        return nn.losses.cross_entropy(logits, y, reduction="mean")

    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=args.weight_decay, betas=[0.9, 0.95])
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    def train_step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    compiled = mx.compile(train_step, inputs=state, outputs=state) if args.compile else train_step

    val_starts = list(range(0, len(val_ids) - T - 1, T))

    def evaluate() -> float:
        total = 0.0
        for i in range(0, len(val_starts), B):
            x, y = batch_at(val_ids, val_starts[i : i + B])
            total += loss_fn(model, x, y).item() * x.shape[0]
        return total / len(val_starts)

    budget_s = args.minutes * 60.0
    max_steps = 12 if args.probe else args.steps
    t_train = time.time()
    log, best = [], (float("inf"), None, 0)
    ema = None
    step_i = 0
    while step_i < max_steps:
        elapsed = time.time() - t_train
        if not args.probe and elapsed >= budget_s:
            break
        frac = max(step_i / max_steps, elapsed / budget_s)
        if step_i < args.warmup:
            lr = args.lr * (step_i + 1) / args.warmup
        else:
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        optimizer.learning_rate = lr
        x, y = batch_at(train_ids, rng.integers(0, len(train_ids) - T - 1, size=B))
        loss = compiled(x, y)
        mx.eval(state)
        loss = loss.item()
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        step_i += 1
        if args.probe:
            print(f"probe step {step_i}: {time.time() - t_train:.1f}s loss {loss:.3f}", flush=True)
            if step_i == 2:
                t_probe = time.time()
        if not args.probe and (step_i % args.eval_every == 0):
            val = evaluate()
            el = time.time() - t_train
            tps = step_i * B * T / el
            log.append({"step": step_i, "train_loss_ema": round(ema, 4), "val_loss": round(val, 4), "lr": lr, "elapsed_s": round(el, 1)})
            print(f"step {step_i:6d}  train {ema:.3f}  val {val:.3f}  lr {lr:.2e}  {el:7.1f}s  {tps:.0f} tok/s", flush=True)
            if val < best[0]:
                best = (val, tree_map(lambda a: mx.array(a), model.parameters()), step_i)

    if args.probe:
        dt = time.time() - t_probe
        print(f"probe: {(step_i - 2) * B * T / dt:.0f} tokens/s, {dt / (step_i - 2) * 1000:.0f} ms/step")
        return 0

    train_seconds = time.time() - t_train
    final_val = evaluate()
    final = {"step": step_i, "train_loss_ema": round(ema, 4), "val_loss": round(final_val, 4)}
    print(f"final: {final}", flush=True)
    if final_val < best[0]:
        best = (final_val, model.parameters(), step_i)
    val_loss, params, best_step = best
    model.update(params)
    # round to the stored float16 values, but evaluate in float32: float16 matmuls on CPU are slow
    model.set_dtype(mx.float16)
    model.set_dtype(mx.float32)

    # losses of the saved (float16-rounded) weights: train on a fixed sample, val on all of it
    starts = np.random.default_rng(1).integers(0, len(train_ids) - T - 1, size=64)
    saved_train = sum(loss_fn(model, *batch_at(train_ids, starts[i : i + B])).item() for i in range(0, 64, B)) / (64 // B)
    saved_val = evaluate()
    model.set_dtype(mx.float16)
    write_folder(args, config, model, {
        "corpus": "pydoc_data.topics (Python " + platform.python_version() + " standard library), "
        f"{len(train_ids)} train / {len(val_ids)} val tokens; every {args.val_every_nth_topic}th topic held out",
        "command": " ".join(
            [f"{k}={os.environ[k]}" for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS") if os.environ.get(k)]
            + ["python scripts/train_demo_model.py"]
            + (sys.argv[1:] if argv is None else argv)
        ),
        "parameters": n_params,
        "steps": step_i,
        "saved_step": best_step,
        "train_seconds": round(train_seconds, 1),
        "tokens_seen": step_i * B * T,
        "final_train_loss_ema": round(ema, 4),
        "final_val_loss": round(final_val, 4),
        "saved_train_loss_float16": round(saved_train, 4),
        "saved_val_loss_float16": round(saved_val, 4),
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "log": log,
    })
    print(f"saved step {best_step}: train {saved_train:.3f} val {saved_val:.3f} (float16) -> {args.out}")
    print(f"total {time.time() - t_start:.0f}s")
    return 0


def write_folder(args, config: dict, model, record: dict) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config
    from testkit.tokenizer import write_tokenizer

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(dict(config), out / "config.json")
    write_tokenizer(out, vocab_size=args.vocab, model_max_length=config["max_position_embeddings"])
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "TRAINING.md").write_text(
        "# mlxkv demo model\n\n"
        "A tiny Llama-architecture model trained from scratch by `scripts/train_demo_model.py` on CPU, "
        "so that mlxkv has a real (non-random) model to demo and test with offline. It writes "
        "Python-reference-manual-flavoured English; it knows nothing else.\n\n"
        f"- corpus: {record['corpus']}\n"
        f"- command: `{record['command']}`\n"
        f"- parameters: {record['parameters'] / 1e6:.2f} M ({config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, {config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads, "
        f"vocab {config['vocab_size']}, tied embeddings), stored in float16\n"
        f"- training: {record['steps']} steps x {args.batch} x {args.context} tokens in {record['train_seconds']} s; "
        f"saved the best-validation checkpoint (step {record['saved_step']})\n"
        f"- losses of the saved float16 weights: train {record['saved_train_loss_float16']}, "
        f"val {record['saved_val_loss_float16']} (nats/token)\n\n"
        "Corpus license: the Python documentation text is under the PSF license (see "
        "https://docs.python.org/3/license.html).\n"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))  # testkit: the tokenizer trainer
    sys.exit(main())
