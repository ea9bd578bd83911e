"""IPC microbenchmark: the frontend <-> engine transport alone, shm rings vs ZeroMQ.

What is measured: the real transport classes (``core.transport``), the real
message encoders (``shm.serial``, out-of-band pool on shm, aux frames on zmq)
and the real protocol structs, between this process (the frontend's side,
on a uvloop event loop, as in the server) and a spawned *echo engine*: a
process that attaches like an EngineCore, decodes every message with the
typed decoder, re-encodes it and sends it back on one thread. No scheduler
and no model: only what the transport and serialization cost.

Per transport and payload: round-trip p50/p99 hot (back to back) and from
idle (after the receiver went to sleep), pipelined messages/s and bytes/s;
and the CPU both processes use while idle. The 64 MiB tensor is sent one way
(the echo answers with its shape), so its bytes/s is one-way bandwidth.

Run: ``python -m bench ipc`` (``--quick`` for a short run). Prints a table
with shm/zmq ratios and writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    SchedulerStats,
)
from core.transport import ClientTransport, EngineTransport, TransportSpec
from shm.serial import MsgpackDecoder, MsgpackEncoder

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class TensorPayload(msgspec.Struct, array_like=True, gc=False):
    tensor: torch.Tensor


class TensorAck(msgspec.Struct, array_like=True, gc=False):
    shape: list[int]


# Frame 0 of every benchmark message says what the body is.
KINDS: dict[bytes, type] = {
    b"R": EngineCoreRequest,
    b"O": EngineCoreOutputs,
    b"T": TensorPayload,
    b"A": TensorAck,
}
QUIT = b"Q"


def small_request() -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="cmpl-" + "0123456789abcdef" * 2,
        prompt_token_ids=list(range(1000, 1020)),
        sampling_params=SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, stop=["\n\n"]),
        eos_token_id=2,
        arrival_time=time.time(),
    )


def long_request(tokens: int = 8192) -> EngineCoreRequest:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128_000, (tokens,), generator=g).tolist()
    return msgspec.structs.replace(small_request(), prompt_token_ids=ids)


def step_outputs(num: int = 256) -> EngineCoreOutputs:
    outputs = [
        EngineCoreOutput(request_id=f"cmpl-{i:032x}", new_token_ids=[1000 + i], num_cached_tokens=16)
        for i in range(num)
    ]
    stats = SchedulerStats(num_running_reqs=num, kv_cache_usage=0.42, step_counter=12345)
    return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())


def big_tensor(nbytes: int = 64 << 20) -> TensorPayload:
    return TensorPayload(torch.ones(nbytes // 4, dtype=torch.float32))


@dataclass
class Payload:
    name: str
    kind: bytes
    make: Callable[[], Any]
    wire_bytes: int = 0  # filled in: main frame plus aux frames / pool bytes


PAYLOADS = [
    Payload("small request", b"R", small_request),
    Payload("8k-token request", b"R", long_request),
    Payload("256-output step", b"O", step_outputs),
    Payload("64 MiB tensor", b"T", big_tensor),
]


# ----------------------------------------------------------------- echo engine


def _echo_engine(spec: TransportSpec, parent_pid: int) -> None:
    """Attach like an EngineCore and answer every message on one thread."""
    transport = EngineTransport.attach(spec, parent_pid)
    encoder = MsgpackEncoder(pool=transport.pool_writer)
    decoders = {k: MsgpackDecoder(t, pool=transport.pool_reader) for k, t in KINDS.items()}
    buf = bytearray()
    transport.send([b"HELLO"])
    try:
        while True:
            frames = transport.recv()
            kind = bytes(frames[0])
            if kind == QUIT:
                break
            obj = decoders[kind].decode(frames[1:])
            if kind == b"T":  # one-way bulk: answer with the shape only
                kind, obj = b"A", TensorAck(list(obj.tensor.shape))
            transport.send([kind, *encoder.encode_into(obj, buf)])
            del obj
    finally:
        transport.close()
        os._exit(0)


# ------------------------------------------------------------------ frontend


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Measurement:
    rtt_hot_us: list[float] = field(default_factory=list)
    rtt_idle_us: list[float] = field(default_factory=list)
    pipelined_rates: list[float] = field(default_factory=list)  # msgs/s, one per round

    def summary(self, wire_bytes: int) -> dict[str, float]:
        rate = statistics.median(self.pipelined_rates)
        return {
            "rtt_hot_p50_us": statistics.median(self.rtt_hot_us),
            "rtt_hot_p99_us": _percentile(self.rtt_hot_us, 99),
            "rtt_idle_p50_us": statistics.median(self.rtt_idle_us),
            "rtt_idle_p99_us": _percentile(self.rtt_idle_us, 99),
            "pipelined_msgs_per_s": rate,
            "pipelined_bytes_per_s": rate * wire_bytes,
        }


class EchoClient:
    """The frontend's side: a ClientTransport on the event loop plus the echo process."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.transport, spec = ClientTransport.create(kind)
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=_echo_engine, args=(spec, os.getpid()), daemon=True)
        self.proc.start()
        self.transport.set_peer(self.proc.is_alive, self.proc.sentinel)
        frames = self.transport.recv(timeout=60)
        if frames is None or bytes(frames[0]) != b"HELLO":
            raise RuntimeError(f"echo engine over {kind} did not start")
        self.transport.engine_attached(timeout=60)
        self.encoder = MsgpackEncoder(pool=self.transport.pool_writer)
        self.decoders = {k: MsgpackDecoder(t, pool=self.transport.pool_reader) for k, t in KINDS.items()}

    def frames(self, payload: Payload, obj: Any) -> list:
        return [payload.kind, *self.encoder.encode(obj)]

    async def round_trip(self, frames: list) -> Any:
        await self.transport.send_async(frames)
        reply = await self.transport.recv_async()
        return self.decoders[bytes(reply[0])].decode(reply[1:])

    async def pipelined(self, payload: Payload, obj: Any, count: int) -> float:
        """Messages per second with ``count`` messages in flight at once."""

        async def produce() -> None:
            for _ in range(count):
                await self.transport.send_async(self.frames(payload, obj))

        async def consume() -> None:
            for _ in range(count):
                reply = await self.transport.recv_async()
                self.decoders[bytes(reply[0])].decode(reply[1:])

        start = time.perf_counter()
        await asyncio.gather(produce(), consume())
        return count / (time.perf_counter() - start)

    def close(self) -> None:
        self.transport.send([QUIT])
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
        self.transport.stop_async()
        self.transport.close()


def _wire_bytes(obj: Any) -> int:
    frames = MsgpackEncoder().encode(obj)  # without the pool: every byte counted once
    return sum(len(memoryview(f).cast("B")) for f in frames)


async def measure_round(
    client: EchoClient, payload: Payload, obj: Any, iterations: int, idle_iterations: int, into: Measurement
) -> None:
    """One round of every measurement for one payload, appended to ``into``."""
    heavy = payload.wire_bytes > (1 << 20)
    hot, idle = (max(iterations // 50, 4), max(idle_iterations // 5, 2)) if heavy else (iterations, idle_iterations)
    for _ in range(min(hot, 20)):  # warm-up: pools, buffers, code paths
        await client.round_trip(client.frames(payload, obj))
    for _ in range(hot):
        # Encoding is inside the timed span: the frontend pays it for every message.
        start = time.perf_counter()
        await client.round_trip(client.frames(payload, obj))
        into.rtt_hot_us.append((time.perf_counter() - start) * 1e6)
        gc.collect(0) if heavy else None
    for _ in range(idle):
        await asyncio.sleep(0.02)  # long enough for both receivers to go to sleep
        start = time.perf_counter()
        await client.round_trip(client.frames(payload, obj))
        into.rtt_idle_us.append((time.perf_counter() - start) * 1e6)
    count = max(hot * 4, 16) if heavy else max(iterations * 10, 1000)
    into.pipelined_rates.append(await client.pipelined(payload, obj, count))


async def measure_all(kinds: list[str], rounds: int, iterations: int, idle_iterations: int, idle_seconds: float) -> dict:
    """Every transport's echo engine stays up; rounds alternate between them
    (A B A B ...), so that a load drifting on a shared machine hits all alike.
    Latency samples are pooled over the rounds, rates are their medians."""
    clients = {kind: EchoClient(kind) for kind in kinds}
    try:
        measured = {kind: {} for kind in kinds}
        for payload in PAYLOADS:
            obj = payload.make()
            payload.wire_bytes = _wire_bytes(obj)
            per_kind = {kind: Measurement() for kind in kinds}
            for _ in range(rounds):
                for kind in kinds:
                    await measure_round(clients[kind], payload, obj, iterations // rounds,
                                        max(idle_iterations // rounds, 1), per_kind[kind])
            for kind in kinds:
                measured[kind][payload.name] = per_kind[kind].summary(payload.wire_bytes)
            del obj
        # Idle: every process at once, each frontend with a receive pending on
        # our loop and each echo blocked in recv.
        pending = [asyncio.ensure_future(c.transport.recv_async()) for c in clients.values()]
        await asyncio.sleep(0.5)
        pids = {kind: c.proc.pid for kind, c in clients.items()}
        before = {kind: _cpu_seconds(pid) for kind, pid in pids.items()}
        frontend_before = _cpu_seconds(os.getpid())
        await asyncio.sleep(idle_seconds)
        frontend = 100 * (_cpu_seconds(os.getpid()) - frontend_before) / idle_seconds
        for p in pending:
            p.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return {
            kind: {
                "payloads": measured[kind],
                "idle_cpu_percent_engine": 100 * (_cpu_seconds(pids[kind]) - before[kind]) / idle_seconds,
                # One frontend process holds every transport's client here.
                "idle_cpu_percent_frontend": frontend,
            }
            for kind in kinds
        }
    finally:
        for client in clients.values():
            client.close()


# ------------------------------------------------------------------- report

ROWS = [
    ("rtt_hot_p50_us", "RTT hot p50 (µs)", "{:.1f}"),
    ("rtt_hot_p99_us", "RTT hot p99 (µs)", "{:.1f}"),
    ("rtt_idle_p50_us", "RTT from idle p50 (µs)", "{:.1f}"),
    ("rtt_idle_p99_us", "RTT from idle p99 (µs)", "{:.1f}"),
    ("pipelined_msgs_per_s", "pipelined msgs/s", "{:,.0f}"),
    ("pipelined_bytes_per_s", "pipelined MB/s", None),
]


def _fmt(key: str, fmt: str | None, value: float) -> str:
    if fmt is None:
        return f"{value / 1e6:,.1f}"
    return fmt.format(value)


def render_table(results: dict[str, dict]) -> str:
    kinds = list(results)
    lines = []
    head = f"{'payload':<18} {'metric':<24}" + "".join(f"{k:>14}" for k in kinds)
    if len(kinds) == 2:
        head += f"{kinds[0] + '/' + kinds[1]:>12}"
    lines += [head, "-" * len(head)]
    for payload in PAYLOADS:
        for key, label, fmt in ROWS:
            values = [results[k]["payloads"][payload.name][key] for k in kinds]
            row = f"{payload.name:<18} {label:<24}" + "".join(f"{_fmt(key, fmt, v):>14}" for v in values)
            if len(kinds) == 2 and values[1]:
                row += f"{values[0] / values[1]:>12.3f}"
            lines.append(row)
        lines.append("")
    for key, label in (("idle_cpu_percent_frontend", "idle CPU frontend (%)"),
                       ("idle_cpu_percent_engine", "idle CPU engine (%)")):
        values = [results[k][key] for k in kinds]
        lines.append(f"{'idle':<18} {label:<24}" + "".join(f"{v:>14.2f}" for v in values))
    return "\n".join(lines)


HELP = "the frontend<->engine transport alone: shm rings vs ZeroMQ, with an echo engine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", nargs="+", default=["shm", "zmq"], choices=["shm", "zmq"])
    parser.add_argument("--iterations", type=int, default=3000, help="hot round trips per small payload")
    parser.add_argument("--idle-iterations", type=int, default=150, help="round trips from idle per payload")
    parser.add_argument("--rounds", type=int, default=3, help="alternations between the transports")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU measurement window")
    parser.add_argument("--quick", action="store_true", help="a short run (fewer iterations, 1 s idle)")
    parser.add_argument("--result-dir", default=str(RESULTS_DIR))
    parser.add_argument("--no-save", action="store_true", help="print only, write no JSON")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.iterations, args.idle_iterations, args.idle_seconds, args.rounds = 300, 20, 1.0, 1
    import uvloop

    results = uvloop.run(
        measure_all(args.transports, args.rounds, args.iterations, args.idle_iterations, args.idle_seconds)
    )
    print(render_table(results))
    record = {
        "benchmark": "ipc",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": os.sys.version.split()[0]},
        "what": "echo engine process (typed decode + re-encode per message, no scheduler or model)",
        "rounds": args.rounds,
        "payload_bytes": {p.name: p.wire_bytes for p in PAYLOADS},
        "results": results,
    }
    if not args.no_save:
        out_dir = Path(args.result_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"ipc-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(record, indent=2))
        print(f"\nwrote {path}")
    return 0
