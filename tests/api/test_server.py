"""The OpenAI-compatible server (lesson_utils/api) on a tiny random Llama that speaks SmolLM2's tokenizer, on the
loopback address: the unmodified ``openai`` client gets the offline engine's tokens, every bad input gets OpenAI's
error shape and changes nothing, clients that go away leave no block held, and /metrics parses."""

from __future__ import annotations

import concurrent.futures
import json
import random
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
BLOCKS = 96


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lesson_utils.model.trained import trained_folder

    return AutoTokenizer.from_pretrained(trained_folder(show=False))


@pytest.fixture(scope="module")
def weights(tokenizer):
    cfg = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        max_positions=256,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    return weights_from_hf(random_causal_lm(cfg, 7).to(torch.float32))


def _engine(w):
    manager = SharingBlockManager(BLOCKS, 4, enable_prefix_caching=True, max_seq_len=w.max_positions)
    return Engine(w, PagedKVCache.for_model(w, manager=manager))


@pytest.fixture(scope="module")
def server(weights, tokenizer):
    with start_server(_engine(weights), tokenizer, MODEL, max_waiting=256) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _all_free(server) -> bool:
    def free():
        m = server.loop.engine.manager
        return not server.loop.engine.scheduler.has_work and m.num_free_blocks == m.view.num_blocks

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if server.loop.call(free).result(10):
            return True
        time.sleep(0.05)
    return False


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completions_are_the_offline_engines_tokens(client, weights, tokenizer):
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    offline = _engine(weights).generate([ids], 12)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == tokenizer.decode(offline, skip_special_tokens=True)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(offline)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text


def test_chat_streams_in_the_template_and_n_samples_share_a_seed(client, weights, tokenizer):
    messages = [{"role": "user", "content": "Name a prime number."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    offline = _engine(weights).generate([tokenizer.encode(text, add_special_tokens=False)], 10)[0]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == tokenizer.decode(offline, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(offline)
    a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3, temperature=1.0, seed=5)
    b = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3, temperature=1.0, seed=5)
    assert len(a.choices) == 3 and [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert {c.finish_reason for c in a.choices} <= {"stop", "length"}


def test_a_stop_string_ends_the_answer_before_it(client):
    full = client.completions.create(model=MODEL, prompt="one two three", max_tokens=16, temperature=0)
    text = full.choices[0].text
    if len(text) < 4:
        pytest.skip("the tiny model's answer is too short to cut")
    stop = text[2:4]
    cut = client.completions.create(model=MODEL, prompt="one two three", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "n": 99}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
        ),
        ({"model": MODEL, "prompt": "hi", "top_p": 0.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 3}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop"),
        ({"model": MODEL, "prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ],
)
def test_bad_requests_get_openais_error_shape_and_change_nothing(server, body, status, param):
    path = "/chat/completions" if "messages" in body else "/completions"
    r = httpx.post(server.base_url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert _all_free(server)


def test_malformed_json_is_a_400(server):
    r = httpx.post(
        server.base_url + "/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "malformed" in r.json()["error"]["message"]


def test_a_full_waiting_line_is_a_429_with_retry_after(weights, tokenizer):
    with start_server(_engine(weights), tokenizer, MODEL, max_waiting=0) as s:
        r = httpx.post(s.base_url + "/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"


def _stream_then_leave(url, seed):
    rng = random.Random(seed)
    body = {
        "model": MODEL,
        "prompt": f"story {seed}: once upon a time",
        "max_tokens": 40,
        "stream": True,
        "temperature": 0.8,
        "seed": seed,
    }
    read = rng.randrange(0, 6)
    with httpx.stream("POST", url + "/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= read:
                break  # leaving the with-block closes the connection mid-stream
    return read


def _aborted(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "course_requests_finished_total" and sample.labels.get("reason") == "abort":
                return sample.value
    return 0.0


def test_clients_that_disconnect_mid_stream_leave_every_block_free(server):
    before = _aborted(server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _stream_then_leave(server.base_url, i), range(30)))
    assert _all_free(server)
    assert _aborted(server) - before >= 25  # they were cancelled, not served to the end (a 200-token answer each)


def test_metrics_parse_and_count(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="count me", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["course_kv_blocks_total"].samples[0].value == BLOCKS
    assert {"course_requests_running", "course_requests_waiting", "course_kv_blocks_used"} <= set(families)
    ttft = families["course_time_to_first_token_seconds"]
    assert any(s.name.endswith("_count") and s.value >= 1 for s in ttft.samples)
    assert json.loads(httpx.get(server.base_url + "/models", timeout=30).text)["data"][0]["id"] == MODEL


def test_the_chat_page_is_served(server):
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and "/v1/chat/completions" in r.text


def test_plugged_in_functions_that_raise_never_stop_the_loop(weights, tokenizer):
    """Lesson 13 plugs the learner's text rule and cancel into the loop: one that raises ends its own request with an
    error (or is finished by the reference cancel), is noted in ``loop.problems``, and the server goes on serving."""
    from lesson_utils.api.cancel import cancel_request
    from lesson_utils.api.detokenizer import safe_new_text

    calls = []

    def rule_that_breaks_on_its_fifth_call(decode, ids, start, sent):
        calls.append(len(ids))
        if len(calls) == 5:
            raise IndexError("window too long")
        return safe_new_text(decode, ids, start, sent)

    def cancel_that_raises_halfway(engine, seq):
        cancel_request(engine, seq)
        raise KeyError("after aborting")

    rule = {"on": True}

    def switchable_rule(decode, ids, start, sent):
        return (rule_that_breaks_on_its_fifth_call if rule["on"] else safe_new_text)(decode, ids, start, sent)

    with start_server(
        _engine(weights), tokenizer, MODEL, text_rule=switchable_rule, cancel=cancel_that_raises_halfway
    ) as s:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 30, "temperature": 0}
        r = httpx.post(s.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 500 and "text rule raised IndexError" in r.json()["error"]["message"]
        assert _all_free(s)
        rule["on"] = False
        assert httpx.post(s.base_url + "/completions", json=body, timeout=60).status_code == 200
        assert _stream_then_leave(s.base_url, 1) >= 0 and _all_free(s)
        assert any("cancel raised KeyError" in p for p in s.loop.problems)
        assert any("text_rule raised IndexError" in p for p in s.loop.problems)


def test_a_leaving_client_reads_exactly_the_events_it_asked_for(server):
    from lesson_utils.lab.serve_clients import leave_mid_stream

    before = _aborted(server)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 60, "temperature": 0}
    assert [leave_mid_stream(server.base_url, body, n) for n in (0, 1, 3)] == [0, 1, 3]
    assert _all_free(server) and _aborted(server) - before == 3


def test_a_sink_that_raises_ends_its_request_and_the_loop_goes_on(weights, tokenizer):
    """A sink that fails (an HTTP handler whose event loop has closed): its request is cancelled, its blocks come
    back, the failure is noted, and the next request is served."""
    from lesson_utils.api.engine_loop import EngineLoop, SamplingParams

    def broken(out):
        raise RuntimeError("Event loop is closed")

    loop = EngineLoop(_engine(weights), tokenizer).start()
    try:
        loop.submit([5, 6, 7, 8], SamplingParams(20), broken).result(30)
        got = []
        handle = loop.submit([9, 10, 11], SamplingParams(5), got.append).result(30)
        deadline = time.monotonic() + 30
        while not handle.finished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handle.finished and got[-1].finish_reason == "length"
        m = loop.engine.manager
        assert loop.call(lambda: m.num_free_blocks == m.view.num_blocks).result(10)
        assert any("publishing an output raised RuntimeError" in p for p in loop.problems)
    finally:
        loop.stop()
