"""The course's timing protocol (lesson_utils.lab.timing): warm-up, repeats, alternated order, median and spread,
ratios round by round, and the warning when other processes share the machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lesson_utils.lab import timing


def test_measure_warms_up_alternates_and_keeps_every_sample():
    calls = []
    variants = {name: (lambda name=name: calls.append(name) or name) for name in "abc"}
    warm = {name: (lambda name=name: calls.append("warm " + name)) for name in "abc"}
    m = timing.measure(variants, repeats=4, warmup=1, warmup_variants=warm)
    assert calls[:3] == ["warm a", "warm b", "warm c"]  # warm-up first, untimed
    assert calls[3:] == list("abc") + list("cba") + list("abc") + list("cba")
    assert m.order == [list("abc"), list("cba"), list("abc"), list("cba")]
    assert all(m[n].repeats == 4 and m[n].results == [n] * 4 for n in "abc")
    assert m.repeats == 4 and m.warmup == 1


def test_value_turns_a_result_into_the_sample_and_ratios_pair_rounds():
    outputs = iter([10.0, 5.0, 20.0, 5.0, 30.0, 10.0])  # a, b | b, a | a, b in alternated order
    m = timing.measure(
        {"a": lambda: next(outputs), "b": lambda: next(outputs)},
        repeats=3,
        warmup=0,
        value=lambda result, _seconds: result,
        unit="tok/s",
    )
    assert m["a"].samples == [10.0, 5.0, 30.0] and m["b"].samples == [5.0, 20.0, 10.0]
    r = m.ratio("a", "b")
    assert (r.median, r.low, r.high, r.repeats) == (2.0, 0.25, 3.0, 3)
    assert m["a"].median == 10.0 and (m["a"].low, m["a"].high) == (5.0, 30.0)
    assert "median of 3" in m["a"].text(digits=1, unit="tok/s") and "5.0-30.0" in m["a"].text(digits=1, unit="tok/s")


def test_seconds_are_measured_by_default():
    m = timing.measure({"sleep": lambda: time.sleep(0.02)}, repeats=3, warmup=0)
    assert 0.015 < m["sleep"].median < 0.5
    assert "ms" in m["sleep"].text() and "median of 3" in str(m["sleep"])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(repeats=0), "repeats"),
        (dict(repeats=True), "repeats"),
        (dict(warmup=-1), "warmup"),
        (dict(warmup_variants={"other": lambda: None}), "same variants"),
    ],
)
def test_bad_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        timing.measure({"a": lambda: None}, **kw)
    with pytest.raises(ValueError, match="at least one variant"):
        timing.measure({})


def test_contention_is_the_other_processes_share(monkeypatch):
    stats = iter([(100.0, 400.0), (160.0, 480.0)])  # busy, total seconds of all cores: +60 busy of +80
    own = iter([10.0, 30.0])  # this process used 20 of them
    monkeypatch.setattr(timing, "_proc_stat", lambda: next(stats))
    monkeypatch.setattr(timing, "_own_cpu_seconds", lambda: next(own))
    probe = timing.ContentionProbe().start()
    assert probe.stop() == pytest.approx(0.5)  # others: 40 of 80 core-seconds


def test_a_contended_measurement_says_so(monkeypatch):
    m = timing.Measurement({}, 3, 1, [], contention=0.6, contention_how="test")
    assert m.contended and "60 %" in m.warning() and m.report().startswith("WARNING")
    quiet = timing.Measurement({}, 3, 1, [], contention=0.05)
    assert not quiet.contended and quiet.warning() == "" and "5 %" in quiet.protocol()


@pytest.mark.skipif(not os.path.exists("/proc/stat") or (os.cpu_count() or 1) > 4, reason="needs /proc and few cores")
def test_a_busy_neighbour_is_detected():
    """A real busy process beside the measurement: on a machine of up to 4 cores it takes at least a quarter."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        m = timing.measure({"idle": lambda: time.sleep(0.4)}, repeats=3, warmup=0)
    finally:
        busy.kill()
        busy.wait()
    assert m.contended, m.protocol()
    assert "WARNING" in m.report()


def test_goal_verdicts():
    assert timing.goal_verdict(2.41, 2, unit="x") == "met (2.41x >= 2x)"
    assert timing.goal_verdict(1.7, 2, unit="x") == "missed by 0.30x (1.70x < 2x)"
    assert timing.goal_verdict(5.0, 6, higher_is_better=False, unit=" min", digits=1) == "met (5.0 min <= 6 min)"
    assert timing.goal_verdict(7.1, 6, higher_is_better=False, unit=" min", digits=1).startswith("missed by 1.1 min")


def test_alternating_order():
    assert timing.alternating_order(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]
