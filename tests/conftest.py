"""Shared fixtures: model directories and a real `python -m app` server process; and each
test's tier, a marker named after its folder (unit, engine, server, equivalence, bench)."""

from __future__ import annotations

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

from core.models.default_model import DEFAULT_MODEL_DIR as STORIES_DIR  # noqa: E402 (after the Triton switch)
from tests.support.engines import MAX_NEW, hf_greedy, shared_prefix_prompts, tiny_config  # noqa: E402
from tests.support.servers import Server, start_server, stop_server  # noqa: E402

TIERS = ("unit", "engine", "server", "equivalence", "bench")
TESTS = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--alone", action="store_true",
                     help="run only the tests marked alone (make test's second run, after the parallel one)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``--alone`` skips importing the test modules that mark no test alone: most of them,
    and importing them all takes as long as the alone tests' run. A module marks one by
    writing ``pytest.mark.alone``; the marker itself still decides, below."""
    if config.getoption("--alone") and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return "pytest.mark.alone" not in collection_path.read_text()
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test in tests/<tier>/ with the tier's marker (``pytest -m unit``). Tests
    marked ``alone`` look at the whole machine's /dev/shm, where another worker's servers
    would show, or load the machine (a Ray cluster): pytest-xdist's workers leave them out,
    and ``--alone`` runs only them."""
    for item in items:
        folder = item.path.resolve().parent
        if folder.parent == TESTS and folder.name in TIERS:
            item.add_marker(folder.name)
    in_worker = "PYTEST_XDIST_WORKER" in os.environ
    if config.getoption("--alone") and in_worker:
        raise pytest.UsageError("--alone runs the tests marked alone by themselves: not with -n")
    if config.getoption("--alone") or in_worker:
        alone = {item: item.get_closest_marker("alone") is not None for item in items}
        config.hook.pytest_deselected(items=[item for item in items if alone[item] == in_worker])
        items[:] = [item for item in items if alone[item] != in_worker]


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
def llama(tmp_path_factory: pytest.TempPathFactory):
    """A seeded tiny Llama saved by transformers: (the transformers model, its directory)."""
    import transformers

    from core.models.random_model import write_tokenizer

    torch.manual_seed(4321)
    model = transformers.LlamaForCausalLM(tiny_config("llama")).eval().float()
    path = tmp_path_factory.mktemp("llama-features")
    model.save_pretrained(path)
    write_tokenizer(path)
    return model, str(path)


@pytest.fixture(scope="session")
def reference(llama):
    """transformers' greedy continuation of every shared-prefix prompt."""
    model, _ = llama
    prompts = shared_prefix_prompts(model.config.vocab_size)
    return prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="session")
def stories_dir() -> str:
    """The embedded default model, stories260K, as packaged."""
    return str(STORIES_DIR)


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


@pytest.fixture(scope="module")
def module_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """``server_factory`` for servers shared by a whole test module (its ``server`` fixture)."""
    servers: list[Server] = []

    def make(args: list[str]) -> Server:
        server = start_server(args, tmp_path_factory.mktemp("server") / "server.log")
        servers.append(server)
        return server

    yield make
    for server in servers:
        stop_server(server)
