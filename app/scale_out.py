"""How ``python -m app`` starts its engines: one child, a data-parallel group (processes,
Ray actors, or partly on headless hosts), or, with ``--headless``, only engines
that serve a frontend on another host. The flags are vLLM's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from app.frontend_config import ScaleOutConfig
from core.config import EngineArgs, EngineConfig

if TYPE_CHECKING:
    from core.client import AsyncMPClient, EngineLauncher
    from core.dp_client import DPAsyncMPClient
    from core.engine_process import EarlyEngine


def scale_out_error(scale: ScaleOutConfig, engine: EngineArgs) -> str | None:
    """What is wrong with the combination of scale-out flags, if anything."""
    size = engine.data_parallel_size
    local = engine.data_parallel_size_local
    if scale.api_server_count > 1:
        if engine.transport == "zmq":
            return "--api-server-count > 1 needs the shm transport"
        if scale.restart_dead_engines:
            return "--restart-dead-engines works with one API server process only"
        if scale.data_parallel_backend == "ray" or scale.headless or (local is not None and local < size):
            return "--api-server-count > 1 needs every engine on this host (-dp with the mp backend)"
    if scale.ray_engine_resources is not None and scale.data_parallel_backend != "ray":
        return "--ray-engine-resources needs --data-parallel-backend ray"
    if local is not None and not scale.headless and local < size and scale.data_parallel_backend == "ray":
        return "--data-parallel-size-local is for the mp backend (Ray places engines itself)"
    if local is not None and local > size:
        return "--data-parallel-size-local cannot exceed --data-parallel-size"
    start = scale.data_parallel_start_rank
    if scale.headless:
        if scale.data_parallel_address is None:
            return "--headless needs --data-parallel-address (the head's address)"
        if start + (local or size) > size:
            return "--data-parallel-start-rank + --data-parallel-size-local exceed --data-parallel-size"
    elif local is not None and local < size:
        if scale.data_parallel_address is None:
            return "engines on headless hosts need --data-parallel-address (this host's address)"
        if start != 0:
            return "--data-parallel-start-rank is for --headless hosts (the head runs ranks 0 ..)"
    return None


def start_engines(
    scale: ScaleOutConfig, config: EngineConfig, early: EarlyEngine | None = None
) -> AsyncMPClient | DPAsyncMPClient:
    """Start this frontend's engines (not waiting for them); RuntimeError/ValueError if Ray is unusable.
    ``early``: a process already importing the engine, which a lone local engine of a config it
    suits becomes; stopped otherwise."""
    parallel = config.parallel_config
    local = parallel.data_parallel_size_local
    lone = parallel.data_parallel_size == 1 and not scale.restart_dead_engines and scale.data_parallel_backend == "mp"
    if early is not None and not (lone and early.suits(config)):
        early.shutdown()  # it cannot be the engines below: stopped before they start
        early = None
    if lone:
        from core.client import AsyncMPClient

        return AsyncMPClient(config, wait=False, launcher=early)
    from core.dp_client import DPAsyncMPClient, engine_configs

    launcher: EngineLauncher | None = None
    if scale.data_parallel_backend == "ray":
        from core.ray_engines import RayLauncher

        resources = None if scale.ray_engine_resources is None else list(scale.ray_engine_resources)
        launcher = RayLauncher(engine_configs(config)[0], resources)
    elif local is not None and local < parallel.data_parallel_size:
        from core.headless import HeadLauncher

        launcher = HeadLauncher(config, scale.data_parallel_address, scale.data_parallel_rpc_port, 0, local)
    return DPAsyncMPClient(
        config, wait=False, restart_dead_engines=scale.restart_dead_engines, launcher=launcher,
        prefix_affinity=scale.prefix_affinity,
    )


def run_headless_host(scale: ScaleOutConfig, config: EngineConfig) -> int:
    """``--headless``: this host's engines, for the head at --data-parallel-address."""
    from core.dp_client import engine_configs
    from core.headless import run_headless

    start = scale.data_parallel_start_rank
    local = config.parallel_config.data_parallel_size_local or config.parallel_config.data_parallel_size - start
    config = msgspec.structs.replace(
        config, parallel_config=msgspec.structs.replace(config.parallel_config, data_parallel_size_local=local)
    )
    configs = engine_configs(config)[start : start + local]
    assert scale.data_parallel_address is not None  # scale_out_error checked it
    return run_headless(configs, scale.data_parallel_address, scale.data_parallel_rpc_port)
