"""Three Ray nodes on one machine, each on its own loopback address: the
router on the head (127.0.0.2), prefill pinned to 127.0.0.3 by a node
label, decode pinned by a custom resource to 127.0.0.4. Greedy output equals the engine alone, KV
blocks cross nodes at the addresses Ray gives each node, and when the
decode node is stopped the pool recovers on the node left that offers its
resource."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM
from protocol.sampling import SamplingParams
from tests.integration.local_cluster import LocalRayCluster, ray_cli_available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(1200),  # three Ray nodes started, one lost and recovered
    pytest.mark.skipif(not ray_cli_available(), reason="the `ray` command is not installed"),
]

DRIVER = Path(__file__).with_name("multinode_driver.py")
PREFILL_IP, DECODE_IP = "127.0.0.3", "127.0.0.4"


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def _read(driver: subprocess.Popen, phase: str) -> dict:
    for line in driver.stdout:
        if line.startswith("{"):
            message = json.loads(line)
            assert message["phase"] == phase
            return message
    raise AssertionError(f"the driver exited (rc {driver.wait()}) before phase {phase!r}")


def _by_role(workers: dict[str, dict], role: str) -> list[dict]:
    return [w for w in workers.values() if w["role"] == role]


def test_pools_on_separate_nodes_recover_from_a_lost_node(tmp_path):
    from tests.integration.multinode_driver import MAX_TOKENS, prompts

    cluster = LocalRayCluster(log_dir=tmp_path)
    driver = None
    try:
        cluster.start_head(num_cpus=0)  # the router only: no worker lands here
        cluster.wait_for_nodes(1)
        # 127.0.0.3 is the prefill node (label pool=prefill) with a spare
        # decode slot; 127.0.0.4 is a decode node. Ray puts the decode worker
        # on the emptier node, 127.0.0.4, while both are up.
        cluster.add_node(PREFILL_IP, 2, {"decode_node": 1}, labels={"pool": "prefill"})
        cluster.wait_for_nodes(2)
        decode_node = cluster.add_node(DECODE_IP, 2, {"decode_node": 1})
        cluster.wait_for_nodes(3)
        driver = subprocess.Popen(
            [sys.executable, str(DRIVER), cluster.address],
            env=cluster.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "driver.log", "w"),  # noqa: SIM115
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        placed = _read(driver, "placed")

        (prefill,) = _by_role(placed["workers"], "prefill")
        (decode,) = _by_role(placed["workers"], "decode")
        assert prefill["node_ip"] == PREFILL_IP
        assert decode["node_ip"] == DECODE_IP, "Ray placed the decode worker on the prefill node"
        # Each worker advertises its node's address, not 127.0.0.1.
        assert _host(prefill["kv"]) == PREFILL_IP
        assert _host(decode["kv"]) == _host(decode["outputs"]) == DECODE_IP

        llm = LLM(None, kv_cache_memory_bytes=16 << 20)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        reference = [r.token_ids for r in llm.generate(prompts(), params)]
        assert placed["outputs"] == reference

        cluster.stop_node(decode_node)
        driver.stdin.write("go\n")
        driver.stdin.flush()
        recovered = _read(driver, "recovered")

        assert recovered["dropped"] == [n for n, w in placed["workers"].items() if w is decode]
        (new_decode,) = _by_role(recovered["workers"], "decode")
        assert new_decode["node_ip"] == PREFILL_IP  # the only node left with decode_node
        assert _host(new_decode["kv"]) == PREFILL_IP
        assert recovered["outputs"] == reference
        assert recovered["leaked"] == {}
        driver.stdin.close()
        assert driver.wait(timeout=120) == 0
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        cluster.stop()
