"""Shared fixtures: model directories and a real `python -m app` server process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

# Without a GPU the Triton kernels are tested in Triton's interpreter. The switch
# is read when triton is first imported, and transformers imports triton, so it
# must be set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO.parent / "shared" / "models" / "stories260K"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from core.models.default_model import ensure_default_model

    return ensure_default_model(str(tmp_path_factory.mktemp("ringllm-cache")))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A seeded random Llama saved by transformers, with the project's byte-level tokenizer."""
    import torch
    import transformers

    from core.models.default_model import MODEL_CONFIG, write_tokenizer

    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=MODEL_CONFIG["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    write_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def stories_dir() -> str:
    if not (STORIES_DIR / "config.json").exists():
        pytest.skip(f"{STORIES_DIR} is absent (../shared/models not beside the repo)")
    return str(STORIES_DIR)


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def engine_pid(self) -> int:
        """The spawned EngineCore: the server's child running multiprocessing's spawn_main."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return int(pid)
        raise AssertionError(f"no EngineCore child among {children}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(args: list[str], log_path: Path, env: dict | None = None, timeout: float = 120.0) -> Server:
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not become healthy:\n{server.log()}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    servers: list[Server] = []

    def make(args: list[str], env: dict | None = None) -> Server:
        server = start_server(args, tmp_path / f"server{len(servers)}.log", env)
        servers.append(server)
        return server

    yield make
    for server in servers:
        stop_server(server)
