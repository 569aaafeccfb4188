"""The Grafana dashboard only charts metrics the router exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.workers import WorkerStats
from router.backend import WorkerReport
from router.metrics import RouterMetrics

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "tandem.json"


def test_every_charted_metric_is_exported():
    metrics = RouterMetrics()
    metrics.requests.labels("http", "OK").inc()  # labelled: exported once used
    stats = WorkerStats(3, 4, 4, 0, 0, 0, 0, 0, 0, 0)
    metrics.set_workers([WorkerReport("prefill-0", "prefill", 0, stats)])
    exported = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        exported |= {s.name for s in family.samples}
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    charted = {m for e in exprs for m in re.findall(r"\btandem_[a-z0-9_]+", e)}
    assert charted and charted - exported == set()
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
