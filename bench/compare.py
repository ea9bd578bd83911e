"""``python -m bench compare``: our server against another OpenAI-compatible server, same load, taking turns.

The other server is any command line with ``{port}`` and ``{concurrency}``
placeholders, e.g. llama.cpp's ``llama-server`` through ../shared/peer::

    python -m bench compare --model ../shared/models/stories260K \\
        --peer-cmd 'bash ../shared/peer/run_peer.sh $LLAMA_PEER_DIR/models/stories260K-f32.gguf {port} {concurrency}' \\
        --concurrency 1 16 64 --repeats 2

For each concurrency and repeat, each server is started fresh and alone
(ours, then the peer: A B A B), measured with ``bench serve``'s random
workload (``--ignore-eos``, greedy, the same prompts for both), and stopped.
Besides ``serve``'s metrics, the server's CPU time (every process of it, from
/proc) is divided by the output tokens, and for a GGUF file one stream's
decode is set against ``bench membw`` probed just before and after each run.
The table gives the medians and the ratio ours / peer; the result JSON (named by
``--result-filename``, else by the date) and a PNG beside it go to ``--result-dir``.
"""

from __future__ import annotations

import argparse
import copy
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from app.launcher import REPO, ManagedServer
from bench.report import save_result
from bench.serve import BACKENDS, add_workload_arguments, run_benchmark, tokenizer_of

HELP = "our server vs another OpenAI-compatible server (e.g. llama.cpp), same load, alternately"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
CLOCK_TICKS = 100  # os.sysconf("SC_CLK_TCK") on Linux


class CommandServer(ManagedServer):
    """A server started from a command template (``{port}``, ``{concurrency}``), with /health."""

    def __init__(self, template: str, concurrency: int, log_path: Path, timeout: float) -> None:
        super().__init__([], log_path, timeout)
        self.template = template
        self.concurrency = concurrency

    def command(self, port: int) -> list[str]:
        return ["bash", "-c", "exec " + self.template.format(port=port, concurrency=self.concurrency)]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` alone, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc)."""
    found, pending = [], [pid]
    while pending:
        p = pending.pop()
        if p in found:
            continue
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append(p)
    return found


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its descendants (Linux /proc)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            total += process_cpu_s(p)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _tree_kib(pid: int, path: str, field: str) -> int:
    """The sum of one /proc field (in kB) over ``pid`` and its descendants."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/{path}").read_text().splitlines():
                if line.startswith(field):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def process_tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, MiB (VmRSS: file-mapped weights included;
    a page that several of them map counts once in each)."""
    return _tree_kib(pid, "status", "VmRSS:") / 1024


def process_tree_pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` and its descendants, MiB: every resident page once, a page
    shared by n processes counted 1/n in each. Of a multi-process server this is the memory it
    holds; the sum of RSS counts each shared library's pages and the IPC rings once per process."""
    return _tree_kib(pid, "smaps_rollup", "Pss:") / 1024


def _matrices(model: str) -> dict[str, tuple[object, float]] | None:
    """A GGUF file's matrices: name -> (tensor info, the share of it one token uses: of a mixture
    of experts' stacked expert tensors, its k experts' share; else all)."""
    if not model.endswith(".gguf"):
        return None
    from core.models.gguf_header import GGUFHeader

    with GGUFHeader(model) as header:
        arch = header.get("general.architecture")
        used, experts = header.get(f"{arch}.expert_used_count"), header.get(f"{arch}.expert_count")
        share = used / experts if used and experts else 1.0
        return {name: (t, share if len(t.shape) == 3 else 1.0)
                for name, t in header.tensors.items() if len(t.shape) in (2, 3)}


def weight_bytes_per_token(model: str) -> int | None:
    """The bytes of weights one stream's decode step reads, for a GGUF file: every matrix but
    the embedding, which is looked up by row (unless the head is tied to it, reading it whole),
    and of a mixture of experts' stacked expert tensors the share a token's k experts are."""
    from core.models.gguf_checkpoint import tensor_bytes

    matrices = _matrices(model)
    if matrices is None:
        return None
    sizes = {name: tensor_bytes(t) * share for name, (t, share) in matrices.items()}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return int(sum(sizes.values()))


def prefill_macs_per_token(model: str) -> int | None:
    """The multiply-adds of one prompt token's products in a prefill, for a GGUF file: every matrix
    but the embedding (looked up) and the head (a prompt samples from its last token only), a
    mixture's experts by their share."""
    matrices = _matrices(model)
    if matrices is None:
        return None
    return int(sum(math.prod(t.shape) * share for name, (t, share) in matrices.items()
                   if name not in ("token_embd.weight", "output.weight")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("compare")
    g.add_argument("--model", required=True, help="our model directory or GGUF file (also the tokenizer of both)")
    g.add_argument("--server-args", default="", help="arguments for our server, e.g. '--max-model-len 512'")
    g.add_argument("--peer-cmd", required=True, help="the other server's command, with {port} and {concurrency}")
    g.add_argument("--peer-name", default="peer", help="its name in the table")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    g.add_argument("--prompts-per-stream", type=int, default=4, help="requests per concurrent stream (at least 8 in all, unless --num-prompts says)")
    g.add_argument("--repeats", type=int, default=2)
    g.add_argument("--server-timeout", type=float, default=300.0)
    g.add_argument("--endpoint", help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    add_workload_arguments(parser)
    parser.set_defaults(random_input_len=128, random_output_len=128, ignore_eos=True, disable_tqdm=True,
                        result_dir=str(RESULTS_DIR), num_prompts=None)


def measure(server: ManagedServer, args: argparse.Namespace, concurrency: int, tokenizer: str) -> dict[str, Any]:
    """One run against a started server: serve's result plus server CPU per output token."""
    ns = copy.copy(args)
    ns.base_url, ns.host, ns.port = server.base_url, None, None
    ns.model, ns.served_model_name, ns.tokenizer = None, None, tokenizer
    ns.max_concurrency = concurrency
    # --num-prompts, when given, replaces the count (long prompts on a big model: fewer of them).
    ns.num_prompts = args.num_prompts or max(8, concurrency * args.prompts_per_stream)
    ns.save_result = False
    ns.ready_check_timeout_sec = 60.0
    ns.label = server.log_path.stem
    assert server.proc is not None
    before = process_tree_cpu_s(server.proc.pid)
    result = run_benchmark(ns)
    cpu = process_tree_cpu_s(server.proc.pid) - before
    result["server_cpu_ms_per_token"] = cpu * 1e3 / max(result["total_output_tokens"], 1)
    result["server_rss_mb"] = process_tree_rss_mb(server.proc.pid)
    result["server_pss_mb"] = process_tree_pss_mb(server.proc.pid)
    result["startup_s"] = server.ready_s
    return result


ROWS = [
    ("output_throughput", "output tok/s"),
    ("median_tpot_ms", "median TPOT ms"),
    ("median_ttft_ms", "median TTFT ms"),
    ("server_cpu_ms_per_token", "server CPU ms/token"),
    ("startup_s", "start-up s"),
    ("server_rss_mb", "RSS MiB after the run"),
    ("server_pss_mb", "PSS MiB after the run"),
]


def run(args: argparse.Namespace) -> int:
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    ours_args = ["--model", args.model, *shlex.split(args.server_args)]
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    weights = weight_bytes_per_token(args.model)
    with tempfile.TemporaryDirectory(prefix="ringllm-compare-") as logs:
        for concurrency in args.concurrency:
            runs: dict[str, list[dict[str, Any]]] = {"ringllm": [], args.peer_name: []}
            for repeat in range(args.repeats):
                for name in runs:
                    log = Path(logs) / f"{name}-c{concurrency}-r{repeat}.log"
                    if name == "ringllm":
                        server: ManagedServer = ManagedServer(ours_args, log, args.server_timeout)
                    else:
                        server = CommandServer(args.peer_cmd, concurrency, log, args.server_timeout)
                    print(f"\n### {name}, {concurrency} streams, run {repeat + 1}")
                    with server:
                        # One stream's decode is read against the memory's bandwidth: probed with the
                        # server up and idle, just before and just after its run (this machine's
                        # bandwidth moves by the minute; a probe taken later misreads the run).
                        paired = concurrency == 1 and weights is not None
                        before = _membw() if paired else None
                        result = measure(server, args, concurrency, tokenizer_of(args.model) or args.model)
                        if paired:
                            result["membw_gb_s"] = [before, _membw()]
                        runs[name].append(result)
            results[concurrency] = runs
    table = comparison_table(results, args.peer_name)
    if 1 in results:
        table += probe_lines(args.model, results[1], args.random_input_len)
    print("\n" + table)
    summary = {
        "date": date, "model": args.model, "peer_cmd": args.peer_cmd, "server_args": args.server_args,
        "input_len": args.random_input_len, "output_len": args.random_output_len, "repeats": args.repeats,
        "results": {
            str(c): {name: [{k: r.get(k) for k in (*(key for key, _ in ROWS), "membw_gb_s")} for r in rs]
                     for name, rs in runs.items()}
            for c, runs in results.items()
        },
        "table": table,
    }
    path = Path(args.result_dir) / (args.result_filename or f"compare-{date}.json")
    save_result(summary, path)
    plot(results, args.peer_name, path.with_suffix(".png"), Path(args.model).name)
    print(f"saved {path} and its .png")
    return 0


_MEMBW_PROBE = (
    "import statistics; from bench.membw import measure; print(statistics.median(measure(tries=5, hugepages=True)))"
)


def _membw() -> float:
    """``bench membw --hugepages``' median read bandwidth now, GB/s: on huge pages, as the page
    cache holds the weights' files here (large folios), where the default's 4 KiB pages read
    slower and made a decode look faster than memory (bench/README.md). In a child process:
    this one, mapping torch's libraries, would share their pages with our engine and so lower
    the PSS measured of it."""
    probe = subprocess.run([sys.executable, "-c", _MEMBW_PROBE], check=True, capture_output=True, text=True, cwd=REPO)
    return float(probe.stdout.split()[-1])


def bandwidth_line(name: str, weights: int, runs: list[dict[str, Any]]) -> str:
    """One stream's decode against the bandwidth probed around each of its runs: weights per
    token / the run's median TPOT, as a share of the mean of the probe before and after it."""
    from bench.membw import bandwidth_fraction

    rates, shares, probes = [], [], []
    for r in runs:
        tpot, floor = r["median_tpot_ms"] / 1e3, statistics.mean(r["membw_gb_s"])
        rates.append(weights / tpot / 1e9)
        shares.append(bandwidth_fraction(weights, tpot, floor))
        probes += r["membw_gb_s"]
    return (f"\n{name}, one stream: {weights / 1e9:.2f} GB of weights per token / TPOT = "
            f"{statistics.median(rates):.1f} GB/s, {statistics.median(shares):.0%} of what bench membw "
            f"read around the same run (runs {', '.join(f'{x:.0%}' for x in shares)}; "
            f"probes {min(probes):.1f}-{max(probes):.1f} GB/s)")


def probe_lines(model: str, one_stream: dict[str, list[dict[str, Any]]], input_len: int) -> str:
    """One stream's decode against the memory's bandwidth (bench membw, probed around each run) and
    its prefill against the int8 peak (bench int8peak, probed now), for each server."""
    weights, macs = weight_bytes_per_token(model), prefill_macs_per_token(model)
    if weights is None or macs is None:
        return ""
    from bench.int8peak import measure as int8_probe, peak_fraction

    peaks = int8_probe()
    lines = ""
    for name, rs in one_stream.items():
        lines += bandwidth_line(name, weights, rs)
        rate = input_len / (_median(rs, "median_ttft_ms") / 1e3)
        lines += (f"\n{name}, prefill: {input_len} tokens / TTFT = {rate:.1f} prompt tok/s x "
                  f"{macs / 1e9:.2f} GMAC = {rate * macs / 1e9:.1f} GMAC/s")
        if peaks:
            peak = statistics.median(peaks)
            lines += (f", {peak_fraction(macs, rate, peak):.0%} of the {peak:.1f} GMAC/s that bench int8peak "
                      "measures now")
    return lines


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def comparison_table(results: dict[int, dict[str, list[dict[str, Any]]]], peer: str) -> str:
    header = ["streams", *(f"{label} (ringllm / {peer})" for _, label in ROWS), "tok/s ratio", "spread ringllm / peer"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for concurrency, runs in results.items():
        ours, theirs = runs["ringllm"], runs[peer]
        cells = [str(concurrency)]
        for key, _ in ROWS:
            cells.append(f"{_median(ours, key):.2f} / {_median(theirs, key):.2f}")
        cells.append(f"{_median(ours, 'output_throughput') / _median(theirs, 'output_throughput'):.2f}")
        spread = [
            f"{min(r['output_throughput'] for r in rs):.0f}-{max(r['output_throughput'] for r in rs):.0f}"
            for rs in (ours, theirs)
        ]
        cells.append(" / ".join(spread))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def plot(results: dict[int, dict[str, list[dict[str, Any]]]], peer: str, path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, label) in zip(axes, [ROWS[0], ROWS[1]]):
        width = 0.38
        for i, name in enumerate(["ringllm", peer]):
            values = [_median(results[c][name], key) for c in levels]
            ax.bar([x + (i - 0.5) * width for x in range(len(levels))], values, width, label=name)
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_title(label)
        ax.legend()
    fig.suptitle(f"{model}: ringllm vs {peer} (medians)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

