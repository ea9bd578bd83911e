"""The start-up banner: what is served, how, and where to find it.

One short block, logged once the engine is ready, so that a new user sees
the URL of the chat page and an operator sees the KV cache the engine got
without reading the rest of the log.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Sequence

from core.protocol import HandshakeReady

_TRANSPORTS = {"shm": "shared-memory rings", "zmq": "ZeroMQ sockets"}


def display_host(host: str) -> str:
    """A host for URLs a user can open: the loopback address for a wildcard bind."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host or "127.0.0.1"
    if address.is_unspecified:
        return "127.0.0.1" if address.version == 4 else "[::1]"
    return f"[{host}]" if address.version == 6 else host


def binary_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at least 1, to one decimal: 3.5 GiB."""
    size, unit = float(nbytes), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{nbytes:,} bytes" if unit == "bytes" else f"{size:.1f} {unit}"


def format_banner(
    *,
    model: str,
    served_names: Sequence[str],
    ready: HandshakeReady,
    transport: str,
    host: str,
    port: int,
    routes: Collection[str],
    engines: int = 1,
    api_servers: int = 1,
) -> str:
    """The banner's text; ``routes`` are the app's paths, so only pages that exist are listed.
    ``engines``, ``api_servers``: data-parallel engines (the KV cache line is per engine) and
    API server processes."""
    base = f"http://{display_host(host)}:{port}"
    aliases = f" (also answers to {', '.join(served_names[1:])})" if len(served_names) > 1 else ""
    device = f" on {ready.device}" if ready.device else ""
    tokens = ready.num_gpu_blocks * ready.block_size
    held = f" = {tokens:,} tokens" if ready.kv_cache_groups == 1 else (
        f", shared by {ready.kv_cache_groups} groups of layers (sliding windows hold only theirs)"
    )
    lines = [
        "ringllm is ready",
        f"  model      {served_names[0]}{aliases}, from {model}",
        f"  dtype      {ready.dtype or 'unknown'}{device}",
        (
            "  KV cache   none (an encoder keeps nothing between steps); "
            if ready.kv_cache_dtype == "none" else
            f"  KV cache   {ready.num_gpu_blocks:,} blocks x {ready.block_size} tokens{held}"
            + (f" of {ready.kv_cache_dtype}" if ready.kv_cache_dtype else "")
            + (f", {binary_size(ready.kv_cache_bytes)}" if ready.kv_cache_bytes else "") + "; "
        )
        + f"max_model_len {ready.max_model_len:,}" + (f"; in each of {engines} engines" if engines > 1 else ""),
        f"  transport  {transport} ({_TRANSPORTS.get(transport, transport)})",
    ]
    if api_servers > 1:
        lines.append(f"  processes  {api_servers} API servers on the port")
    if "/" in routes:
        lines.append(f"  chat page  {base}/")
    lines.append(f"  API        {base}/v1")
    if "/metrics" in routes:
        lines.append(f"  metrics    {base}/metrics")
    return "\n".join(lines)
