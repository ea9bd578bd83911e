"""Several API server processes on one port (``--api-server-count M``).

This process becomes a supervisor. It creates every link (one ring pair per
API server and engine, M x N, and the load table with a column per API
server), starts the N EngineCore processes (each engine's input thread waits
on its M rings at once and answers each request on the ring it came by),
then M API server processes, which share the listening socket (one accept
queue; whichever process is free takes the next connection) and each adopt
their row of links (``client_index`` = their index). Each API server routes
on its own, reading the same load table; prometheus_client's multiprocess
mode (a private directory) makes any server's /metrics answer for all of them.

Shutdown: SIGTERM or SIGINT is passed to the API servers, which drain; once
they have exited the engines are stopped; a second SIGINT kills everything at
once. An API server that dies on its own takes the others down (status 1);
a dead engine is the API servers' business (they route around it, and exit
when none is left).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from app.frontend_config import FrontendConfig
from core.client import spawn_engine
from core.config import EngineConfig
from core.dp_client import EngineGroupSpec, engine_configs
from core.load import create_load_table
from core.transport import ClientTransport, TransportSpec

logger = logging.getLogger("ringllm.supervisor")

EXIT_API_SERVER_DIED = 1
ENGINE_STOP_GRACE_S = 5.0

def run_api_server(frontend: FrontendConfig, config: EngineConfig, sock: socket.socket, group: EngineGroupSpec) -> None:
    """Entry point of one API server process (spawned by the supervisor)."""
    logging.basicConfig(
        level=frontend.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [api {group.client_index}]: %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the event loop takes the signals over
    import uvloop

    from app.frontend import serve
    from core.dp_client import DPAsyncMPClient
    from core.protocol import EngineStartError

    engine_core = DPAsyncMPClient(config, wait=False, group=group, prefix_affinity=frontend.scale_out.prefix_affinity)
    try:
        code = uvloop.run(serve(config, engine_core, frontend, sock, client_index=group.client_index))
    except EngineStartError as exc:  # the engine logged why; the supervisor stops the others
        logger.error("%s", exc)
        code = EXIT_API_SERVER_DIED
    finally:
        engine_core.shutdown()
    sys.exit(code)


class Supervisor:
    """Owns the links, the engines and the API server processes (see the module docstring)."""

    def __init__(self, frontend: FrontendConfig, config: EngineConfig, sock: socket.socket) -> None:
        self.config = config
        self.num_servers = frontend.scale_out.api_server_count
        self.num_engines = config.parallel_config.data_parallel_size
        self.ctx = multiprocessing.get_context("spawn")
        self.metrics_dir = tempfile.mkdtemp(prefix="ringllm-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir  # inherited by the API servers
        # One load table per engine; API servers attach them at start, so the names stay
        # until the end (a SIGKILL of this process leaves these small files behind).
        self.tables = [create_load_table(self.num_servers) for _ in range(self.num_engines)]
        # links[i][j]: API server i <-> engine j. Kept open here until the end, so that
        # every name can be removed even if a process never attached.
        self.links: list[list[tuple[ClientTransport, TransportSpec]]] = [
            [ClientTransport.create("shm") for _ in range(self.num_engines)] for _ in range(self.num_servers)
        ]
        self.engines: list[multiprocessing.process.BaseProcess] = []
        for j, engine_config in enumerate(engine_configs(config)):
            specs = [self.links[i][j][1] for i in range(self.num_servers)]
            engine = spawn_engine(engine_config, specs, self.tables[j].name)
            engine.start()
            self.engines.append(engine)
        self.servers: list[multiprocessing.process.BaseProcess] = []
        for i in range(self.num_servers):
            group = EngineGroupSpec(
                i, [t.name for t in self.tables], [(self.links[i][j][1], e.pid) for j, e in enumerate(self.engines)]  # type: ignore[misc]
            )
            server = self.ctx.Process(
                target=run_api_server, args=(frontend, config, sock, group), name=f"ApiServer_{i}"
            )
            server.start()
            self.servers.append(server)
        sock.close()  # the API servers hold it
        self.stopping = False
        self.signals = 0

    def on_signal(self, sig: int, _frame: Any) -> None:
        self.signals += 1
        if self.signals > 1 and sig == signal.SIGINT:
            logger.warning("second SIGINT: killing every process now")
            for proc in (*self.servers, *self.engines):
                if proc.is_alive():
                    proc.kill()
            return
        if not self.stopping:
            logger.info("%s: stopping the API servers (they drain first)", signal.Signals(sig).name)
            self.stop_servers()

    def stop_servers(self) -> None:
        self.stopping = True
        for server in self.servers:
            if server.is_alive():
                server.terminate()

    def run(self) -> int:
        """Until every API server has exited; the exit code to return."""
        code = 0
        running = {server.sentinel: server for server in self.servers}
        while running:
            multiprocessing.connection.wait(list(running), timeout=1.0)  # is_alive reaps; a sentinel may lag
            for sentinel, server in list(running.items()):
                if server.is_alive():
                    continue
                del running[sentinel]
                server.join()
                if not self.stopping:
                    logger.error("API server %s exited (code %s); stopping the others", server.name, server.exitcode)
                    code = EXIT_API_SERVER_DIED
                    self.stop_servers()
                elif server.exitcode not in (0, None) and code == 0:
                    code = server.exitcode
        return code

    def close(self) -> None:
        """Stop the engines (they have nothing left to drain), remove every name."""
        for engine in self.engines:
            if engine.is_alive():
                engine.terminate()
        for engine in self.engines:
            engine.join(timeout=self.config.engine_drain_timeout + ENGINE_STOP_GRACE_S)
            if engine.is_alive():
                engine.kill()
                engine.join(timeout=5)
        for row in self.links:
            for transport, _ in row:
                transport.close()
        for table in self.tables:
            table.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def run_api_servers(frontend: FrontendConfig, config: EngineConfig, sock: socket.socket) -> int:
    """Serve with ``--api-server-count`` API server processes; the exit code."""
    supervisor = Supervisor(frontend, config, sock)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, supervisor.on_signal)
        logger.info(
            "%d API server processes and %d engines started (pids: API %s, engines %s)",
            supervisor.num_servers, supervisor.num_engines,
            [s.pid for s in supervisor.servers], [e.pid for e in supervisor.engines],
        )
        return supervisor.run()
    finally:
        supervisor.close()
