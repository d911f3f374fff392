"""Random operation sequences against KVCacheManager with a lower tier and pins.

Extends the simulated-KV state machine of tests/cache/test_cache_stateful.py: a dict stands in
for the disk tier, filled the way the engine fills it (evicted and written-through blocks are
copied out before anything overwrites them), requests whose prefix continues in the tier load
it into fresh blocks, and pins come and go on an injected clock. A request's visible KV must
always equal its own salt and tokens, whatever was restored, pinned, demoted or expired.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from cache.kv_cache_manager import KVCacheManager
from tests.cache.test_cache_stateful import CacheMachine, Req, salts, tokens


class DictTier:
    name = "dict"

    def __init__(self) -> None:
        self.store: dict[bytes, tuple] = {}

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.store


class TierMachine(CacheMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 12),
                prefix_caching=st.just(True), pin_fraction=st.sampled_from([0.0, 0.25, 0.5]))
    def setup(self, block_size, num_blocks, prefix_caching, pin_fraction):
        super().setup(block_size, num_blocks, prefix_caching)
        self.tier = DictTier()
        self.seen: list[tuple[list[int], str | None]] = []
        self.now = 0.0
        self.mgr = KVCacheManager(num_blocks, block_size, True, tier=self.tier, pin_fraction=pin_fraction,
                                  clock=lambda: self.now)
        self.slow = None  # the base machine's shadow does not follow pins and tier loads

    def _drain(self) -> None:
        """What the engine does right after scheduling: copy blocks out before the forward pass."""
        for block_id, block_hash, _ in self.mgr.take_offloads():
            self.tier.store.setdefault(block_hash, tuple(self.kv[block_id]))

    def _compute(self, req: Req, num_tokens: int) -> None:
        self._drain()
        super()._compute(req, num_tokens)

    @rule(prompt=tokens, salt=salts, chunk=st.integers(1, 14), corrupt=st.booleans())
    def add_request_via_tier(self, prompt, salt, chunk, corrupt):
        self._via_tier(prompt, salt, chunk, corrupt)

    @precondition(lambda self: self.seen)
    @rule(pick=st.integers(0, 10**6), extra=tokens, chunk=st.integers(1, 14), corrupt=st.booleans())
    def revisit_via_tier(self, pick, extra, chunk, corrupt):
        """A prompt seen before (plus a new tail): its prefix is likely in the tier by now."""
        prompt, salt = self.seen[pick % len(self.seen)]
        self._via_tier(prompt + extra, salt, chunk, corrupt)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6))
    def finish(self, pick):
        request_id = list(self.running)[pick % len(self.running)]
        req = self.running.pop(request_id)
        self.seen.append((list(req.all_token_ids), req.cache_salt))
        self.mgr.free(request_id)

    def _via_tier(self, prompt, salt, chunk, corrupt):
        req = Req(f"r{self.next_id}", list(prompt), cache_salt=salt)
        self.next_id += 1
        hits, num_hit_tokens = self.mgr.get_computed_blocks(req.all_token_ids, salt)
        tier_hashes = self.mgr.get_tier_hits(req.all_token_ids, salt, hits)
        if not tier_hashes:
            return
        fresh = self.mgr.allocate_for_load(req, hits, tier_hashes)
        if fresh is None:
            return
        self._drain()  # fresh blocks may have been evicted for this
        num_ok = len(fresh) - 1 if corrupt else len(fresh)  # a bad last file: a shorter load
        for block, block_hash in zip(fresh[:num_ok], tier_hashes):
            self.kv[block.block_id] = list(self.tier.store[block_hash])
        self.mgr.finish_load(req.request_id, num_ok)
        req.num_computed_tokens = num_hit_tokens + num_ok * self.bs
        self.running[req.request_id] = req
        num_new = min(chunk, len(prompt) - req.num_computed_tokens)
        if self._schedule(req, num_new):
            self._compute(req, num_new)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6), ttl=st.sampled_from([1.0, 5.0]))
    def pin(self, pick, ttl):
        req = list(self.running.values())[pick % len(self.running)]
        self.mgr.pin_request(req.request_id, req.num_computed_tokens, ttl)
        assert self.mgr.num_pinned_blocks <= self.mgr.max_pinned_blocks

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def tick(self, dt):
        self.now += dt
        self.mgr.expire_pins()
        assert all(p.expires_at > self.now for p in self.mgr._pins.values())

    @rule()
    def reset(self):
        """Pins hold blocks, so a reset is refused while any pin lives."""
        held = any(self.mgr.get_blocks(r) for r in self.running) or self.mgr.num_pinned_blocks > 0
        assert self.mgr.reset_prefix_cache() == (not held)

    @rule()
    def demote(self):
        had = bool(self.mgr._pins)
        assert self.mgr.demote_oldest_pin() == had

    @invariant()
    def consistent(self):
        """As the base machine's, except that a request whose tier load stopped early holds the
        blocks it will recompute into before it has computed them."""
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        for req in self.running.values():
            blocks = self.mgr.get_blocks(req.request_id)
            assert len(blocks) >= -(-req.num_computed_tokens // self.bs)
            n = req.num_computed_tokens
            seen = [self.kv[blocks[p // self.bs].block_id][p % self.bs] for p in range(n)]
            assert seen == [(req.cache_salt, t) for t in req.all_token_ids[:n]]

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        self.now += 1e9
        self.mgr.expire_pins()
        assert self.mgr.num_pinned_blocks == 0
        super().teardown()


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
