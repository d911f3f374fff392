"""The GGUF block kernel against oneDNN and MKL on the default model's own matrices.

For each matrix shape of SmolLM2-135M (fused qkv, o_proj, fused gate/up, down: Q4_1; the
tied LM head: Q8_0) and each row count, one call's time through

* ``block``: ``torch.ops.kvserve.gguf_linear`` on the packed GGUF blocks (``--int8``:
  ``gguf_linear_q8``, int8 activations, the default path where the format has that kernel),
* ``onednn``: kvserve's dense path (``PackedLinear``: oneDNN on packed fp32 weights from 4
  rows, MKL below),
* ``mkl``: ``F.linear`` on the fp32 weights (what transformers runs),
* ``panels``: ``gguf_linear_panels``, what ``weights_resident: blocks`` runs for calls above
  ``MAX_ROWS`` (prefill): 4 MB fp32 tiles decoded from the blocks, one MKL GEMM per tile,
* ``bf16``: ``gguf_linear_bf16`` (``prefill_matmul_dtype`` bfloat16: x and decoded weight panels
  rounded to bf16 on AMX-BF16 tiles), where the CPU runs it,

cycling over all 30 layers' copies so that, as in a real step, each call reads its weights
from memory rather than from cache. Each call's output is dropped before the next call, as a
layer's is in a step, so the allocator hands the next one the same memory: a list of the 30
outputs (as this probe kept until 2026-12-07) made every call fault in fresh pages (~800 a call
at 512 rows of gate/up, a 6 MB output: 3.6 ms a call against 1.4 with the output dropped). The
ratios say where ``BlockLinear.MAX_ROWS`` belongs: the block kernel wins while a call is bound
by weight bytes and loses once it is compute bound.

    python -m bench.probes.quant_linear [--rows 1 4 8 16 32 64] [--num-threads N] [--gguf FILE.gguf] [--int8]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from bench.machine import machine_info, set_threads
from bench.report import print_table, ratio, write_results
from engine.loader.gguf.blocks import GGUFMatrix, PackedMatrix


def each(fn: Callable[..., Any], copies: Sequence[Any]) -> Callable[[], None]:
    """A call of ``fn`` on every copy in turn, each output dropped before the next call."""
    def run() -> None:
        for c in copies:
            fn(c)
    return run


def time_call(fn: Callable[[], Any], min_s: float = 0.3) -> float:
    """Seconds per call: the mean over as many calls as fit in ``min_s`` (at least 3), after one warm-up."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < min_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def default_model_matrices() -> dict[str, list[PackedMatrix]]:
    """Each matrix kind of the default model, one packed copy per layer (the LM head once)."""
    from engine.model.arch import ModelArch
    from engine.loader import default_gguf_path, resolve_model_dir
    from engine.model.decoder_layer import DecoderLayer
    from engine.loader.gguf.tensors import read_gguf_blocks
    from transformers import AutoConfig

    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(None)[0], local_files_only=True))
    blocks = read_gguf_blocks(default_gguf_path(), arch)

    def layer(i: int, *names: str) -> PackedMatrix:
        stacked = GGUFMatrix.stack([blocks[f"model.layers.{i}.{n}.weight"] for n in names])
        assert stacked is not None
        return stacked.pack()

    matrices = {kind: [layer(i, *names) for i in range(arch.num_layers)] for kind, names in DecoderLayer.FUSED.items()}
    matrices["lm_head"] = [blocks["model.embed_tokens.weight"].pack()]
    return matrices


def gguf_matrices(path: str, max_layers: int = 8) -> dict[str, list[PackedMatrix]]:
    """Each matrix kind of any Llama-family GGUF (up to ``max_layers`` copies, layers whose fused
    parts share one format), the LM head once; row order as stored (timing only)."""
    import gguf
    import numpy as np

    from engine.model.decoder_layer import DecoderLayer
    from engine.loader.gguf.blocks import BlockFormat
    from engine.loader.gguf.names import hf_name

    reader = gguf.GGUFReader(path)
    blocks = {}
    for t in reader.tensors:
        fmt, name = BlockFormat.from_ggml(t.tensor_type), hf_name(t.name)
        if fmt is not None and name is not None:
            blocks[name] = GGUFMatrix(torch.from_numpy(np.array(t.data)), fmt, int(t.shape[0]))
    layers = 1 + max(int(n.split(".")[2]) for n in blocks if n.startswith("model.layers."))
    matrices: dict[str, list[PackedMatrix]] = {}
    for kind, names in DecoderLayer.FUSED.items():
        for i in range(layers):
            stacked = GGUFMatrix.stack([blocks.get(f"model.layers.{i}.{n}.weight") for n in names])
            if stacked is not None and len(matrices.get(kind, [])) < max_layers:
                matrices.setdefault(kind, []).append(stacked.pack())
    head = blocks.get("lm_head.weight") or blocks.get("model.embed_tokens.weight")
    if head is not None:
        matrices["lm_head"] = [head.pack()]
    return matrices


def run_quant_linear(matrices: dict[str, list[PackedMatrix]], rows: Sequence[int],
                     min_s: float = 0.3, int8: bool = False) -> dict[str, Any]:
    from engine.model.linear import PackedLinear
    from engine.model.block_linear import BlockLinear

    results = []
    for kind, copies in matrices.items():
        dense = [m.dequantize() for m in copies]
        packed = [PackedLinear(w, None, 16) for w in dense]
        first = copies[0]
        q8 = int8 and torch.ops.kvserve.gguf_q8_supported(int(first.format))
        block = torch.ops.kvserve.gguf_linear_q8 if q8 else torch.ops.kvserve.gguf_linear
        for m in rows:
            x = torch.randn(m, first.in_features)
            block_s = time_call(each(lambda c: block(x, c.data, c.out_features, int(c.format)), copies),
                                min_s) / len(copies)
            onednn_s = time_call(each(lambda p: p(x), packed), min_s) / len(copies)
            mkl_s = time_call(each(lambda w: F.linear(x, w), dense), min_s) / len(copies)
            tile = BlockLinear(first, None, None).tile_rows
            panels_s = time_call(each(lambda c: torch.ops.kvserve.gguf_linear_panels(
                x, c.data, c.out_features, int(c.format), tile), copies), min_s) / len(copies)
            bf16_s = (time_call(each(lambda c: torch.ops.kvserve.gguf_linear_bf16(
                x, c.data, c.out_features, int(c.format)), copies), min_s) / len(copies)
                      if torch.ops.kvserve.gguf_linear_bf16_supported() else None)
            results.append({
                "matrix": kind, "format": first.format.name + (" int8" if q8 else ""),
                "shape": [first.out_features, first.in_features],
                "rows": m, "block_us": round(block_s * 1e6, 1), "onednn_us": round(onednn_s * 1e6, 1),
                "mkl_us": round(mkl_s * 1e6, 1), "panels_us": round(panels_s * 1e6, 1), "block_gflops": round(2 * m * first.out_features
                                                                       * first.in_features / block_s / 1e9, 1),
                "onednn_over_block": ratio(onednn_s, block_s), "mkl_over_block": ratio(mkl_s, block_s),
                "bf16_us": None if bf16_s is None else round(bf16_s * 1e6, 1),
                "block_over_bf16": None if bf16_s is None else ratio(block_s, bf16_s),
            })
    return {"scenario": "quant_linear", "machine": machine_info(), "results": results}


def print_report(result: dict[str, Any]) -> None:
    rows = [[r["matrix"], r["format"], "x".join(map(str, r["shape"])), r["rows"], r["block_us"], r["onednn_us"],
             r["mkl_us"], r["panels_us"], r["block_gflops"], r["onednn_over_block"], r["mkl_over_block"],
             r.get("bf16_us"), r.get("block_over_bf16")] for r in result["results"]]
    print_table("one call, microseconds (ratios > 1: the block kernel is faster)", rows,
                ["matrix", "format", "N x K", "rows", "block", "onednn", "mkl", "panels", "block GFLOP/s", "onednn/block",
                 "mkl/block", "bf16", "block/bf16"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 64])
    parser.add_argument("--num-threads", type=int, help="torch threads (default: available cores)")
    parser.add_argument("--gguf", help="time the matrices of this GGUF instead of the default model's")
    parser.add_argument("--output", help="JSON path (default bench/results/quant_linear-<time>.json)")
    parser.add_argument("--int8", action="store_true",
                        help="the block column through the int8-activation kernel, where the format has one")
    args = parser.parse_args(argv)
    set_threads(args.num_threads)
    from engine.kernels import load_kernels

    if not load_kernels():
        raise SystemExit("the native kernels could not be built (see the warning above)")
    result = run_quant_linear(gguf_matrices(args.gguf) if args.gguf else default_model_matrices(), args.rows,
                              int8=args.int8)
    print_report(result)
    print(f"  results: {write_results('quant_linear', result, args.output)}")
    return result


if __name__ == "__main__":
    main()
