"""``python -m bench embed``: embedding throughput (inputs per second), ours against references.

Three references on the same model and inputs, taking turns (A B C, A B C...):

- ``SentenceTransformer.encode`` in this process, ``--batch`` inputs at a time;
- our server: requests of ``--batch`` inputs one after another, the same two at a time, and
  ``--concurrency`` clients sending one input per request;
- with ``--gguf``, llama.cpp's ``llama-server --embedding`` on the same model converted to
  GGUF (../shared/peer/convert_to_gguf.sh), under the same two loads.

``make-model`` writes a seeded random BERT in a real embedding model's shape (bge-small:
12 layers, hidden 384, 12 heads) as a sentence-transformers directory (mean pooling,
normalised), with a small WordPiece vocabulary: speed depends on shapes, not values, and
the inputs are whole words of that vocabulary, one token each.

    python -m bench embed make-model /tmp/bert-small
    python -m bench embed to-gguf /tmp/bert-small /tmp/bert-small-f32.gguf
    LLAMA_SERVER=... python -m bench embed compare --model /tmp/bert-small --gguf /tmp/bert-small-f32.gguf

``to-gguf`` runs llama.cpp's converter (the peer's, ../shared/peer) and tells it that the
made-up vocabulary is pre-tokenized as BERT's (which it cannot recognise by its hash).
``compare`` first checks that llama-server embeds as we do (cosine of the two vectors).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from app.launcher import ManagedServer
from bench.compare import CommandServer

HELP = "embedding throughput: our server vs SentenceTransformer.encode and llama-server --embedding"
SHAPES = {
    "bge-small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536),
    "minilm-l6": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
}
WORDS = (
    "the a cat dog sat on mat ran to park and she he was happy because sun out birds sang all day long in tall "
    "green trees once upon time there little girl boy red ball big small house went home with her his friend "
    "play played liked likes jump over fox quick brown lazy what is how many people live city known for of"
).split()
PEER_FLAGS = "--embedding --pooling mean -ub 512 -b 4096"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("make-model", help="write a random BERT in a real shape as a sentence-transformers dir")
    make.add_argument("out")
    make.add_argument("--shape", choices=sorted(SHAPES), default="bge-small")
    make.add_argument("--seed", type=int, default=0)
    conv = sub.add_parser("to-gguf", help="convert a BERT directory to an f32 GGUF file with llama.cpp's converter")
    conv.add_argument("model")
    conv.add_argument("out")
    cmp = sub.add_parser("compare", help="inputs/s of ours, SentenceTransformer.encode and llama-server")
    cmp.add_argument("--model", required=True, help="a sentence-transformers directory (make-model)")
    cmp.add_argument("--gguf", help="the same model as GGUF, for llama-server --embedding")
    cmp.add_argument("--inputs", type=int, default=512, help="inputs per measurement")
    cmp.add_argument("--words", type=int, default=48, help="words (tokens) per input")
    cmp.add_argument("--batch", type=int, default=32)
    cmp.add_argument("--concurrency", type=int, default=16)
    cmp.add_argument("--rounds", type=int, default=3)
    cmp.add_argument("--server-args", default="", help="extra arguments for our server")
    cmp.add_argument("--result", type=Path, help="write the runs and medians here (JSON)")
    mixed = sub.add_parser("mixed", help="chat streams' TPOT with and without embedding load beside them")
    mixed.add_argument("--chat-model", required=True)
    mixed.add_argument("--embed-model", required=True)
    mixed.add_argument("--streams", type=int, default=16)
    mixed.add_argument("--embed-rate", type=float, nargs="+", default=[5.0, 50.0],
                       help="embedding inputs per second sent beside the chat streams (one input per request)")
    mixed.add_argument("--words", type=int, default=48)
    mixed.add_argument("--rounds", type=int, default=3)
    mixed.add_argument("--embed-nice", type=int, default=0,
                       help="run the embedding server at this nice value (its every thread and child)")
    mixed.add_argument("--chat-server-args", default="")
    mixed.add_argument("--embed-server-args", default="")


def make_model(out: str, shape: str, seed: int) -> None:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    out_dir = Path(out)
    body = out_dir.with_name(out_dir.name + "-body")
    body.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters), *WORDS]
    (body / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tokenizer = transformers.BertTokenizerFast(str(body / "vocab.txt"))
    config = transformers.BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **SHAPES[shape])
    torch.manual_seed(seed)
    transformers.BertModel(config).eval().save_pretrained(body)
    tokenizer.save_pretrained(body)
    transformer = modules.Transformer(str(body))
    pooling = modules.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device="cpu").save(out)
    print(f"wrote {out} ({shape})")


_CONVERT = """
import os, runpy, sys
llama = sys.argv[1]
sys.path.insert(0, llama)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "bert-bge"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outtype", "f32", "--outfile", sys.argv[3]]
runpy.run_path(os.path.join(llama, "convert_hf_to_gguf.py"), run_name="__main__")
"""


def to_gguf(model_dir: str, out: str) -> int:
    peer = Path(os.environ.get("LLAMA_PEER_DIR", Path.home() / ".cache" / "ringllm-peer"))
    python = peer / "venv" / "bin" / "python"
    return subprocess.call([str(python), "-c", _CONVERT, str(peer / "llama.cpp"), model_dir, out])


def make_inputs(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def sentence_transformers_rate(model_dir: str, texts: list[str], batch: int) -> float:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    model.encode(texts[:batch], batch_size=batch)  # warm-up
    start = time.perf_counter()
    model.encode(texts, batch_size=batch)
    return len(texts) / (time.perf_counter() - start)


async def _post_all(base_url: str, bodies: list[dict[str, Any]], concurrency: int) -> float:
    """Send every body to /v1/embeddings with ``concurrency`` requests in flight; inputs per second."""
    queue = list(reversed(bodies))
    inputs = sum(len(b["input"]) if isinstance(b["input"], list) else 1 for b in bodies)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            body = queue.pop()
            response = await http.post(base_url + "/v1/embeddings", json=body)
            response.raise_for_status()

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return inputs / (time.perf_counter() - start)


def embeddings_of(server: ManagedServer, texts: list[str]) -> list[list[float]]:
    response = httpx.post(server.base_url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"},
                          timeout=120, trust_env=False)
    response.raise_for_status()
    return [d["embedding"] for d in response.json()["data"]]


def check_same_model(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """The smallest cosine between our embedding of an input and the peer's (near 1: the same model)."""
    import numpy as np

    a, b = np.array(ours), np.array(theirs)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def server_rates(server: ManagedServer, texts: list[str], batch: int, concurrency: int) -> dict[str, float]:
    """inputs/s of one server: batched requests one at a time, then single inputs ``concurrency`` at a time."""
    batched = [{"input": texts[i : i + batch], "encoding_format": "float"} for i in range(0, len(texts), batch)]
    singles = [{"input": t, "encoding_format": "float"} for t in texts]
    asyncio.run(_post_all(server.base_url, batched[:2], 1))  # warm-up
    return {
        f"batch{batch}": asyncio.run(_post_all(server.base_url, batched, 1)),
        # Two requests in flight: the server computes one while it answers the other.
        f"batch{batch}_x2": asyncio.run(_post_all(server.base_url, batched, 2)),
        f"single_x{concurrency}": asyncio.run(_post_all(server.base_url, singles, concurrency)),
    }


def compare(args: argparse.Namespace) -> int:
    texts = make_inputs(args.inputs, args.words)
    logs = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    runs: dict[str, list[dict[str, float]]] = {"sentence_transformers": [], "ringllm": [], "llama_server": []}
    ours_args = ["--model", args.model, *args.server_args.split()]
    peer = None
    if args.gguf:
        peer = (
            f"bash ../shared/peer/run_peer.sh {args.gguf} {{port}} {{concurrency}} 512 {PEER_FLAGS}"
        )
    probe: dict[str, list[list[float]]] = {}
    for r in range(args.rounds):
        runs["sentence_transformers"].append({f"batch{args.batch}": sentence_transformers_rate(args.model, texts, args.batch)})
        with ManagedServer(ours_args, logs / f"ours{r}.log") as server:
            probe.setdefault("ours", embeddings_of(server, texts[:8]))
            runs["ringllm"].append(server_rates(server, texts, args.batch, args.concurrency))
        if peer is not None:
            with CommandServer(peer, args.concurrency, logs / f"peer{r}.log", 300) as server:
                if "peer" not in probe:
                    probe["peer"] = embeddings_of(server, texts[:8])
                    print(f"same model check: min cosine ours vs llama-server {check_same_model(probe['ours'], probe['peer']):.6f}")
                runs["llama_server"].append(server_rates(server, texts, args.batch, args.concurrency))
        print(f"round {r + 1}: " + json.dumps({k: v[-1] for k, v in runs.items() if v}))
    medians = {
        name: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for name, rs in runs.items() if rs
    }
    spreads = {
        name: {key: (min(run[key] for run in rs), max(run[key] for run in rs)) for key in rs[0]}
        for name, rs in runs.items() if rs
    }
    print(f"\n{args.inputs} inputs of {args.words} words, medians of {args.rounds} rounds (inputs/s, min-max):")
    for name, values in medians.items():
        print(f"  {name:22s} " + "  ".join(
            f"{k} {v:8.1f} ({spreads[name][k][0]:.1f}-{spreads[name][k][1]:.1f})" for k, v in values.items()
        ))
    ours = medians["ringllm"]
    batch_key, single_key = f"batch{args.batch}", f"single_x{args.concurrency}"
    for key in (batch_key, f"{batch_key}_x2"):
        print(f"  ours {key} / SentenceTransformer.encode at batch {args.batch}: "
              f"{ours[key] / medians['sentence_transformers'][batch_key]:.2f}x")
    if "llama_server" in medians:
        for key in (batch_key, f"{batch_key}_x2", single_key):
            print(f"  ours / llama-server, {key}: {ours[key] / medians['llama_server'][key]:.2f}x")
    if args.result:
        args.result.write_text(json.dumps({"args": vars(args) | {"result": str(args.result)}, "runs": runs,
                                           "medians": medians}, indent=2, default=str))
    return 0


class NicedServer(ManagedServer):
    """Our server under ``nice``: the kernel gives its threads the cores others leave."""

    niceness = 0

    def command(self, port: int) -> list[str]:
        return ["nice", "-n", str(self.niceness), *super().command(port)]


class PacedEmbeddings:
    """A thread sending one-input embedding requests at ``rate`` per second until stopped."""

    def __init__(self, base_url: str, rate: float, words: int) -> None:
        self.base_url, self.rate, self.texts = base_url, rate, make_inputs(256, words, seed=1)
        self.sent = 0
        self.latencies: list[float] = []  # seconds, of the requests answered so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
            pending: set[asyncio.Task] = set()
            start = time.perf_counter()
            while not self._stop.is_set():
                due = start + self.sent / self.rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                body = {"input": self.texts[self.sent % len(self.texts)], "encoding_format": "float"}
                task = asyncio.ensure_future(self._timed(http, body))
                pending.add(task)
                task.add_done_callback(pending.discard)
                self.sent += 1
            await asyncio.gather(*pending, return_exceptions=True)

    async def _timed(self, http: httpx.AsyncClient, body: dict[str, Any]) -> None:
        start = time.perf_counter()
        (await http.post(self.base_url + "/v1/embeddings", json=body)).raise_for_status()
        self.latencies.append(time.perf_counter() - start)

    def __enter__(self) -> PacedEmbeddings:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def mixed(args: argparse.Namespace) -> int:
    """Median TPOT of ``--streams`` chat streams alone and beside each embedding rate, taking turns."""
    from bench.compare import measure
    from bench.serve import add_workload_arguments

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    workload = parser.parse_args([])
    workload.random_input_len, workload.random_output_len, workload.ignore_eos = 128, 128, True
    workload.disable_tqdm, workload.prompts_per_stream = True, 2
    workload.endpoint, workload.backend = None, "openai"
    logs = Path(tempfile.mkdtemp(prefix="bench-embed-mixed-"))
    chat = ManagedServer(["--model", args.chat_model, *args.chat_server_args.split()], logs / "chat.log")
    embed = NicedServer(["--model", args.embed_model, *args.embed_server_args.split()], logs / "embed.log")
    embed.niceness = args.embed_nice
    tpot: dict[str, list[float]] = {"alone": [], **{f"{r:g}/s": [] for r in args.embed_rate}}
    latency: dict[str, list[float]] = {label: [] for label in tpot if label != "alone"}  # embedding ms
    with chat, embed:
        for r in range(args.rounds):
            for label in tpot:
                rate = None if label == "alone" else float(label[:-2])
                if rate is None:
                    result = measure(chat, workload, args.streams, args.chat_model)
                else:
                    with PacedEmbeddings(embed.base_url, rate, args.words) as paced:
                        result = measure(chat, workload, args.streams, args.chat_model)
                    latency[label].append(statistics.median(paced.latencies) * 1e3 if paced.latencies else math.inf)
                tpot[label].append(result["median_tpot_ms"])
            print(f"round {r + 1}: " + json.dumps({k: round(v[-1], 2) for k, v in tpot.items()}))
    alone = statistics.median(tpot["alone"])
    print(f"\n{args.streams} chat streams, median TPOT ms (min-max), medians of {args.rounds} rounds:")
    for label, values in tpot.items():
        embedding = f"; embedding latency median {statistics.median(latency[label]):.0f} ms" if label in latency else ""
        print(f"  {label:8s} {statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"
              f"  x{statistics.median(values) / alone:.3f}{embedding}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "make-model":
        make_model(args.out, args.shape, args.seed)
        return 0
    if args.action == "to-gguf":
        return to_gguf(args.model, args.out)
    if args.action == "mixed":
        return mixed(args)
    return compare(args)
