"""Checkers for lesson 05 (prefix sharing)."""

from __future__ import annotations

from lesson_utils.memory import sharing
from lesson_utils.memory.block_pool import NO_PARENT, BlockPool, block_hash
from lesson_utils.memory.block_table import BlockTable

from .core import CheckResult, call_learner, failed, not_implemented, passed


def _pool_with(
    tables_blocks: list[list[int]], num_blocks: int = 12, block_size: int = 4
) -> tuple[BlockPool, list[BlockTable]]:
    pool = BlockPool(num_blocks)
    tables = []
    for blocks in tables_blocks:
        for b in blocks:
            pool.incref(b)
        tables.append(BlockTable(block_size, list(blocks), block_size * len(blocks) - 1))
    return pool, tables


def _pool_state(pool: BlockPool) -> tuple:
    """What a lookup must not change: counts, the free queue (and its order), the cached hashes."""
    return (list(pool.ref_count), pool.free_order(), dict(pool.hash_of), dict(pool.tokens_of))


def check_fork_table(fn) -> CheckResult:
    """Exercise 05-1: fork = share the parent's blocks, bump their counts, allocate nothing."""
    name = "fork_table"
    for blocks, block_size in (([3, 7, 1], 4), ([5], 16), ([2, 3, 9, 0], 8), ([6, 4], 1)):
        pool, (parent,) = _pool_with([blocks], block_size=block_size)
        before_counts, before_free = list(pool.ref_count), pool.num_free
        try:
            child = fn(parent, pool)
        except NotImplementedError:
            return not_implemented(name, sharing.fork_table)
        except Exception as err:  # noqa: BLE001
            return failed(
                name, f"forking a table with blocks {blocks} raised {type(err).__name__}: {err}", sharing.fork_table
            )
        if not isinstance(child, BlockTable):
            return failed(name, f"return a BlockTable for the child, got {type(child).__name__}", sharing.fork_table)
        if pool.num_free != before_free:
            return failed(
                name,
                f"forking allocated {before_free - pool.num_free} block(s): a fork shares the parent's blocks, it never allocates",
                sharing.fork_table,
            )
        if child.blocks != blocks or child.num_tokens != parent.num_tokens:
            return failed(
                name,
                f"the child's table is {child.blocks} with {child.num_tokens} tokens; expected the parent's {blocks} with {parent.num_tokens}",
                sharing.fork_table,
            )
        if child.block_size != parent.block_size:
            return failed(
                name,
                f"the parent's blocks hold {parent.block_size} tokens, the child's table says {child.block_size}: "
                "where can the child's table take its block size from?",
                sharing.fork_table,
            )
        if parent.blocks != blocks:
            return failed(
                name,
                f"the parent's table changed to {parent.blocks}: a fork leaves the parent as it was",
                sharing.fork_table,
            )
        if child.blocks is parent.blocks:
            return failed(
                name,
                "the child's block list IS the parent's list object: when one grows, the other would too. Copy the list (the blocks stay shared).",
                sharing.fork_table,
            )
        for b in set(blocks):
            want = before_counts[b] + blocks.count(b)
            if pool.ref_count[b] != want:
                return failed(
                    name,
                    f"block {b}'s reference count is {pool.ref_count[b]} after the fork; expected {want} (one more holder: the child): how does the pool learn that?",
                    sharing.fork_table,
                )
    return passed(name, "the child shares every block, counts went up by one, nothing was allocated.", fn)


def check_copy_on_write(fn) -> CheckResult:
    """Exercise 05-2: copy a shared block before writing, repoint only the writer."""
    name = "copy_on_write"
    # exclusive block: nothing to do
    pool, (t,) = _pool_with([[4, 6]])
    try:
        got = fn(t, 1, pool)
    except NotImplementedError:
        return not_implemented(name, sharing.copy_on_write)
    except Exception as err:  # noqa: BLE001
        return failed(
            name, f"on an exclusive block your code raised {type(err).__name__}: {err}", sharing.copy_on_write
        )
    if got is not None or t.blocks != [4, 6] or pool.num_free != 10:
        return failed(
            name,
            f"block 6 is held by this table only (count 1): nothing should change, but you returned {got!r} and the table is {t.blocks}, {12 - pool.num_free} blocks held (expected 2)",
            sharing.copy_on_write,
        )
    # shared block: copy, repoint the writer only - at the last block, and at one that is not the last
    for index in (1, 0):
        pool, (writer, other) = _pool_with([[4, 6], [4, 6]])
        old, kept = writer.blocks[index], writer.blocks[1 - index]
        got, err = call_learner(fn, writer, index, pool)
        if err is not None:
            return failed(
                name,
                f"writing into block {old} (shared by two tables, at index {index}) raised {type(err).__name__}: {err}",
                sharing.copy_on_write,
            )
        if not (isinstance(got, tuple) and len(got) == 2 and got[0] == old and isinstance(got[1], int)):
            return failed(
                name,
                f"block {old} (index {index}) is shared by two tables: expected the copy the cache must "
                f"make, ({old}, new_block), but got {got!r}",
                sharing.copy_on_write,
            )
        new = got[1]
        problems = [
            (
                writer.blocks[index] != new or writer.blocks[1 - index] != kept,
                f"you copied block {old} to block {new}, and the writer's table is now {writer.blocks}: "
                f"only its entry {index} should point to the copy",
            ),
            (
                other.blocks != [4, 6],
                f"the other sequence's table changed to {other.blocks}: only the writer is repointed",
            ),
            (
                pool.ref_count[old] != 1,
                f"block {old} has count {pool.ref_count[old]} after the copy; expected 1: does the writer still hold it?",
            ),
            (
                pool.ref_count[new] != 1,
                f"the new block {new} has count {pool.ref_count[new]}; expected 1: where did it come from?",
            ),
            (
                pool.ref_count[kept] != 2,
                f"block {kept} was not written and must stay shared (count 2), but has count {pool.ref_count[kept]}",
            ),
        ]
        for wrong, message in problems:
            if wrong:
                return failed(name, message, sharing.copy_on_write)
    return passed(
        name,
        "exclusive blocks are left alone; a shared block (last or not) is copied and only the writer repointed.",
        fn,
    )


def _cached_pool(block_size: int = 2):
    """A pool holding two cached prefixes of ``block_size``-token blocks: "a" = [1,2 | 3,4 | 5,6] and "b" =
    [3,4 | 9,9] at block size 2 (the second's first block looks like the first's second block, but its parent
    differs); at other sizes the same shapes with the tokens 1, 2, 3, ... cut into blocks of that size."""
    pool = BlockPool(16)
    ids = {}
    a = [list(range(1 + i * block_size, 1 + (i + 1) * block_size)) for i in range(3)]
    b = [list(a[1]), [9] * block_size]
    for name, chunks in (("a", a), ("b", b)):
        parent = NO_PARENT
        for i, chunk in enumerate(chunks):
            b_id = pool.allocate()
            parent = block_hash(parent, chunk)
            pool.cache(b_id, parent, chunk)
            ids[name, i] = b_id
    for block in range(16):
        if pool.ref_count[block]:
            pool.decref(block)  # freed but still cached
    return pool, ids


def _prefix_cases() -> list[tuple]:
    """``(what, pool, tokens, expected hits, block size)``: blocks of 2 (the lesson's pictures), then of 3 and 5."""
    cases = []
    pool, ids = _cached_pool()
    cases.append(
        ("a cached prompt plus one new token", pool, [1, 2, 3, 4, 5, 6, 7], [ids["a", 0], ids["a", 1], ids["a", 2]])
    )
    pool, ids = _cached_pool()
    cases.append(
        (
            "a prompt that is exactly the cached blocks: the last token must be recomputed",
            pool,
            [1, 2, 3, 4],
            [ids["a", 0]],
        )
    )
    pool, ids = _cached_pool()
    cases.append(
        (
            "[3, 4] then [5, 6]: [5, 6] is cached only after [1, 2 | 3, 4], a different prefix",
            pool,
            [3, 4, 5, 6, 0],
            [ids["b", 0]],
        )
    )
    pool, ids = _cached_pool()
    cases.append(
        (
            "[1, 2 | 9, 9 ...]: the second block is new; stop at the first miss",
            pool,
            [1, 2, 9, 9, 5, 6, 0],
            [ids["a", 0]],
        )
    )
    pool, ids = _cached_pool()
    pool.tokens_of[ids["a", 1]] = (7, 7)  # a hash collision stand-in: same hash, other tokens
    cases.append(("a hash whose block holds other tokens (a collision)", pool, [1, 2, 3, 4, 5, 6, 0], [ids["a", 0]]))
    cases = [case + (2,) for case in cases]
    for bs in (3, 5):  # block sizes that are not powers of two: a shift or a mask counts blocks wrongly there
        pool, ids = _cached_pool(bs)
        every = list(range(1, 3 * bs + 1))
        cases.append(
            (
                f"blocks of {bs}: a cached prompt plus two new tokens",
                pool,
                every + [0, 0],
                [ids["a", i] for i in range(3)],
                bs,
            )
        )
        pool, ids = _cached_pool(bs)
        cases.append(
            (f"blocks of {bs}: a prompt of exactly two cached blocks", pool, every[: 2 * bs], [ids["a", 0]], bs)
        )
        pool, ids = _cached_pool(bs)
        cases.append(
            (f"blocks of {bs}: the second block one token short", pool, every[: 2 * bs - 1], [ids["a", 0]], bs)
        )
    return cases


def check_prefix_hits(fn) -> CheckResult:
    """Exercise 05-3: chained block hashes and the prefix lookup."""
    name = "prefix_hits"
    cases = _prefix_cases()
    for what, pool, tokens, want, block_size in cases:
        before = _pool_state(pool)
        try:
            got = fn(pool, tokens, block_size, block_hash)
        except NotImplementedError:
            return not_implemented(name, sharing.prefix_hits)
        except Exception as err:  # noqa: BLE001
            return failed(name, f"case '{what}': your code raised {type(err).__name__}: {err}", sharing.prefix_hits)
        if not isinstance(got, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in got):
            return failed(name, f"case '{what}': return a list of block ids (ints), got {got!r}", sharing.prefix_hits)
        if _pool_state(pool) != before:
            return failed(
                name,
                f"case '{what}': looking up the prefix changed the pool (reference counts, free queue or "
                "cached hashes). A lookup only finds blocks; the block manager takes them afterwards - "
                "taking them here too would leak them",
                sharing.prefix_hits,
            )
        if list(got) != want:
            got = list(got)
            if got[: len(want)] == want and len(got) == len(want) + 1 and len(tokens) % block_size == 0:
                hint = "one block too many, the one with the last prompt token: what does the model still need from that token?"
            elif any(b not in want for b in got):
                hint = (
                    "a block you returned holds the same tokens after a different prefix, or other tokens: what "
                    "does each block's hash depend on, and what does pool.lookup compare?"
                )
            else:
                hint = "fewer hits than cached: does your walk go on while the lookups hit?"
            return failed(
                name,
                f"case '{what}' (block size {block_size}, prompt {tokens})\n    expected blocks: {want}\n    got blocks:      {got}"
                f"\n    hint: {hint}",
                sharing.prefix_hits,
            )
    return passed(name, f"all {len(cases)} lookups hit exactly the right cached blocks.", fn)
