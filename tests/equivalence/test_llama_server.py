"""ringllm and llama.cpp's llama-server serving the same GGUF files, greedy, side by side.

The files are made by llama.cpp's own tools (../shared/peer: its converter on
stories260K, then ``llama-quantize``), so the comparison also covers reading
what the reference writer wrote. Both servers are real processes answering
the official openai client. Two implementations that round differently need
not agree on every greedy token, so where the texts part, transformers (float32,
reading the same file) judges: ringllm's token must be transformers' choice
there (the peer is the one that left the reference), or a near tie in
ringllm's own distribution (the top two log-probabilities close). A kernel
error or a misread tensor gives neither. llama.cpp keeps its KV cache in
float16 and rounds activations for its products (to 8 bits for the block
formats, to float16 for F16 weights); ringllm is told ``--kv-cache-dtype
float16`` and rounds activations to int8 per block for the block formats.

Skipped where the peer is not built (``bash ../shared/peer/build_llama_server.sh``,
about 7 minutes; CI has no peer).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from app.launcher import ServerStartError
from bench.compare import CommandServer
from core.models.default_model import DEFAULT_MODEL_DIR
from tests.support.gguf_files import gemma3_checkpoint, moe_checkpoint
from tests.support.servers import start_server, stop_server

PEER_DIR = Path(os.environ.get("LLAMA_PEER_DIR", Path.home() / ".cache" / "ringllm-peer"))
SCRIPTS = Path(__file__).resolve().parents[3] / "shared" / "peer"
# LLAMA_SERVER: another build of it (run_peer.sh starts that one too).
SERVER_BIN = Path(os.environ.get("LLAMA_SERVER", PEER_DIR / "llama.cpp" / "build" / "bin" / "llama-server"))
QUANTIZE_BIN = PEER_DIR / "llama.cpp" / "build" / "bin" / "llama-quantize"

pytestmark = pytest.mark.skipif(
    not (SERVER_BIN.is_file() and QUANTIZE_BIN.is_file() and (SCRIPTS / "run_peer.sh").is_file()),
    reason="llama.cpp's llama-server is not built (bash ../shared/peer/build_llama_server.sh)",
)

PROMPTS = [
    "Once upon a time", "Lily and Tom went to the", "The little dog was sad because", "One day, a bird",
    "Sam had a big red ball.", "Mom said",
]
NEW_TOKENS = 48
# Where the texts part and ringllm's token is not transformers' choice, the widest gap allowed
# between ringllm's top two log-probabilities: float32 weights differ only in summation order;
# block formats also in each side's rounding of the activations.
NEAR_TIE = {"f32": 0.02, "q8_0": 0.1, "q4_0": 0.1, "q4_k_m": 0.1, "q5_k_m": 0.1, "iq4_xs": 0.1}
# stories260K's rows (64 values) are not of 256: llama-quantize writes its Q5_K_M and IQ4_XS files'
# matrices in the 32-value formats it falls back to, Q5_1 and IQ4_NL.
QUANTIZED = ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "iq4_xs"]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("peer-gguf")
    f32 = folder / "stories-f32.gguf"
    env = {**os.environ, "LLAMA_PEER_DIR": str(PEER_DIR)}
    subprocess.run(["bash", str(SCRIPTS / "convert_to_gguf.sh"), str(DEFAULT_MODEL_DIR), str(f32), "f32"],
                   check=True, capture_output=True, env=env)
    files = {"f32": f32}
    for qtype in QUANTIZED:
        files[qtype] = folder / f"stories-{qtype}.gguf"
        subprocess.run([str(QUANTIZE_BIN), str(f32), str(files[qtype]), qtype.upper()], check=True,
                       capture_output=True)
    return files


def _completions(client: openai.OpenAI, model: str, extra_body: dict | None = None, **options) -> list:
    return [
        client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, **(extra_body or {})}, **options).choices[0]
        for prompt in PROMPTS
    ]


def _parting(ours, theirs: str) -> tuple[int, float] | None:
    """None if the texts are equal; else the index of ringllm's token where its text leaves
    the peer's, and the gap between ringllm's top two log-probabilities there."""
    if ours.text == theirs:
        return None
    at = 0
    for i, (token, top) in enumerate(zip(ours.logprobs.tokens, ours.logprobs.top_logprobs, strict=True)):
        if not theirs.startswith(ours.text[: at + len(token)]):
            first, second = sorted(top.values(), reverse=True)[:2]
            return i, first - second
        at += len(token)
    return len(ours.logprobs.tokens), 0.0  # the peer's text is longer: it wrote past where ringllm's ends


@pytest.mark.parametrize("qtype", ["f32", *QUANTIZED])
def test_greedy_texts_equal_llama_server_but_where_it_leaves_transformers(qtype, gguf_files, tmp_path) -> None:
    path = gguf_files[qtype]
    peer = CommandServer(f"bash {SCRIPTS / 'run_peer.sh'} {path} {{port}} 1 256", 1, tmp_path / "peer.log", 120)
    try:
        try:
            peer.start()
        except ServerStartError as exc:
            if "exited with code -4" not in str(exc):
                raise
            pytest.skip("llama-server died of SIGILL: a -march=native build whose AMX kernels this machine "
                        "does not grant (bench/README.md: build it without AMX, point LLAMA_SERVER at it)")
        peer_client = openai.OpenAI(base_url=peer.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        theirs = [choice.text for choice in _completions(peer_client, path.stem)]
    finally:
        peer.stop()
    server = start_server(["--model", str(path), "--served-model-name", "m", "--kv-cache-dtype", "float16"],
                          tmp_path / "ours.log")
    try:
        client = server.openai()
        ours = _completions(client, "m", logprobs=2)
        ids = [[int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
               for choice in _completions(client, "m", logprobs=1, extra_body={"return_tokens_as_token_ids": True})]
        prompts = [httpx.post(server.base_url + "/tokenize", json={"model": "m", "prompt": p}).json()["tokens"]
                   for p in PROMPTS]
    finally:
        stop_server(server)

    assert all(o.text for o in ours) and all(theirs)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    report = []
    for prompt, mine, choice, their_text in zip(prompts, ids, ours, theirs, strict=True):
        parted = _parting(choice, their_text)
        if parted is None:
            report.append("equal")
            continue
        at, margin = parted
        if at == len(mine):
            report.append("peer longer")
            continue
        with torch.no_grad():
            reference = int(oracle(torch.tensor([prompt + mine[:at]])).logits[0, -1].argmax())
        report.append(f"parted at {at}: ours {'is' if reference == mine[at] else 'is not'} transformers' "
                      f"choice, margin {margin:.4f}")
        assert reference == mine[at] or margin <= NEAR_TIE[qtype], (report, choice.text, their_text)
    print(qtype, report)
    assert report.count("equal") >= len(PROMPTS) // 2, report


def test_gemma3_greedy_tokens_equal_llama_server(tmp_path) -> None:
    """A Gemma 3 (five local layers to one global, windows shorter than the continuations)
    converted by llama.cpp's converter: both servers write the same greedy token ids in F32;
    in Q8_0 too, but where they part, which must be a near tie of ringllm's top two."""
    hf_dir = gemma3_checkpoint(tmp_path / "gemma3")
    env = {**os.environ, "LLAMA_PEER_DIR": str(PEER_DIR)}
    f32 = tmp_path / "gemma3-f32.gguf"
    subprocess.run(["bash", str(SCRIPTS / "convert_to_gguf.sh"), str(hf_dir), str(f32), "f32"], check=True,
                   capture_output=True, env=env)
    q8 = tmp_path / "gemma3-q8_0.gguf"
    subprocess.run([str(QUANTIZE_BIN), str(f32), str(q8), "Q8_0"], check=True, capture_output=True)
    _assert_greedy_tokens_equal_llama_server({"f32": f32, "q8_0": q8}, tmp_path)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_greedy_tokens_equal_llama_server(family, tmp_path) -> None:
    """A Mixtral converted by llama.cpp's converter (its stacked expert tensors), a Qwen3-MoE
    written in the same layout and keys by tests/support/gguf_files.py (the converter wants a
    Qwen BPE tokenizer for it; this one has stories260K's): 32 greedy tokens of both servers,
    equal in F32; in Q8_0 too, but where they part, which must be a near tie of ringllm's top two."""
    from tests.support.gguf_files import write_gguf

    hf_dir = moe_checkpoint(tmp_path / family, family)
    f32 = tmp_path / f"{family}-f32.gguf"
    if family == "mixtral":
        env = {**os.environ, "LLAMA_PEER_DIR": str(PEER_DIR)}
        subprocess.run(["bash", str(SCRIPTS / "convert_to_gguf.sh"), str(hf_dir), str(f32), "f32"], check=True,
                       capture_output=True, env=env)
    else:
        write_gguf(hf_dir, f32, qtype="f32")
    q8 = tmp_path / f"{family}-q8_0.gguf"
    subprocess.run([str(QUANTIZE_BIN), str(f32), str(q8), "Q8_0"], check=True, capture_output=True)
    _assert_greedy_tokens_equal_llama_server({"f32": f32, "q8_0": q8}, tmp_path)


def _assert_greedy_tokens_equal_llama_server(files: dict[str, Path], tmp_path: Path) -> None:
    """Each file's 32 greedy tokens from three prompts, by llama-server and by ringllm (float16
    KV caches both): equal for "f32"; for the others, equal up to where they part, which must be
    a near tie of ringllm's top two log-probabilities."""
    prompts = [[1, 400, 300, 200], [1, *range(17, 41)], [1, 5]]
    for qtype, path in files.items():
        peer = CommandServer(f"bash {SCRIPTS / 'run_peer.sh'} {path} {{port}} 1 256", 1, tmp_path / "peer.log", 120)
        peer.start()
        try:
            theirs = [httpx.post(peer.base_url + "/completion", timeout=120, json={
                "prompt": p, "n_predict": 32, "temperature": 0, "ignore_eos": True, "return_tokens": True,
            }).json()["tokens"] for p in prompts]
        finally:
            peer.stop()
        server = start_server(["--model", str(path), "--served-model-name", "m", "--kv-cache-dtype", "float16"],
                              tmp_path / "ours.log")
        try:
            ours = [httpx.post(server.base_url + "/v1/completions", json={
                "model": "m", "prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 2,
                "return_tokens_as_token_ids": True,
            }, timeout=120).json()["choices"][0]["logprobs"] for p in prompts]
        finally:
            stop_server(server)
        for logprobs, their_ids in zip(ours, theirs, strict=True):
            our_ids = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
            part = next((i for i, (a, b) in enumerate(zip(our_ids, their_ids)) if a != b), None)
            if qtype == "f32" or part is None:
                assert our_ids == their_ids, qtype
                continue
            first, second = sorted(logprobs["top_logprobs"][part].values(), reverse=True)[:2]
            assert first - second < NEAR_TIE[qtype], (qtype, part, first - second)

