"""``--data-parallel-backend ray`` on a two-node Ray cluster that lives on this machine
(``ray.cluster_utils.Cluster``; the nodes differ by a custom resource). Engine 0 is
forced onto the head node, where the server runs, and engine 1 onto the second node:
engine 0 talks over the shared-memory rings (its actor maps ringllm segments), engine 1
over ZeroMQ/TCP (it maps none), and greedy outputs equal those of a one-engine server."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest

from tests.support.servers import mapped_segments

ray = pytest.importorskip("ray", reason="the Ray backend needs ray (pip install 'ringllm[ray]')")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.slow

MODEL = "stories260K"
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, Tom", "The sun was", "Mom said"]


@pytest.fixture(scope="module")
def cluster():
    # Ray starts its workers at nice 15 unless told otherwise: beside any busy process of nice 0
    # the engines' actors got a few percent of a core and did not start in minutes.
    head = {"num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": 100 << 20, "include_dashboard": False,
            "_system_config": {"worker_niceness": 0}}
    made = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    try:
        made.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=100 << 20)
        yield made
    finally:
        made.shutdown()


async def _greedy(server, ranks: list[int | None]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        done = await asyncio.gather(*(
            client.completions.create(
                model=MODEL, prompt=p, max_tokens=24, temperature=0,
                extra_body={} if rank is None else {"data_parallel_rank": rank},
            )
            for p, rank in zip(PROMPTS, ranks)
        ))
    finally:
        await client.close()
    return [c.choices[0].text for c in done]


# Alone: the two nodes' daemons and the engines' actors are a dozen processes, too many to start
# within the server's start-up time beside another worker's tests on a busy 2-core machine.
@pytest.mark.alone
def test_engines_on_two_ray_nodes_use_rings_here_and_tcp_there(cluster, server_factory, monkeypatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    server = server_factory([
        "-dp", "2", "--data-parallel-backend", "ray", "--ray-engine-resources", '[{"node_a": 1}, {"node_b": 1}]',
    ])
    log = server.log()
    pids = {int(j): int(pid) for j, pid, _ in re.findall(r"engine (\d) runs in Ray actor pid (\d+) over (\S+)", log)}
    assert re.search(r"engine 0 runs in Ray actor pid \d+ over shm rings", log)
    assert re.search(r"engine 1 runs in Ray actor pid \d+ over zmq/TCP", log)
    assert mapped_segments(pids[0]) and not mapped_segments(pids[1])

    ranks = [j % 2 for j in range(len(PROMPTS))]  # half on each engine
    two = asyncio.run(_greedy(server, ranks))
    unpinned = asyncio.run(_greedy(server, [None] * len(PROMPTS)))
    monkeypatch.delenv("RAY_ADDRESS")
    one = asyncio.run(_greedy(server_factory([]), [None] * len(PROMPTS)))
    assert two == one and unpinned == one

    server.stop()
    assert server.proc is not None and server.proc.returncode == 0
