"""lesson_utils.core.state: what a refused step's restore copies (containers, one level into dicts, records) and what it
keeps by reference (objects of their own)."""

from __future__ import annotations

from collections import OrderedDict, deque

from lesson_utils.core.state import capture
from lesson_utils.memory.block_table import BlockTable


class _List(list):
    pass


class _Deque(deque):
    pass


def test_capture_restores_containers_records_and_keeps_objects():
    class Holder:
        pass

    other = Holder()
    h = Holder()
    h.items, h.queue, h.chains = _List([1]), _Deque([1, 2], maxlen=3), {1: [2]}
    h.order, h.tables, h.ref, h.n = OrderedDict(x=None, y=None), {7: BlockTable(4, [3, 5], 6)}, other, 1
    saved = capture(h)
    h.items.append(2)
    h.queue.append(9)
    h.chains[1].append(3)
    h.order.move_to_end("x")
    h.tables[7].blocks.append(8)
    h.tables[7].num_tokens = 9
    h.n, h.extra = 2, "new"
    saved.restore()
    assert type(h.items) is _List and h.items == [1]
    assert type(h.queue) is _Deque and list(h.queue) == [1, 2] and h.queue.maxlen == 3
    assert h.chains == {1: [2]} and list(h.order) == ["x", "y"]
    assert h.tables[7] == BlockTable(4, [3, 5], 6) and h.ref is other and h.n == 1 and not hasattr(h, "extra")
    h.items.append(5)
    saved.restore()  # as often as asked
    assert h.items == [1]
