"""Block hash chains: determinism, prefix sensitivity, salts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache.hashing import hash_block_tokens, hash_full_blocks

TOKENS = list(range(100, 120))  # 5 full blocks of 4


def test_only_full_blocks_are_hashed():
    assert len(hash_full_blocks(TOKENS, 4)) == 5
    assert len(hash_full_blocks(TOKENS[:19], 4)) == 4
    assert len(hash_full_blocks(TOKENS[:3], 4)) == 0
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hash_full_blocks(TOKENS, 4))


def test_chain_matches_hash_block_tokens():
    hashes = hash_full_blocks(TOKENS[:8], 4)
    h0 = hash_block_tokens(None, TOKENS[:4])
    assert hashes == [h0, hash_block_tokens(h0, TOKENS[4:8])]


def test_same_prefix_same_hashes():
    a = hash_full_blocks(TOKENS + [1, 2, 3], 4)
    b = hash_full_blocks(TOKENS[:12] + [7, 7, 7, 7, 7], 4)
    assert a[:3] == b[:3]
    assert a[3] != b[3]


@pytest.mark.parametrize("changed", [0, 5, 10, 19])
def test_changing_one_token_changes_that_block_and_all_later(changed):
    other = list(TOKENS)
    other[changed] += 1
    a, b = hash_full_blocks(TOKENS, 4), hash_full_blocks(other, 4)
    block = changed // 4
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:], strict=True))


def test_hash_depends_on_parent():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(hash_block_tokens(None, [0, 0]), [1, 2])


def test_encoding_is_unambiguous():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [0, 1])
    # Extra keys keep their types apart.
    keys = [(), (None,), ("1",), (1,), (1.0,), (True,), ("a", "b"), ("ab",)]
    assert len({hash_block_tokens(None, [5], k) for k in keys}) == len(keys)


def test_salt_only_in_block_zero_but_changes_whole_chain():
    plain = hash_full_blocks(TOKENS, 4)
    salted = hash_full_blocks(TOKENS, 4, cache_salt="tenant-a")
    other = hash_full_blocks(TOKENS, 4, cache_salt="tenant-b")
    assert salted == hash_full_blocks(TOKENS, 4, cache_salt="tenant-a")
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)
    assert salted[0] == hash_block_tokens(None, TOKENS[:4], ("tenant-a",))
    assert salted[1] == hash_block_tokens(salted[0], TOKENS[4:8])  # no salt past block 0


def test_incremental_continuation_matches_full_hash():
    full = hash_full_blocks(TOKENS, 4, cache_salt="s")
    assert hash_full_blocks(TOKENS, 4, cache_salt="s", parent=full[1], start_block=2) == full[2:]
    assert hash_full_blocks(TOKENS, 4, parent=full[4], start_block=5) == []


def test_continuation_without_parent_is_rejected():
    with pytest.raises(ValueError):
        hash_full_blocks(TOKENS, 4, start_block=2)


def test_hash_is_stable_across_processes():
    code = ("from cache.hashing import hash_full_blocks; "
            "print(hash_full_blocks(list(range(100, 120)), 4, cache_salt='tenant-a')[-1].hex())")
    root = Path(__file__).resolve().parents[2]
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        digests.add(out)
    assert digests == {hash_full_blocks(TOKENS, 4, cache_salt="tenant-a")[-1].hex()}
