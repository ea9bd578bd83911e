"""Shared fixtures: model directories and a real `python -m app` server process."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels are tested in Triton's interpreter. The switch
# is read when triton is first imported, and transformers imports triton, so it
# must be set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.server import REPO, ManagedServer  # noqa: E402, F401 (after the Triton switch; REPO for tests)
from core.models.default_model import DEFAULT_MODEL_DIR as STORIES_DIR  # noqa: E402
from shm.tensors import TensorPool, TensorPoolReader, TensorPoolWriter  # noqa: E402


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from core.models.random_model import ensure_random_model

    return ensure_random_model(str(tmp_path_factory.mktemp("ringllm-cache")))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A seeded random Llama saved by transformers, with the project's byte-level tokenizer."""
    import torch
    import transformers

    from core.models.random_model import MODEL_CONFIG, write_tokenizer

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
    """The embedded default model, stories260K, as packaged."""
    return str(STORIES_DIR)


class Server(ManagedServer):
    """A real ``python -m app`` subprocess (bench's launcher) plus what tests look at."""

    def engine_pid(self) -> int:
        """The spawned EngineCore: the server's child running multiprocessing's spawn_main."""
        assert self.proc is not None
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


def start_server(args: list[str], log_path: Path, timeout: float = 120.0) -> Server:
    server = Server(args, log_path, timeout)
    try:
        return server.start()
    except BaseException:
        server.stop()
        raise


def stop_server(server: Server) -> None:
    server.stop()


@contextlib.contextmanager
def tensor_pool_pair(capacity: int) -> Iterator[tuple[TensorPoolWriter, TensorPoolReader]]:
    """A producer's and a consumer's view of one pool, as two processes would hold them."""
    pool = TensorPool.create(capacity)
    peer = TensorPool.attach(pool.name)
    pool.unlink()
    try:
        yield TensorPoolWriter(pool), TensorPoolReader(peer)
    finally:
        gc.collect()
        peer.close()
        pool.close()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    servers: list[Server] = []

    def make(args: list[str]) -> Server:
        server = start_server(args, tmp_path / f"server{len(servers)}.log")
        servers.append(server)
        return server

    yield make
    for server in servers:
        stop_server(server)
