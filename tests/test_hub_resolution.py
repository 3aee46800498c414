"""``--model`` resolution: real Hugging Face repo ids, malformed ids, local paths, and the hub path end to end.

The hub path runs without a network: :func:`populate_hf_cache` lays a tiny test model out in a Hugging Face cache
folder the way ``huggingface_hub`` leaves a download (``models--owner--name/{blobs,snapshots,refs,trees}``), and
``mlxkv generate`` / ``mlxkv serve`` load it by repo id with ``HF_HUB_OFFLINE=1``, so ``snapshot_download``
resolves it from the cache as it would after a real download.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import validate_repo_id
from mlxkv.cli.main import app
from testkit.serve_process import free_port, wait_for_health
from testkit.serve_thread import openai_client
from typer.testing import CliRunner

from mlxkv import models
from mlxkv.models import DOWNLOAD_PATTERNS, ModelLoadError, resolve_model_path

runner = CliRunner()

# Ids people pass to --model: dots, dashes, underscores, digits, upper case, digit-led owners.
REAL_IDS = [
    "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
    "meta-llama/Llama-3.2-1B-Instruct",
    "microsoft/Phi-3.5-mini-instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "Qwen/Qwen3.5-0.8B",
    "Qwen/Qwen2.5-Coder-7B-Instruct",
    "Qwen/Qwen3-0.6B",
    "mistralai/Mistral-7B-Instruct-v0.3",
    "google/gemma-3-1b-it",
    "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "mlx-community/Llama-3.2-3B-Instruct-4bit",
    "mlx-community/Meta-Llama-3.1-8B-Instruct-8bit",
    "mlx-community/Qwen3-30B-A3B-4bit-DWQ",
    "mlx-community/gemma-3-270m-it-bf16",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "stabilityai/stablelm-2-zephyr-1_6b",
    "01-ai/Yi-1.5-6B-Chat",
    "openai-community/gpt2",
    "microsoft/phi-4",
    "ibm-granite/granite-3.3-2b-instruct",
    "unsloth/Llama-3.2-1B-Instruct-GGUF",
    "allenai/OLMo-2-0425-1B-Instruct",
]

# (spec, fragment of the error): neither local nor an owner/name id the hub allows.
MALFORMED_IDS = [
    ("big-model", "a repo id is owner/name"),
    ("gpt2", "a repo id is owner/name"),
    ("owner/na me", "ASCII letters, digits"),
    ("café/model", "ASCII letters, digits"),
    ("owner/model!", "ASCII letters, digits"),
    ("owner/-model", "cannot start or end"),
    ("owner/model.", "cannot start or end"),
    ("owner/x--y", "'--' and '..'"),
    ("owner/x..y", "'--' and '..'"),
    ("owner/model.git", "'.git'"),
    ("owner/", "1 to 96 characters"),
    ("owner/" + "m" * 97, "1 to 96 characters"),
]

# Specs that can only be paths; none of them exists.
MISSING_PATHS = ["./my-model", "../models/llama", "/definitely/not/here", "~/no-such-model-4f2a", "models/llama/q4",
                 "model.gguf", "owner/model-Q4_K_M.gguf", "C:\\models\\llama"]


# ---------------------------------------------------------------------------------- the HF cache, hub layout
def _git_blob_sha1(data: bytes) -> str:
    """The git object id of a file's bytes: the hub's blob id, and the etag (blob name) of non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    """Whether the hub stores ``name`` with Git LFS (weights and binary tokenizers, as its .gitattributes do)."""
    return name.endswith((".safetensors", ".bin", ".gguf", ".model", ".tiktoken"))


def _tree_entry(name: str, data: bytes) -> tuple[str, dict]:
    """(blob name in the cache, tree-listing entry): LFS files are stored under their sha256, others under
    their git blob id; an LFS file's blob id is that of its pointer file."""
    if not _is_lfs(name):
        sha1 = _git_blob_sha1(data)
        return sha1, {"size": len(data), "blob_id": sha1}
    sha256 = hashlib.sha256(data).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
    return sha256, {"size": len(data), "blob_id": _git_blob_sha1(pointer), "lfs_sha256": sha256,
                    "lfs_size": len(data)}


def populate_hf_cache(cache_dir: Path, repo_id: str, model_dir: Path) -> Path:
    """Put the files of ``model_dir`` into the Hugging Face cache ``cache_dir`` as repo ``repo_id``, laid out
    as ``hf_hub_download`` / ``snapshot_download`` leave a download, and return the snapshot folder.

    ``models--owner--name/blobs/<etag>`` holds the bytes, ``snapshots/<commit>/<file>`` are relative symlinks to
    them, ``refs/main`` names the commit (no newline) and ``trees/<commit>.json`` is the cached tree listing the
    offline path checks a snapshot's completeness against; ``CACHEDIR.TAG`` marks the cache folder.
    """
    files = {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}
    entries = {name: _tree_entry(name, data) for name, data in files.items()}
    # A stand-in commit id: 40 hex digits that change with the content, as a commit's would.
    commit = hashlib.sha1(repo_id.encode() + b"".join(e[0].encode() for e in entries.values())).hexdigest()
    storage = Path(cache_dir) / hf_constants.REPO_ID_SEPARATOR.join(["models", *repo_id.split("/")])
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / entries[name][0]
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = snapshot / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        if not pointer.is_symlink():
            pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    tree = {"format_version": 1, "files": {name: entries[name][1] for name in sorted(entries)}}
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps(tree, indent=1))
    tag = Path(cache_dir) / "CACHEDIR.TAG"
    if not tag.exists():
        tag.write_text("Signature: 8a477f597d28d172789f06886806bc55\n"
                       "# This file is a cache directory tag created by huggingface_hub.\n")
    return snapshot


def offline_env(cache_dir: Path) -> dict[str, str]:
    """The environment of a subprocess that may use only the HF cache ``cache_dir``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache_dir)}
    env.pop("HF_HUB_ENABLE_HF_TRANSFER", None)
    return env


def use_offline_cache(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """Make this process use only ``cache_dir``: huggingface_hub reads its environment once, at import, into
    ``constants``, so those are patched along with the environment."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache_dir))


HUB_ID = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"  # the README's own example, served by the test llama


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, test_model_dir) -> Path:
    """A Hugging Face cache folder holding the test llama as ``HUB_ID`` and as ``meta-llama/Llama-3.2-1B``."""
    cache = tmp_path_factory.mktemp("hf_hub_cache")
    for repo_id in (HUB_ID, "meta-llama/Llama-3.2-1B-Instruct"):
        populate_hf_cache(cache, repo_id, test_model_dir("llama"))
    return cache


@pytest.fixture
def offline(monkeypatch, hub_cache) -> Path:
    """This test process resolves repo ids from ``hub_cache`` only."""
    use_offline_cache(monkeypatch, hub_cache)
    return hub_cache


# ---------------------------------------------------------------------------------- resolution rules
@pytest.fixture
def nowhere(tmp_path, monkeypatch) -> Path:
    """Run in an empty folder, so that no relative spec exists locally."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def downloads(monkeypatch) -> list[str]:
    """Record the repo ids handed to the downloader instead of downloading."""
    asked: list[str] = []

    def fake_download(repo_id: str, *, progress: bool, revision: str | None = None) -> Path:
        asked.append(repo_id)
        return Path("/snapshot")

    monkeypatch.setattr(models, "_download", fake_download)
    return asked


@pytest.mark.parametrize("repo_id", REAL_IDS)
def test_real_repo_ids_go_to_the_hub(repo_id, nowhere, downloads):
    assert resolve_model_path(repo_id, progress=False) == Path("/snapshot")
    assert downloads == [repo_id]
    validate_repo_id(repo_id)  # the hub's own validator agrees


@pytest.mark.parametrize("spec, fragment", MALFORMED_IDS)
def test_malformed_ids_say_why(spec, fragment, nowhere, downloads):
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path(spec, progress=False)
    message = str(err.value)
    assert message.startswith(f"model not found: {spec} is neither a local file or folder nor a Hugging Face repo id")
    assert fragment in message and "\n" not in message
    assert downloads == []


@pytest.mark.parametrize("spec", MISSING_PATHS)
def test_missing_paths_are_reported_as_paths(spec, nowhere, downloads):
    with pytest.raises(ModelLoadError, match="^model not found: no such file or folder: ") as err:
        resolve_model_path(spec, progress=False)
    assert str(err.value).endswith(spec) and downloads == []


def test_existing_local_paths_win_over_ids(nowhere, downloads, test_model_dir):
    import shutil

    shaped_like_id = Path("mlx-community/Qwen2.5-0.5B-Instruct-4bit")
    shutil.copytree(test_model_dir("llama"), nowhere / shaped_like_id)
    assert resolve_model_path(str(shaped_like_id)) == shaped_like_id
    assert resolve_model_path(f"./{shaped_like_id}") == shaped_like_id
    assert resolve_model_path(str(nowhere / shaped_like_id)) == nowhere / shaped_like_id
    assert downloads == []


def test_gguf_files_and_folders_holding_one(nowhere, downloads):
    gguf = nowhere / "one" / "tiny-Q4_K_M.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))  # resolution reads the magic bytes only
    assert resolve_model_path("one/tiny-Q4_K_M.gguf") == Path("one/tiny-Q4_K_M.gguf")
    assert resolve_model_path("one") == Path("one/tiny-Q4_K_M.gguf")
    (nowhere / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="neither a folder nor a GGUF file"):
        resolve_model_path("notes.txt")
    assert downloads == []


def test_home_relative_paths_expand(nowhere, downloads, monkeypatch, test_model_dir):
    monkeypatch.setenv("HOME", str(nowhere))
    (nowhere / "models").mkdir()
    (nowhere / "models" / "llama").symlink_to(test_model_dir("llama"))
    assert resolve_model_path("~/models/llama") == nowhere / "models" / "llama"
    assert downloads == []


# ---------------------------------------------------------------------------------- the hub path, offline
def test_the_cache_is_laid_out_as_huggingface_hub_lays_it_out(hub_cache, test_model_dir):
    info = huggingface_hub.scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    repo = next(r for r in info.repos if r.repo_id == HUB_ID)
    assert repo.repo_type == "model" and repo.refs.keys() == {"main"}
    (revision,) = repo.revisions
    assert len(revision.commit_hash) == 40 and revision.refs == {"main"}
    source = test_model_dir("llama")
    assert {f.file_name for f in revision.files} == {p.name for p in source.iterdir()}
    for f in revision.files:
        assert f.file_path.is_symlink() and f.blob_path.parent.name == "blobs"
        assert f.file_path.read_bytes() == (source / f.file_name).read_bytes()
    snapshot = huggingface_hub.snapshot_download(HUB_ID, cache_dir=hub_cache, local_files_only=True,
                                                 allow_patterns=DOWNLOAD_PATTERNS)
    assert Path(snapshot) == revision.snapshot_path


def test_repo_id_resolves_to_the_cached_snapshot_offline(offline):
    path = resolve_model_path(HUB_ID, progress=False)
    assert path.parent.name == "snapshots" and path.is_relative_to(offline)
    assert (path / "config.json").is_file()


def test_generate_on_a_cached_repo_id_equals_the_local_folder(offline, test_model_dir):
    args = ["generate", "--raw", "-n", "8", "Lists are mutable sequences"]
    by_id = runner.invoke(app, [*args, "-m", HUB_ID])
    by_path = runner.invoke(app, [*args, "-m", str(test_model_dir("llama"))])
    assert by_id.exit_code == 0, by_id.output
    assert by_id.stdout.strip() and by_id.stdout == by_path.stdout


def test_repo_id_not_in_the_cache_offline_is_one_line(offline):
    result = runner.invoke(app, ["generate", "-m", "Qwen/Qwen3.5-0.8B", "hi"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "error: Qwen/Qwen3.5-0.8B is not in the local Hugging Face cache and downloads are off or unreachable "
        "(HF_HUB_OFFLINE or no network)"]


def _mlxkv(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxkv", *args], capture_output=True, text=True, env=env,
                          timeout=300, **kwargs)


def test_subprocess_generate_on_a_cached_repo_id(hub_cache, tmp_path):
    proc = _mlxkv(["generate", "-m", "meta-llama/Llama-3.2-1B-Instruct", "-n", "6", "--verbose", "Hello"],
                  offline_env(hub_cache), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "tok/s" in proc.stderr


def test_subprocess_repo_id_not_cached_is_one_line(hub_cache, tmp_path):
    proc = _mlxkv(["generate", "-m", "microsoft/Phi-3.5-mini-instruct", "hi"], offline_env(hub_cache), cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: microsoft/Phi-3.5-mini-instruct is not in the local Hugging Face cache and downloads are off or "
        "unreachable (HF_HUB_OFFLINE or no network)"]


def stop_server(proc: subprocess.Popen, log: Path) -> None:
    """Interrupt the server's process group (as Ctrl-C does) and require a clean exit."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the server did not stop on SIGINT: {log.read_text()}")
    assert proc.returncode == 0, log.read_text()


@pytest.mark.server
def test_serve_a_cached_repo_id(hub_cache, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxkv", "serve", "-m", HUB_ID, "--port", str(port),
                                 "--max-sequences", "2", "--log-level", "warning"], env=offline_env(hub_cache),
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, proc, log)
        client = openai_client(base)
        assert [m.id for m in client.models.list().data] == [HUB_ID]
        reply = client.chat.completions.create(model=HUB_ID, max_tokens=4,
                                               messages=[{"role": "user", "content": "What is a tuple?"}])
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content is not None
    finally:
        stop_server(proc, log)
