"""Benchmarks of kvserve against its peers (transformers, llama.cpp) and of its own parts.

Three packages, imported in one direction only (``bench.probes`` -> the suite -> ``bench.peers``;
``tests/bench/test_bench_layout.py`` checks it), and nothing in the product imports any of them:

* the suite, ``bench/`` itself: ``python -m bench <scenario>`` (``__main__``; one module per
  scenario: ``serve_load``, ``prefix``, ``structured``, ``vs_peers``, ``vs_llama_server``,
  ``kv_cache``, ``kv_memory``, ``kv_tier``, ``roofline``), what they share by job (``client``,
  ``server``, ``machine``, ``workload``, ``engine_runs``, ``agreement``, ``context``, ``report``), and the
  checks and tools that scripts and tests run (``gpu_check``, ``scale``, ``make_gguf``);
* ``bench.peers``: one adapter per peer (how to install, start and run it);
* ``bench.probes``: one-off measurements behind numbers in docs/benchmarks.md and BENCHMARKS.md,
  each ``python -m bench.probes.<name>``.

Never imports ``server`` itself: a served kvserve is reached over HTTP
(``bench.server.start_subprocess`` runs ``kvserve serve``, the composition root) or handed in
already composed (``start_inprocess(app, ...)``).
"""
