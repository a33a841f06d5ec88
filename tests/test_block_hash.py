"""The chained block hash: full blocks only, chained, stable across processes."""

from __future__ import annotations

import os
import subprocess
import sys

from pagefleet.common.block_hash import hash_block, hash_blocks


def test_only_full_blocks_are_hashed():
    assert len(hash_blocks(list(range(15)), 16)) == 0
    assert len(hash_blocks(list(range(16)), 16)) == 1
    assert len(hash_blocks(list(range(47)), 16)) == 2


def test_hash_is_chained_on_the_prefix():
    a = hash_blocks([1] * 16 + [2] * 16, 16)
    b = hash_blocks([3] * 16 + [2] * 16, 16)
    # Same tokens in block 1, different block 0: the second hashes must differ.
    assert a[1] != b[1]
    assert a[1] == hash_block(a[0], [2] * 16)


def test_extra_keys_and_token_order_change_the_hash():
    tokens = list(range(16))
    assert hash_block(None, tokens) != hash_block(None, tokens, b"lora-1")
    assert hash_block(None, tokens) != hash_block(None, tokens[::-1])


def test_large_token_ids_are_encoded_exactly():
    # 2**16 + 1 and 1 must not collide (no truncation to 16 bits).
    assert hash_block(None, [2**16 + 1] * 4) != hash_block(None, [1] * 4)


def test_hash_is_the_same_in_another_process_with_another_hash_seed():
    tokens = list(range(100, 164))
    here = [h.hex() for h in hash_blocks(tokens, 16)]
    code = (
        "from pagefleet.common.block_hash import hash_blocks;"
        "print(','.join(h.hex() for h in hash_blocks(list(range(100, 164)), 16)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.strip().split(",") == here
