"""The ground floor's one integer check: every count, id and size goes through it."""

import numpy as np
import pytest
import torch

from lesson_utils.core.types import is_int
from lesson_utils.memory.block_allocator import BlockAllocator
from lesson_utils.serving.token_budget import ChunkedPrefill


def test_is_int_takes_whole_numbers_and_refuses_bools_floats_and_tensors():
    assert is_int(3) and is_int(0) and is_int(-2) and is_int(np.int64(5))
    assert not any(is_int(v) for v in (True, False, 3.0, "3", None, torch.tensor(3), np.float32(2)))


@pytest.mark.parametrize("bad", [True, 2.0, "4"])
def test_a_bool_or_a_float_is_refused_where_a_count_is_asked_for(bad):
    with pytest.raises(ValueError):
        ChunkedPrefill(bad)
    with pytest.raises((ValueError, TypeError)):
        BlockAllocator(bad)
