"""The dtypes a loaded model computes in: half precision upcast on the CPU backend, quantized layers dequantized."""

from __future__ import annotations

from typing import Any


def upcast_on_cpu(model: Any) -> None:
    """On the CPU backend, run float16/bfloat16 weights, and quantized layers' scales and biases, as float32.

    float32 is MLX's fast CPU dtype (half-precision matmuls bypass BLAS there, and half-precision scales slow
    quantized matmuls down: SmolLM2-135M Q4_1 decodes at 4.8 tok/s with float16 scales, 5.8 with float32),
    and float32 arithmetic makes every KV path (dense SDPA, paged reference kernel) agree token for token.
    Packed quantized weights stay packed. GPUs keep the stored dtype, and so does the CPU under
    ``MLXKV_CPU_KEEP_DTYPE=1`` (to run the half-precision paths a GPU runs).
    """
    import mlx.core as mx
    from mlx.utils import tree_map

    from mlxkv.env import flags

    if mx.default_device() != mx.cpu or flags().cpu_keep_dtype:
        return
    halves = (mx.float16, mx.bfloat16)
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype in halves else p, model.parameters()))
    # Materialise now: a lazy cast is bound to this thread's stream (serve's engine thread could not evaluate it).
    mx.eval(model.parameters())


def check_runs_on_cpu(model: Any) -> None:
    """Refuse, on the CPU backend, a model whose unquantized experts (mlx-lm's ``SwitchLinear``) are float16/bfloat16
    (left so by ``MLXKV_CPU_KEEP_DTYPE=1``): MLX's CPU ``gather_mm`` runs float32 only, so its first forward fails.

    Raises:
        ValueError: naming the first such layer and the way out.
    """
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device() != mx.cpu:
        return
    for name, m in model.named_modules():
        if isinstance(m, SwitchLinear) and m.weight.dtype in (mx.float16, mx.bfloat16):
            dtype = str(m.weight.dtype).split(".")[-1]
            raise ValueError(f"MLXKV_CPU_KEEP_DTYPE=1: the model's experts ({name}) are {dtype}, which "
                             "MLX's CPU backend cannot run (gather_mm is float32 only); unset it to run them as "
                             "float32")


def dequantize_in_place(model: Any, config: dict) -> dict:
    """Replace quantized layers by float ones (mlx-lm's ``dequantize_model``), after upcasting their scales
    on the CPU backend so the weights come out in float32 (in the scales' dtype wherever the upcast keeps it);
    returns the config without its quantization."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    upcast_on_cpu(model)
    dequantize_model(model)
    mx.eval(model.parameters())  # materialise on this thread's stream, as the upcast does
    return {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
