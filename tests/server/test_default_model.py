"""Out of the box: ``python -m app`` with no --model serves the packaged stories260K.

A real server process, the official openai client, and transformers on the
same packaged checkpoint as the oracle.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from core.models.default_model import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
STORY = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory(["--seed", "0"])


def transformers_greedy(prompt: str, max_new_tokens: int) -> tuple[str, int]:
    """(continuation text, new tokens) from transformers' own generate on the packaged files."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
    full = tok.decode(out, skip_special_tokens=True)
    return full[len(tok.decode(ids, skip_special_tokens=True)):], len(out) - len(ids)


def test_models_lists_stories260k_and_the_old_name_still_works(server) -> None:
    client = server.openai()
    assert [m.id for m in client.models.list().data] == ["stories260K"]
    response = client.completions.create(model="ringllm-default", prompt=PROMPT, max_tokens=4, temperature=0)
    assert response.model == "stories260K" and response.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)


def test_greedy_completion_equals_transformers(server) -> None:
    response = server.openai().completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=64, temperature=0
    )
    want_text, want_tokens = transformers_greedy(PROMPT, 64)
    assert response.choices[0].text == want_text
    assert response.usage.completion_tokens == want_tokens
    assert want_text.startswith(STORY)


def test_streamed_chat_arrives_in_many_chunks_of_readable_text(server) -> None:
    stream = server.openai().chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Hello! Do you want to play with me?"}],
        stream=True, temperature=0, max_tokens=100,
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(pieces)
    assert "\ufffd" not in text and text.isascii() and text.isprintable(), text
    words = text.split()
    assert len(words) >= 5 and sum(w.strip(".,!?'").isalpha() for w in words) >= 0.8 * len(words), text
    # The template's turn ends at the closing quote: a stop string, not the length limit.
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Streamed, not sent whole: deltas are merged by design while the engine is
    # ahead of the stream, and a short reply takes a few milliseconds, so the
    # count is taken over a reply long enough to span many of the frontend's turns.
    long = server.openai().chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Hello! Do you want to play with me?"}],
        stream=True, temperature=0, max_tokens=400, extra_body={"ignore_eos": True},
    )
    long_pieces = [c.choices[0].delta.content for c in long if c.choices and c.choices[0].delta.content]
    assert len(long_pieces) >= 2, long_pieces
    assert "".join(long_pieces).startswith(text)


def test_chat_turn_stops_come_from_the_model_directory(server) -> None:
    client = server.openai()
    messages = [{"role": "user", "content": "Hello!"}]
    turn = client.chat.completions.create(model="stories260K", messages=messages, temperature=0, max_tokens=100)
    assert turn.choices[0].finish_reason == "stop" and turn.choices[0].stop_reason == '"'
    assert '"' not in turn.choices[0].message.content
    # Like an end-of-turn token, the turn stop does not apply under ignore_eos ...
    long = client.chat.completions.create(
        model="stories260K", messages=messages, temperature=0, max_tokens=60, extra_body={"ignore_eos": True}
    )
    assert long.choices[0].finish_reason == "length"
    assert long.choices[0].message.content.startswith(turn.choices[0].message.content + '"')
    # ... nor with a template of the request's own, whose turns it knows nothing of.
    own = client.chat.completions.create(
        model="stories260K", messages=messages, temperature=0, max_tokens=30,
        extra_body={"chat_template": "{{ bos_token }}{{ messages[0]['content'] }} Lily said, \""},
    )
    assert own.choices[0].finish_reason == "length"


def test_page_is_served_with_its_files(server) -> None:
    page = httpx.get(server.base_url + "/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert '<script src="/static/chat.js"' in page.text and "/static/chat.css" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no third-party asset
    for name, content_type in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
        asset = httpx.get(f"{server.base_url}/static/{name}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(content_type)
        assert "http://" not in asset.text and "https://" not in asset.text
    assert httpx.get(server.base_url + "/static/ui.py", timeout=10).status_code == 404  # the page's files only
    assert httpx.get(server.base_url + "/ui/config", timeout=10).json() == {"api_key_required": False}


def test_start_up_banner(server) -> None:
    log = server.log()
    banner = log[log.index("ringllm is ready"):]
    assert "stories260K (also answers to ringllm-default)" in banner
    assert "float32 on cpu" in banner and "transport  shm" in banner
    assert f"chat page  {server.base_url}/" in banner and f"API        {server.base_url}/v1" in banner
    assert f"metrics    {server.base_url}/metrics" in banner
    assert "KV cache" in banner and " tokens of float16, " in banner and "; max_model_len 512" in banner
    # Its memory, from the checkpoint's own config: K and V of every layer, float16.
    config = json.loads((Path(DEFAULT_MODEL_DIR) / "config.json").read_text())
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    blocks, block_size = re.search(r"KV cache   ([\d,]+) blocks x (\d+) tokens", banner).groups()
    held = int(blocks.replace(",", "")) * int(block_size) * per_token
    assert f"of float16, {held / 2**20:.1f} MiB; " in banner
