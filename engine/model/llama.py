"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights are fused at load (q/k/v into one matrix, gate/up into another) so a layer is five
matmuls. The forward takes a flat batch of tokens from many sequences (no padding) and
returns hidden states; ``compute_logits`` runs the LM head only on the rows that sample.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.arch import ModelArch
from engine.attention import AttentionBackend, AttentionMetadata, TorchAttention
from engine.config import ACTIVATION_QUANTS
from engine.loader.gguf.blocks import BlockFormat, BlockMatrix, GGUFMatrix
from engine.model.block_linear import BlockLinear
from engine.model.linear import dense_linear, onednn_linear_available
from engine.model.rope import apply_rope_signed, rope_cos_sin, signed_sin

logger = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_size, self.kv_size = arch.num_heads * d, arch.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attn_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h))
        self.qkv_bias: nn.Parameter | None = None
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size))
        self.o_bias: nn.Parameter | None = None
        self.gate_up = nn.Parameter(torch.empty(2 * arch.intermediate_size, h))
        self.down = nn.Parameter(torch.empty(h, arch.intermediate_size))
        self.blocks: dict[str, BlockMatrix] = {}  # weight name -> the same matrix as GGUF blocks
        self.blocks_only: set[str] = set()  # weights whose dense copy was dropped (see drop_dense_weights)
        self.use_linear("aten", use_blocks=False)

    # (matmul attribute, weight parameter, bias parameter) of the layer's four matmuls
    MATMULS = (("qkv_mm", "qkv", "qkv_bias"), ("o_mm", "o_proj", "o_bias"),
               ("gate_up_mm", "gate_up", None), ("down_mm", "down", None))
    # weight parameter -> the HF modules (under ``model.layers.N.``) whose rows it stacks, in order
    FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}

    def use_linear(self, dense: str, use_blocks: bool, batch_hint: int = 16, int8_activations: bool = False) -> None:
        """Bind the four matmuls: ``dense`` (``aten`` or ``onednn``, see ``dense_linear``), each
        wrapped in a BlockLinear where ``use_blocks`` and the weight has blocks; a weight in
        ``blocks_only`` runs from its blocks alone whatever ``use_blocks`` says."""
        for attr, weight_name, bias_name in self.MATMULS:
            weight = getattr(self, weight_name)
            bias = getattr(self, bias_name) if bias_name else None
            mm: Callable[[torch.Tensor], torch.Tensor] | None = None
            if weight_name not in self.blocks_only:
                mm = dense_linear(weight, bias, dense, batch_hint)
            if (use_blocks or mm is None) and weight_name in self.blocks:
                mm = BlockLinear(self.blocks[weight_name], bias, mm, int8_activations)
            setattr(self, attr, mm)

    # Rows up to which a dense (no blocks) matrix runs in the native decode path: its plain fp32
    # dot products stream the weight once, as MKL's gemv does at 1-3 rows (see PackedLinear).
    NATIVE_DENSE_MAX_ROWS = 4

    def native_decode_args(self) -> tuple[tuple, int]:
        """The layer's constant arguments of ``torch.ops.kvserve.decode_layer`` for the matmuls
        as bound now (``use_linear``), and the most rows a step may have for that call to
        compute what ``forward`` computes: a matrix on blocks stays on them up to its
        ``BlockLinear.max_rows`` (above that ``forward`` switches to the dense copy)."""
        args: list = [self.input_norm.detach(), self.post_attn_norm.detach(), self.eps]
        max_rows = 1 << 30
        for attr, weight_name, bias_name in self.MATMULS:
            mm = getattr(self, attr)
            if isinstance(mm, BlockLinear):
                weights = [data for data, _, _ in mm.parts]
                rows = [n for _, n, _ in mm.parts]
                formats = [f for _, _, f in mm.parts]
                bias = mm.bias
                max_rows = min(max_rows, mm.max_rows)
            else:
                weight = getattr(self, weight_name).detach()
                weights, rows, formats = [weight], [weight.shape[0]], [-1]
                bias = getattr(self, bias_name) if bias_name else None
                max_rows = min(max_rows, self.NATIVE_DENSE_MAX_ROWS)
            args += [weights, rows, formats]
            if bias_name:
                args.append(bias.detach() if bias is not None else None)
        return tuple(args), max_rows

    def native_decode_unavailable(self) -> str | None:
        """Why ``decode_layer`` cannot run this layer's matmuls as bound, or None."""
        for attr, _, _ in self.MATMULS:
            mm = getattr(self, attr)
            if isinstance(mm, BlockLinear):
                offset = 0
                for _, n, f in mm.parts:
                    if BlockFormat(f).strips and offset % 8:
                        return f"a {BlockFormat(f).name} part of {attr[:-3]} starts at row {offset}, not a multiple of 8"
                    offset += n
        return None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """``sin`` is the sign-adjusted table of :func:`signed_sin`.

        Each stage is a method that takes its input as a temporary, so a prefill chunk's
        intermediates (qkv, the normed rows, the MLP's ``[T, 2 * intermediate]``) are freed as
        soon as the stage ends rather than when this frame returns: the step's peak memory is
        one stage's, not the layer's sum."""
        x = x + self.o_mm(self._attention(F.rms_norm(x, (x.shape[-1],), self.input_norm, self.eps),
                                          cos, sin, k_cache, v_cache, meta, attn))
        return x + self._mlp(F.rms_norm(x, (x.shape[-1],), self.post_attn_norm, self.eps))

    def _attention(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        t = y.shape[0]
        qkv = self.qkv_mm(y)
        del y
        # RoPE on q and k together: they are adjacent columns of qkv, so one view covers both.
        qk = apply_rope_signed(qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                                           self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return attn.forward(q, k, v, k_cache, v_cache, meta)

    def _mlp(self, y: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_mm.swiglu(y) if isinstance(self.gate_up_mm, BlockLinear) else None
        if h is None:
            gate, up = self.gate_up_mm(y).chunk(2, dim=-1)
            h = F.silu(gate).mul_(up)
            del gate, up  # the [T, 2 * intermediate] product goes before down_mm allocates
        del y
        return self.down_mm(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, hf_config: Any, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = self.embed if arch.tie_word_embeddings else nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size))
        cos, sin = rope_cos_sin(hf_config, arch.head_dim, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)
        self.attn: AttentionBackend = TorchAttention()
        self.lm_head_mm: Callable[[torch.Tensor], torch.Tensor] = lambda h: F.linear(h, self.lm_head)
        self.lm_head_blocks: BlockMatrix | None = None
        self.lm_head_blocks_only = False
        self.embed_blocks: BlockMatrix | None = None  # blocks-only embedding: lookups decode rows
        self.linear_backend = "aten"
        self.decode_path = "python"  # see select_decode_path
        self._native_layers: list[tuple] = []  # decode_layer's constant arguments per layer
        self._native_stack: Any = None  # those layers bound in one torch.classes.kvserve.DecodeStack
        self.native_max_rows = 0
        # "none" | "int8" (ModelConfig.activation_quant): read by select_linear_backend
        self.activation_quant = "none"

    def select_linear_backend(self, backend: str = "auto", batch_hint: int = 16) -> str:
        """Bind the matmul kernels once the weights are loaded; return the backend in use.

        ``aten``: ``F.linear`` (MKL). ``onednn``: calls of 4+ rows through oneDNN on a second,
        packed copy of each weight (see PackedLinear); ``aten`` where oneDNN cannot run (not
        fp32 on a CPU). ``gguf``: the matrices that have GGUF blocks (see ``attach_blocks``)
        run calls of up to ``BlockLinear.MAX_ROWS`` rows from the blocks, everything else as
        ``onednn``; an error when no blocks are attached. ``auto``: ``gguf`` when blocks are
        attached, else ``onednn``. Call it again after reloading weights.
        """
        if backend not in ("auto", "gguf", "onednn", "aten"):
            raise ValueError(f"linear backend must be auto, gguf, onednn or aten, got {backend!r}")
        if self.holds_blocks_only() and backend not in ("auto", "gguf"):
            raise ValueError(f"linear backend {backend!r} needs dense weights, and this model keeps only "
                             "GGUF blocks (weights_resident: blocks)")
        has_blocks = self.lm_head_blocks is not None or any(layer.blocks for layer in self.layers)
        if backend == "gguf" and not has_blocks:
            raise ValueError("linear backend 'gguf' needs a GGUF checkpoint with block-format weights, a CPU "
                             "in float32 and the native kernels; use 'auto'")
        if backend == "auto":
            backend = "gguf" if has_blocks else "onednn"
        onednn_ok = self.embed.device.type == "cpu" and self.embed.dtype == torch.float32 and onednn_linear_available()
        dense = "onednn" if backend in ("gguf", "onednn") and onednn_ok else "aten"
        if backend == "onednn":
            backend = dense
        use_blocks = backend == "gguf"
        if self.activation_quant == "int8" and not use_blocks:
            raise ValueError("activation_quant 'int8' needs the gguf linear backend (a GGUF model's blocks on the "
                             f"CPU in float32), and the backend is {backend!r}; use activation_quant 'none'")
        int8 = self.activation_quant == "int8"
        for layer in self.layers:
            layer.use_linear(dense, use_blocks, batch_hint, int8)
        if self.lm_head_blocks_only:
            self.lm_head_mm = BlockLinear(self.lm_head_blocks, None, None, int8)
        else:
            self.lm_head_mm = dense_linear(self.lm_head, None, dense, batch_hint)
            if use_blocks and self.lm_head_blocks is not None:
                self.lm_head_mm = BlockLinear(self.lm_head_blocks, None, self.lm_head_mm, int8)
        self.linear_backend = backend
        if self.decode_path == "native":  # its arguments name the matmuls just bound
            self._bind_native_decode()
        return backend

    def block_linears(self) -> list[BlockLinear]:
        """The matmuls bound to GGUF blocks now (layers', then the LM head's)."""
        mms = [mm for layer in self.layers for attr, _, _ in layer.MATMULS
               if isinstance(mm := getattr(layer, attr), BlockLinear)]
        return mms + ([self.lm_head_mm] if isinstance(self.lm_head_mm, BlockLinear) else [])

    def set_activation_quant(self, mode: str) -> None:
        """Switch ``activation_quant`` on the matmuls as bound (cheap: no weight is touched; the
        benches alternate steps between the modes). The gguf backend must be in use for int8."""
        if mode not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant must be none or int8, got {mode!r}")
        if mode == "int8" and self.linear_backend != "gguf":
            raise ValueError("activation_quant 'int8' needs the gguf linear backend")
        self.activation_quant = mode
        for mm in self.block_linears():
            mm.use_int8_activations(mode == "int8")
        if self.decode_path == "native":  # native_max_rows follows the kernels' max_rows
            self._bind_native_decode()

    def describe_activation_quant(self) -> str:
        """``activation_quant`` as bound: which block matrices multiply int8 activations."""
        if self.activation_quant != "int8":
            return "none (fp32 activations)"
        parts = [(f, op is torch.ops.kvserve.gguf_linear_q8)
                 for mm in self.block_linears() for op, (_, _, f) in zip(mm.kernels, mm.parts)]
        int8 = sorted({BlockFormat(f).name for f, q in parts if q})
        fp32 = sorted({BlockFormat(f).name for f, q in parts if not q})
        # calls over INT8_MAX_ROWS rows (prefill) stay on the int8 kernel where max_rows is unbounded
        unbounded = [mm.max_rows == sys.maxsize for mm in self.block_linears()]
        prefill = ("int8 as well" if unbounded and all(unbounded) else
                   f"int8 for {sum(unbounded)} of {len(unbounded)} matmuls, fp32 for the rest" if any(unbounded)
                   else "fp32 activations")
        return (f"int8 for {sum(q for _, q in parts)} of {len(parts)} block matrices "
                f"({', '.join(int8) or 'no format with an int8 kernel on this CPU'}); "
                f"fp32 activations for {', '.join(fp32) or 'none'} and dense matmuls; prefill: {prefill}")

    DECODE_PATHS = ("auto", "native", "python")

    def native_decode_unavailable(self) -> str | None:
        """Why the native decode path cannot run this model, or None (see select_decode_path)."""
        from engine.kernels import has_op

        if self.embed.device.type != "cpu" or self.norm.dtype != torch.float32:
            return "it runs on the CPU in float32 only"
        if not has_op("decode_layer"):
            return "the native kernels could not be built"
        if self.arch.intermediate_size % 8:
            return "the intermediate size is not a multiple of 8"
        if self.attn.name != "native":
            return f"it attends as the native attention backend does, and {self.attn.name!r} is in use"
        return next(filter(None, (layer.native_decode_unavailable() for layer in self.layers)), None)

    def select_decode_path(self, choice: str = "auto") -> tuple[str, str | None]:
        """How decode rows run; returns (path, why not native or None).

        ``native``: the single-new-token rows of a step, at most ``native_max_rows`` of them, over
        a float32 or float16 pool, run every layer in ONE ``DecodeStack`` call
        (engine/kernels/cpu/decode_layer.cpp: one OpenMP region instead of ~10 torch calls per layer,
        each with its own fork/join); a mixed step's prefill chunks then run
        ``DecoderLayer.forward``, as do larger batches and int8 pools. Needs the CPU, float32, the kernels and
        the native attention backend (whose numerics it shares). ``python``: always
        ``DecoderLayer.forward``. ``auto``: ``native`` where it can run. Both paths compute the
        same function, differing only in fp32 summation order.
        """
        if choice not in self.DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {', '.join(self.DECODE_PATHS)}, got {choice!r}")
        reason = None if choice == "python" else self.native_decode_unavailable()
        if choice == "native" and reason:
            raise ValueError(f"decode_path 'native' cannot run: {reason}; use 'auto' or 'python'")
        self.decode_path = "python" if choice == "python" or reason else "native"
        self._bind_native_decode()
        return self.decode_path, reason

    def _bind_native_decode(self) -> None:
        if self.decode_path != "native":
            self._native_layers, self.native_max_rows, self._native_stack = [], 0, None
            return
        bound = [layer.native_decode_args() for layer in self.layers]
        self._native_layers = [args for args, _ in bound]
        self.native_max_rows = min(rows for _, rows in bound)
        a = self.arch
        self._native_stack = torch.classes.kvserve.DecodeStack(a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim)
        for args in self._native_layers:
            self._native_stack.add_layer(*args)
        self._native_stack.set_final_norm(self.norm, self.arch.rms_norm_eps)

    def _native_rows(self, meta: AttentionMetadata, kv_caches: list) -> int:
        """How many of this step's rows the native decode path takes (see select_decode_path):
        the decode rows, which come first, when they are one group of at most native_max_rows
        over float pools; else 0. In a mixed step they run before the prefill chunks, so not
        when one of them reads a block a chunk fills in this step (a prefix hit on a block
        computed in the same step: the scheduler shares those)."""
        if (self.decode_path != "native" or len(meta.decode_groups) != 1 or meta.paged is not None
                or type(kv_caches[0][0]) is not torch.Tensor):
            return 0
        group = meta.decode_groups[0]
        if group.start != 0 or group.end > self.native_max_rows:
            return 0
        if meta.prefills:
            filled = meta.slot_mapping[group.end:] // kv_caches[0][0].shape[1]
            if torch.isin(group.block_ids, filled).any():
                return 0
        return group.end

    def _native_decode(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], final_norm: bool = False) -> torch.Tensor:
        """The decode rows through every layer natively, in place; with ``final_norm`` also the
        model's final RMSNorm (the hidden states the LM head reads)."""
        group = meta.decode_groups[0]
        cos, sin = self.rope_cos[positions], self.rope_sin_signed[positions]
        table, lens = group.block_table.contiguous(), group.context_lens
        # every layer in one call and one OpenMP region (decode_layer.cpp DecodeStack): the
        # same arithmetic as one torch.ops.kvserve.decode_layer call per layer
        self._native_stack.run(x, cos, sin, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
                               table, lens, self.arch.head_dim ** -0.5, self.activation_quant == "int8", final_norm)
        return x

    @torch.no_grad()
    def attach_blocks(self, blocks: dict[str, GGUFMatrix]) -> int:
        """Keep GGUF blocks (HF-named, see ``engine.loader.gguf.blocks.read_gguf_blocks``) for the fused
        matrices they cover exactly: a fused matrix gets blocks only when every part has them
        in one format and they decode to the loaded dense weight bit for bit. Needs the
        native kernels loaded. Returns the number of matrices covered."""
        def attach(dense: torch.Tensor, parts: list[str]) -> BlockMatrix | None:
            packed = BlockMatrix.stack([blocks.get(p) for p in parts])
            if packed is not None and packed.dequantize().equal(dense):
                return packed
            if packed is not None:
                logger.warning("GGUF blocks of %s do not decode to the loaded weights; running it dense", parts[0])
            return None

        covered = 0
        for i, layer in enumerate(self.layers):
            layer.blocks = {}
            for weight_name, modules in DecoderLayer.FUSED.items():
                found = attach(getattr(layer, weight_name), [f"model.layers.{i}.{m}.weight" for m in modules])
                if found is not None:
                    layer.blocks[weight_name] = found
                    covered += 1
        head = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
        self.lm_head_blocks = attach(self.lm_head, [head])
        return covered + (self.lm_head_blocks is not None)

    def holds_blocks_only(self) -> bool:
        return self.lm_head_blocks_only or any(layer.blocks_only for layer in self.layers)

    def blocked_dense_bytes(self) -> int:
        """fp32 bytes of the dense weights that have blocks attached (what dropping them frees)."""
        total = sum(getattr(layer, n).numel() * 4 for layer in self.layers for n in layer.blocks)
        untied_head = self.lm_head_blocks is not None and not self.arch.tie_word_embeddings
        return total + (self.lm_head.numel() * 4 if untied_head else 0)

    @torch.no_grad()
    def _take_blocks(self, blocks: dict[str, GGUFMatrix], sd: dict[str, torch.Tensor]) -> None:
        """``weights_resident: blocks``: every fused matrix whose parts all have blocks runs
        from them alone and its dense parameter is released (never filled). A matrix some of
        whose parts have no blocks runs dense: the parts that have blocks are decoded into ``sd``.
        Parts taken are removed from ``blocks`` (the caller's dict), so load peaks near one copy."""
        def take(parts: list[str]) -> BlockMatrix | None:
            found = BlockMatrix.stack([blocks.get(p) for p in parts])
            if found is None:
                for p in parts:
                    if p in blocks:
                        sd[p] = blocks[p].pack().dequantize()
            if found is not None:
                for p in parts:  # the stacked copy replaces them: free each as soon as it is used
                    blocks.pop(p, None)
            return found

        empty = lambda: nn.Parameter(torch.empty(0), requires_grad=False)  # noqa: E731
        for i, layer in enumerate(self.layers):
            for weight_name, modules in DecoderLayer.FUSED.items():
                found = take([f"model.layers.{i}.{m}.weight" for m in modules])
                if found is not None:
                    layer.blocks[weight_name] = found
                    layer.blocks_only.add(weight_name)
                    setattr(layer, weight_name, empty())
        self.embed_blocks = take(["model.embed_tokens.weight"])
        if self.arch.tie_word_embeddings:
            self.lm_head_blocks = self.embed_blocks
        else:
            self.lm_head_blocks = take(["lm_head.weight"])
        if self.lm_head_blocks is not None:
            self.lm_head_blocks_only = True
            if not self.arch.tie_word_embeddings:
                self.lm_head = empty()
        if self.embed_blocks is not None:
            self.embed = empty()
            if self.arch.tie_word_embeddings:
                self.lm_head = self.embed

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        b = self.embed_blocks
        if b is None:
            return F.embedding(input_ids, self.embed)
        part = b.parts[0]
        return torch.ops.kvserve.gguf_rows(part.data, part.out_features, part.in_features, int(part.format), input_ids)

    def weight_bytes(self) -> dict[str, int]:
        """Resident weight memory: ``dense`` (parameters and buffers, each storage once) and
        ``blocks`` (the GGUF blocks in use)."""
        seen, dense = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                dense += t.untyped_storage().nbytes()
        blocks = sum(b.nbytes for layer in self.layers for b in layer.blocks.values())
        heads = {id(b): b.nbytes for b in (self.lm_head_blocks, self.embed_blocks) if b is not None}
        return {"dense": dense, "blocks": blocks + sum(heads.values())}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids/positions ``[T]`` -> final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(input_ids)
        decodes = self._native_rows(meta, kv_caches)
        if decodes == x.shape[0]:
            # the final norm too, inside the layers' parallel region: after the layers have swept
            # the caches, F.rms_norm's first call ran cold (~0.1 ms, 3% of a one-row step)
            return self._native_decode(x.contiguous(), positions, meta, kv_caches, final_norm=True)
        if decodes:
            # A mixed step: the decode rows natively, then the prefill chunks on DecoderLayer.forward.
            # _native_rows made sure no decode row reads a block a chunk fills in this step; a chunk
            # may read one a decode row fills (a prefix hit), so the decode rows go first.
            decode_meta, meta = meta.split_decodes()
            head = self._native_decode(x[:decodes].contiguous(), positions[:decodes], decode_meta, kv_caches)
            x, positions = x[decodes:], positions[decodes:]
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin_signed[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer.forward(x, cos, sin, k_cache, v_cache, meta, self.attn)
        if decodes:
            x = torch.cat([head, x])
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.arch.rms_norm_eps)

    def decode_weight_bytes(self) -> int:
        """Weight bytes one single-row decode step streams with the kernels in use: every
        layer, the final norm and the LM head, counted as blocks where the ``gguf`` backend
        reads blocks (the embedding lookup reads a single row and is not counted)."""
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        gguf = self.linear_backend == "gguf"
        total = nbytes(self.norm)
        for layer in self.layers:
            covered = layer.blocks if gguf else {}
            total += sum(covered[n].nbytes if n in covered else nbytes(p) for n, p in layer.named_parameters())
        head = self.lm_head_blocks if gguf else None
        return total + (head.nbytes if head is not None else nbytes(self.lm_head))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head_mm(hidden)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], blocks: dict[str, GGUFMatrix] | None = None) -> None:
        """Copy HF-named weights (``model.layers.N.self_attn.q_proj.weight``, ...) into the fused layout.

        With ``blocks`` (``weights_resident: blocks``, see ``_take_blocks``) the matrices they
        cover are not in ``sd`` and get no dense copy; such a model cannot be reloaded."""
        if self.holds_blocks_only():
            raise ValueError("this model holds GGUF blocks only (weights_resident: blocks); build a new one")
        self.select_linear_backend("aten")  # packed copies would go stale; select again after loading
        self.lm_head_blocks = None
        for layer in self.layers:
            layer.blocks = {}
        sd = dict(sd)
        take = sd.pop
        if blocks:
            self._take_blocks(blocks, sd)
        if self.embed_blocks is None:
            self.embed.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if self.arch.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        elif not self.lm_head_blocks_only:
            self.lm_head.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_attn_norm.copy_(take(p + "post_attention_layernorm.weight"))
            for weight_name, modules in DecoderLayer.FUSED.items():
                if weight_name not in layer.blocks_only:
                    getattr(layer, weight_name).copy_(torch.cat([take(f"{p}{m}.weight") for m in modules]))
            a = p + "self_attn."
            if a + "q_proj.bias" in sd:
                bias = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
                layer.qkv_bias = nn.Parameter(bias.to(layer.qkv.device, layer.qkv.dtype))
            if a + "o_proj.bias" in sd:
                layer.o_bias = nn.Parameter(take(a + "o_proj.bias").to(layer.o_proj.device, layer.o_proj.dtype,
                                                                        copy=True))
        leftover = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")
