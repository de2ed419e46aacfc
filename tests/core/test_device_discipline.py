"""The device-discipline mode itself: it must raise where CUDA raises, stay quiet where CUDA is happy, and
count the reads that would make the host wait for a GPU. (Its use on the course's code: test_gpu_path.py.)"""

from __future__ import annotations

import pytest
import torch

from lesson_utils.core import device_discipline as dd
from lesson_utils.core import host_copy
from lesson_utils.core.device_discipline import DEVICE, DeviceMismatch, discipline, place


@pytest.fixture
def mode():
    with discipline() as m:
        yield m


def test_factories_are_tagged_by_their_device_argument(mode):
    assert place(torch.zeros(3, device=DEVICE)) == "device"
    assert place(torch.zeros(3)) == "host"
    assert place(torch.zeros(3, device="cpu")) == "host"
    d = torch.arange(4, device=DEVICE)
    assert place(torch.zeros_like(d)) == "device"
    assert place(torch.zeros_like(d, device="cpu")) == "host"
    assert place(d.new_zeros(2)) == "device"
    assert place(torch.tensor([1, 2], device=d.device)) == "device"  # d.device answers DEVICE
    assert d.device == DEVICE and torch.zeros(1).device == torch.device("cpu")


def test_moves_retag_and_do_not_alias_the_original(mode):
    h = torch.ones(3)
    d = h.to(DEVICE)
    assert place(d) == "device" and place(h) == "host" and d is not h
    assert place(d.cpu()) == "host" and place(d.to("cpu")) == "host" and place(h.cuda()) == "device"
    assert place(d.to(torch.float16)) == "device"
    assert place(h.to(d)) == "device"


def test_mixing_host_and_device_raises_like_cuda(mode):
    d, h = torch.ones(3, device=DEVICE), torch.ones(3)
    with pytest.raises(DeviceMismatch, match="same device"):
        d + h
    with pytest.raises(DeviceMismatch):
        torch.cat([d, h])
    # what CUDA allows: Python scalars and 0-dim host tensors, ops among device tensors
    assert place(d + 1) == "device"
    assert place(d * torch.tensor(2.0)) == "device"
    assert place(d + d) == "device" and place(h + h) == "host"


def test_indexing_rules(mode):
    d, h = torch.arange(6, device=DEVICE), torch.arange(6)
    hi, di = torch.tensor([0, 2]), torch.tensor([0, 2], device=DEVICE)
    assert place(d[hi]) == "device"  # a device tensor may be indexed with a host index
    with pytest.raises(DeviceMismatch, match="device index"):
        h[di]
    with pytest.raises(DeviceMismatch, match="device index"):
        h[di] = 0
    with pytest.raises(DeviceMismatch, match="tensor indices"):
        d[hi] = torch.ones(2, dtype=d.dtype)  # advanced-index assignment needs values on the device
    d[0:2] = torch.ones(2, dtype=d.dtype)  # basic slicing copies across devices, as CUDA does
    d[hi] = torch.ones(2, dtype=d.dtype, device=DEVICE)


def test_numpy_of_a_device_tensor_fails(mode):
    with pytest.raises(DeviceMismatch, match="numpy"):
        torch.ones(2, device=DEVICE).numpy()
    torch.ones(2).numpy()


def test_syncs_are_counted_only_for_device_tensors(mode):
    d, h = torch.arange(4, device=DEVICE), torch.arange(4)
    with dd.count_syncs() as c:
        h.tolist(), int(h[0]), h.sum().item()
    assert c.n == 0
    with dd.count_syncs() as c:
        d.tolist()
        int(d[0])
        d.sum().item()
        d.cpu()
        d.to("cpu", non_blocking=True)  # asynchronous: no wait (the caller synchronises once)
        d[d > 1]
        repeats = torch.tensor([1, 2, 1], device=DEVICE)  # itself a copy to the device (counted below)
        torch.arange(3, device=DEVICE).repeat_interleave(repeats)
    assert c.n == 7, c.why
    assert [t.direction for t in mode.transfers[-2:]] == ["to host", "to host"]


def test_host_to_device_copies_count_unless_pinned_and_non_blocking(mode):
    """On CUDA a copy to the device from pageable memory, or one without non_blocking, waits for the stream."""
    h, d = torch.arange(4), torch.arange(4, device=DEVICE)
    waits = {
        "torch.tensor of Python data": lambda: torch.tensor([1, 2], device=DEVICE),
        "as_tensor of a host tensor": lambda: torch.as_tensor(h, device=DEVICE),
        "new_tensor": lambda: d.new_tensor([1, 2]),
        ".to, blocking": lambda: h.to(DEVICE),
        ".to, non_blocking from pageable": lambda: h.to(DEVICE, non_blocking=True),
        ".cuda()": lambda: h.cuda(),
        "copy_ from pageable": lambda: d.copy_(h, non_blocking=True),
        "slice assignment of host values": lambda: d.__setitem__(slice(0, 2), torch.ones(2, dtype=d.dtype)),
        "host index tensor": lambda: d[torch.tensor([0, 2])],
        "list index": lambda: d[[0, 2]],
        "copy to pageable host memory": lambda: torch.empty(4, dtype=d.dtype).copy_(d, non_blocking=True),
    }
    for what, op in waits.items():
        with dd.count_syncs() as c:
            op()
        assert c.n == 1, (what, c.why)
    pinned = torch.tensor([1, 2, 3, 4], pin_memory=True)
    assert pinned.is_pinned() and not h.is_pinned() and h.pin_memory().is_pinned()
    free = {
        "pinned, non_blocking .to": lambda: pinned.to(DEVICE, non_blocking=True),
        "pinned, non_blocking copy_": lambda: d.copy_(pinned, non_blocking=True),
        "factories without data": lambda: (torch.zeros(3, device=DEVICE), torch.arange(3, device=DEVICE)),
        "a device index, a Python int, a 0-dim host tensor": lambda: (d[d[:2]], d[1], d[torch.tensor(1)]),
        "non_blocking .to the host (pinned by CUDA)": lambda: d.to("cpu", non_blocking=True),
        "copy into pinned host memory": lambda: torch.empty(4, dtype=d.dtype, pin_memory=True).copy_(
            d, non_blocking=True
        ),
        "host_copy.to_device": lambda: host_copy.to_device([[1, 2], [3, 4]], torch.int32, DEVICE),
        "host_copy.move": lambda: host_copy.move(torch.arange(5), DEVICE),
    }
    for what, op in free.items():
        with dd.count_syncs() as c:
            op()
        assert c.n == 0, (what, c.why)
    assert place(host_copy.to_device([1], torch.long, DEVICE)) == "device"
    assert d.to("cpu", non_blocking=True).is_pinned()


def test_synchronize_counts_in_the_mode_and_is_free_on_a_plain_cpu(mode):
    with dd.count_syncs() as c:
        dd.synchronize(DEVICE, "a test")
        dd.synchronize("cpu", "not a GPU")
    assert c.why == ["synchronize: a test"]


def test_host_copy_leaves_a_plain_cpu_device_alone():
    """Outside the mode a CPU device is no GPU: no pinning (a CPU build has no pinned allocator)."""
    t = host_copy.to_device([1, 2], torch.long, "cpu")
    assert t.tolist() == [1, 2] and not host_copy.wants_pinned("cpu")
    h = torch.arange(3)
    assert host_copy.move(h, "cpu") is h


def test_kernel_launches_need_device_tensors(mode):
    with pytest.raises(ValueError, match="q is a host tensor"):
        dd.check_kernel_args("k", q=torch.ones(1), cache=torch.ones(1, device=DEVICE))
    dd.check_kernel_args("k", q=torch.ones(1, device=DEVICE))


def test_modules_moved_to_the_device_are_device_tensors(mode):
    m = torch.nn.Linear(3, 2).to(DEVICE)
    assert place(m.weight) == "device" and m.weight.device == DEVICE
    assert place(m(torch.ones(1, 3, device=DEVICE))) == "device"
    with pytest.raises(DeviceMismatch):
        m(torch.ones(1, 3))


def test_outside_the_mode_nothing_is_checked():
    d = None
    with discipline():
        d = torch.ones(3, device=DEVICE)
    assert dd.active() is None
    assert torch.equal(d + torch.ones(3), torch.full((3,), 2.0))  # tags stay, but nobody enforces them
    dd.check_kernel_args("k", q=torch.ones(1))
    assert dd.acts_as_gpu(DEVICE) is False and dd.acts_as_gpu("cuda") is True


def test_the_environment_variable_turns_it_on_for_a_process(tmp_path):
    import subprocess
    import sys

    code = (
        "import lesson_utils.core.env as e, torch\n"
        "from lesson_utils.core import device_discipline as dd\n"
        "p = e.get_profile(); assert p.device == 'cpu:0' and 'device discipline' in p.device_name, p\n"
        "assert dd.active() is not None\n"
        "try:\n    torch.ones(2, device=p.device) + torch.ones(2)\nexcept dd.DeviceMismatch:\n    print('caught')\n"
    )
    env = {**__import__("os").environ, "COURSE_DEVICE_DISCIPLINE": "1", "COURSE_PROFILE": "ci"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "caught" in out.stdout


def test_the_fast_tensor_walk_finds_what_pytree_finds():
    """The mode walks every call's arguments and results itself (pytree was most of its cost): the same tensors."""
    import collections

    from torch.utils._pytree import tree_flatten

    from lesson_utils.core.device_places import _tensors

    a, b, c = torch.zeros(1), torch.ones(2), torch.arange(3)
    pair = collections.namedtuple("pair", "x y")
    cases = [
        (a, [b, (c, 3)], {"out": a}),
        torch.max(torch.randn(3, 4), dim=1),  # a torch.return_types structseq
        collections.OrderedDict(k=[a, {"z": b}]),
        pair(a, [b, None, "text", 2.0]),
        ((), [], {}, torch.Size([2, 3])),
    ]
    for case in cases:
        want = [x for x in tree_flatten(case)[0] if isinstance(x, torch.Tensor)]
        got = _tensors(case)
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), case
