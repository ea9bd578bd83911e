"""Soak: a closed loop of streamed completions for a fixed time, with a share of the
clients hanging up mid-stream, while the server's RSS and open file descriptors
(frontend and EngineCore) are sampled once a second.

A leak shows as a rising RSS or fd curve under a flat request rate; an error is any
request that did not end with finish_reason "length" and the exact token count it
asked for (ignore_eos). Starts our server (``--model``, ``--server-arg``) unless
``--base-url`` points at a running one (then only its frontend is sampled, if local:
``--pid``). Writes RESULT.json and RESULT.png (requests/s, errors, RSS, fds over time).

Each of the ``--concurrency`` clients has its own keep-alive connection (a new one
after it hangs up), which it drops once idle for half the server's keep-alive
timeout (``--keepalive-expiry``), so it never sends a request on a connection the
server is closing as idle. Nothing is retried: every failure counts, and the JSON's
``error_kinds`` tells a failure before the response began from one during it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HELP = "streamed requests for --duration seconds at --concurrency, with disconnects: rate, errors, RSS and fds"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SETTLE_S = 6.0  # default idle time after the load (past the keep-alive timeout) before the last sample
KEEPALIVE_SHARE = 0.5  # the client's idle-connection expiry, as a share of the server's keep-alive timeout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--concurrency", type=int, default=64, help="clients in the closed loop (default 64)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.25, help="share of clients that hang up")
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", help="model directory for the server we start (default: stories260K)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for the server (repeatable)")
    parser.add_argument("--base-url", help="a running server instead of starting one")
    parser.add_argument("--pid", type=int, help="with --base-url: the server's pid, to sample its RSS and fds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--settle", type=float, default=SETTLE_S,
        help=f"idle seconds after the load before the last sample (default {SETTLE_S:g})",
    )
    parser.add_argument(
        "--keepalive-expiry", type=float, metavar="SECONDS",
        help="how long the client keeps an idle connection for reuse (default: half the server's "
        "--keep-alive-timeout, from --server-arg or the server's default; must be shorter than it)",
    )
    parser.add_argument("--output", type=Path, help="result prefix (default bench/results/soak-TIMESTAMP)")


def server_keep_alive_timeout(server_args: list[str]) -> float:
    """The ``--keep-alive-timeout`` among the server's flags, else the server's default."""
    from app.frontend_config import DEFAULT_KEEP_ALIVE_TIMEOUT_S

    timeout = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    for i, arg in enumerate(server_args):
        if arg == "--keep-alive-timeout" and i + 1 < len(server_args):
            timeout = float(server_args[i + 1])
        elif arg.startswith("--keep-alive-timeout="):
            timeout = float(arg.split("=", 1)[1])
    return timeout


def client_keepalive_expiry(args: argparse.Namespace) -> float:
    """The client's idle-connection expiry: given, or a share of the server's keep-alive timeout."""
    if args.keepalive_expiry is not None:
        return args.keepalive_expiry
    return KEEPALIVE_SHARE * server_keep_alive_timeout(args.server_arg)


def _proc_rss_fds(pid: int) -> tuple[int, int]:
    try:
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return 0, 0


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _causes(exc: BaseException) -> str:
    """The exception's message and what it was raised from ("ReadError" alone says little)."""
    parts, seen = [], set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen and len(parts) < 5:
        seen.add(id(cause))
        parts.append(f"{type(cause).__name__}({cause})" if cause is not exc else str(exc))
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(parts)


class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str, pid: int | None) -> None:
        self.args = args
        self.base_url = base_url
        self.pid = pid
        self.rng = random.Random(args.seed)
        self.completed = self.disconnected = self.errors = 0
        self.error_samples: list[str] = []
        self.error_kinds: Counter[str] = Counter()  # "ReadError before the response": 3
        self.client_lag = 0.0  # the longest the client's event loop was late, seconds
        self.samples: list[dict[str, float]] = []

    async def one(self, client: Any) -> None:
        args = self.args
        max_tokens = self.rng.randint(args.min_tokens, args.max_tokens)
        hang_up = self.rng.randint(0, max_tokens) if self.rng.random() < args.disconnect_fraction else None
        body = {
            "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        finish = tokens = None
        events = 0
        stage = "before the response"
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                stage = "during the response"
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                if hang_up == 0:
                    self.disconnected += 1
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"]["message"])
                    events += 1
                    if hang_up is not None and events >= hang_up:
                        self.disconnected += 1
                        return
                    for choice in event["choices"]:
                        finish = choice["finish_reason"] or finish
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            if (finish, tokens) != ("length", max_tokens):
                raise RuntimeError(f"finish {finish} with {tokens} of {max_tokens} tokens")
            self.completed += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported
            self.errors += 1
            self.error_kinds[f"{type(exc).__name__} {stage}"] += 1
            if len(self.error_samples) < 10:
                self.error_samples.append(f"{type(exc).__name__} {stage}: {_causes(exc)}")

    def sample(self, started: float) -> None:
        point: dict[str, float] = {
            "t": time.monotonic() - started, "completed": self.completed,
            "disconnected": self.disconnected, "errors": self.errors,
        }
        if self.pid is not None:
            point["frontend_rss"], point["frontend_fds"] = _proc_rss_fds(self.pid)
            engines = [_proc_rss_fds(c) for c in _children(self.pid)]
            point["engine_rss"] = max((r for r, _ in engines), default=0)
            point["engine_fds"] = max((f for _, f in engines), default=0)
        self.samples.append(point)

    async def run(self) -> None:
        import ssl
        from contextlib import AsyncExitStack

        import httpx

        args = self.args
        # One client, and so one keep-alive connection, per simulated user: a connection is
        # idle only between its user's requests, never long enough for the server's
        # keep-alive timeout. (A pool shared by all users let a connection sit idle until
        # the server closed it as the client reused it, and httpcore 1.0.9's pool can close
        # an expired connection it has already handed to a waiting request, under that
        # request: encode/httpcore#1110. Both showed as a rare ReadError.)
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1,
                              keepalive_expiry=client_keepalive_expiry(args))
        tls = ssl.create_default_context()  # unused over http://; shared, not loaded 256 times
        async with AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=self.base_url, timeout=300, limits=limits, verify=tls)
                )
                for _ in range(args.concurrency)
            ]
            started = time.monotonic()
            deadline = started + args.duration

            async def worker(client: httpx.AsyncClient) -> None:
                while time.monotonic() < deadline:
                    await self.one(client)

            async def sampler() -> None:
                while True:
                    self.sample(started)
                    asleep = time.monotonic()
                    await asyncio.sleep(1.0)
                    # How late this client's own event loop woke (a busy client is slow to
                    # read its streams, which slows the rate it measures).
                    self.client_lag = max(self.client_lag, time.monotonic() - asleep - 1.0)

            sampling = asyncio.create_task(sampler())
            await asyncio.gather(*(worker(client) for client in clients))
            sampling.cancel()
            self.sample(started)
            # Idle again: what the load left behind (sockets, memory) shows here.
            await asyncio.sleep(args.settle)
            self.sample(started)
            self.stats = (await clients[0].get("/engine/stats")).json()


def save_plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    rate = [0.0] + [
        (b["completed"] + b["disconnected"] - a["completed"] - a["disconnected"]) / max(b["t"] - a["t"], 1e-9)
        for a, b in zip(samples, samples[1:])
    ]
    axes[0].plot(t, rate, label="requests/s")
    axes[0].plot(t, [s["errors"] for s in samples], label="errors (total)", color="red")
    axes[0].legend()
    axes[0].set_ylabel("requests")
    for key, label in (("frontend_rss", "frontend"), ("engine_rss", "EngineCore")):
        if samples and key in samples[0]:
            axes[1].plot(t, [s[key] / 2**20 for s in samples], label=label)
    axes[1].set_ylabel("RSS (MiB)")
    axes[1].legend()
    for key, label in (("frontend_fds", "frontend"), ("engine_fds", "EngineCore")):
        if samples and key in samples[0]:
            axes[2].plot(t, [s[key] for s in samples], label=label)
    axes[2].set_ylabel("open fds")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    fig.suptitle(
        f"soak: {result['concurrency']} clients, {result['requests_per_s']:.1f} req/s, "
        f"{result['errors']} errors, {result['disconnected']} hang-ups"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from app.launcher import ManagedServer

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    prefix = args.output or RESULTS_DIR / f"soak-{stamp}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    server = None
    if args.base_url:
        base_url, pid = args.base_url, args.pid
    else:
        server_args = (["--model", args.model] if args.model else []) + args.server_arg
        server = ManagedServer(server_args, prefix.with_suffix(".log")).start()
        assert server.proc is not None
        base_url, pid = server.base_url, server.proc.pid
    try:
        soak = Soak(args, base_url, pid)
        asyncio.run(soak.run())
    finally:
        if server is not None:
            server.stop()
    samples = soak.samples
    elapsed = samples[-1]["t"] if samples else args.duration
    result = {
        "duration_s": elapsed, "concurrency": args.concurrency, "completed": soak.completed,
        "disconnected": soak.disconnected, "errors": soak.errors, "error_kinds": dict(soak.error_kinds),
        "error_samples": soak.error_samples, "client_keepalive_expiry_s": client_keepalive_expiry(args),
        "client_max_loop_lag_s": soak.client_lag,
        "requests_per_s": (soak.completed + soak.disconnected) / max(elapsed - args.settle, 1e-9),
        "engine_stats_after": soak.stats, "samples": samples,
    }
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=1))
    save_plot(result, prefix.with_suffix(".png"))
    first, last = (samples[1] if len(samples) > 1 else samples[0]), samples[-1]
    print(f"{result['requests_per_s']:.1f} requests/s over {elapsed - args.settle:.0f} s: {soak.completed} completed, "
          f"{soak.disconnected} hung up, {soak.errors} errors")
    if "frontend_rss" in last:
        print(f"frontend RSS {first['frontend_rss'] / 2**20:.0f} -> {last['frontend_rss'] / 2**20:.0f} MiB "
              f"({args.settle:g} s after the load), "
              f"fds {first['frontend_fds']:.0f} -> {last['frontend_fds']:.0f}; EngineCore RSS "
              f"{first['engine_rss'] / 2**20:.0f} -> {last['engine_rss'] / 2**20:.0f} MiB")
    print(f"client: idle connections kept {client_keepalive_expiry(args):g} s, event loop up to "
          f"{soak.client_lag * 1000:.0f} ms late")
    for sample in soak.error_samples:
        print("  error:", sample)
    print(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.png')}")
    return 1 if soak.errors else 0
