"""Random operation sequences against KVCacheManager with H2O eviction (cache/eviction/h2o.py):
the streaming machine's rules (tests/cache/test_eviction_stateful.py) over the same simulated KV
store, plus random attention mass reported per block, so the blocks evicted are anywhere past
the sinks (holes in the text, not in the block table).

A request's kept slots must hold its own tokens at their own text positions (no rebase: rotary
position == text position), in increasing text order, with its sink tokens and its last
``recent_tokens`` computed tokens always there, and exactly its tokens before its first
eviction clean: so a prefix-cache hit on a block computed after an eviction (whose KV depends on
the evicted context), a leak, a wrong ref count or a stale hash fails (check_invariants).
"""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from cache.eviction import EvictionConfig, build_policy
from cache.kv_cache_manager import KVCacheManager
from tests.cache.test_eviction_stateful import CHUNK, EvictionMachine, Req, tokens


class H2OMachine(EvictionMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 20),
                sinks=st.sampled_from([0, 1, 3]), recent=st.integers(0, 3), extra=st.integers(1, 2),
                slack=st.integers(0, 6), prefix_caching=st.booleans())
    def setup(self, block_size, num_blocks, sinks, recent, extra, slack, prefix_caching):
        self.bs = block_size
        sink_blocks = -(-sinks // block_size)
        budget = (sink_blocks + -(-recent // block_size) + 1 + extra) * block_size
        config = EvictionConfig("h2o", sinks, block_size=block_size, budget_tokens=budget, recent_tokens=recent)
        held = config.resolve(10**6, CHUNK).max_held_tokens
        self.config = config.resolve(held + slack + 12, CHUNK)
        self.sink_tok = self.config.sink_blocks * block_size
        self.mgr = KVCacheManager(num_blocks, block_size, prefix_caching, eviction=build_policy(self.config))
        self.kv = {i: [None] * block_size for i in range(num_blocks)}
        self.running = {}
        self.next_id = 0

    @rule(prompt=tokens, salt=st.sampled_from([None, None, "s"]), chunk=st.integers(1, CHUNK),
          evicts=st.sampled_from([True, True, False]))
    def add_request(self, prompt, salt, chunk, evicts):
        """As the streaming machine's, but the context bounds every request (keys keep their text positions)."""
        req = Req(f"r{self.next_id}", list(prompt[:self.config.max_positions - 1]), cache_salt=salt, evicts=evicts)
        self.next_id += 1
        self._admit(req, chunk)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6), token=st.integers(0, 1), chunk=st.integers(1, CHUNK))
    def step(self, pick, token, chunk):
        req = list(self.running.values())[pick % len(self.running)]
        if len(req.all_token_ids) - req.num_computed_tokens == 0 and len(req.all_token_ids) >= self.config.max_positions:
            return  # the engine caps an h2o request's prompt + output at the context
        super().step(pick, token, chunk)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6), mass=st.lists(st.floats(0, 100), min_size=0, max_size=24))
    def attend(self, pick, mass):
        """A step's attention mass per block-table index, as the runner reports it."""
        req = list(self.running.values())[pick % len(self.running)]
        self.mgr.add_block_mass(req.request_id, mass)

    def check_kept(self, req, blocks, evicted, shift, clean_until):
        """Which blocks h2o keeps depends on the mass: the held slots are in text order, hold every
        sink and recent token, whole blocks only, keys never re-rotated."""
        assert shift == 0, "h2o never re-rotates"
        c = req.num_computed_tokens
        seen = [self.kv[blocks[i // self.bs].block_id][i % self.bs] for i in range(c - evicted)]
        text = [s[2] for s in seen]
        assert text == sorted(set(text)), f"kept slots out of text order: {text}"
        assert set(range(min(c, self.sink_tok))) <= set(text), "a sink token was evicted"
        assert set(range(max(0, c - self.config.recent_tokens), c)) <= set(text), "a recent token was evicted"
        assert all(t % self.bs == i % self.bs for i, t in enumerate(text)), "evicted a partial block"
        want = [(req.cache_salt, req.all_token_ids[t], t, t, t < clean_until) for t in text]
        assert seen == want

TestH2OMachine = H2OMachine.TestCase
TestH2OMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
