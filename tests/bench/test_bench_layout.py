"""bench's three packages import in one direction: ``bench.probes`` -> the suite -> ``bench.peers``
(the contracts in their ``__init__`` docstrings), from the code's own imports, lazy ones included."""
from __future__ import annotations

from tests.test_layering import GRAPH


def part(module: str) -> str:
    if module.startswith("bench.probes"):
        return "probes"
    if module.startswith("bench.peers"):
        return "peers"
    return "suite"


def bench_edges() -> list[tuple[str, str]]:
    return [(m, t) for m, targets in GRAPH.items() if m.startswith("bench") for t in targets
            if t.startswith("bench")]


def test_the_bench_graph_has_all_three_parts():
    parts = {(part(m), part(t)) for m, t in bench_edges()}
    assert {("probes", "suite"), ("suite", "peers"), ("peers", "peers")} <= parts


def test_peers_import_neither_the_suite_nor_the_probes():
    wrong = sorted(f"{m} -> {t}" for m, t in bench_edges() if part(m) == "peers" and part(t) != "peers")
    assert not wrong, "a peer adapter imports the suite or a probe:\n" + "\n".join(wrong)


def test_nothing_but_a_probe_imports_a_probe():
    wrong = sorted(f"{m} -> {t}" for m, t in bench_edges() if part(t) == "probes" and part(m) != "probes")
    assert not wrong, "the suite or a peer imports a probe:\n" + "\n".join(wrong)
