"""Benchmarks against peers (transformers, llama.cpp) and of kvserve's own parts, side by side.

Contract: never imported by ``server`` or the engine, and never imports ``server`` itself: a
served kvserve is reached over HTTP (``bench.serving.start_subprocess`` runs ``kvserve serve``,
the composition root) or handed in already composed (``start_inprocess(app, ...)``).
"""
