"""Lesson 09's model copy (a temporary folder that does not outlive its use) and goodput under latency targets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lesson_utils.disagg.model_copy import PREFIX, ModelCopy, remove_stale
from lesson_utils.serving.goodput import SLO, goodput


class _Saves:
    """Stands in for a Hugging Face model: save_pretrained writes one file (or fails, when asked to)."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_pretrained(self, path):
        (Path(path) / "config.json").write_text("{}")
        if self.fail:
            raise OSError("disk full")


def _ours(root: Path) -> list[Path]:
    return sorted(root.glob(f"{PREFIX}*"))


def test_a_copy_is_removed_when_asked_and_a_second_copy_replaces_the_first(tmp_path):
    first = ModelCopy(_Saves(), root=tmp_path)
    assert Path(first.path).is_dir() and (Path(first.path) / "config.json").exists()
    assert Path(first.path).name.startswith(f"{PREFIX}{os.getpid()}-") and first.size_bytes == 2
    second = ModelCopy(_Saves(), root=tmp_path)
    assert not first.exists and _ours(tmp_path) == [Path(second.path)]  # at most one per process
    with pytest.raises(FileNotFoundError, match="run the cell that saves it again"):
        _ = first.path
    second.remove()
    second.remove()  # idempotent
    assert _ours(tmp_path) == []


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    with pytest.raises(OSError, match="disk full"):
        ModelCopy(_Saves(fail=True), root=tmp_path)
    assert _ours(tmp_path) == []


def test_a_context_manager_removes_the_copy_on_an_error(tmp_path):
    with pytest.raises(RuntimeError):
        with ModelCopy(_Saves(), root=tmp_path):
            raise RuntimeError("the measurement failed")
    assert _ours(tmp_path) == []


def test_a_copy_is_removed_when_its_process_exits(tmp_path):
    code = (
        "import sys; from lesson_utils.disagg.model_copy import ModelCopy\n"
        "class M:\n    def save_pretrained(self, p): open(str(p) + '/x', 'w').close()\n"
        f"c = ModelCopy(M(), root={str(tmp_path)!r}); print(c.path)\n"
    )
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert made.startswith(str(tmp_path)) and not Path(made).exists()


def test_stale_copies_of_dead_processes_go_and_live_ones_stay(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # that process has exited
    stale = tmp_path / f"{PREFIX}{dead_pid}-abc"
    live = tmp_path / f"{PREFIX}{os.getppid()}-def"  # our parent: alive
    other = tmp_path / f"{PREFIX}notapid-x"
    legacy_old, legacy_new = tmp_path / f"{PREFIX}ab12cd34", tmp_path / f"{PREFIX}ef56gh78"  # the old code's names
    for d in (stale, live, other, legacy_old, legacy_new):
        d.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(legacy_old, (two_hours_ago, two_hours_ago))
    assert sorted(remove_stale(tmp_path)) == sorted([legacy_old, stale])
    assert not stale.exists() and not legacy_old.exists()
    assert live.exists() and other.exists() and legacy_new.exists()  # a young legacy copy may still be in use
    copy = ModelCopy(_Saves(), root=tmp_path)  # making a copy cleans up too
    assert live.exists() and copy.exists
    copy.remove()


def test_goodput_counts_requests_within_both_targets():
    arrival = {0: 0.0, 1: 0.0, 2: 1.0, 3: 0.5, 4: 0.0}
    times = {
        0: [0.1, 0.2, 0.3],  # TTFT 0.1, gaps 0.1: meets both
        1: [0.1, 0.5, 0.9],  # TPOT 0.4: misses it
        2: [2.0, 2.05],  # TTFT 1.0: misses it
        3: [0.6],  # one token: only its TTFT counts
        # 4 never produced a token: it meets nothing, and still counts
    }
    g = goodput(times, arrival, SLO(ttft_s=0.5, tpot_s=0.2))
    assert (g.total, g.met, g.ttft_met, g.tpot_met) == (5, 2, 3, 3)
    assert g.share == pytest.approx(0.4)
    assert "2/5 requests (40%)" in g.text()
    loose = goodput(times, arrival, SLO(0.5, 0.2).scaled(10))
    assert loose.met == 4  # the request with no token never meets a target
    assert g.met <= min(g.ttft_met, g.tpot_met)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), "1", True, None])
def test_an_slo_refuses_targets_that_are_not_positive_seconds(bad):
    with pytest.raises(ValueError, match="positive number of seconds"):
        SLO(bad, 0.1)
    with pytest.raises(ValueError, match="tpot_s"):
        SLO(0.1, bad)
