"""The autoscaler on a rate step (2x, 8x, back to 2x) on the simulated
engine (benchkit/autoscale_scenario.py), with shorter shoulders than the
bench: what must hold whatever the machine's speed. No request fails while
pools grow and retire workers; the autoscaler sizes the deployment to 16
workers or more at the peak and at least 8 of them serve (how many more
start within the peak depends on how fast workers start here); the pools
are back at their minimum once the load ends; the requests replayed again
then give the same outputs (the simulated engine's tokens are a function of
the request); no block is left held.

The SLO attainment against fixed splits depends on how fast workers start
here, so it is measured by bench/autoscale.py, not asserted; this test
prints the autoscaled run's figures for the log."""

from __future__ import annotations

import dataclasses

import pytest

from benchkit.autoscale_scenario import AGAIN, Scenario, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_autoscaler_grows_retires_and_fails_nothing_on_a_rate_step(ray_cluster, tmp_path):
    s = dataclasses.replace(Scenario(), phases_s=(8.0, 40.0, 8.0))
    out = run(s, tmp_path, fixed=False)
    figures = out.figures(s)
    print(figures, "back at the minimum after", out.at_minimum_after_s, "s")
    assert out.autoscaled.errors == [] and out.again.errors == []
    assert figures["autoscaled_peak_target"] >= 16, figures  # a cluster-sized deployment
    assert figures["autoscaled_peak_workers"] >= 8, figures  # grown, not only asked for
    assert out.at_minimum_after_s is not None, "pools did not return to their minimum"
    assert out.again.tokens == out.autoscaled.tokens[:AGAIN]
    assert all(t is not None for t in out.autoscaled.tokens)
    assert out.leaks == {}
