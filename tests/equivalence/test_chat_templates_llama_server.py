"""The published chat templates with tools rendered by ringllm as llama-server renders them.

llama.cpp's llama-server (``--jinja --chat-template-file``) answers
``/apply-template`` with the prompt it would generate from: the same
conversation (tools, an assistant call, its result, reasoning, a new
question) and the same template kwargs must render to the same text by
ringllm's chat request path, but for the BOS text llama-server leaves to its
tokenizer. Both render with the special tokens of one GGUF file
(stories260K's, made by llama.cpp's converter). The two servers differ in
what they pass unasked (llama-server: today's ``date_string``,
``enable_thinking`` true), so both get these explicitly here.

Skipped where the peer is not built (``bash ../shared/peer/build_llama_server.sh``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from app.tokenizer import Tokenizer
from core.models.default_model import DEFAULT_MODEL_DIR
from tests.support.chat_models import ARGUMENTS, TEMPLATES, TOOLS, conversation, render_as_chat_request
from tests.support.waiting import wait_for

PEER_DIR = Path(os.environ.get("LLAMA_PEER_DIR", Path.home() / ".cache" / "ringllm-peer"))
SCRIPTS = Path(__file__).resolve().parents[3] / "shared" / "peer"
SERVER_BIN = Path(os.environ.get("LLAMA_SERVER", PEER_DIR / "llama.cpp" / "build" / "bin" / "llama-server"))

pytestmark = pytest.mark.skipif(
    not (SERVER_BIN.is_file() and (SCRIPTS / "convert_to_gguf.sh").is_file() and TEMPLATES.is_dir()),
    reason="llama.cpp's llama-server is not built (bash ../shared/peer/build_llama_server.sh)",
)

KWARGS = {"enable_thinking": True, "date_string": "26 Jul 2024"}
# Gemma 2's template has no system or tool roles (llama-server refuses to load it for tools).
TEMPLATE_NAMES = sorted(p.name for p in TEMPLATES.glob("*.jinja") if not p.name.startswith("google-gemma"))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("peer-template") / "stories-f32.gguf"
    env = {**os.environ, "LLAMA_PEER_DIR": str(PEER_DIR)}
    subprocess.run(["bash", str(SCRIPTS / "convert_to_gguf.sh"), str(DEFAULT_MODEL_DIR), str(out), "f32"],
                   check=True, capture_output=True, env=env)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llama_server_prompt(gguf: Path, template: Path) -> str:
    port = _free_port()
    proc = subprocess.Popen(
        [str(SERVER_BIN), "-m", str(gguf), "--jinja", "--chat-template-file", str(template), "--port", str(port),
         "-c", "2048"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(base + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, "llama-server to load")
        body = {"messages": conversation(json.dumps(ARGUMENTS, ensure_ascii=False)), "tools": TOOLS,
                "chat_template_kwargs": KWARGS}
        response = httpx.post(base + "/apply-template", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["prompt"]
    finally:
        proc.terminate()
        proc.wait()


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_rendered_prompt_equals_llama_server(name: str, gguf: Path) -> None:
    tokenizer = Tokenizer.from_directory(str(DEFAULT_MODEL_DIR))
    theirs = _llama_server_prompt(gguf, TEMPLATES / name)
    ours = render_as_chat_request(tokenizer, (TEMPLATES / name).read_text(), KWARGS)
    if tokenizer.bos_token and not theirs.startswith(tokenizer.bos_token):
        ours = ours.removeprefix(tokenizer.bos_token)  # llama-server adds the BOS when it tokenizes
    assert ours == theirs
