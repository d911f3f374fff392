"""``StepHistogram`` (server/histogram.py) writes the exposition ``prometheus_client``'s own
``Histogram`` writes for the same observations: values on a bound, between bounds, past the
last one, integer bounds, and none at all."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from server.histogram import StepHistogram

CASES = [
    ((0.01, 0.025, 0.05, 1.0, 2.5), [0.0, 0.01, 0.011, 0.05, 0.7, 1.0, 3.0, 1e9, 0.024999]),
    ((1, 8, 16, 512), [1, 2, 8, 9, 512, 513, 7]),  # tokens per step: integer bounds
    ((0.0005, 0.001, 1e6, 2e7), [0.0004, 5e6, 3e7]),  # bounds Go writes with exponents
    ((0.1, 0.2), []),
]


class _One:
    def __init__(self, histogram: StepHistogram) -> None:
        self.histogram = histogram

    def collect(self):
        family = HistogramMetricFamily("kvserve_x", "Doc.", labels=["model_name"])
        self.histogram.add_to(family, ["m"])
        yield family


@pytest.mark.parametrize("bounds,values", CASES)
def test_exposition_equals_prometheus_clients_histogram(bounds, values):
    reference_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x", "Doc.", ["model_name"], namespace="kvserve", buckets=bounds,
                          registry=reference_registry).labels("m")
    ours = StepHistogram(bounds)
    for v in values:
        reference.observe(v)
        ours.observe(v)
    ours_registry.register(_One(ours))
    expected = b"\n".join(line for line in generate_latest(reference_registry).splitlines()
                          if b"_created" not in line)
    assert generate_latest(ours_registry).rstrip(b"\n") == expected.rstrip(b"\n")
