"""``python -m bench sweep``: the same ``serve`` workload against several server configurations.

For each ``--config NAME='SERVER ARGS'`` (default: ``shm='--transport shm'``
and ``zmq='--transport zmq'``) a real ``python -m app`` is started. All
servers are started first (side by side, which saves start-up time) and stay
up, idle while another one is measured, so that with ``--repeats N`` the runs
alternate between configurations (A B A B ...) and a load that drifts on a
shared machine hits them all alike. The
table shows each metric's median over the repeats (or, with ``--aggregate
best``, the run with the best output throughput: the least disturbed one on a
shared machine) and each configuration's ratio to the first. A configuration whose server does not start, or whose run
fails, is reported in the table and the sweep goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import re
import shlex
import statistics
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from app.launcher import REPO, ManagedServer, ServerStartError
from bench.compare import process_cpu_s, process_tree_cpu_s, process_tree_pss_mb, process_tree_rss_mb
from bench.report import percentile_key, save_result
from bench.serve import BACKENDS, add_workload_arguments, run_benchmark, tokenizer_of

HELP = "start our server once per configuration and compare the same workload across them"
DEFAULT_CONFIGS = ["shm=--transport shm", "zmq=--transport zmq"]

# (result key, label, True when higher is better); latency rows are added per percentile.
THROUGHPUT_ROWS = [
    ("completed", "Successful requests", True),
    ("failed", "Failed requests", False),
    ("duration", "Benchmark duration (s)", False),
    ("request_throughput", "Request throughput (req/s)", True),
    ("output_throughput", "Output token throughput (tok/s)", True),
    ("total_token_throughput", "Total token throughput (tok/s)", True),
    ("max_output_tokens_per_s", "Peak output token throughput (tok/s)", True),
    ("max_concurrent_requests", "Peak concurrent requests", True),
    ("client_cpu_s", "Benchmark client CPU (s)", False),
    ("frontend_cpu_us_per_token", "Frontend CPU per output token (us)", False),
    ("server_cpu_us_per_token", "Server CPU per output token, engine included (us)", False),
    ("server_rss_mb", "Server RSS after the run (MiB)", False),
    ("server_pss_mb", "Server PSS after the run (MiB)", False),
    ("spec_decode_acceptance_rate", "Speculative decoding acceptance rate (%)", True),
    ("spec_decode_acceptance_length", "Speculative decoding acceptance length", True),
]
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


@dataclass
class ConfigRun:
    """One server configuration: its arguments, its server, and the result of each repeat."""

    name: str
    server_args: list[str]
    tree: Path | None = None  # another source tree's app (NAME@TREE), else this one's
    server: ManagedServer | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    aggregate: str = "median"

    def value(self, key: str) -> Any:
        """The key's median over the repeats, or its value in the best run (None without any result).

        The best run is the one with the highest output throughput: on a shared
        machine, the run that other processes disturbed least.
        """
        if self.aggregate == "best" and self.results:
            return max(self.results, key=lambda r: r["output_throughput"]).get(key)
        values = [r[key] for r in self.results if isinstance(r.get(key), (int, float))]
        if not values:
            return None
        if all(isinstance(v, int) for v in values):  # counts stay whole: the lower middle value
            return statistics.median_low(values)
        return statistics.median(values)


def parse_config(text: str) -> tuple[str, list[str], Path | None]:
    """NAME='SERVER ARGS', or NAME@TREE='SERVER ARGS' to run the app of another source tree
    (a checkout of another commit: an A/B of two versions, alternated like any two configs)."""
    name, sep, args = text.partition("=")
    name, at, tree = name.strip().partition("@")
    if not sep or not name or (at and not Path(tree, "app", "__main__.py").is_file()):
        raise argparse.ArgumentTypeError(f"--config {text!r}: expected NAME='SERVER ARGS' or NAME@TREE='SERVER ARGS'")
    return name, shlex.split(args), Path(tree).resolve() if at else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sweep")
    g.add_argument("--config", action="append", type=parse_config, metavar="NAME[@TREE]='ARGS'",
                   help="a server configuration (repeatable); default: " + ", ".join(DEFAULT_CONFIGS))
    g.add_argument("--model", help="model directory for every server (default: the random-weights test model, "
                                   "core/models/random_model.py)")
    g.add_argument("--server-args", default="", help="arguments given to every server, e.g. '--seed 0'")
    g.add_argument("--server-timeout", type=float, default=300.0, help="seconds for a server to become healthy")
    g.add_argument("--log-dir", help="keep each server's log here (default: a temporary directory, removed "
                   "afterwards; a server that fails to start has its log's tail in the report either way)")
    g.add_argument("--repeats", type=int, default=1, help="runs per configuration, alternating between them")
    g.add_argument("--aggregate", choices=["median", "best"], default="median",
                   help="over the repeats: each metric's median, or the run with the best output throughput")
    g.add_argument("--endpoint", help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    add_workload_arguments(parser)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (the sweep ignores EOS by default)")
    # A sweep compares transports under load: 64 streams of fixed length by default.
    parser.set_defaults(
        num_prompts=256, max_concurrency=64, random_input_len=128, random_output_len=128,
        ignore_eos=True, disable_tqdm=True,
    )


# Seeds between repeats: each repeat draws its own prompts (and warm-ups, with the next seed), since
# a server kept across repeats would serve an earlier repeat's prompts from its prefix cache.
REPEAT_SEED_STRIDE = 1000


def serve_args_for(args: argparse.Namespace, config: ConfigRun, model_dir: str, tag: str,
                   repeat: int) -> argparse.Namespace:
    """The ``serve`` options of repeat ``repeat`` against one configuration's server."""
    assert config.server is not None
    ns = copy.copy(args)
    ns.base_url, ns.host, ns.port = config.server.base_url, None, None
    ns.model, ns.served_model_name = None, None  # the model name from /v1/models
    ns.tokenizer = tokenizer_of(model_dir) or model_dir  # a GGUF file: the directory made from its metadata
    ns.ready_check_timeout_sec = 60.0
    ns.label = config.name
    ns.result_filename = f"sweep-{tag}.json"
    ns.seed = args.seed + REPEAT_SEED_STRIDE * repeat
    return ns


def start_servers(configs: list[ConfigRun], args: argparse.Namespace, model_dir: str, log_dir: Path) -> None:
    """Start every configuration's server (all launched, then awaited); failures become errors."""
    for config in configs:
        server_args = ["--model", model_dir, *shlex.split(args.server_args), *config.server_args]
        print(f"### {config.name}: python -m app {shlex.join(server_args)}")
        if config.tree is not None:
            print(f"### {config.name} runs the app of {config.tree}")
        tree = config.tree or REPO
        config.server = ManagedServer(server_args, log_dir / f"{config.name}.log", args.server_timeout, tree).launch()
    for config in configs:
        assert config.server is not None
        try:
            config.server.wait_ready()
        except ServerStartError as exc:
            config.server.stop()
            config.error = f"server did not start: {exc}"
            kept = f"\n(log: {config.server.log_path})" if args.log_dir else ""
            print(f"### {config.name} FAILED: {config.error}{kept}")


def engine_pids(log_path: Path) -> list[int]:
    """The engines' pids, from the line each one logs when it is ready."""
    text = log_path.read_text(errors="replace")
    return [int(pid) for pid in re.findall(r"EngineCore \d+ \(pid (\d+)\) ready", text)]


def frontend_cpu_s(pid: int, engines: list[int]) -> float:
    """CPU seconds of the server's processes other than its engines."""
    total = process_tree_cpu_s(pid)
    for engine in engines:
        try:
            total -= process_cpu_s(engine)
        except OSError:  # gone (restarted): its time left the tree with it
            pass
    return total


def run_once(config: ConfigRun, args: argparse.Namespace, model_dir: str, tag: str, repeat: int) -> None:
    """One run of the workload against the configuration's server; a failure is kept as its error."""
    print(f"\n### {config.name}: {tag}")
    assert config.server is not None and config.server.proc is not None
    pid = config.server.proc.pid
    try:
        # The frontend is the server's process tree less its engines (one frontend
        # process, or a supervisor and its API server processes).
        engines = engine_pids(config.server.log_path)
        frontend, server = frontend_cpu_s(pid, engines), process_tree_cpu_s(pid)
        result = run_benchmark(serve_args_for(args, config, model_dir, tag, repeat))
        tokens = max(result["total_output_tokens"], 1)
        result["frontend_cpu_us_per_token"] = (frontend_cpu_s(pid, engines) - frontend) * 1e6 / tokens
        result["server_cpu_us_per_token"] = (process_tree_cpu_s(pid) - server) * 1e6 / tokens
        result["server_rss_mb"] = process_tree_rss_mb(pid)  # the server stays up: what its runs so far left
        result["server_pss_mb"] = process_tree_pss_mb(pid)
        config.results.append(result)
    except (ValueError, RuntimeError, OSError) as exc:
        config.error = f"benchmark failed: {exc}"
        print(f"### {config.name} FAILED: {config.error}")


def table_rows(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    rows = list(THROUGHPUT_ROWS)
    for name in [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]:
        label = LATENCY_NAMES[name]
        rows.append((f"mean_{name}_ms", f"Mean {label} (ms)", False))
        rows.append((f"median_{name}_ms", f"Median {label} (ms)", False))
        for p in percentiles:
            if p == 50:
                continue  # the median, already there
            key = percentile_key(p)
            rows.append((f"{key}_{name}_ms", f"{key.upper()} {label} (ms)", False))
    return rows


def short_error(error: str) -> str:
    """First and last line of an error (what failed, and the exception that says why)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def comparison_table(configs: list[ConfigRun], rows: list[tuple[str, str, bool]]) -> str:
    """A text table of every configuration's medians and their ratio to the first one's."""
    base = configs[0]
    header = ["metric", *(c.name for c in configs), *(f"{c.name}/{base.name}" for c in configs[1:])]
    body = []
    for key, label, _ in rows:
        line = [label]
        for c in configs:
            line.append("FAILED" if not c.results else _cell(c.value(key)))
        for c in configs[1:]:
            a, b = base.value(key), c.value(key)
            line.append(f"{b / a:.3f}" if a and b is not None else "-")
        body.append(line)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:  # labels left, numbers right
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    out = [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in body)]
    for c in configs:
        if len(c.results) > 1:
            runs = ", ".join(f"{r['output_throughput']:.0f}" for r in c.results)
            out.append(f"{c.name}: output tok/s of each run: {runs}")
    for c in configs:
        if c.error:
            out.append(f"{c.name}: {short_error(c.error)}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    pairs = args.config or [parse_config(c) for c in DEFAULT_CONFIGS]
    configs = [ConfigRun(name, a, tree, aggregate=args.aggregate) for name, a, tree in pairs]
    if len({c.name for c in configs}) != len(configs):
        print("error: --config names must be distinct")
        return 2
    if args.repeats < 1:
        print("error: --repeats must be at least 1")
        return 2
    model_dir = args.model
    if model_dir is None:
        from core.models.random_model import ensure_random_model

        model_dir = ensure_random_model()
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    with contextlib.ExitStack() as servers:
        if args.log_dir:
            log_dir = Path(args.log_dir)
        else:
            log_dir = Path(servers.enter_context(tempfile.TemporaryDirectory(prefix=f"ringllm-sweep-{date}-")))
        for config in configs:
            servers.callback(lambda c=config: c.server and c.server.stop())
        start_servers(configs, args, model_dir, log_dir)
        for repeat in range(args.repeats):
            for config in configs:
                if not config.error:
                    run_tag = f"-run{repeat + 1}" if args.repeats > 1 else ""
                    run_once(config, args, model_dir, f"{date}-{config.name}{run_tag}", repeat)

    rows = table_rows(args)
    workload = (
        f"{args.num_prompts} requests, dataset {args.dataset_name}, max concurrency {args.max_concurrency}, "
        f"request rate {args.request_rate}, model {model_dir}; {args.aggregate} of {args.repeats} run(s) each"
    )
    print("\n" + " Sweep comparison ".center(50, "=") + f"\n{workload}\n" + comparison_table(configs, rows))
    summary = {
        "date": date,
        "workload": workload,
        "configs": [
            {"name": c.name, "server_args": c.server_args, "error": c.error or None, "runs": len(c.results),
             **{key: c.value(key) for key, _, _ in rows}}
            for c in configs
        ],
    }
    if args.save_result:
        path = Path(args.result_dir) / (args.result_filename or f"sweep-{date}.json")
        save_result(summary, path)
        print(f"sweep summary saved to {path}")
    return 0 if all(c.results and not c.error and c.value("completed") for c in configs) else 1
