"""Profiles, the banner and version warnings; plots that survive a headless run."""

from __future__ import annotations

import os
import subprocess
import sys

import matplotlib
import pytest

from lesson_utils.core import env
from lesson_utils.lab import plotting

matplotlib.use("Agg")


@pytest.fixture
def fresh_profile(monkeypatch):
    env.get_profile.cache_clear()
    yield monkeypatch
    env.get_profile.cache_clear()


def test_profile_from_environment(fresh_profile):
    fresh_profile.setenv("COURSE_PROFILE", "cpu")
    p = env.get_profile()
    assert p.name == "cpu" and p.device == "cpu" and str(p.dtype) == "torch.float32"
    assert p.pick(gpu=1, cpu=2, ci=3) == 2
    assert "cpu profile" in p.label() and "CPU" in p.label()


def test_ci_variable_selects_ci_profile(fresh_profile):
    fresh_profile.delenv("COURSE_PROFILE", raising=False)
    fresh_profile.setenv("CI", "true")
    assert env.get_profile().name == "ci"


def test_unknown_profile_is_a_clear_error(fresh_profile):
    fresh_profile.setenv("COURSE_PROFILE", "tpu")
    with pytest.raises(ValueError, match="not a profile; choose one of gpu, cpu, ci"):
        env.get_profile()


def test_gpu_profile_without_cuda_is_refused(fresh_profile):
    fresh_profile.setenv("COURSE_PROFILE", "gpu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        env.get_profile()


def test_triton_interpreter_is_set_without_cuda():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest called env.configure_triton()
    assert env.triton_interpreted()


def test_importing_env_changes_no_environment_variable():
    code = "import os; before = dict(os.environ); import lesson_utils.core.env; print(dict(os.environ) == before)"
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True"


def test_bf16_is_never_chosen_without_ampere():
    assert not env.supports_bf16()


def test_version_warnings():
    ok = {"python": "3.12.1", "torch": "2.11.0+cu128", "triton": "3.6.0", "transformers": "5.15.0"}
    assert env.version_warnings(ok) == []
    old = dict(ok, torch="2.1.0", transformers="missing")
    lines = env.version_warnings(old)
    assert any("torch 2.1.0 is outside the tested range" in line for line in lines)
    assert any("transformers is not installed" in line for line in lines)
    clash = dict(ok, numpy="2.4.1", interpreted=True)  # Colab's triton 3.6 in the interpreter with a numpy 2.4
    assert any("numpy below 2.4" in line for line in env.version_warnings(clash))
    assert env.version_warnings(dict(clash, numpy="2.3.5")) == []
    assert env.version_warnings(dict(clash, triton="3.9.0")) == []
    assert env.version_warnings(dict(clash, interpreted=False)) == []  # compiled kernels do not meet it


def test_banner_names_device_profile_and_versions(fresh_profile):
    fresh_profile.setenv("COURSE_PROFILE", "ci")
    text = env.banner()
    for part in ("CPU", "profile ci", "torch", "triton", "interpreter", "transformers"):
        assert part in text
    assert all(len(line) <= 100 for line in text.splitlines()), "JupyterLab wraps long lines mid-word"


def test_measured_titles_name_the_device(fresh_profile):
    fresh_profile.setenv("COURSE_PROFILE", "cpu")
    assert "measured on CPU" in plotting.measured_title("x")
    assert "simulated" in plotting.simulated_title("x")


def test_check_messages_are_folded_into_short_lines(capsys):
    from lesson_utils.checks import core

    long = "[try again] Exercise 'x': " + "word " * 60 + "\n    expected: " + "1, " * 50
    core.show_message(long)
    out = capsys.readouterr().out
    assert all(len(line) <= core.WIDTH for line in out.splitlines())
    assert out.split() == long.split()  # folded, not cut: every word is still there


def test_interactive_keeps_a_static_picture_in_a_live_notebook(monkeypatch, capsys):
    monkeypatch.delenv("COURSE_HEADLESS", raising=False)
    calls = []
    import ipywidgets

    monkeypatch.setattr(ipywidgets, "interact", lambda fn, **kw: calls.append("widget"))
    plotting.interactive(lambda a: calls.append(a), a=(0, 10))
    assert calls == [5, "widget"]  # the default view drawn as a plain figure first, then the controls
    assert "kept when the notebook is saved" in capsys.readouterr().out


def test_interactive_draws_once_with_defaults_when_headless(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_HEADLESS", "1")
    calls = []
    plotting.interactive(lambda a, b, c: calls.append((a, b, c)), a=["x", "y"], b=(0, 10), c=(0.0, 1.0, 0.1))
    assert calls == [("x", 5, 0.5)]
    assert "drawn once with the default values" in capsys.readouterr().out


def test_check_messages_in_a_live_notebook_are_marked_html_with_a_plain_fallback(monkeypatch):
    import IPython
    import IPython.display

    from lesson_utils.checks import core

    class ZMQInteractiveShell:  # what get_ipython() returns inside a Jupyter kernel
        pass

    shown = []
    monkeypatch.delenv("COURSE_HEADLESS", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: ZMQInteractiveShell())
    monkeypatch.setattr(IPython.display, "display", lambda bundle, raw=False: shown.append(bundle))
    core.show_message("[passed] Exercise 'x': all 3 cases match the reference.")
    core.show_message("[try again] Exercise 'x': on input (a < b)")
    assert "\u2705" in shown[0]["text/html"] and "\u274c" in shown[1]["text/html"]
    assert "a &lt; b" in shown[1]["text/html"]  # escaped
    assert shown[1]["text/plain"].startswith("[try again]")


def test_setup_shows_one_widget_in_a_live_kernel_and_none_headless(monkeypatch, fresh_profile):
    """The first widget of a kernel leaves JupyterLab saying "Idle": setup shows it, so later long cells say "Busy"."""
    import IPython
    import IPython.display
    import ipywidgets

    class ZMQInteractiveShell:
        pass

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    monkeypatch.setenv("COURSE_PROFILE", "ci")
    monkeypatch.setenv("COURSE_HEADLESS", "1")
    monkeypatch.setattr(IPython, "get_ipython", lambda: ZMQInteractiveShell())
    env.setup()
    assert shown == []  # headless (the runner, CI): nothing
    monkeypatch.delenv("COURSE_HEADLESS")
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    env.setup()
    assert shown == []  # a plain Python process: nothing
    monkeypatch.setattr(IPython, "get_ipython", lambda: ZMQInteractiveShell())
    env.setup()
    assert len(shown) == 2 and isinstance(shown[1], ipywidgets.HTML)  # the invisible wrapping rule, one widget
    assert isinstance(shown[0], IPython.display.HTML) and shown[0].data == env.OUTPUT_WRAP_STYLE


def test_the_static_picture_is_the_moment_the_slider_starts_at(monkeypatch, capsys):
    """interact starts a slider at the function's own default: the saved picture must show that moment too."""
    import ipywidgets

    monkeypatch.delenv("COURSE_HEADLESS", raising=False)
    started = []

    def fake_interact(fn, **controls):  # what ipywidgets does: the function's default, if any, is the start
        import inspect

        started.append(inspect.signature(fn).parameters["moment"].default)

    monkeypatch.setattr(ipywidgets, "interact", fake_interact)
    drawn = []

    def show(moment=9, other="x"):
        drawn.append((moment, other))

    plotting.interactive(show, moment=(0, 9, 1), other=["y", "x"])
    assert drawn == [(9, "x")] and started == [9]
    monkeypatch.setenv("COURSE_HEADLESS", "1")
    plotting.interactive(lambda a: drawn.append(a), a=(0, 10))
    assert drawn[-1] == 5  # no default of its own: the control's middle, as interact does


def test_the_setup_cell_makes_jupyterlab_break_printed_lines_between_words(monkeypatch):
    """JupyterLab's output area breaks long lines anywhere (word-break: break-all: "1.88x" became "1.88" / "x");
    the setup cell displays a rule that overrides it (checked in JupyterLab in headless Chromium: no word split
    with it, three words split without it)."""
    import IPython
    import IPython.display

    from lesson_utils.core import env

    class ZMQInteractiveShell:  # what a live Jupyter kernel's shell is called
        pass

    shown = []
    monkeypatch.delenv("COURSE_HEADLESS", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: ZMQInteractiveShell())
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    assert env.show_first_widget(env.get_profile())
    styles = [o.data for o in shown if isinstance(o, IPython.display.HTML)]
    assert styles == [env.OUTPUT_WRAP_STYLE]
    assert ".jp-OutputArea .jp-OutputArea-output pre" in styles[0] and "word-break: normal" in styles[0]
    monkeypatch.setenv("COURSE_HEADLESS", "1")
    shown.clear()
    assert not env.show_first_widget(env.get_profile()) and shown == []


def test_busy_keeps_a_bar_moving_while_one_long_call_runs(monkeypatch):
    """A single call of seconds (a model load, a checker's engine runs) shows a clock that moves, then closes."""
    import time

    import tqdm.auto

    from lesson_utils.core.progress import busy

    events = []

    class FakeBar:
        def __init__(self, **kw):
            events.append(("open", kw["desc"]))

        def refresh(self):
            events.append("refresh")

        def close(self):
            events.append("close")

    monkeypatch.setattr(tqdm.auto, "tqdm", FakeBar)
    with busy("loading a model", interval_s=0.02):
        time.sleep(0.2)
    assert events[0] == ("open", "loading a model") and events[-1] == "close"
    assert events.count("refresh") >= 3
    events.clear()
    with busy("nothing", show=False):
        pass
    assert events == []


def test_a_ticking_bar_is_redrawn_between_updates_seconds_apart():
    import time

    from lesson_utils.core.progress import ticking

    class Bar:
        refreshes = 0

        def refresh(self):
            self.refreshes += 1

    bar = Bar()
    with ticking(bar, interval_s=0.05):
        time.sleep(0.3)
    after = bar.refreshes
    assert after >= 3  # its clock moved while nothing updated it
    time.sleep(0.15)
    assert bar.refreshes == after  # and the redrawing stopped with the block
    with ticking(None):  # no bar (progress off): nothing to redraw
        pass
