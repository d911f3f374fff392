"""The native decode path: every decoder layer of an all-decode step in ONE C++ call.

``native``: the single-new-token rows of a step, at most ``NativeDecoder.max_rows`` of them,
over a float32, float16 or int4 pool (``pool_arguments``), run every layer in one
``torch.classes.kvserve.DecodeStack`` call (engine/kernels/cpu/decode_layer.cpp: one OpenMP region instead of ~10 torch calls per
layer, each with its own fork/join); a mixed step's prefill chunks then run
``DecoderLayer.forward``, as do larger batches, unless the whole step fits in ``max_rows``
rows and every chunk continues a context already in the pool (speculative verify rows,
short extends): then the chunks' tokens are rows of the native call too. ``python``: always ``DecoderLayer.forward``.
``auto``: ``native`` where it can run. Both paths compute the same function, differing only in
fp32 summation order.

This module is the one place that decides whether the path runs (``decide_decode_path``, once,
when the model is built, with the reason when it cannot) and binds it (``NativeDecoder``). It
needs the CPU, float32, the kernels and an attention backend whose numerics it shares
(``AttentionBackend.supports_native_decode``); it does not cover tensor-parallel ranks or int8
KV pools. An int4 pool's write follows the step's plan (engine/kv/int4.py ``Int4Plan``, made
once before the forward pass): the native call takes the plan of its rows, and in a mixed step
the Python layers that of the rest (``Int4Residual.rows_from``). Per step, the model only asks
``NativeDecoder.rows``: is this an all-decode step (or a mixed one whose decode rows can go
first) of at most ``max_rows`` rows.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from engine.kv.int4 import Int4KV
from engine.loader.gguf.blocks import BlockFormat
from engine.model.arch import ModelArch
from engine.model.block_linear import BlockLinear
from engine.model.decoder_layer import DecoderLayer
from engine.model.parallel_linear import ModelShard

logger = logging.getLogger(__name__)

DECODE_PATHS = ("auto", "native", "python")
# Rows up to which a dense (no blocks) matrix runs in the native decode path: its plain fp32
# dot products stream the weight once, as MKL's gemv does at 1-3 rows (see linear.PackedLinear).
DENSE_MAX_ROWS = 4
UNBOUNDED = 1 << 30


class DecodingModel(Protocol):
    """What the native path reads of the model (``LlamaForCausalLM``)."""

    arch: ModelArch
    attn: AttentionBackend
    layers: Sequence[DecoderLayer]
    embed: torch.Tensor
    norm: torch.Tensor
    shard: ModelShard | None
    native: "NativeDecoder | None"


def bf16_min_rows(layers: Sequence[DecoderLayer]) -> int:
    """The fewest rows from which some matmul of these layers takes a call on the AMX-BF16 tiles
    (``BlockLinear.bf16_min_rows``; ``UNBOUNDED`` where none does)."""
    return min((mm.bf16_min_rows for layer in layers for attr, _, _ in layer.MATMULS
                if isinstance(mm := getattr(layer, attr), BlockLinear)), default=UNBOUNDED)


def layer_arguments(layer: DecoderLayer) -> tuple[tuple, int]:
    """The layer's constant arguments of ``torch.ops.kvserve.decode_layer`` for the matmuls as
    bound now (``DecoderLayer.use_linear``), and the most rows a step may have for that call to
    compute what ``forward`` computes: a matrix on blocks stays on them up to its
    ``BlockLinear.max_rows`` (above that ``forward`` switches to the dense copy)."""
    args: list = [layer.input_norm.detach(), layer.post_attn_norm.detach(), layer.eps]
    max_rows = UNBOUNDED
    for attr, weight_name, bias_name in layer.MATMULS:
        mm = getattr(layer, attr)
        if isinstance(mm, BlockLinear):
            weights = [data for data, _, _ in mm.parts]
            rows = [n for _, n, _ in mm.parts]
            formats = [f for _, _, f in mm.parts]
            bias = mm.bias
            max_rows = min(max_rows, mm.max_rows)
        else:
            weight = getattr(layer, weight_name).detach()
            weights, rows, formats = [weight], [weight.shape[0]], [-1]
            bias = getattr(layer, bias_name) if bias_name else None
            max_rows = min(max_rows, DENSE_MAX_ROWS)
        args += [weights, rows, formats]
        if bias_name:
            args.append(bias.detach() if bias is not None else None)
    return tuple(args), max_rows


def layer_unavailable(layer: DecoderLayer) -> str | None:
    """Why ``decode_layer`` cannot run this layer's matmuls as bound, or None."""
    for attr, _, _ in layer.MATMULS:
        mm = getattr(layer, attr)
        if isinstance(mm, BlockLinear):
            offset = 0
            for _, n, f in mm.parts:
                if BlockFormat(f).strips and offset % 8:
                    return f"a {BlockFormat(f).name} part of {attr[:-3]} starts at row {offset}, not a multiple of 8"
                offset += n
    return None


def not_covered(model: DecodingModel, kv_cache_dtype: str) -> str | None:
    """A setting the native path does not cover at all (as opposed to a check that failed), or None."""
    if model.shard is not None:
        return "tensor parallel ranks"
    if kv_cache_dtype == "int8":
        return "an int8 KV pool"
    return None


def unavailable(model: DecodingModel) -> str | None:
    """Why the native decode path cannot run this model as bound now, or None."""
    from engine.kernels import has_op

    if model.embed.device.type != "cpu" or model.norm.dtype != torch.float32:
        return "it runs on the CPU in float32 only"
    if not has_op("decode_layer"):
        return "the native kernels could not be built"
    if model.arch.intermediate_size % 8:
        return "the intermediate size is not a multiple of 8"
    if not model.attn.supports_native_decode:
        return f"it attends as the native attention backend does, and {model.attn.name!r} is in use"
    return next(filter(None, (layer_unavailable(layer) for layer in model.layers)), None)


class NativeDecoder:
    """The model's layers bound in one ``DecodeStack`` (their matmuls as bound when it was built:
    rebuild it after rebinding them, see ``rebind_native_decoder``), with the final norm."""

    # A step of prefill chunks runs here (each token a row attending to its own context through
    # the decode kernel) only while its attention is at most this many (query, key) pairs, as a
    # speculative verify chunk's or a short chunk's is; past that the Python layers' SDPA, which
    # multiplies a chunk's queries by its keys as GEMMs, wins. SmolLM2 Q4_1, 2 threads, 512-token
    # chunks (the default budget), prefill in process: 1,000 tokens 1.06 -> 0.91 s, 2,000 2.76 ->
    # 2.22 s, 4,000 9.0 -> 7.34 s on SDPA; 64-token chunks of 1,000 stay here (0.86 s against 1.51).
    max_chunk_attention = 1 << 16
    # Where prefill chunks attend on the AMX-BF16 tiles, so do a chunk's rows here (``chunk_tiles``:
    # a chunk of more than ``tiles_chunk_rows`` rows, in the stack's own region, with the Python
    # layers' numerics); verify-sized chunks stay on the decode kernel, which re-reads the context
    # for each row in fp32 vectors. A step then stays here while its tiled chunks have at most
    # ``tiles_step_rows`` rows (the others bounded by their pairs, as above). SmolLM2 Q4_1, 2
    # threads, a prefix hit's step in process (decode kernel / tiles / Python layers, ms): 24 rows
    # over 1,000 cached tokens 40 / 24 / 36, 72 over 1,000 103 / 46 / 58, 72 over 6,000 399 / 99 /
    # 111, 128 over 3,000 451 / 100 / 113, 208 over 1,000 332 / 119 / 121 (about even).
    # `python -m bench.probes.chunk_path`; docs/benchmarks.md, "an eighteenth session". Where the
    # layers' matmuls take prefill calls on the AMX-BF16 tiles from fewer rows (``BF16_MIN_ROWS``:
    # Q4_K / Q6_K from 32; Q4_1's 128 leaves it at 127), the step bound is one below that, so such
    # chunks get the Python layers' bf16 matmuls, as ``forward`` computes them: the 1B Q4_K_M's
    # 50-token prompt 201 -> 180 ms in process (SmolLM2 Q4_K_M even), docs/benchmarks.md, "a
    # twenty-first session".
    tiles_chunk_rows = 8
    tiles_step_rows = 128

    def __init__(self, layers: Sequence[DecoderLayer], final_norm: torch.Tensor, arch: ModelArch,
                 tiles_prefill: bool = False) -> None:
        bound = [layer_arguments(layer) for layer in layers]
        self.layers: list[tuple] = [args for args, _ in bound]  # decode_layer's constant arguments per layer
        self.max_rows = min(rows for _, rows in bound)
        self.scale = arch.head_dim ** -0.5
        self.stack = torch.classes.kvserve.DecodeStack(arch.hidden_size, arch.num_heads, arch.num_kv_heads,
                                                       arch.head_dim)
        for args in self.layers:
            self.stack.add_layer(*args)
        self.stack.set_final_norm(final_norm, arch.rms_norm_eps)
        # tiles_prefill: the Python layers' prefill chunks attend on the AMX tiles (bf16 q, k and v);
        # the stack then takes its chunks' rows there too, those of more than tiles_chunk_rows rows
        self.chunk_tiles = bool(self.stack.set_chunk_tiles(tiles_prefill, self.tiles_chunk_rows))
        self.tiles_step_rows = min(type(self).tiles_step_rows, bf16_min_rows(layers) - 1)

    def rows(self, meta: AttentionMetadata, kv_caches: list) -> int:
        """How many of this step's rows the native path takes (the first ones), or 0.

        Every row, when the step has at most ``max_rows``, each chunk's earlier context is in
        the pool (``PrefillChunk.block_ids``) and the chunks attend to at most
        ``max_chunk_attention`` (query, key) pairs: a chunk's tokens are then rows of their own, each
        with its context length, and every layer writes the step's K/V before it attends, as the
        Python layers do (a speculative verify row is such a chunk: ``1 + k`` tokens). Else the
        decode rows, which come first, when they are one group of at most ``max_rows``; in a
        mixed step they run before the prefill chunks, so not when one of them reads a block a
        chunk fills in this step (a prefix hit on a block computed in the same step: the
        scheduler shares those)."""
        groups = meta.decode_groups
        if len(groups) > 1 or (groups and groups[0].start != 0):
            return 0
        num_rows = meta.slot_mapping.shape[0]
        if (meta.prefills and num_rows <= self.max_rows and all(c.block_ids is not None for c in meta.prefills)
                and self.chunks_fit(meta.prefills)):
            return num_rows
        if not groups:
            return 0
        group = groups[0]
        if group.end > self.max_rows:
            return 0
        if meta.prefills:
            filled = meta.slot_mapping[group.end:] // kv_caches[0][0].shape[1]
            if torch.isin(group.block_ids, filled).any():
                return 0
        return group.end

    def chunks_fit(self, chunks: Sequence[PrefillChunk]) -> bool:
        """Whether these prefill chunks (each continuing a context in the pool) run here at a cost
        the Python layers would not beat: the chunks the decode kernel attends attend to at most
        ``max_chunk_attention`` (query, key) pairs, and with ``chunk_tiles`` those of more than
        ``tiles_chunk_rows`` rows, which attend on the tiles, have at most ``tiles_step_rows`` rows."""
        pairs = tiled_rows = 0
        for c in chunks:
            if self.chunk_tiles and c.end - c.start > self.tiles_chunk_rows:
                tiled_rows += c.end - c.start
            else:
                pairs += (c.end - c.start) * c.context_len
        return pairs <= self.max_chunk_attention and tiled_rows <= self.tiles_step_rows

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], int8_activations: bool,
            final_norm: bool) -> torch.Tensor:
        """The decode rows ``x`` (contiguous, at their positions' cos / signed sin) through every
        layer, in place; with ``final_norm`` also the model's final RMSNorm. With
        ``meta.block_mass`` (H2O), each row's attention mass per block, over heads and layers, is
        added to its sequence's row of it (a chunk's rows to the chunk's)."""
        table, lens = row_tables(meta)
        k_pools, v_pools = pool_arguments(self.stack, kv_caches, x.shape[0])
        mass = None if meta.block_mass is None else torch.zeros(table.shape, dtype=torch.float32)
        # every layer in one call and one OpenMP region (decode_layer.cpp DecodeStack): the
        # same arithmetic as one torch.ops.kvserve.decode_layer call per layer
        self.stack.run(x, cos, sin, k_pools, v_pools, meta.slot_mapping,
                       table, lens, self.scale, int8_activations, final_norm, bool(meta.prefills), mass)
        if mass is not None:
            meta.block_mass[:, :mass.shape[1]].index_add_(0, row_sequences(meta), mass)
        return x


def pool_arguments(stack, kv_caches: list, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's K and V pools as ``DecodeStack.run`` takes them: a float pool itself; an int4
    pool its codes, after handing the stack the scales, residuals, ``slot_of`` and the write plan
    of the step's first ``rows`` rows (``DecodeStack.int4_step``)."""
    k0 = kv_caches[0][0]
    if not isinstance(k0, Int4KV):
        return [k for k, _ in kv_caches], [v for _, v in kv_caches]
    plan = k0.state.plan_
    if plan is None or plan.num_rows < rows:
        raise RuntimeError("int4 KV: the step's write plan is missing (ModelRunner.prepare_inputs makes it)")
    if plan.num_rows > rows:  # a mixed step's decode rows
        plan = plan.split(rows)[0]
    stack.int4_step([k.scale for k, _ in kv_caches], [v.scale for _, v in kv_caches],
                    [k.residual for k, _ in kv_caches], [v.residual for _, v in kv_caches], k0.state.slot_of,
                    plan.res_rows, plan.res_slots, plan.direct_blocks, plan.direct_rows, plan.done_blocks,
                    plan.done_slots)
    return [k.codes for k, _ in kv_caches], [v.codes for _, v in kv_caches]


def row_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table ``[rows, width]`` (padded with block 0, never read) and context
    length ``[rows]``: the decode group's, then, for each chunk of ``q`` tokens ending at
    ``context_len``, its blocks on each of its rows and lengths ``context_len - q + 1 ..
    context_len`` (causal: a token attends to itself and what precedes it)."""
    tables, lens = [], []
    if meta.decode_groups:
        group = meta.decode_groups[0]
        tables.append(group.block_table)
        lens.append(group.context_lens)
    for chunk in meta.prefills:
        q = chunk.end - chunk.start
        tables.append(chunk.block_ids.expand(q, -1))
        lens.append(torch.arange(chunk.context_len - q + 1, chunk.context_len + 1, device=chunk.block_ids.device))
    if len(tables) == 1:
        return tables[0].contiguous(), lens[0]
    width = max(t.shape[1] for t in tables)
    return (torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]).contiguous(),
            torch.cat(lens))


def row_sequences(meta: AttentionMetadata) -> torch.Tensor:
    """The sequence (``block_mass`` row) of each of ``row_tables``' rows: a decode row is its own,
    chunk j's rows are sequence ``decode rows + j``."""
    decodes = meta.decode_groups[0].end if meta.decode_groups else 0
    chunks = torch.tensor([c.end - c.start for c in meta.prefills], dtype=torch.long)
    return torch.cat([torch.arange(decodes), torch.arange(decodes, decodes + len(chunks)).repeat_interleave(chunks)])


@dataclass(frozen=True)
class DecodePath:
    """What ``decide_decode_path`` decided: ``path`` (``native`` or ``python``) and, for
    ``python``, why not native (None when ``python`` was chosen); ``covered`` is False when the
    reason is a setting the native path does not cover (``not_covered``)."""

    path: str
    reason: str | None = None
    covered: bool = True
    max_rows: int = 0

    def describe(self) -> str:
        """The startup log line's text after ``Decode path: ``."""
        if self.path == "native":
            most = "any number of them" if self.max_rows >= UNBOUNDED else f"up to {self.max_rows}"
            return (f"native (a step's decode rows, {most}, run every layer in one C++ call, with a "
                    "short chunk's tokens when the step fits; larger prefill chunks then run in torch)")
        if not self.covered:
            return f"python (the native path does not cover {self.reason})"
        return "python" + (f" (native unavailable: {self.reason})" if self.reason else "")


def decide_decode_path(model: DecodingModel, choice: str = "auto", kv_cache_dtype: str = "auto") -> DecodePath:
    """Decide how decode rows run (``ModelConfig.decode_path``) and bind ``model.native``
    accordingly; ValueError when ``choice`` is unknown, or ``native`` and it cannot run."""
    if choice not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {', '.join(DECODE_PATHS)}, got {choice!r}")
    outside = not_covered(model, kv_cache_dtype)
    if outside is not None:
        if choice == "native":
            raise ValueError(f"decode_path 'native' cannot run with {outside}; use 'auto' or 'python'")
        model.native = None
        return DecodePath("python", outside, covered=False)
    reason = None if choice == "python" else unavailable(model)
    if choice == "native" and reason:
        raise ValueError(f"decode_path 'native' cannot run: {reason}; use 'auto' or 'python'")
    if choice == "python" or reason:
        model.native = None
        return DecodePath("python", reason)
    model.native = bind_native_decoder(model)
    return DecodePath("native", max_rows=model.native.max_rows)


def bind_native_decoder(model: DecodingModel) -> NativeDecoder:
    """The model's layers as bound now, and whether its prefill chunks attend on the AMX tiles."""
    return NativeDecoder(model.layers, model.norm, model.arch, model.attn.prefill_on_tiles(model.arch.head_dim))


def rebind_native_decoder(model: DecodingModel) -> None:
    """After the model's matmuls were rebound (linear backend, activation quantization): the
    native path, if it runs, over the new bindings (``max_rows`` follows the kernels')."""
    if model.native is not None:
        model.native = bind_native_decoder(model)


def configure_decode_path(model: DecodingModel, choice: str, kv_cache_dtype: str,
                          log: logging.Logger = logger) -> None:
    """The engine's one decision of the decode path, logged (on ``log``) as it was decided."""
    log.info("Decode path: %s", decide_decode_path(model, choice, kv_cache_dtype).describe())
