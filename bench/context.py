"""What the scenarios of one ``python -m bench`` run share: the thread count, the kvserve server
(started once, on first use) and the default model in process (engine, transformers twin, tokenizer).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import CpuMonitor, set_threads


def auto_threads(probe_s: float = 2.0) -> int:
    """The cores this process may use, less those other processes keep busy (measured over
    ``probe_s``), at least 1. On a shared 2-core machine a 2-thread matmul (torch or
    llama.cpp) next to a busy neighbour runs 5-10x slower than a 1-thread one."""
    from engine.builder import available_cores

    cores = available_cores()
    with CpuMonitor() as mon:
        time.sleep(probe_s)
    busy = mon.foreign_cores or 0.0
    threads = max(1, cores - int(busy + 0.5))
    if threads < cores:
        print(f"other processes keep {busy} of {cores} cores busy: using {threads} thread(s); "
              "pin with --num-threads", file=sys.stderr)
    return threads


class Context:
    """What several scenarios share in one run: the server, the default model in process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if args.num_threads is None:
            args.num_threads = auto_threads()
        self.threads = set_threads(args.num_threads)
        print(f"threads: {self.threads} (torch, the server and llama.cpp)", file=sys.stderr)
        self._server = None
        self._engine = None
        self._hf = None
        self._tokenizer = None

    @property
    def server(self) -> Any:
        if self._server is None:
            from bench.server import connect, start_subprocess

            if self.args.url:
                self._server = connect(self.args.url, self.args.api_key)
            else:
                serve_args = ["--num-threads", str(self.threads), *(self.args.serve_arg or [])]
                print(f"starting kvserve serve {' '.join(serve_args)} (log: {self.out / 'server.log'})",
                      file=sys.stderr)
                self._server = start_subprocess(serve_args, log_path=self.out / "server.log")
        return self._server

    def _load(self, with_hf: bool) -> None:
        from bench.engine_runs import load_default_pair

        if self._engine is None:
            self._engine, self._hf = load_default_pair(self.args.num_threads, max_model_len=2048, kv_cache_gib=0.5,
                                                       max_num_seqs=64, with_hf=with_hf)
        elif with_hf and self._hf is None:
            from bench.peers.transformers import load_model

            self._hf = load_model()

    @property
    def engine(self) -> Any:
        self._load(with_hf=False)
        return self._engine

    @property
    def hf(self) -> Any:
        self._load(with_hf=True)
        return self._hf

    @property
    def tokenizer(self) -> Any:
        if self._engine is not None:
            return self._engine.tokenizer
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from engine.loader import resolve_model_dir

            path, _ = resolve_model_dir(None)
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return self._tokenizer

    def vocab_and_eos(self) -> tuple[int, list[int]]:
        if self._engine is not None:
            return self._engine.arch.vocab_size, list(self._engine.arch.eos_token_ids)
        import json as _json

        from engine.loader import resolve_model_dir

        path, _ = resolve_model_dir(None)
        cfg = _json.loads((Path(path) / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        return cfg["vocab_size"], list(eos) if isinstance(eos, list) else [eos]

    def quiet_wait(self) -> float:
        """Seconds to wait for a quiet CPU before a timed side: --quiet-wait, else 10 s in a full run
        on all cores (0 when auto-threads already gave a busy neighbour its cores, or --quick)."""
        if self.args.quiet_wait is not None:
            return self.args.quiet_wait
        from engine.builder import available_cores

        return 0.0 if self.args.quick or self.threads < available_cores() else 10.0

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def close_server(self) -> None:
        self.close()
