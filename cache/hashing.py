"""Prefix-cache block hashes.

A block hash identifies a full block *together with its whole prefix*:
``hash(block i) = sha256(hash(block i-1), tokens of block i, extra keys)``. Equal hashes therefore
mean equal token prefixes (up to sha256 collisions), which is what makes a cached block's KV
reusable. The encoding is canonical and process independent (never Python's ``hash()``), and
every variable-length field is length-prefixed so no two inputs share an encoding.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterator, Sequence

BlockHash = bytes  # 32-byte sha256 digest

_ROOT_PARENT = bytes(32)


def _length_prefixed(payload: bytes) -> bytes:
    return len(payload).to_bytes(8, "little") + payload


def _encode_token_ids(token_ids: Sequence[int]) -> bytes:
    ids = array("q", token_ids)  # raises OverflowError/TypeError on non int64 ids
    if sys.byteorder != "little":
        ids.byteswap()
    return _length_prefixed(ids.tobytes())


def _encode_extra_keys(extra_keys: tuple[object, ...]) -> bytes:
    # JSON keeps types apart ("1" vs 1 vs true vs 1.0) and is canonical with these options;
    # unsupported types raise TypeError instead of being silently stringified.
    text = json.dumps(list(extra_keys), separators=(",", ":"), sort_keys=True,
                      ensure_ascii=True, allow_nan=False)
    return _length_prefixed(text.encode("ascii"))


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[object, ...] = ()) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block of a sequence)."""
    if parent is not None and len(parent) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(parent)}")
    h = hashlib.sha256()
    h.update(_ROOT_PARENT if parent is None else parent)
    h.update(_encode_token_ids(token_ids))
    h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[object, ...]:
    """Extra keys of block ``block_index``: the salt goes into block 0 only (the chain carries it on)."""
    return (cache_salt,) if block_index == 0 and cache_salt is not None else ()


def iter_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                      parent: BlockHash | None = None, start_block: int = 0) -> Iterator[BlockHash]:
    """Lazily yield the chained hashes of the full blocks from ``start_block`` on (see hash_full_blocks)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    if start_block > 0 and parent is None:
        raise ValueError("parent (the hash of block start_block-1) is required when start_block > 0")
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   block_extra_keys(i, cache_salt))
        yield parent


def hash_full_blocks(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                     parent: BlockHash | None = None, start_block: int = 0) -> list[BlockHash]:
    """Hashes of the FULL blocks of ``token_ids`` with index >= ``start_block``.

    A trailing partial block is never hashed. ``parent`` must be the hash of block
    ``start_block - 1`` (None when ``start_block == 0``). ``cache_salt`` enters block 0's extra
    keys only, so different salts give disjoint hash chains.
    """
    return list(iter_block_hashes(token_ids, block_size, cache_salt, parent, start_block))
