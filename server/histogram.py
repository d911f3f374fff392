"""Histograms and counters the frontend updates on every engine step, kept as plain numbers and
exported as Prometheus families when ``/metrics`` is scraped.

Why not ``prometheus_client``'s ``Histogram`` / ``Counter``: each ``observe`` there takes a lock
for the sum and one for the bucket, behind two checks, and the frontend observes per step and per
streamed token on its event loop. Here ``observe`` is a bisect and two additions.

Contract: one thread writes (the engine client's receiving side); a scrape reads the numbers as
they are, without a lock, so a scrape during a step may see one observation in the buckets and
not yet in the sum, never a count that goes backwards. The exposition is byte for byte what
``prometheus_client`` writes for the same observations (bucket bounds through ``floatToGoString``).
"""
from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from typing import Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class StepHistogram:
    """Observations counted into ``bounds`` (each bucket holds the values up to its bound, as a
    Prometheus ``le`` bucket), plus their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf's own
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, label_values: Sequence[str]) -> None:
        """Add this histogram's cumulative buckets and sum to ``family`` under ``label_values``."""
        cumulative = itertools.accumulate(list(self.counts))
        family.add_metric(list(label_values), [(floatToGoString(bound), count) for bound, count in
                                               zip((*self.bounds, math.inf), cumulative)], self.sum)
