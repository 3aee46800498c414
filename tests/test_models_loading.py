"""mlxkv.models.load: half-precision weights on CPU, usable from any thread (the server's engine thread)."""

import threading

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxkv.models import demo_model_path, load


def test_demo_model_loads_as_float32_on_cpu_and_runs_in_another_thread():
    loaded = load(None, progress=False)
    assert loaded.path == demo_model_path()
    dtypes = {p.dtype for _, p in tree_flatten(loaded.model.parameters())}
    if mx.default_device() == mx.cpu:
        assert dtypes == {mx.float32}
    result = {}

    def forward():
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                logits = loaded.model(mx.array([[1, 5, 9]]))  # (1, 3, vocab)
                mx.eval(logits)
                result["shape"] = logits.shape
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = repr(exc)

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join(60)
    assert "error" not in result, result.get("error")
    assert result["shape"][-1] == loaded.config["vocab_size"]
