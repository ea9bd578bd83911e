"""LoRA adapters on a real server, through the official openai client: requests pick an adapter
by model name and get peft's greedy tokens while base and adapter requests run together;
/v1/models lists the adapters under their parent; adapters are loaded and unloaded at run time
behind the API key; an adapter in use is not unloaded (409); a bad adapter is a 400, or exit 2
at start-up, naming the problem."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from core.config import LoRAModule
from tests.support.http import MODEL, assert_openai_error, make_engine, running_server
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model

pytestmark = pytest.mark.slow

KEY = "sk-lora"
MAX_NEW = 10
PROMPTS = [[1, 403, 261, 259, 120, 398], [1, 338, 409, 470, 29, 374, 261], [1, 115, 280, 259, 365]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_dir):
    root = tmp_path_factory.mktemp("lora-server")
    paths = {
        "tales": make_adapter(stories_dir, root / "tales", seed=21),
        "fables": make_adapter(stories_dir, root / "fables", seed=22, targets=["q_proj", "v_proj", "down_proj"],
                               rank=4, alpha=8, rslora=True, std=0.3),
        "late": make_adapter(stories_dir, root / "late", seed=23, rank=16, alpha=16),
        "too-big": make_adapter(stories_dir, root / "too-big", seed=24, rank=32),
    }
    reference = {}
    for name in (None, "tales", "fables", "late"):
        model = peft_model(stories_dir, None if name is None else paths[name])
        reference[name] = [peft_greedy(model, p, MAX_NEW) for p in PROMPTS]
        assert name is None or reference[name] != reference[None]
    return paths, reference


@pytest.fixture(scope="module")
def server(module_server_factory, adapters):
    paths, _ = adapters
    fables = json.dumps({"name": "fables", "path": paths["fables"], "base_model_name": "stories"})
    return module_server_factory([
        "--served-model-name", "stories", "--dtype", "float32", "--kv-cache-dtype", "float32", "--api-key", KEY, "--block-size", "4",
        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3", "--lora-modules", f"tales={paths['tales']}",
        fables, "--allow-runtime-lora-updating",
    ])


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


async def _tokens(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int = MAX_NEW):
    response = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert response.model == model
    return [int(t.removeprefix("token_id:")) for t in response.choices[0].logprobs.tokens]


def _post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def test_models_lists_the_adapters_under_their_parent(server, adapters):
    paths, _ = adapters
    models = {m.id: m for m in openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY).models.list().data}
    assert set(models) == {"stories", "tales", "fables"}
    assert models["tales"].parent == "stories" and models["tales"].root == paths["tales"]
    assert models["fables"].parent == "stories"
    assert models["stories"].parent is None


async def test_base_and_adapters_together_equal_peft(server, adapters):
    _, reference = adapters
    client = _client(server)
    jobs = [(name, p) for _ in range(2) for name in ("stories", "tales", "fables") for p in range(len(PROMPTS))]
    results = await asyncio.gather(*(_tokens(client, name, PROMPTS[p]) for name, p in jobs))
    for (name, p), tokens in zip(jobs, results):
        assert tokens == reference[None if name == "stories" else name][p], (name, p)
    chat = await client.chat.completions.create(
        model="tales", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=5
    )
    assert chat.model == "tales" and chat.usage.completion_tokens >= 1


async def test_load_and_unload_at_run_time(server, adapters):
    paths, reference = adapters
    client = _client(server)
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]}, key=None)\
        .status_code == 401
    response = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]})
    assert response.status_code == 200 and "'late' added" in response.text
    assert [await _tokens(client, "late", p) for p in PROMPTS] == reference["late"]
    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]})
    assert_openai_error(again, 400, "BadRequestError", "has already been loaded")
    response = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert response.status_code == 200 and "'late' removed" in response.text
    with pytest.raises(openai.NotFoundError, match="The model `late` does not exist"):
        await _tokens(client, "late", PROMPTS[0])
    assert_openai_error(_post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}), 404, "NotFoundError",
                        "cannot be found")
    # Loaded again under the same name: correct again (a new number: nothing stale from the cache).
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]}).status_code == 200
    assert await _tokens(client, "late", PROMPTS[0]) == reference["late"][0]
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200


def test_bad_adapters_are_400s_naming_the_problem(server, adapters, tmp_path):
    paths, _ = adapters
    cases = [
        ({"lora_name": "big", "lora_path": paths["too-big"]}, "rank 32 is above --max-lora-rank 16"),
        ({"lora_name": "gone", "lora_path": str(tmp_path / "nothing")}, "no such directory"),
        ({"lora_name": "stories", "lora_path": paths["late"]}, "is the base model's name"),
        ({"lora_name": "x", "lora_path": paths["late"], "extra": 1}, "extra"),
    ]
    for body, needle in cases:
        assert_openai_error(_post(server, "/v1/load_lora_adapter", body), 400, "BadRequestError", needle)
    assert {m["id"] for m in httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            .json()["data"]} == {"stories", "tales", "fables"}


async def test_an_adapter_in_use_is_not_unloaded(server, adapters):
    _, reference = adapters
    client = _client(server)
    stream = await client.completions.create(
        model="tales", prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    first = await stream.__anext__()  # running now
    assert first.model == "tales"
    refused = await asyncio.to_thread(_post, server, "/v1/unload_lora_adapter", {"lora_name": "tales"})
    assert_openai_error(refused, 409, "ConflictError", "in use by 1 unfinished request")
    async for _ in stream:
        pass
    assert await _tokens(client, "tales", PROMPTS[1]) == reference["tales"][1]  # still served


async def test_runtime_routes_are_absent_without_their_flag(stories_dir, adapters):
    paths, _ = adapters
    engine = make_engine(stories_dir, enable_lora=True, lora_modules=[LoRAModule(name="tales", path=paths["tales"])])
    async with running_server(engine) as (client, _):
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["late"]})
        assert_openai_error(response, 404, "NotFoundError", "There is no route")
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [MODEL, "tales"]


def test_bad_lora_modules_exit_2_naming_the_problem(adapters, tmp_path):
    paths, _ = adapters
    for extra, needle in [
        ([f"tales={tmp_path / 'missing'}"], "no such directory"),
        ([f"big={paths['too-big']}"], "rank 32 is above --max-lora-rank 16"),
        (["nonsense"], "expected name=path or JSON"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "app", "--port", "0", "--enable-lora", "--lora-modules", *extra],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert needle in done.stderr
