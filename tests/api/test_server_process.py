"""``python -m lesson_utils.api`` as a process of its own, as a learner starts it from a terminal: it serves the trained
SmolLM2-135M-Instruct to the unmodified ``openai`` client on the port it prints, and Ctrl+C stops it cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest


@pytest.fixture(scope="module")
def served():
    from lesson_utils.model.trained import trained_folder

    trained_folder(show=False)  # converted once (shared with the other tests), before the process's clock starts
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "lesson_utils.api", "--port", "0", "--blocks", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # as a shell's background job: SIGINT ignored (pytest-xdist's workers ignore it too); the server must still stop
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    lines, url, deadline = [], None, time.monotonic() + 120
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        lines.append(line)
        found = re.search(r"at (http://127\.0\.0\.1:\d+) ", line)
        url = found.group(1) if found else None
    if url is None:
        proc.kill()
        pytest.fail("the server process did not print its address:\n" + "".join(lines))
    yield proc, url
    if proc.poll() is None:
        proc.kill()


def test_the_command_line_server_answers_the_openai_client(served):
    from openai import OpenAI

    _, url = served
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    got = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert got.choices[0].message.content and 1 <= got.usage.completion_tokens <= 8


def test_ctrl_c_stops_it_cleanly_even_where_sigint_was_ignored(served):
    proc, _ = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
