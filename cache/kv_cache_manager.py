"""Per-request block tables on top of the BlockPool, with prefix caching."""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cache.block import KVBlock
from cache.block_pool import BlockPool, _check
from cache.eviction import EvictionPolicy, RopeShift
from cache.eviction.allocation import check_kept_blocks, kept_text_indices, plan_allocation, rebase_blocks
from cache.hashing import BlockHash, iter_block_hashes
from cache.pins import Pin, PinInfo, salt_id
from cache.tiers import KVTier, tier_members


class CacheRequest(Protocol):
    """What the manager reads of a scheduler Request (read-only)."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt + output tokens so far (the known tokens)."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is already in this request's blocks."""
        ...

    @property
    def cache_salt(self) -> str | None: ...  # (and optionally ``evicts``: read with getattr, default False)


@dataclass
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    # Chained hashes of the request's text blocks [0, len(block_hashes)). A block may be missing
    # from the cache map (a duplicate of another request's block) but its hash is still needed to
    # chain the next one. Kept block j is text block j, or j + num_evicted_blocks past the sinks.
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_evicted_blocks: int = 0  # evicted text blocks (streaming: the ones right after the sink blocks)
    position_shift: int = 0  # kept tokens past the sinks sit at text position - shift (cache/eviction)
    evicted_text: list[int] = field(default_factory=list)  # the evicted text block indices, ascending
    # h2o: accumulated attention mass per kept block, in block-table order (missing ones: 0)
    block_mass: list[float] = field(default_factory=list)


class KVCacheManager:
    """Maps request ids to their blocks; hands out prefix-cache hits and new blocks.

    Block ``i`` of a request holds the KV of token positions ``[i*block_size, (i+1)*block_size)``.
    Every block of a request that is full of known tokens is registered in the prefix cache
    (unless the same content is already registered), so prompt and decode blocks alike become
    reusable once the request frees them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: KVTier | None = None, pin_fraction: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 eviction: EvictionPolicy | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= pin_fraction < 1.0:
            raise ValueError(f"pin_fraction must be in [0, 1), got {pin_fraction}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        # ---- lower tier (see cache/tiers.py): evicted hashed blocks are recorded for offload.
        self.tier = tier if enable_prefix_caching else None
        if self.tier is not None:
            self.block_pool.evicted = []
        self._pending_writes: list[tuple[int, BlockHash, float]] = []  # write-through: (block id, hash, expires_at)
        self._loading: dict[str, int] = {}  # request id -> blocks it held before its tier load
        # ---- pins (see cache/pins.py); clock is monotonic for TTLs, wall_clock dates tier retention.
        self.clock = clock
        self.wall_clock = wall_clock
        self.max_pinned_blocks = int(pin_fraction * num_blocks)
        self._pins: dict[BlockHash, Pin] = {}
        self._pin_refs: Counter[int] = Counter()  # block id -> pins holding it
        self._unpin_requests: queue.SimpleQueue[BlockHash] = queue.SimpleQueue()
        self._pin_snapshot: tuple[PinInfo, ...] = ()
        # ---- eviction inside a sequence (cache/eviction): the policy, the pool edits its plans
        # need before the next forward pass, and counters for the metrics.
        self.eviction = eviction
        if eviction is not None and eviction.block_size != block_size:
            raise ValueError(f"the eviction policy's block size {eviction.block_size} is not the pool's")
        self._rope_shifts: list[RopeShift] = []
        self.num_evicted_blocks_total = 0  # blocks evicted inside sequences, ever

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_held(self) -> int:
        """Blocks held by at least one live request."""
        return self.num_blocks - self.num_free_blocks

    def get_computed_blocks(self, token_ids: Sequence[int],
                            cache_salt: str | None = None) -> tuple[list[KVBlock], int]:
        """Longest chain of prefix-cache hits over the full blocks of ``token_ids``.

        Stops at the first miss and never covers the last token (its logits are needed), so at
        most ``(len(token_ids) - 1) // block_size`` blocks. Returns ``(blocks, len(blocks) *
        block_size)``. The blocks are NOT touched: pass them to ``allocate_slots`` in the same
        scheduling step, before anything else can evict them.
        """
        if not self.enable_prefix_caching or not token_ids:
            return [], 0
        max_hit_tokens = self._max_hit_tokens(token_ids)
        hits: list[KVBlock] = []
        refreshed = False
        for block_hash in iter_block_hashes(token_ids[:max_hit_tokens], self.block_size, cache_salt):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
            pin = self._pins.get(block_hash)
            if pin is not None:  # a hit covering a pinned prefix refreshes its TTL
                pin.last_refresh = self.clock()
                pin.expires_at = max(pin.expires_at, pin.last_refresh + pin.ttl_s)
                refreshed = True
        if refreshed:
            self._refresh_snapshot()
        return hits, len(hits) * self.block_size

    def _max_hit_tokens(self, token_ids: Sequence[int]) -> int:
        most = min(len(token_ids) - 1, self.eviction.max_hit_tokens if self.eviction else len(token_ids))
        return most // self.block_size * self.block_size

    # ---- the lower tier ------------------------------------------------------------------------
    def get_tier_hits(self, token_ids: Sequence[int], cache_salt: str | None,
                      device_hits: Sequence[KVBlock]) -> list[BlockHash]:
        """Continue the hash chain past ``device_hits`` into the lower tier: the hashes of the
        following blocks the tier holds, up to its first miss (never covering the last token)."""
        if self.tier is None or not token_ids:
            return []
        max_hit_tokens = self._max_hit_tokens(token_ids)
        parent = device_hits[-1].block_hash if device_hits else None
        found: list[BlockHash] = []
        for block_hash in iter_block_hashes(token_ids[:max_hit_tokens], self.block_size, cache_salt,
                                            parent, len(device_hits)):
            if not self.tier.contains(block_hash):
                break
            found.append(block_hash)
        return found

    def tier_names(self) -> list[str]:
        """The lower tiers' names, top first (e.g. ``["host", "disk"]``)."""
        return [t.name for t in tier_members(self.tier)]

    def tier_sources(self, hashes: Sequence[BlockHash]) -> list[str]:
        """For each hash, the name of the lower tier that holds it now (for the per-tier metrics)."""
        members = tier_members(self.tier)
        return [next((t.name for t in members if t.contains(h)), members[-1].name if members else "") for h in hashes]

    def allocate_for_load(self, request: CacheRequest, device_hits: Sequence[KVBlock],
                          tier_hashes: Sequence[BlockHash]) -> list[KVBlock] | None:
        """First allocation of a request whose prefix continues in the lower tier: take the device
        hits and fresh blocks for ``tier_hashes``; return the fresh blocks (to be filled from the
        tier), or None (nothing changes) if the pool cannot supply them.

        The fresh blocks stay out of the prefix cache until ``finish_load`` says their contents
        arrived, so no other request can hit a block that is still being loaded.
        """
        if request.request_id in self._requests and self._requests[request.request_id].blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        num_evictable_hits = sum(1 for block in device_hits if block.ref_cnt == 0)
        if len(tier_hashes) + num_evictable_hits > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(device_hits)
        new_blocks = self.block_pool.get_new_blocks(len(tier_hashes))
        hashes = [block.block_hash for block in device_hits]
        if any(h is None for h in hashes):
            raise ValueError("device_hits must be cached blocks")
        self._requests[request.request_id] = _RequestBlocks(
            blocks=list(device_hits) + new_blocks, block_hashes=hashes + list(tier_hashes))  # type: ignore[operator]
        self._loading[request.request_id] = len(device_hits)
        return new_blocks

    def finish_load(self, request_id: str, num_loaded: int) -> None:
        """The first ``num_loaded`` fresh blocks of ``allocate_for_load`` now hold their contents:
        register them in the prefix cache. Blocks after a failed read stay unhashed and forget
        their hash, so the request recomputes them (and registers them then)."""
        num_before = self._loading.pop(request_id, None)
        state = self._requests.get(request_id)
        if num_before is None or state is None:
            return
        end = num_before + num_loaded
        for block, block_hash in zip(state.blocks[num_before:end], state.block_hashes[num_before:end]):
            self.block_pool.cache_block(block, block_hash)
        del state.block_hashes[end:]

    def retain_request(self, request_id: str, num_tokens: int, expires_at: float) -> int:
        """Write the request's first ``num_tokens // block_size`` blocks through to the tier,
        protected from its LRU until ``expires_at`` (wall clock); return the tokens not there yet."""
        state = self._requests.get(request_id)
        if self.tier is None or state is None:
            return 0
        written = 0
        n = min(num_tokens // self.block_size, len(state.block_hashes))
        for i, block_hash in enumerate(state.block_hashes[:n]):
            # past an eviction kept block i is another text block; an evicted one may still be cached
            block = state.blocks[i] if not state.num_evicted_blocks else self.block_pool.get_cached_block(block_hash)
            if block is None:
                continue
            if not self.tier.contains(block_hash):
                written += self.block_size
            self._pending_writes.append((block.block_id, block_hash, expires_at))
        return written

    def take_offloads(self) -> list[tuple[int, BlockHash, float]]:
        """Blocks to copy to the tier NOW, before the next forward pass overwrites them:
        ``(block_id, hash, expires_at)`` for evicted blocks (expires_at 0) and write-throughs."""
        if self.tier is None:
            return []
        evicted = self.block_pool.evicted or []
        out = [(block_id, block_hash, 0.0) for block_id, block_hash in evicted] + self._pending_writes
        self.block_pool.evicted = []
        self._pending_writes = []
        return out

    # ---- pins ----------------------------------------------------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pin_refs)

    def pin_request(self, request_id: str, num_tokens: int, ttl_s: float, cache_salt: str | None = None,
                    tenant: str | None = None) -> int:
        """Pin the request's cached blocks covering its first ``num_tokens`` tokens for ``ttl_s``.

        Re-pinning the same prefix refreshes it. Returns the tokens newly pinned (0 when refreshed,
        when nothing is cached, or when the pin alone exceeds the cap - then it is written through
        to the tier instead). The caller passes only tokens whose KV is computed.
        """
        state = self._requests.get(request_id)
        if state is None or not self.enable_prefix_caching or ttl_s <= 0:
            return 0
        blocks: list[KVBlock] = []
        for block_hash in state.block_hashes[:num_tokens // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return 0
        key = blocks[-1].block_hash
        assert key is not None
        now = self.clock()
        pin = self._pins.get(key)
        if pin is not None:
            pin.ttl_s = max(pin.ttl_s, ttl_s)
            pin.last_refresh = now
            pin.expires_at = max(pin.expires_at, now + ttl_s)
            self._refresh_snapshot()
            return 0
        if len(blocks) > self.max_pinned_blocks:
            self._pending_writes.extend((b.block_id, b.block_hash, 0.0) for b in blocks if self.tier is not None)
            return 0
        self.block_pool.touch(blocks)
        self._pin_refs.update(block.block_id for block in blocks)
        self._pins[key] = Pin(key=key, block_ids=tuple(b.block_id for b in blocks),
                              num_tokens=len(blocks) * self.block_size, ttl_s=ttl_s, expires_at=now + ttl_s,
                              last_refresh=now, salt_id=salt_id(cache_salt), tenant=tenant)
        while self.num_pinned_blocks > self.max_pinned_blocks:
            oldest = min(self._pins.values(), key=lambda p: (p.key == key, p.last_refresh))
            self._release_pin(oldest, write_through=True)
        self._refresh_snapshot()
        return len(blocks) * self.block_size if key in self._pins else 0

    def expire_pins(self) -> int:
        """Release pins past their TTL and pins whose removal was requested; return how many."""
        released = 0
        while True:
            try:
                key = self._unpin_requests.get_nowait()
            except queue.Empty:
                break
            pin = self._pins.get(key)
            if pin is not None:
                self._release_pin(pin, write_through=False)
                released += 1
        now = self.clock()
        for pin in [p for p in self._pins.values() if p.expires_at <= now]:
            self._release_pin(pin, write_through=False)
            released += 1
        if released:
            self._refresh_snapshot()
        return released

    def demote_oldest_pin(self) -> bool:
        """Memory pressure that preemption cannot relieve: unpin the least recently refreshed pin
        (its blocks go to the tier). False if there is no pin."""
        if not self._pins:
            return False
        self._release_pin(min(self._pins.values(), key=lambda p: p.last_refresh), write_through=True)
        self._refresh_snapshot()
        return True

    def list_pins(self) -> list[PinInfo]:
        """Live pins (thread safe: reads an immutable snapshot), expired ones left out."""
        now = self.clock()
        return [info for info in self._pin_snapshot if info.expires_at > now]

    def request_unpin(self, key_hex: str) -> bool:
        """Ask for a pin's release at the next scheduling step (thread safe); False if not pinned."""
        for info in self.list_pins():
            if info.hash == key_hex:
                self._pin_snapshot = tuple(i for i in self._pin_snapshot if i.hash != key_hex)
                self._unpin_requests.put(bytes.fromhex(key_hex))
                return True
        return False

    def _release_pin(self, pin: Pin, write_through: bool) -> None:
        del self._pins[pin.key]
        blocks = [self.block_pool.blocks[i] for i in pin.block_ids]
        for block in blocks:
            self._pin_refs[block.block_id] -= 1
            if self._pin_refs[block.block_id] == 0:
                del self._pin_refs[block.block_id]
            if write_through and self.tier is not None and block.block_hash is not None:
                self._pending_writes.append((block.block_id, block.block_hash, 0.0))
        self.block_pool.free_blocks(reversed(blocks))

    def _refresh_snapshot(self) -> None:
        self._pin_snapshot = tuple(
            PinInfo(hash=p.key.hex(), num_tokens=p.num_tokens, num_blocks=len(p.block_ids), ttl_s=p.ttl_s,
                    expires_at=p.expires_at, salt_id=p.salt_id, tenant=p.tenant)
            for p in self._pins.values())

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Make the request's blocks hold ``num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`` tokens; return the newly allocated blocks.

        ``new_computed_blocks`` (from ``get_computed_blocks``, only while the request holds no
        blocks) are touched and become its first blocks. Returns None, changing nothing, if the
        pool cannot supply the blocks. Afterwards every block full of known tokens is hashed and
        registered in the prefix cache.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(request.request_id)
        if state is not None and not new_computed_blocks and self._fits(request, state, num_new_tokens):
            return []
        state = state or _RequestBlocks()
        if new_computed_blocks and state.blocks:
            raise ValueError("new_computed_blocks are only allowed on a request's first allocation")
        bs = self.block_size
        if request.num_computed_tokens - state.num_evicted_blocks * bs > len(state.blocks) * bs:
            raise ValueError(f"request {request.request_id!r} claims {request.num_computed_tokens} "
                             f"computed tokens but holds only {len(state.blocks)} blocks")

        computed = request.num_computed_tokens + len(new_computed_blocks) * bs  # text tokens before the step
        num_tokens = computed + num_new_tokens
        plan = plan_allocation(self.eviction, getattr(request, "evicts", False), state.blocks, new_computed_blocks,
                               state.num_evicted_blocks, state.position_shift, computed, num_new_tokens, bs,
                               state.block_mass)
        # Touching a hit with ref_cnt 0 takes it out of the free queue, so it costs a free block too.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and block not in plan.dropped)
        if plan.num_new_blocks + plan.num_copies + num_evictable_hits > self.block_pool.num_free_blocks + plan.num_freed:
            return None

        # Hash before mutating anything, so a stale hit is reported with the pool untouched.
        num_full_blocks = self._full_blocks(request, num_tokens)
        new_hashes = self._hash_blocks(request, state, num_full_blocks) if not state.num_evicted_blocks else []
        for i, block in enumerate(new_computed_blocks):
            if i >= len(new_hashes) or block.block_hash != new_hashes[i]:
                raise ValueError(f"new_computed_blocks[{i}] (block {block.block_id}) is not a cache "
                                 "hit for this request's tokens (evicted since get_computed_blocks?)")

        self.block_pool.touch(new_computed_blocks)
        state.blocks.extend(new_computed_blocks)
        if plan.num_evicted:
            # Blocks computed after an eviction depend on more than their tokens: never offered.
            state.block_hashes.extend(new_hashes[:len(new_computed_blocks)])
            new_hashes = []
        if plan.num_evict:
            texts = kept_text_indices(len(state.blocks), state.evicted_text)
            state.evicted_text = sorted(state.evicted_text + [texts[i] for i in plan.indices])
            for i in reversed(plan.indices):
                del state.blocks[i]
                if i < len(state.block_mass):
                    del state.block_mass[i]
            self.block_pool.free_blocks(reversed(plan.dropped))
            state.num_evicted_blocks = plan.num_evicted
            self.num_evicted_blocks_total += plan.num_evict
        if plan.rebase:
            self._rebase(state, plan.sinks, plan.num_evicted * bs)
        new_blocks = self.block_pool.get_new_blocks(plan.num_new_blocks)
        state.blocks.extend(new_blocks)
        for block_hash in new_hashes:
            block = state.blocks[len(state.block_hashes)]
            state.block_hashes.append(block_hash)
            self.block_pool.cache_block(block, block_hash)  # False for a duplicate: stays unhashed
        self._requests[request.request_id] = state
        return new_blocks

    def _fits(self, request: CacheRequest, state: _RequestBlocks, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots`` has nothing to do: the held blocks take the new tokens, no
        block fills up (nothing to hash), nothing was or will be evicted. Most decode steps of a
        request (block_size - 1 of every block_size) end here, before the full plan."""
        if state.num_evicted_blocks or getattr(request, "evicts", False):
            return False
        num_tokens = request.num_computed_tokens + num_new_tokens
        return num_tokens <= len(state.blocks) * self.block_size and (
            not self.enable_prefix_caching or self._full_blocks(request, num_tokens) <= len(state.block_hashes))

    def _full_blocks(self, request: CacheRequest, num_tokens: int) -> int:
        """The request's blocks full of known tokens once it holds ``num_tokens``: the ones to hash."""
        return min(num_tokens, len(request.all_token_ids)) // self.block_size

    def _rebase(self, state: _RequestBlocks, sinks: int, shift: int) -> None:
        """Move the kept tokens past the sinks to contiguous positions (``position_shift =
        shift``): their keys get rotated back by the difference before the next forward pass.
        Shared blocks are copied first, its own ones leave the prefix cache (``rebase_blocks``)."""
        copies, uncached = rebase_blocks(self.block_pool, state.blocks, sinks)
        if uncached:  # a write-through not taken yet would copy rotated keys under the old hash
            self._pending_writes = [w for w in self._pending_writes if w[0] not in uncached]
        delta = shift - state.position_shift
        state.position_shift = shift
        self._rope_shifts.append(RopeShift(tuple(b.block_id for b in state.blocks[sinks:]), delta, tuple(copies)))

    def add_block_mass(self, request_id: str, mass: Sequence[float]) -> None:
        """Add one step's attention mass per block-table index (h2o: summed over layers, heads
        and the step's query rows, as the attention backend exported it) to the request's
        accumulated mass. The step's block table is the current one: it changes only when the
        next step is scheduled. An unknown request (finished, preempted) is a no-op."""
        state = self._requests.get(request_id)
        if state is None:
            return
        acc = state.block_mass
        n = min(len(mass), len(state.blocks))
        if len(acc) < n:
            acc.extend([0.0] * (n - len(acc)))
        for j in range(n):
            acc[j] += float(mass[j])

    def block_mass(self, request_id: str) -> list[float]:
        """The request's accumulated attention mass per kept block (0 where none was reported)."""
        state = self._requests.get(request_id) or _RequestBlocks()
        return [state.block_mass[j] if j < len(state.block_mass) else 0.0 for j in range(len(state.blocks))]

    def take_rope_shifts(self) -> list[RopeShift]:
        """The pool edits the step's rebases need, in order, before its forward pass (cache/eviction)."""
        out, self._rope_shifts = self._rope_shifts, []
        return out

    def sequence_offsets(self, request_id: str) -> tuple[int, int]:
        """``(evicted tokens, position shift)`` of a request: its new token at text position ``t``
        goes to cache slot ``t - evicted`` and is rotated at position ``t - shift``."""
        state = self._requests.get(request_id) or _RequestBlocks()
        return state.num_evicted_blocks * self.block_size, state.position_shift

    def _hash_blocks(self, request: CacheRequest, state: _RequestBlocks,
                     num_full_blocks: int) -> list[BlockHash]:
        """Hashes of the request's full blocks not hashed yet (incremental along the chain)."""
        start = len(state.block_hashes)
        if not self.enable_prefix_caching or num_full_blocks <= start:
            return []
        parent = state.block_hashes[-1] if state.block_hashes else None
        return list(iter_block_hashes(request.all_token_ids[:num_full_blocks * self.block_size],
                                      self.block_size, request.cache_salt, parent, start))

    def free(self, request_id: str) -> None:
        """Release the request's blocks and forget it; unknown ids are a no-op.

        Blocks are freed tail first, so within a request the deepest blocks (least likely to be
        shared by other prompts) land earlier in the LRU order and are evicted first.
        """
        state = self._requests.pop(request_id, None)
        self._loading.pop(request_id, None)
        if state is not None:
            self.block_pool.free_blocks(reversed(state.blocks))

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Keep only the blocks covering the request's first ``num_tokens`` positions; free the
        rest, tail first; return how many were freed. Speculative decoding's rollback: the freed
        blocks hold only rejected draft slots. A block to be freed that carries a hash is an
        error (nothing changes): only blocks full of known tokens are hashed."""
        state = self._requests.get(request_id)
        if state is None:
            return 0
        if state.num_evicted_blocks:
            raise ValueError(f"request {request_id!r}: cannot truncate a sequence that evicted blocks")
        keep = -(-num_tokens // self.block_size)
        tail = state.blocks[keep:]
        if len(state.block_hashes) > keep or any(block.block_hash is not None for block in tail):
            raise ValueError(f"request {request_id!r}: cannot truncate to {num_tokens} tokens, "
                             "a block past them is hashed")
        del state.blocks[keep:]
        del state.block_mass[keep:]
        self.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def get_blocks(self, request_id: str) -> list[KVBlock]:
        """The request's blocks in token order ([] for an unknown id); a copy."""
        state = self._requests.get(request_id)
        return list(state.blocks) if state is not None else []

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.get_blocks(request_id)]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changes) while any request holds blocks."""
        # Requests still registered hold no blocks, hence no hashes: nothing to clear here.
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError unless pool and block tables agree (scheduler tests call it every step).

        Each block is either free (ref 0, in the queue) or held (ref > 0, not queued); free + held
        == total; ref_cnt == number of requests whose block list contains it; hashed blocks and
        the cache map agree both ways; each request's recorded hashes match its hashed blocks.
        """
        self.block_pool.check_invariants()
        holders: Counter[int] = Counter(self._pin_refs)
        for pin in self._pins.values():
            for block_id in pin.block_ids:
                _check(self.block_pool.blocks[block_id].block_hash is not None, f"pinned block {block_id} lost its hash")
        for request_id, state in self._requests.items():
            ids = [block.block_id for block in state.blocks]
            _check(len(set(ids)) == len(ids), f"request {request_id!r} holds a block twice: {ids}")
            holders.update(ids)
            _check(len(state.block_hashes) <= len(state.blocks) + state.num_evicted_blocks,
                   f"request {request_id!r} has more hashes than blocks")
            sinks = self.eviction.sink_blocks if self.eviction is not None and state.num_evicted_blocks else 0
            check_kept_blocks(request_id, state.blocks, state.block_hashes, sinks, state.num_evicted_blocks,
                              state.position_shift, state.evicted_text)
        for block in self.block_pool.blocks:
            _check(block.ref_cnt == holders[block.block_id],
                   f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders")
        num_held = sum(1 for block in self.block_pool.blocks if block.ref_cnt > 0)
        _check(self.num_free_blocks + num_held == self.num_blocks, "free + held != total blocks")
