"""One wording for a busy machine, whether the timing came from timing.measure or a bare probe (lesson 09)."""

from lesson_utils.lab import timing


def test_a_probe_warns_only_past_the_threshold():
    probe = timing.ContentionProbe()
    probe.share, probe.how = 0.1, "test"
    assert probe.warning() == ""
    probe.share = 0.6
    assert probe.warning().startswith("WARNING: other processes used 60 %") and "(test)" in probe.warning()
    assert probe.warning() == timing.contention_warning(0.6, "test")
