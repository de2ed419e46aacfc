"""Lesson 05's checkers reject plausible wrong implementations (forgetting to bump a count, aliasing the
parent's list, copying without repointing, hashing a block without its parent, ...) with a precise message."""

from __future__ import annotations

import pytest
from helpers import rejected

from lesson_utils.checks import lesson05
from lesson_utils.memory import sharing
from lesson_utils.memory.block_pool import NO_PARENT
from lesson_utils.memory.block_table import BlockTable

pytestmark = pytest.mark.usefixtures("not_strict")


def test_references_pass():
    assert lesson05.check_fork_table(sharing.fork_table).passed
    assert lesson05.check_copy_on_write(sharing.copy_on_write).passed
    assert lesson05.check_prefix_hits(sharing.prefix_hits).passed


def test_fork_mistakes():
    def no_incref(parent, pool):
        return BlockTable(parent.block_size, list(parent.blocks), parent.num_tokens)

    def aliased(parent, pool):
        for b in parent.blocks:
            pool.incref(b)
        return BlockTable(parent.block_size, parent.blocks, parent.num_tokens)

    def copies(parent, pool):
        return BlockTable(parent.block_size, [pool.allocate() for _ in parent.blocks], parent.num_tokens)

    assert rejected(lesson05.check_fork_table(no_incref), "one more holder")
    assert rejected(lesson05.check_fork_table(aliased), "list object")
    assert rejected(lesson05.check_fork_table(copies), "never allocates")


def test_copy_on_write_mistakes():
    def no_repoint(table, i, pool):
        old = table.blocks[i]
        if pool.ref_count[old] == 1:
            return None
        new = pool.allocate()
        pool.decref(old)
        return old, new

    def no_decref(table, i, pool):
        old = table.blocks[i]
        if pool.ref_count[old] == 1:
            return None
        table.blocks[i] = pool.allocate()
        return old, table.blocks[i]

    def always_copies(table, i, pool):
        old = table.blocks[i]
        table.blocks[i] = pool.allocate()
        pool.decref(old)
        return old, table.blocks[i]

    assert rejected(
        lesson05.check_copy_on_write(no_repoint), "the writer's table is now [4, 6]", "should point to the copy"
    )
    assert rejected(lesson05.check_copy_on_write(no_decref), "does the writer still hold it")
    assert rejected(lesson05.check_copy_on_write(always_copies), "nothing should change")


def test_prefix_hits_mistakes():
    def no_parent(pool, tokens, bs, hash_fn):
        hits = []
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            b = pool.lookup(hash_fn(NO_PARENT, chunk), chunk)
            if b is None:
                break
            hits.append(b)
        return hits

    def includes_last_token(pool, tokens, bs, hash_fn):
        hits, parent = [], NO_PARENT
        for i in range(len(tokens) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            parent = hash_fn(parent, chunk)
            b = pool.lookup(parent, chunk)
            if b is None:
                break
            hits.append(b)
        return hits

    def does_not_stop(pool, tokens, bs, hash_fn):
        hits, parent = [], NO_PARENT
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            parent = hash_fn(parent, chunk)
            b = pool.block_of.get(parent)  # no token check either
            if b is not None:
                hits.append(b)
        return hits

    assert rejected(lesson05.check_prefix_hits(no_parent), "different prefix", "what does each block's hash depend on")
    assert rejected(lesson05.check_prefix_hits(includes_last_token), "the one with the last prompt token")
    assert rejected(lesson05.check_prefix_hits(does_not_stop), "expected blocks")


def counts_blocks_with_a_shift(pool, tokens, block_size, hash_fn):
    """Full blocks counted with a shift: right for blocks of 2 (the lesson's pictures), wrong for 3 or 5."""
    from lesson_utils.memory.sharing import NO_PARENT

    full = (len(tokens) - 1) >> (block_size.bit_length() - 1)
    hits, parent = [], NO_PARENT
    for i in range(full):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        parent = hash_fn(parent, chunk)
        block = pool.lookup(parent, chunk)
        if block is None:
            break
        hits.append(block)
    return hits


def test_a_prefix_lookup_right_only_for_powers_of_two_is_rejected():
    assert rejected(lesson05.check_prefix_hits(counts_blocks_with_a_shift), "blocks of 3", "one block too many")
