"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

The model: the embedding, the stack of ``DecoderLayer`` (engine/model/decoder_layer.py), the
final norm and the LM head, with GGUF block attachment and weight accounting. The forward takes
a flat batch of tokens from many sequences (no padding) and returns hidden states;
``compute_logits`` runs the LM head only on the rows that sample. One class for one rank and
for each rank of a tensor-parallel group: with a ``ModelShard`` its matmuls are the rank's
(engine/model/parallel_linear.py), and ``ranks`` (engine/model/ranks.py) is how rank 0 drives
the others.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, TorchAttention
from engine.kernels import has_op, load_kernels
from engine.kv.int4 import Int4KV
from engine.kv.transfer import BlockCopier
from engine.loader import LoadedModel
from engine.loader.gguf.blocks import BlockMatrix, GGUFMatrix
from engine.loader.gguf.tensors import read_gguf_blocks
from engine.model.arch import ModelArch
from engine.model.block_linear import BlockLinear
from engine.model.decoder_layer import DecoderLayer, rms_norm
from engine.model.linear import (check_activation_quant, choose_linear, dense_linear, describe_activation_quant,
                                 describe_prefill_matmuls, resolve_activation_quant)
from engine.model.native_decode import NativeDecoder, decide_decode_path, rebind_native_decoder
from engine.model.parallel_linear import ModelShard
from engine.model.ranks import ModelRanks
from engine.model.rope import rope_cos_sin, signed_sin
from engine.platform import huge_pages
from engine.platform.host_malloc import trim_malloc

logger = logging.getLogger(__name__)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, hf_config: Any, max_positions: int, shard: ModelShard | None = None) -> None:
        """``arch`` is this rank's (``engine.parallel.tensor_parallel.shard_arch`` with a ``shard``)."""
        super().__init__()
        self.arch = arch
        self.shard = shard
        self.embed = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch, shard) for _ in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = self.embed if arch.tie_word_embeddings else nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size))
        cos, sin = rope_cos_sin(hf_config, arch.head_dim, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)
        self.attn: AttentionBackend = TorchAttention()
        self.lm_head_mm: Callable[[torch.Tensor], torch.Tensor] = lambda h: F.linear(h, self.lm_head)
        if shard is not None:
            self.lm_head_mm = shard.lm_head(self.lm_head_mm)
        self.lm_head_blocks: BlockMatrix | None = None
        self.lm_head_blocks_only = False
        self.embed_blocks: BlockMatrix | None = None  # blocks-only embedding: lookups decode rows
        self.linear_backend = "aten"
        # RMSNorm, the residual add before a layer's second one, and RoPE on the native kernels
        # (CPU, fp32; DecoderLayer.native_rows), bound by select_linear_backend
        self.native_rows = False
        self.native: NativeDecoder | None = None  # the native decode path when it runs (select_decode_path)
        # "auto" | "none" | "int8" (ModelConfig.activation_quant): select_linear_backend resolves
        # auto to none or int8 (linear.resolve_activation_quant)
        self.activation_quant = "none"
        # "float32" | "bfloat16" (ModelConfig.prefill_matmul_dtype, resolved): set_prefill_matmul_dtype
        self.prefill_matmul_dtype = "float32"
        self.ranks = ModelRanks()  # rank 0 of a tensor-parallel group: TensorParallelRanks

    # ---- the processes (engine/model/ranks.py) --------------------------------------------
    def block_copier(self, kv_caches: list) -> BlockCopier:
        """The KV tiers' block copier over every rank's pool."""
        return self.ranks.block_copier(kv_caches)

    def watch_ranks(self, on_lost: Callable[[int, int | None], None]) -> bool:
        """Call ``on_lost(rank, exitcode)`` when another rank dies; False with a single rank."""
        return self.ranks.watch(on_lost)

    def close(self) -> None:
        """Stop the other ranks, if any (idempotent)."""
        self.ranks.close()

    # ---- kernels (engine/model/linear.py, engine/model/native_decode.py) -------------------
    def select_linear_backend(self, backend: str = "auto", batch_hint: int = 16) -> str:
        """Bind the matmul kernels once the weights are loaded (``linear.choose_linear`` decides
        which), and the row ops (``native_rows``); return the backend in use. Call it again after
        reloading weights."""
        has_blocks = self.lm_head_blocks is not None or any(layer.blocks for layer in self.layers)
        auto_choice = choose_linear(backend, has_blocks, self.holds_blocks_only(), self.embed.device,
                                    self.embed.dtype)
        self.activation_quant = resolve_activation_quant(self.activation_quant, auto_choice.use_blocks,
                                                         self.block_formats())
        choice = choose_linear(backend, has_blocks, self.holds_blocks_only(), self.embed.device, self.embed.dtype,
                               self.activation_quant)
        int8 = self.activation_quant == "int8"
        for layer in self.layers:
            layer.use_linear(choice.dense, choice.use_blocks, batch_hint, int8)
        if self.lm_head_blocks_only:
            self.lm_head_mm = BlockLinear(self.lm_head_blocks, None, None, int8)
        else:
            self.lm_head_mm = dense_linear(self.lm_head, None, choice.dense, batch_hint)
            if choice.use_blocks and self.lm_head_blocks is not None:
                self.lm_head_mm = BlockLinear(self.lm_head_blocks, None, self.lm_head_mm, int8)
        if self.shard is not None:
            self.lm_head_mm = self.shard.lm_head(self.lm_head_mm)
        self.linear_backend = choice.backend
        self.use_native_rows(self.norm.device.type == "cpu" and self.norm.dtype == torch.float32
                             and has_op("add_rms_norm_"))
        # onto the matmuls just bound; it rebinds the native path, whose arguments name them
        self.set_prefill_matmul_dtype(self.prefill_matmul_dtype)
        return choice.backend

    def use_native_rows(self, on: bool) -> None:
        """The row ops (RMSNorm, the residual add before a layer's second one, RoPE) on the native
        kernels where ``on`` (a float32 model on the CPU: ``select_linear_backend`` decides), else on
        torch's composites; cheap, so the benches alternate prompts between the two."""
        self.native_rows = on
        for layer in self.layers:
            layer.native_rows = on

    def block_formats(self) -> set[int]:
        """The GGUF block formats (``BlockFormat`` codes) of the attached block matrices."""
        matrices = [m for layer in self.layers for m in layer.blocks.values()]
        matrices += [self.lm_head_blocks] if self.lm_head_blocks is not None else []
        return {int(p.format) for m in matrices for p in m.parts}

    def block_linears(self) -> list[BlockLinear]:
        """The matmuls bound to GGUF blocks now (layers', then the LM head's)."""
        mms = [mm for layer in self.layers for attr, _, _ in layer.MATMULS
               if isinstance(mm := getattr(layer, attr), BlockLinear)]
        return mms + ([self.lm_head_mm] if isinstance(self.lm_head_mm, BlockLinear) else [])

    def set_activation_quant(self, mode: str) -> None:
        """Switch ``activation_quant`` on the matmuls as bound (cheap: no weight is touched; the
        benches alternate steps between the modes). The gguf backend must be in use for int8."""
        check_activation_quant(mode, self.linear_backend)
        self.activation_quant = mode
        for mm in self.block_linears():
            mm.use_int8_activations(mode == "int8")
        rebind_native_decoder(self)  # max_rows follows the kernels' max_rows

    def set_prefill_matmul_dtype(self, mode: str) -> None:
        """``float32`` or ``bfloat16`` (resolved, ``engine.model.linear.resolve_prefill_matmul_dtype``):
        whether the block matmuls take prefill chunks on the AMX-BF16 kernel (from each format's
        ``BlockLinear.BF16_MIN_ROWS``)."""
        self.prefill_matmul_dtype = mode
        for mm in self.block_linears():
            mm.use_bf16_prefill(mode == "bfloat16")
        rebind_native_decoder(self)  # its chunk bound follows the bf16 thresholds

    def describe_prefill_matmuls(self) -> str:
        """``prefill_matmul_dtype`` as bound: which block matrices take bf16 prefill chunks."""
        return describe_prefill_matmuls(self.prefill_matmul_dtype, self.block_linears())

    def describe_activation_quant(self) -> str:
        """``activation_quant`` as bound: which block matrices multiply int8 activations."""
        return describe_activation_quant(self.activation_quant, self.block_linears())

    @property
    def decode_path(self) -> str:
        """``native`` or ``python``: how decode rows run (see ``select_decode_path``)."""
        return "python" if self.native is None else "native"

    def select_decode_path(self, choice: str = "auto", kv_cache_dtype: str = "auto") -> tuple[str, str | None]:
        """How decode rows run (``engine.model.native_decode``, where it is decided); returns
        (path, why not native or None). ``kv_cache_dtype``: the pool's (the native path does not
        cover int8)."""
        decided = decide_decode_path(self, choice, kv_cache_dtype)
        return decided.path, decided.reason

    def native_decode(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], final_norm: bool = False) -> torch.Tensor:
        """The decode rows through every layer natively, in place; with ``final_norm`` also the
        model's final RMSNorm (the hidden states the LM head reads)."""
        return self.native.run(x, self.rope_cos[positions], self.rope_sin_signed[positions], meta, kv_caches,
                               self.activation_quant == "int8", final_norm)

    # ---- weights --------------------------------------------------------------------------
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

    @torch.no_grad()
    def gather_blocks(self) -> int:
        """Every GGUF block matrix's packed bytes moved into one buffer on huge pages (decode streams
        them every step: engine/platform/huge_pages.py), before any matmul binds them; each original
        is dropped as soon as it is copied. Returns the bytes moved."""
        matrices = [m for layer in self.layers for m in layer.blocks.values()]
        matrices += [m for m in (self.embed_blocks, self.lm_head_blocks) if m is not None]
        parts = list({id(p): p for m in matrices for p in m.parts}.values())
        for part, slot in zip(parts, huge_pages.slots([p.data.numel() * p.data.element_size() for p in parts])):
            part.data = huge_pages.copy_into(slot, part.data)
        return sum(p.data.numel() * p.data.element_size() for p in parts)

    def holds_blocks_only(self) -> bool:
        return self.lm_head_blocks_only or any(layer.blocks_only for layer in self.layers)

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
        if self.shard is not None:  # vocab-parallel: this rank's rows, then an all-reduce
            return self.shard.embed(input_ids, self.embed)
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

    # ---- the forward pass -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids/positions ``[T]`` -> final hidden states ``[T, hidden]``."""
        self.ranks.announce_forward(input_ids, positions, meta, kv_caches)
        x = self.embed_tokens(input_ids)
        decodes = self.native.rows(meta, kv_caches) if self.native is not None else 0
        if decodes == x.shape[0]:
            # the final norm too, inside the layers' parallel region: after the layers have swept
            # the caches, F.rms_norm's first call ran cold (~0.1 ms, 3% of a one-row step)
            return self.native_decode(x.contiguous(), positions, meta, kv_caches, final_norm=True)
        if decodes:
            # A mixed step: the decode rows natively, then the prefill chunks on DecoderLayer.forward.
            # NativeDecoder.rows made sure no decode row reads a block a chunk fills in this step; a
            # chunk may read one a decode row fills (a prefix hit), so the decode rows go first.
            decode_meta, meta = meta.split_decodes()
            head = self.native_decode(x[:decodes].contiguous(), positions[:decodes], decode_meta, kv_caches)
            x, positions = x[decodes:], positions[decodes:]
        cos, sin = self.rope_cos[positions], self.rope_sin_signed[positions]
        int4 = kv_caches[0][0].state if decodes and isinstance(kv_caches[0][0], Int4KV) else None
        with int4.rows_from(decodes) if int4 is not None else nullcontext():  # the decode rows wrote theirs
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x = layer.forward(x, cos, sin, k_cache, v_cache, meta, self.attn)
        if decodes:
            x = torch.cat([head, x])
        return rms_norm(x, self.norm, self.arch.rms_norm_eps, self.native_rows)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.ranks.announce_logits(hidden)
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


def configure_linear_layers(model: LlamaForCausalLM, loaded: LoadedModel, backend: str, device: torch.device,
                            dtype: torch.dtype, log: logging.Logger = logger) -> None:
    """The engine's binding of a loaded model's matmuls, logged (on ``log``): attach the GGUF
    blocks when the gguf backend may run (CPU, fp32, kernels built; for ``auto`` also the
    kernel's AVX2 path, its portable loop being slower than dense fp32), then bind the matmuls.
    A blocks-only model got its blocks at load."""
    runnable = loaded.gguf_path is not None and device.type == "cpu" and dtype == torch.float32 and load_kernels()
    fast = runnable and torch.ops.kvserve.gguf_kernel_isa() == "avx2"
    if loaded.blocks is None and ((backend == "gguf" and runnable) or (backend == "auto" and fast)):
        covered = model.attach_blocks(read_gguf_blocks(loaded.gguf_path, loaded.arch))
        log.info("GGUF blocks kept for %d weight matrices (decode matmuls read them, %s kernel)", covered,
                 torch.ops.kvserve.gguf_kernel_isa())
    if device.type == "cpu" and huge_pages.supported():
        log.info("GGUF blocks gathered onto huge pages: %.0f MB", model.gather_blocks() / 1e6)
        trim_malloc()  # the originals' freed chunks back to the system
    chosen = model.select_linear_backend(backend)
    held = model.weight_bytes()
    log.info("Weights resident: %.0f MB blocks, %.0f MB dense%s", held["blocks"] / 1e6, held["dense"] / 1e6,
             " (blocks only: no fp32 copy; the activation line says what prefill runs)"
             if model.holds_blocks_only() else "")
    log.info("Linear layers: %s (decode streams %.0f MB of weights per step)", chosen,
             model.decode_weight_bytes() / 1e6)
    log.info("Activation quantization: %s", model.describe_activation_quant())
