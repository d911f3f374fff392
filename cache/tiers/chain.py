"""``TierChain``: the lower tiers in order (host -> disk) behind the one ``KVTier`` interface (contract in ``cache.tiers``)."""
from __future__ import annotations


from cache.hashing import BlockHash
from cache.tiers.base import KVTier
from cache.tiers.base import TierStats
from cache.tiers.host import HostTier


class TierChain:
    """The lower tiers in order (e.g. host -> disk) as one ``KVTier``; see the module docstring.
    ``members`` are the tiers themselves (the engine reads their own stats for the metrics)."""

    name = "chain"

    def __init__(self, members: list[KVTier]) -> None:
        if len(members) < 2:
            raise ValueError("a tier chain needs at least two tiers")
        self.members = members
        self.stats = TierStats()  # unused: the members' own stats are reported
        for upper, lower in zip(members, members[1:]):
            if isinstance(upper, HostTier):
                upper.on_evict = lambda h, payload, lower=lower: lower.put(h, payload)

    def locate(self, block_hash: BlockHash) -> str | None:
        """The name of the first tier holding the block, or None."""
        return next((t.name for t in self.members if t.contains(block_hash)), None)

    def contains(self, block_hash: BlockHash) -> bool:
        return any(t.contains(block_hash) for t in self.members)

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The payload from the first member that holds it; a block served from a lower member
        (disk) is promoted into the members above it (host), so that after the device pool
        evicts it again the next hit is served from the faster tier: the offloader skips a
        block the chain already holds, so without this it would stay on disk only."""
        for index, tier in enumerate(self.members):
            if tier.contains(block_hash):
                payload = tier.get(block_hash)
                if payload is not None:
                    for upper in self.members[:index]:
                        upper.put(block_hash, payload)
                    return payload
        return None

    def put(self, block_hash: BlockHash, payload: bytes, expires_at: float = 0.0) -> None:
        self.members[0].put(block_hash, payload, expires_at)
        if expires_at > 0:  # retention is the persistent tier's job
            self.members[-1].put(block_hash, payload, expires_at)

    def retain(self, block_hash: BlockHash, expires_at: float) -> bool:
        last = self.members[-1]
        if last.retain(block_hash, expires_at):
            return True
        for tier in self.members[:-1]:
            payload = tier.peek(block_hash) if isinstance(tier, HostTier) else None
            if payload is not None:
                last.put(block_hash, payload, expires_at)
                return True
        return False

    def usage_bytes(self) -> int:
        return sum(t.usage_bytes() for t in self.members)

    def capacity_bytes(self) -> int:
        return sum(t.capacity_bytes() for t in self.members)

    def flush(self, timeout: float | None = None) -> None:
        for tier in self.members:
            tier.flush(timeout)

    def close(self) -> None:
        for tier in self.members:
            tier.close()


def tier_members(tier: KVTier | None) -> list[KVTier]:
    """The individual tiers behind ``tier`` (a chain's members, or the tier itself), top first."""
    if tier is None:
        return []
    return list(tier.members) if isinstance(tier, TierChain) else [tier]
