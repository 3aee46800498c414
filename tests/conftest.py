"""Shared pytest fixtures: tiny random-weight test models written to disk once per test run.

Parametrize over architectures with ``from testkit.archs import ARCH_NAMES``.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from pathlib import Path
from typing import Callable

import pytest
from testkit import real_model
from testkit.archs import ARCH_NAMES

__all__ = ["ARCH_NAMES"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``real_model`` are skipped, with the way to run them, when SmolLM2's GGUF file is missing."""
    if real_model.available():
        return
    skip = pytest.mark.skip(reason=real_model.MISSING)
    for item in items:
        if item.get_closest_marker("real_model") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_flags():
    """Each test starts and ends with the MLXKV_* flags parsed from the environment as it then is: flags are
    parsed once (mlxkv.env.flags), so a test that changes one calls ``mlxkv.env.reload`` itself, and the
    change does not outlive it (this teardown runs after monkeypatch has restored the environment)."""
    from mlxkv import env

    env.reload()
    yield
    env.reload()


@pytest.fixture(autouse=True, scope="module")
def _release_module_memory():
    """After each module (its own fixtures torn down first: this one is set up first), what its servers and models
    held goes back to the system. FastAPI keeps every route function it classified in module-level LRU caches
    (``fastapi.dependencies.models``), and a route's closure holds its server's engine, pool and model: one test
    server on the real model would otherwise keep ~1 GB for the rest of the run. Then MLX's cache of freed buffers
    is released, and glibc returns the freed heap to the system (it keeps it otherwise)."""
    yield
    import gc

    import mlx.core as mx
    from fastapi.dependencies import models as fastapi_models

    for name in dir(fastapi_models):
        cached = getattr(fastapi_models, name)
        if name.endswith("_cached") and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    gc.collect()
    mx.clear_cache()
    if sys.platform == "linux":
        ctypes.CDLL(None).malloc_trim(0)


@pytest.fixture(autouse=True, scope="session")
def _models_list(tmp_path_factory):
    """The list of GGUF files ``mlxkv models`` shows is the test run's own, never the user's (subprocesses too)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("MLXKV_MODELS_FILE", str(tmp_path_factory.mktemp("mlxkv-home") / "models.json"))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """Factory ``test_model_dir(arch, seed=0) -> Path``: the folder of that test model, written on
    first use and reused for the rest of the session. Load it with ``mlx_lm.utils.load(str(path))``."""
    from testkit.models import write_test_model

    root = tmp_path_factory.mktemp("test_models")
    built: dict[tuple[str, int], Path] = {}

    def get(arch: str, seed: int = 0) -> Path:
        key = (arch, seed)
        if key not in built:
            built[key] = write_test_model(arch, root / f"{arch}-seed{seed}", seed=seed)
        return built[key]

    return get


@pytest.fixture(scope="session")
def fresh_install(tmp_path_factory):
    """mlxkv installed from its wheel into a venv that holds only its runtime dependencies, as ``pip install .``
    leaves a user's (``testkit/fresh_install.py``); built once per test run. Run its CLI through ``.env()``."""
    from testkit.fresh_install import make_fresh_install

    return make_fresh_install(tmp_path_factory.mktemp("fresh-install"))


@pytest.fixture(scope="module")
def model():
    """The random-weight test llama with mlxkv's attention hook installed (built once per test module; a module
    may define its own ``model`` fixture instead)."""
    from testkit.archs import build_model

    from mlxkv.kv.layouts.attention_hook import install_attention_hook

    m = build_model("llama")[0]
    install_attention_hook(m)
    return m


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct loaded by mlxkv from its GGUF, dequantized to float32 (MLX's fast CPU dtype), once per
    run for every real-model test that only reads it."""
    from mlxkv.models import load

    return load(str(real_model.GGUF), dequantize=True)


@pytest.fixture(scope="session")
def smollm2_f32_folder(tmp_path_factory) -> Path:
    """The GGUF converted by ``mlxkv convert --dequantize`` (once per run): the float32 folder mlx-lm loads."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("smollm2") / "f32"
    subprocess.run([sys.executable, "-m", "mlxkv", "convert", "--dequantize", str(real_model.GGUF), str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def llama_dir(test_model_dir) -> str:
    """The random-weight test llama's folder, as the string ``-m`` takes (read-only: shared by the whole run)."""
    return str(test_model_dir("llama"))


@pytest.fixture(scope="session")
def served(llama_dir):
    """Factory ``served(**options) -> ServerThread``: the test llama served in this process with these options,
    started on first use and shared, for the rest of the run, by every test that asks for the same ones. Share a
    server only between tests that leave it as they found it and assert nothing that another module's traffic
    changes (absolute counters, cache contents, events); give the others a server of their own
    (:func:`testkit.serve_thread.serve_in_thread`).

    Options: ``max_sequences`` (4) and ``max_queue_depth`` (16) of the engine; ``model_name`` ("tiny-llama"),
    ``api_key``, ``admin_key`` of :func:`mlxkv.server.runner.build`; the rest are ``run_config``'s
    (``kv_backend`` "paged", ``chat_template``, ...). ``parts`` holds the engine and the loaded model.
    """
    from testkit.run_config import run_config
    from testkit.serve_thread import serve_in_thread

    from mlxkv.config import EngineConfig

    with contextlib.ExitStack() as stack:
        servers: dict[tuple, object] = {}

        def get(*, max_sequences: int = 4, max_queue_depth: int = 16, model_name: str = "tiny-llama",
                api_key: str | None = None, admin_key: str | None = None, kv_backend: str = "paged", **options):
            key = (max_sequences, max_queue_depth, model_name, api_key, admin_key, kv_backend,
                   tuple(sorted(options.items())))
            if key not in servers:
                engine = EngineConfig(max_sequences=max_sequences, max_queue_depth=max_queue_depth)
                config = run_config(llama_dir, engine=engine, kv_backend=kv_backend, **options)
                servers[key] = stack.enter_context(serve_in_thread(config, model_name=model_name, api_key=api_key,
                                                                   admin_key=admin_key))
            return servers[key]

        yield get
