"""Random operation sequences against KVCacheManager, with a simulated KV store.

The simulation writes (cache_salt, token id) of each computed position into the slot the position
maps to; a request's visible KV must then always equal its own salt and tokens. That catches wrong
prefix hits, hits across salts, hits on evicted-and-reused blocks and writes into shared blocks, on
top of check_invariants(). A second manager with allocate_slots' decode fast path
(``_fits``) switched off follows the same operations and must end every step in the same state:
the fast path may skip only what the full plan would not do.
"""

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache.kv_cache_manager import KVCacheManager

tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny vocab: prefixes collide
salts = st.sampled_from([None, None, "s"])


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None


class CacheMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 12),
                prefix_caching=st.booleans())
    def setup(self, block_size, num_blocks, prefix_caching):
        self.bs = block_size
        self.mgr = KVCacheManager(num_blocks, block_size, prefix_caching)
        self.slow = KVCacheManager(num_blocks, block_size, prefix_caching)
        self.slow._fits = lambda *args: False
        self.kv: dict[int, list[tuple | None]] = {i: [None] * block_size for i in range(num_blocks)}
        self.running: dict[str, Req] = {}
        self.next_id = 0

    def _snapshot(self, mgr=None):
        mgr = mgr or self.mgr
        pool = mgr.block_pool
        return ([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks],
                [b.block_hash for b in pool.blocks],
                {r: mgr.get_block_ids(r) for r in self.running})

    def _hits(self, req: Req):
        """Prefix hits from both managers: the same blocks, each manager's own objects."""
        hits, num_hit_tokens = self.mgr.get_computed_blocks(req.all_token_ids, req.cache_salt)
        if self.slow is None:
            return (hits, ()), num_hit_tokens
        slow_hits, slow_num = self.slow.get_computed_blocks(req.all_token_ids, req.cache_salt)
        assert ([b.block_id for b in hits], num_hit_tokens) == ([b.block_id for b in slow_hits], slow_num)
        return (hits, slow_hits), num_hit_tokens

    def _free(self, request_id: str) -> None:
        self.mgr.free(request_id)
        if self.slow is not None:
            self.slow.free(request_id)

    def _compute(self, req: Req, num_tokens: int) -> None:
        """Simulate the model runner writing KV for the next num_tokens positions."""
        blocks = self.mgr.get_blocks(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_tokens):
            block = blocks[pos // self.bs]
            assert block.ref_cnt == 1, f"writing into shared block {block.block_id}"
            self.kv[block.block_id][pos % self.bs] = (req.cache_salt, req.all_token_ids[pos])
        req.num_computed_tokens += num_tokens

    def _schedule(self, req: Req, num_new: int, hits=((), ())) -> bool:
        before = self._snapshot()
        new = self.mgr.allocate_slots(req, num_new, hits[0])
        if self.slow is not None:
            slow_new = self.slow.allocate_slots(req, num_new, hits[1])
            assert (new is None) == (slow_new is None)
            if new is not None:
                assert [b.block_id for b in new] == [b.block_id for b in slow_new]
        if new is None:
            assert self._snapshot() == before
            return False
        return True

    @rule(prompt=tokens, salt=salts, chunk=st.integers(1, 14))
    def add_request(self, prompt, salt, chunk):
        req = Req(f"r{self.next_id}", list(prompt), cache_salt=salt)
        self.next_id += 1
        hits, num_hit_tokens = self._hits(req)
        assert num_hit_tokens < len(prompt)
        num_new = min(chunk, len(prompt) - num_hit_tokens)
        if self._schedule(req, num_new, hits):
            req.num_computed_tokens = num_hit_tokens
            self.running[req.request_id] = req
            self._compute(req, num_new)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6), token=st.integers(0, 2), chunk=st.integers(1, 14))
    def step(self, pick, token, chunk):
        """Next prefill chunk, or one decode token once the prompt is done."""
        req = list(self.running.values())[pick % len(self.running)]
        remaining = len(req.all_token_ids) - req.num_computed_tokens
        if remaining == 0:
            req.all_token_ids.append(token)
            num_new = 1
        else:
            num_new = min(chunk, remaining)
        if self._schedule(req, num_new):
            self._compute(req, num_new)
        elif remaining == 0:
            req.all_token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6))
    def finish(self, pick):
        request_id = list(self.running)[pick % len(self.running)]
        del self.running[request_id]
        self._free(request_id)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6))
    def preempt_and_recompute(self, pick):
        req = list(self.running.values())[pick % len(self.running)]
        self._free(req.request_id)
        del self.running[req.request_id]
        req.num_computed_tokens = 0
        hits, num_hit_tokens = self._hits(req)
        num_new = len(req.all_token_ids) - num_hit_tokens
        if self._schedule(req, num_new, hits):
            req.num_computed_tokens = num_hit_tokens
            self.running[req.request_id] = req
            self._compute(req, num_new)

    @rule()
    def reset(self):
        held = any(self.mgr.get_blocks(r) for r in self.running)
        assert self.mgr.reset_prefix_cache() == (not held)
        if self.slow is not None:
            assert self.slow.reset_prefix_cache() == (not held)
        if not held:
            assert self.mgr.block_pool.cached_blocks == {}

    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        if self.slow is not None:
            assert self._snapshot() == self._snapshot(self.slow)
        for req in self.running.values():
            blocks = self.mgr.get_blocks(req.request_id)
            assert len(blocks) == -(-req.num_computed_tokens // self.bs)
            n = req.num_computed_tokens
            seen = [self.kv[blocks[p // self.bs].block_id][p % self.bs] for p in range(n)]
            assert seen == [(req.cache_salt, t) for t in req.all_token_ids[:n]]

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for request_id in list(self.running):
            self._free(request_id)
        self.mgr.check_invariants()
        assert self.mgr.usage == 0
        assert self.mgr.num_free_blocks == self.mgr.num_blocks


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
