"""The top of kvserve: the composition root (``kvserve.compose``) and the ``kvserve`` command.

Contract: this is the only package that wires the layers together. It may import every package
below it (server, engine, scheduler, cache, configs, kvtypes); nothing below imports it, and it
never imports ``bench``, which sits on top (``kvserve bench`` execs ``python -m bench``).
``build_service`` is the one function that turns configuration into an engine client, metrics
and the app; the CLI, the tests and (through the CLI) the benches all call it.
"""
