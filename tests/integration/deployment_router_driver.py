"""A router of a named deployment in a process of its own, for
tests/integration/test_named_deployment.py to SIGKILL.

argv: the Ray cluster's GCS address, the deployment's name. It attaches
(deployment.attach), prints {"address": ..., "workers": {name: process id}}
as one JSON line, then serves until it is killed.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray

from benchkit.deployment import Deployment
from router.config import ServeConfig


def main() -> None:
    address, name = sys.argv[1], sys.argv[2]
    ray.init(address=address, _node_ip_address="127.0.0.2", log_to_driver=False)
    config = ServeConfig(
        engine={"kv_cache_memory_mb": 32}, deployment={"name": name, "attach": True}
    )
    router = Deployment(config)
    b = router.backend
    workers = b.prefill.workers + b.decode.workers
    ids = {w.name: ray.get(w.actor.pid.remote()) for w in workers}
    print(json.dumps({"address": router.address, "workers": ids}), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
