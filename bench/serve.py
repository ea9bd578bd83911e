"""``python -m bench serve``: latency and throughput of a running OpenAI-compatible server.

Flags, metrics, console block and result JSON follow ``vllm bench serve``,
so the same command line measures ours, vLLM, or any other such server, and
the numbers compare. See bench/README.md for what each metric means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.arrival import arrival_offsets, paced
from bench.client import (
    RequestResult,
    build_payload,
    is_chat,
    make_http_client,
    stream_request,
)
from bench.datasets import (
    SampleRequest,
    add_dataset_arguments,
    load_tokenizer,
    sample_requests,
)
from bench.metrics import LATENCY_METRICS, calculate_metrics, parse_goodput
from bench.report import (
    build_result,
    default_filename,
    format_console,
    format_failures,
    save_result,
)

HELP = "benchmark a running OpenAI-compatible server (as vllm bench serve)"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
READY_RETRY_S = 1.0
# The readiness check's prompt: short, and the start of no benchmark prompt.
READY_PROMPT = "Are you ready?"


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", help="server URL without the endpoint, e.g. http://127.0.0.1:8000")
    g.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    g.add_argument("--port", type=int, default=8000, help="used when --base-url is not given")
    g.add_argument("--endpoint", help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--backend", choices=sorted(BACKENDS), default="openai",
                   help="openai-chat implies --endpoint /v1/chat/completions")
    g.add_argument("--model", help="model name in requests (default: the server's first model); "
                                   "a local directory or GGUF file also gives the tokenizer")
    g.add_argument("--served-model-name", help="model name in requests when it differs from --model")
    g.add_argument("--tokenizer", help="tokenizer directory (default: --model's if a directory or GGUF file, "
                                       "the embedded model's for stories260K and ringllm-default)")
    g.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                   help="wait this long for the server to answer a first test request (0: no test)")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Dataset, arrival, sampling and report options: shared by ``serve`` and ``sweep``."""
    add_dataset_arguments(parser)
    g = parser.add_argument_group("traffic")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (inf: all at once); gaps are gamma distributed")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 is Poisson, <1 burstier, >1 more regular")
    g.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent (and ignored) before the run: the dataset's, drawn with the next seed")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM extension)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--extra-body", type=json.loads, help="JSON object merged into every request body")

    r = parser.add_argument_group("report")
    r.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles")
    r.add_argument("--percentile-metrics", default=",".join(LATENCY_METRICS),
                   help="comma-separated subset of ttft,tpot,itl,e2el to report")
    r.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="service level objectives, e.g. ttft:500 tpot:50 e2el:2000")
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--result-dir", default=str(RESULTS_DIR))
    r.add_argument("--result-filename", help="default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json")
    r.add_argument("--label", help="a name for this run, kept in the result")
    r.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="extra fields for the JSON")
    r.add_argument("--plot", action="store_true", help="also write PNG plots beside the JSON")
    r.add_argument("--disable-tqdm", action="store_true")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    add_workload_arguments(parser)


@dataclass
class Target:
    """Where and what to send: the endpoint URL, the model name in requests, the tokenizer."""

    base_url: str
    endpoint: str
    model: str
    tokenizer: str

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def tokenizer_of(model: str) -> str | None:
    """The tokenizer directory of a local model: the directory itself, or the one made from a
    GGUF file's metadata (as the server makes it); None for anything else."""
    if not Path(model).exists():
        return None
    from core.models.gguf_checkpoint import gguf_file, metadata_dir_of

    path = gguf_file(model)
    if path is not None:
        return metadata_dir_of(path)
    return model if Path(model).is_dir() else None


def resolve_target(args: argparse.Namespace) -> Target:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or BACKENDS[args.backend]
    model = args.served_model_name or args.model or first_served_model(base_url, args.ready_check_timeout_sec)
    tokenizer = args.tokenizer
    for candidate in (args.model, model):  # a served name may be the model's own directory (or GGUF file)
        if tokenizer is None and candidate:
            tokenizer = tokenizer_of(candidate)
    if tokenizer is None:
        from core.models.default_model import SERVED_NAMES, default_model_dir

        if model in SERVED_NAMES:  # our server without --model
            tokenizer = default_model_dir()
    if tokenizer is None:
        raise ValueError(f"no tokenizer for model {model!r}: pass --tokenizer DIR (a local model directory)")
    return Target(base_url, endpoint, model, tokenizer)


def first_served_model(base_url: str, timeout: float) -> str:
    """The first model id of /v1/models, waiting up to ``timeout`` seconds for the server to listen."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30, trust_env=False)
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise ValueError(f"--model not given and {base_url} did not answer within {timeout:.0f} s") from None
            time.sleep(READY_RETRY_S)
        except (httpx.HTTPStatusError, KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"--model not given and {base_url}/v1/models did not name one: {exc}") from None


def _percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in [0, 100]: {text}")
    return values


def _selected_metrics(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in LATENCY_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {','.join(LATENCY_METRICS)}")
    return names


class Runner:
    """Sends a list of requests on an arrival schedule, at most ``max_concurrency`` in flight."""

    def __init__(self, target: Target, args: argparse.Namespace) -> None:
        self.target = target
        self.args = args
        sampling = {"temperature": args.temperature}
        if args.top_p is not None:
            sampling["top_p"] = args.top_p
        if args.top_k is not None:
            sampling["top_k"] = args.top_k
        self.sampling = sampling

    def payload(self, request: SampleRequest) -> dict[str, Any]:
        return build_payload(
            self.target.endpoint, self.target.model, request.prompt, request.expected_output_len,
            self.args.ignore_eos, self.sampling, self.args.extra_body,
        )

    async def send(self, client: httpx.AsyncClient, request: SampleRequest) -> RequestResult:
        return await stream_request(client, self.target.url, self.payload(request), request.prompt_len)

    async def wait_until_ready(self, client: httpx.AsyncClient) -> None:
        """Wait until the server answers at all, then send one test request, which must succeed.
        Its prompt is none of the run's: a server's prefix cache would otherwise serve the run's
        first prompt from the test's blocks, and a prefill's time to first token would halve."""
        timeout = self.args.ready_check_timeout_sec
        if timeout <= 0:
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                await client.get(self.target.base_url)  # any HTTP answer: something is listening
                break
            except httpx.TransportError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.target.base_url} did not answer within {timeout:.0f} s: {exc}") from None
                await asyncio.sleep(READY_RETRY_S)
        result = await self.send(client, SampleRequest(READY_PROMPT, 0, 1))
        if not result.success:
            raise RuntimeError(f"the initial test request to {self.target.url} failed: {result.error.strip()}")

    async def run(
        self, requests: list[SampleRequest], warmups: Sequence[SampleRequest] = (),
    ) -> tuple[list[RequestResult], float, float]:
        """The results in request order, the wall-clock duration, and this process's CPU seconds;
        ``warmups`` are sent first and not counted."""
        args = self.args
        limit = args.max_concurrency
        async with make_http_client(limit) as client:
            await self.wait_until_ready(client)
            semaphore = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

            async def limited(request: SampleRequest) -> RequestResult:
                async with semaphore:
                    return await self.send(client, request)

            if warmups:
                results = await asyncio.gather(*(limited(r) for r in warmups))
                failed = sum(not r.success for r in results)
                if failed:
                    print(f"warning: {failed} of {len(warmups)} warmup requests failed")

            from tqdm import tqdm

            offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
            progress = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")
            tasks = []
            start, cpu_start = time.perf_counter(), time.process_time()
            async for request in paced(requests, offsets):
                task = asyncio.create_task(limited(request))
                task.add_done_callback(lambda _: progress.update(1))
                tasks.append(task)
            outputs = await asyncio.gather(*tasks)
            duration, client_cpu = time.perf_counter() - start, time.process_time() - cpu_start
            progress.close()
        return list(outputs), duration, client_cpu


def run_info(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """The run's description, at the top of the result JSON (vLLM's keys first)."""
    info: dict[str, Any] = {
        "endpoint_type": "openai-chat" if is_chat(target.endpoint) else args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": target.model,
        "tokenizer_id": target.tokenizer,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "dataset_name": args.dataset_name,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "goodput": parse_goodput(args.goodput) or None,
    }
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        info[key] = value
    return info


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the options describe and return vLLM's result dict."""
    percentiles = _percentiles(args.metric_percentiles)
    selected = _selected_metrics(args.percentile_metrics)
    goodput = parse_goodput(args.goodput)
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    target = resolve_target(args)
    tokenizer = load_tokenizer(target.tokenizer)
    requests = sample_requests(args, tokenizer)
    # Warm-ups of the same shape but other prompts (another seed): the run's own would be cached.
    warmups = sample_requests(args, tokenizer, num_prompts=args.num_warmups, seed=args.seed + 1) \
        if args.num_warmups > 0 else []
    info = run_info(args, target)
    print(f"{len(requests)} requests ({args.dataset_name}) -> {target.url}, model {target.model!r}")

    import uvloop

    load_before = os.getloadavg()[0]
    spec_before = spec_decode_counters(target.base_url)
    outputs, duration, client_cpu = uvloop.run(Runner(target, args).run(requests, warmups))
    load_after = os.getloadavg()[0]
    spec_after = spec_decode_counters(target.base_url)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    metrics = calculate_metrics(outputs, duration, percentiles, goodput, count_tokens)
    result = build_result(metrics, outputs, duration, selected, info)
    # The harness's own CPU use and the machine's load: on a shared machine, what else competed.
    result.update(client_cpu_s=client_cpu, load_avg_before=load_before, load_avg_after=load_after)
    if spec_after is not None:  # (none before: the server had not reported any yet)
        result.update(spec_decode_summary(spec_before or {}, spec_after))
    print(format_console(result, selected, percentiles))
    print(
        f"benchmark client CPU: {client_cpu:.2f} s ({100 * client_cpu / duration:.0f}% of one core); "
        f"load average {load_before:.2f} before, {load_after:.2f} after"
    )
    failures = format_failures(result["errors"])
    if failures:
        print(failures)
    write_outputs(result, args, info)
    return result


SPEC_DECODE_PREFIX = "vllm:spec_decode_"


def spec_decode_counters(base_url: str) -> dict[str, float] | None:
    """The server's speculative decoding counters (vLLM's names) from /metrics, summed over
    engines, per position as ``num_accepted_tokens_per_pos[i]``; None without any (a server
    without speculation, or without /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
        families = list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return None
    counters: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if not sample.name.startswith(SPEC_DECODE_PREFIX) or not sample.name.endswith("_total"):
                continue
            name = sample.name[len(SPEC_DECODE_PREFIX) : -len("_total")]
            if "position" in sample.labels:
                name += f"[{sample.labels['position']}]"
            counters[name] = counters.get(name, 0.0) + sample.value
    return counters or None


def spec_decode_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Acceptance over the run, as vLLM's bench reports it: accepted / drafted tokens, and
    the mean tokens per verification (1 + accepted / drafts)."""
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    drafts, drafted, accepted = (delta.get(k, 0.0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    positions = sorted(
        (int(name[name.index("[") + 1 : -1]), value) for name, value in delta.items() if name.startswith("num_accepted_tokens_per_pos")
    )
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(drafted),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": 100.0 * accepted / drafted if drafted else 0.0,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
        "spec_decode_per_position_acceptance": [100.0 * v / drafts if drafts else 0.0 for _, v in positions],
    }


def write_outputs(result: dict[str, Any], args: argparse.Namespace, info: dict[str, Any]) -> None:
    """The result JSON (--save-result) and the PNG plots beside it (--plot)."""
    path = Path(args.result_dir) / (args.result_filename or default_filename(info))
    if args.save_result:
        save_result(result, path)
        print(f"result saved to {path}")
    if args.plot:
        from bench.plot import save_plots

        path.parent.mkdir(parents=True, exist_ok=True)
        for png in save_plots(result, path.with_suffix("")):
            print(f"plot saved to {png}")


def run(args: argparse.Namespace) -> int:
    try:
        result = run_benchmark(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    return 0 if result["completed"] else 1
