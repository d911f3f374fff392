"""One-off probes: measurements run by hand, each ``python -m bench.probes.<name>`` (see its docstring).

They answer one question each (where a step's time goes, which IPC transport, is int8 KV good
enough, ...) and their numbers are quoted in docs/benchmarks.md and BENCHMARKS.md with the
command that reproduces them. They are not scenarios of the suite: nothing runs them in
``python -m bench all`` and they have no PASS/FAIL targets of the issue's (a few print their own).

Imports: the suite (``bench.*``) and the peers (``bench.peers``) freely, the engine through its
public hooks only (no private attribute: ``ModelRunner.prepare_inputs``, not ``_prepare``).
Nothing imports a probe, but the tests of tests/bench/probes.
"""
