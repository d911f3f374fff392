"""Random operation sequences against KVCacheManager with streaming eviction, over a simulated
KV store that records, per slot, what a real pool would hold: (salt, token, text position,
rotary position, clean), where clean means computed with the whole prefix in its context (no
eviction had happened in its sequence yet). Rebases rotate the simulated keys (copies first).

A request's kept slots must always hold its own tokens at its own rotary positions, and exactly
its tokens before its first eviction must be clean: so a prefix hit on a re-rotated block or on
one computed after an eviction fails, as does any leak, wrong ref count or stale hash
(check_invariants), and position ids never reach the context.
"""

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache.eviction import EvictionConfig, build_policy
from cache.kv_cache_manager import KVCacheManager

# tiny vocab, and often one repeated token: long prefixes collide, so hits reach past evictions
tokens = st.one_of(st.lists(st.integers(0, 1), min_size=1, max_size=30), st.integers(1, 30).map(lambda n: [0] * n))
CHUNK = 6


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    evicts: bool = True
    first_evicted_at: int | None = None  # text tokens computed when it first evicted


class EvictionMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 16),
                sinks=st.sampled_from([0, 1, 3]), window=st.integers(1, 8), slack=st.integers(0, 6),
                prefix_caching=st.booleans())
    def setup(self, block_size, num_blocks, sinks, window, slack, prefix_caching):
        self.bs = block_size
        config = EvictionConfig("streaming", sinks, window, block_size=block_size)
        held = config.resolve(10**6, CHUNK).max_held_tokens
        self.config = config.resolve(held + slack, CHUNK)
        self.sink_tok = self.config.sink_blocks * block_size
        self.mgr = KVCacheManager(num_blocks, block_size, prefix_caching, eviction=build_policy(self.config))
        self.kv: dict[int, list[tuple | None]] = {i: [None] * block_size for i in range(num_blocks)}
        self.running: dict[str, Req] = {}
        self.next_id = 0

    def _snapshot(self):
        pool = self.mgr.block_pool
        return ([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks],
                [b.block_hash for b in pool.blocks], {r: self.mgr.get_block_ids(r) for r in self.running},
                {r: self.mgr.sequence_offsets(r) for r in self.running}, len(self.mgr._rope_shifts))

    def _apply_shifts(self) -> None:
        for shift in self.mgr.take_rope_shifts():
            for src, dst in shift.copies:
                self.kv[dst] = list(self.kv[src])
            for block_id in shift.block_ids:
                self.kv[block_id] = [None if s is None else s[:3] + (s[3] - shift.delta,) + s[4:]
                                     for s in self.kv[block_id]]

    def _compute(self, req: Req, num_tokens: int) -> None:
        """The model runner writing KV for the next num_tokens positions at their cache slots."""
        blocks = self.mgr.get_blocks(req.request_id)
        evicted, shift = self.mgr.sequence_offsets(req.request_id)
        if evicted and req.first_evicted_at is None:
            req.first_evicted_at = req.num_computed_tokens
        for t in range(req.num_computed_tokens, req.num_computed_tokens + num_tokens):
            block = blocks[(t - evicted) // self.bs]
            assert block.ref_cnt == 1, f"writing into shared block {block.block_id}"
            assert t - shift < self.config.max_positions, "a position id reached the context"
            self.kv[block.block_id][(t - evicted) % self.bs] = (req.cache_salt, req.all_token_ids[t], t, t - shift,
                                                                  not evicted)
        req.num_computed_tokens += num_tokens

    def _schedule(self, req: Req, num_new: int, hits=()) -> bool:
        before = self._snapshot()
        new = self.mgr.allocate_slots(req, num_new, hits)
        if new is None:
            assert self._snapshot() == before
            return False
        self._apply_shifts()
        return True

    def _admit(self, req: Req, chunk: int) -> None:
        hits, num_hit_tokens = self.mgr.get_computed_blocks(req.all_token_ids, req.cache_salt)
        assert num_hit_tokens < len(req.all_token_ids)
        num_new = min(chunk, len(req.all_token_ids) - num_hit_tokens)
        req.num_computed_tokens = 0
        if self._schedule(req, num_new, hits):
            req.num_computed_tokens = num_hit_tokens
            self.running[req.request_id] = req
            self._compute(req, num_new)

    @rule(prompt=tokens, salt=st.sampled_from([None, None, "s"]), chunk=st.integers(1, CHUNK),
          evicts=st.sampled_from([True, True, False]))
    def add_request(self, prompt, salt, chunk, evicts):
        if not evicts:  # the context bounds it (the engine refuses a longer prompt)
            prompt = prompt[:self.config.max_positions - 1]
        req = Req(f"r{self.next_id}", list(prompt), cache_salt=salt, evicts=evicts)
        self.next_id += 1
        self._admit(req, chunk)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6), token=st.integers(0, 1), chunk=st.integers(1, CHUNK))
    def step(self, pick, token, chunk):
        """Next prefill chunk, or one decode token once the prompt is done."""
        req = list(self.running.values())[pick % len(self.running)]
        remaining = len(req.all_token_ids) - req.num_computed_tokens
        if remaining == 0:
            if not req.evicts and len(req.all_token_ids) >= self.config.max_positions:
                return  # the context bounds a request that does not evict
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
        self.mgr.free(request_id)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10**6), chunk=st.integers(1, CHUNK))
    def preempt_and_recompute(self, pick, chunk):
        req = list(self.running.values())[pick % len(self.running)]
        self.mgr.free(req.request_id)
        del self.running[req.request_id]
        req.first_evicted_at = None
        self._admit(req, chunk)

    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        for req in self.running.values():
            blocks = self.mgr.get_blocks(req.request_id)
            evicted, shift = self.mgr.sequence_offsets(req.request_id)
            c = req.num_computed_tokens
            assert len(blocks) == -(-(c - evicted) // self.bs)
            assert not req.evicts or c - evicted <= self.config.max_held_tokens
            clean_until = c if req.first_evicted_at is None else req.first_evicted_at
            self.check_kept(req, blocks, evicted, shift, clean_until)

    def check_kept(self, req, blocks, evicted, shift, clean_until):
        """The held slots are exactly the sinks and the window, keys rotated by ``shift``."""
        c = req.num_computed_tokens
        text = list(range(min(c, self.sink_tok))) + list(range(max(self.sink_tok, evicted + self.sink_tok), c))
        if not evicted:
            text = list(range(c))
        seen = [self.kv[blocks[i // self.bs].block_id][i % self.bs] for i in range(len(text))]
        want = [(req.cache_salt, req.all_token_ids[t], t, t if t < self.sink_tok or not evicted else t - shift,
                 t < clean_until) for t in text]
        assert seen == want

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for request_id in list(self.running):
            self.mgr.free(request_id)
        self.mgr.check_invariants()
        assert self.mgr.usage == 0


TestEvictionMachine = EvictionMachine.TestCase
TestEvictionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
