"""Data-parallel engines placed by Ray (``--data-parallel-backend ray``).

Ray decides where engines run; we write no cluster manager. The launcher
connects to the cluster (``RAY_ADDRESS``, else a local Ray is started), reserves
one placement-group bundle per engine (its threads' worth of CPUs plus any
custom resources given per engine), and starts each engine as an actor in its
bundle. The actor's one method runs the engine's busy loop until it stops.

Transport, chosen per engine: an engine whose bundle is on this node gets the
shared-memory rings (and writes its row of the load table); one on another node
gets the ZeroMQ transport over TCP to this node's address, and its load is
estimated by the client from what it has routed there.

Ray is an optional dependency (``pip install 'ringllm[ray]'``); only this
module imports it, and only when this backend is chosen.
"""

from __future__ import annotations

import logging
import os
import select
from typing import Any

from core.config import EngineConfig
from core.transport import TransportSpec

logger = logging.getLogger("ringllm.ray")

PLACEMENT_TIMEOUT_S = 120.0


class _EngineActor:
    """Body of the Ray actor that hosts one EngineCore (made a remote class lazily)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, config: EngineConfig, spec: TransportSpec, frontend_pid: int | None, load_table: str | None) -> int:
        """Serve until the engine stops; its exit code."""
        from core.thread_pools import configure_cpu_threads, set_thread_count

        configure_cpu_threads(encoder=config.model_config.encoder)
        set_thread_count(config.parallel_config.engine_threads)
        if config.parallel_config.engine_threads is not None:
            import torch

            torch.set_num_threads(config.parallel_config.engine_threads)  # the pool may exist already in a Ray worker
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine] %(message)s")
        from core.engine_core import serve_engine

        return serve_engine(config, [spec], load_table, parent_pid=frontend_pid, frontend_is_parent=False)


class RayEngineHandle:
    """A started engine actor, looked at as a process (what ``MPClient`` needs)."""

    def __init__(self, actor: Any, run_ref: Any, pid: int, local: bool) -> None:
        self.actor = actor
        self.run_ref = run_ref
        self.pid = pid
        self.exitcode: int | None = None
        # On this node the actor's process can be watched like a child's.
        self.sentinel = os.pidfd_open(pid) if local else None

    def is_alive(self) -> bool:
        if self.sentinel is not None:
            return not select.select([self.sentinel], [], [], 0)[0]
        import ray

        done, _ = ray.wait([self.run_ref], timeout=0)
        return not done

    def terminate(self) -> None:
        """Ray cannot signal a process on another node: the actor is killed (the frontend
        has drained its requests by then)."""
        self.kill()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.run_ref], timeout=timeout)
        if not self.is_alive() and self.exitcode is None:
            try:
                self.exitcode = int(ray.get(self.run_ref, timeout=0))
            except Exception:  # noqa: BLE001 - killed or crashed: no code of its own
                self.exitcode = -9


class RayLauncher:
    """One placement group for the data-parallel engines; ``launch`` starts one of them."""

    def __init__(self, config: EngineConfig, engine_resources: list[dict[str, float]] | None = None) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, placement_group_table
        except ImportError as exc:
            raise RuntimeError("--data-parallel-backend ray needs Ray: pip install 'ringllm[ray]'") from exc
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING, log_to_driver=False)
        size = config.parallel_config.data_parallel_size
        extra = engine_resources or [{} for _ in range(size)]
        if len(extra) != size:
            raise ValueError(f"--ray-engine-resources names {len(extra)} engines, -dp is {size}")
        cpus = float(config.parallel_config.engine_threads or 1)
        self.bundles = [{"CPU": cpus, **resources} for resources in extra]
        self.group = placement_group(self.bundles, strategy="PACK")
        ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        self._local = [nodes[j] == here for j in range(size)]
        self.frontend_host = ray.util.get_node_ip_address()
        self._actor_class = ray.remote(_EngineActor)
        self.handles: dict[int, RayEngineHandle] = {}
        logger.info(
            "Ray placed %d engines: %s", size,
            ", ".join(f"{j} {'here (rings)' if local else 'on node ' + nodes[j][:8] + ' (TCP)'}"
                      for j, local in enumerate(self._local)),
        )

    def is_local(self, engine_index: int) -> bool:
        return self._local[engine_index]

    def can_restart(self, engine_index: int) -> bool:
        return True  # a new actor in the same bundle

    def launch(self, config: EngineConfig, spec: TransportSpec, load_table: str | None) -> RayEngineHandle:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        j = config.parallel_config.data_parallel_rank
        bundle = self.bundles[j]
        actor = self._actor_class.options(
            num_cpus=bundle["CPU"],
            resources={k: v for k, v in bundle.items() if k != "CPU"},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=j),
        ).remote()
        pid = ray.get(actor.pid.remote(), timeout=PLACEMENT_TIMEOUT_S)
        local = self._local[j]
        frontend_pid = os.getpid() if local else None
        run_ref = actor.run.remote(config, spec, frontend_pid, load_table)
        handle = RayEngineHandle(actor, run_ref, pid, local)
        self.handles[j] = handle
        logger.info("engine %d runs in Ray actor pid %d over %s", j, pid, "shm rings" if local else "zmq/TCP")
        return handle

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in self.handles.values():
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - the cluster is gone already
            pass
