"""The chat page (lesson_utils/api/chat.html) in headless Chromium, driven by Playwright: a message sent shows the
server's streamed reply - the same text the API answers whole - arriving in pieces; a second tab closed mid-reply
aborts its request and leaves every block free, and so does the page's Stop button.

Chromium is Debian's (``.ci/run`` installs it when missing and sets ``COURSE_REQUIRE_BROWSER=1``, so CI cannot skip
this); elsewhere the test is skipped, with the reason, when no ``chromium`` is on the PATH."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest
import torch

from lesson_utils.api.server import start_server
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.model import weights_from_hf
from lesson_utils.model.catalog import random_causal_lm, tiny_config
from lesson_utils.serving.engine import Engine

MODEL = "tiny-llama"
BLOCKS = 64
PAGE_MAX_TOKENS = 96  # what chat.html asks for


def _missing(what: str):
    if os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"COURSE_REQUIRE_BROWSER=1 but {what}")
    pytest.skip(f"{what}: the chat page is tested in a browser only where there is one")


@pytest.fixture(scope="module")
def browser():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        _missing("no chromium is on the PATH (Debian's `chromium`; .ci/run installs it)")
    try:
        from playwright import sync_api
    except ImportError:
        _missing("playwright is not installed (the course's test extra installs it)")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


class _SlowEngine(Engine):
    """Each step first waits ``delay_s``, so a 96-token reply lasts long enough to watch it arrive or leave it."""

    delay_s = 0.0

    def step(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return super().step(*args, **kwargs)


@pytest.fixture(scope="module")
def server():
    from transformers import AutoTokenizer

    from lesson_utils.model.trained import trained_folder

    tokenizer = AutoTokenizer.from_pretrained(trained_folder(show=False))
    # no end-of-sequence token the random model could draw: every reply runs to the page's max_tokens
    cfg = tiny_config("llama", vocab_size=len(tokenizer), max_positions=256, eos_token_id=None)
    w = weights_from_hf(random_causal_lm(cfg, 11).to(torch.float32))
    manager = SharingBlockManager(BLOCKS, 4, enable_prefix_caching=True, max_seq_len=w.max_positions)
    with start_server(_SlowEngine(w, PagedKVCache.for_model(w, manager=manager)), tokenizer, MODEL) as s:
        yield s


def _all_free(server, timeout_s: float = 20) -> bool:
    def free():
        m = server.loop.engine.manager
        return not server.loop.engine.scheduler.has_work and m.num_free_blocks == m.view.num_blocks

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.loop.call(free).result(10):
            return True
        time.sleep(0.05)
    return False


def _aborted(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "course_requests_finished_total" and s.labels.get("reason") == "abort":
                return s.value
    return 0.0


# Every length the reply's element takes, in order: a streamed reply takes many, a reply shown at once takes one.
_WATCH_REPLY = """() => {
  window.replyLengths = [];
  new MutationObserver(() => {
    const a = document.querySelector('.assistant');
    if (a && window.replyLengths[window.replyLengths.length - 1] !== a.textContent.length)
      window.replyLengths.push(a.textContent.length);
  }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
}"""


def _open(browser, server):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('model:')", timeout=30_000)
    return page


def _send(page, text: str) -> None:
    page.fill("#msg", text)
    page.click("#send")


def test_a_message_gets_the_servers_reply_streamed_into_the_page(browser, server):
    message = "Tell me about paged memory."
    whole = httpx.post(
        server.base_url + "/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": PAGE_MAX_TOKENS,
            "temperature": 0,
        },
        timeout=120,
    ).json()["choices"][0]["message"]["content"]
    assert whole, "the API's reply is empty: the page would have nothing to show"
    _SlowEngine.delay_s = 0.01
    page = _open(browser, server)
    try:
        page.evaluate(_WATCH_REPLY)
        _send(page, message)
        page.wait_for_function("document.getElementById('status').textContent.endsWith('done')", timeout=60_000)
        assert page.text_content(".user") == "You: " + message
        assert page.text_content(".assistant") == whole  # the page joins the stream's pieces into the whole answer
        lengths = page.evaluate("window.replyLengths")
        assert len(lengths) >= 5 and lengths == sorted(lengths), f"the reply did not arrive in pieces: {lengths}"
    finally:
        page.close()
        _SlowEngine.delay_s = 0.0
    assert _all_free(server)


def test_a_tab_closed_mid_reply_aborts_its_request_and_frees_its_blocks(browser, server):
    before = _aborted(server)
    _SlowEngine.delay_s = 0.015
    stays, leaves = _open(browser, server), _open(browser, server)
    try:
        _send(stays, "A first question")
        _send(leaves, "A second question")
        leaves.wait_for_function("document.querySelector('.assistant')?.textContent.length > 0", timeout=60_000)
        free = server.loop.call(lambda: server.loop.engine.manager.num_free_blocks).result(10)
        assert free < BLOCKS, "no block was held while both tabs were being answered"
        leaves.close()  # mid-reply: the page asked for 96 tokens and has shown only the first ones
        stays.wait_for_function("document.getElementById('status').textContent.endsWith('done')", timeout=60_000)
        assert stays.text_content(".assistant"), "the tab that stayed got no reply"
    finally:
        stays.close()
        if not leaves.is_closed():
            leaves.close()
        _SlowEngine.delay_s = 0.0
    assert _all_free(server), "blocks are still held after both tabs ended"
    assert _aborted(server) - before == 1, "the closed tab's request was not aborted (served to its end instead?)"


def test_the_stop_button_aborts_the_reply_and_frees_its_blocks(browser, server):
    before = _aborted(server)
    _SlowEngine.delay_s = 0.015
    page = _open(browser, server)
    try:
        _send(page, "Tell me a long story")
        page.wait_for_function("document.querySelector('.assistant')?.textContent.length > 0", timeout=60_000)
        page.click("#stop")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('stopped')", timeout=30_000)
        assert page.is_disabled("#stop"), "the Stop button stays enabled after the reply ended"
        assert _all_free(server), "blocks are still held after Stop"
        assert _aborted(server) - before == 1, "Stop did not abort the request on the server"
        _send(page, "And another one?")  # the conversation goes on after a stopped reply
        page.wait_for_function("document.getElementById('status').textContent.endsWith('done')", timeout=60_000)
        assert len(page.query_selector_all(".assistant")) == 2
    finally:
        page.close()
        _SlowEngine.delay_s = 0.0
    assert _all_free(server)
