"""Checkers for lesson 13 (serve it): the rule for when streamed text is safe to send, and the cancel path a
disconnected client takes. Both run the learner's code inside the course's own machinery (the detokenizer, a real
engine) and compare what a client or the engine would see."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from lesson_utils.api.cancel import LIVE, cancel_request
from lesson_utils.api.detokenizer import REPLACEMENT, IncrementalDetokenizer, safe_new_text
from lesson_utils.core.types import SequenceStatus, is_int

from .core import CheckResult, call_learner, failed, not_implemented, passed, short

TEXTS = (
    "Crème brûlée, 東京の天気 and a 🚀 launch: naïve café ✓",
    "The answer is Paris.<|im_end|> and then more",  # a special token: it adds no text
    "plain ASCII text with spaces  and\nnew lines",
    "emoji run: 👩‍💻🧑🏽‍🚀🎉 then words",
    "中文字符和日本語のテキスト",
    "numbers 3.14159 and symbols ≤ ≥ ∑ €",
)


class _LeadingSpaceDropped:
    """A tokenizer whose decode drops one space a window starts with, as SentencePiece tokenizers do (Llama's): the
    text of a token depends on what came before it, which is why the rule decodes a window, not the new tokens
    alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text, add_special_tokens=False):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text[1:] if text.startswith(" ") else text


class _Composing(_LeadingSpaceDropped):
    """A tokenizer whose decode composes an accent with the letter before it (Unicode NFC): the context's own text
    changes when the accent's tokens arrive ("cafe" becomes "café"), the case the rule must hold back for."""

    def decode(self, ids, skip_special_tokens=True):
        return unicodedata.normalize("NFC", self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


COMPOSED_TEXTS = ("cafe\u0301 au lait, Zoe\u0308 and Rene\u0301e",)  # letters followed by combining accents


def _states(tokenizer, text: str):
    """Every call the reference makes while the text's tokens arrive one by one: (ids so far, start, sent)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids, start, sent = [], 0, 0
    for t in tokenizer.encode(text, add_special_tokens=False):
        ids.append(t)
        yield list(ids), start, sent
        _, start, sent = safe_new_text(decode, ids, start, sent)


def _text_hint(expected, got, decode, ids, start, sent) -> str:
    text, *_ = got
    if REPLACEMENT in text:
        return "you sent text with U+FFFD in it: is the last character complete yet, or should it wait?"
    if got[1:] != expected[1:] and text == expected[0]:
        return (
            "the text is right but the window is not: once you send, which tokens are the next call's context, and "
            "where does the next call's new text start?"
        )
    before, after = decode(ids[start:sent]), decode(ids[start:])
    if not expected[0] and text and not after.startswith(before):
        return "the context's own text changed under the new tokens: can the new text still be cut after it?"
    if not expected[0] and text:
        return "this text is not final yet: what does decode(ids[start:]) end with here?"
    if expected[0] and not text:
        return "this text is final: nothing in it is a broken character - why hold it back?"
    return "the new text is what decode(ids[start:]) adds to decode(ids[start:sent]): compare the two decodes"


def check_safe_new_text(fn, tokenizer) -> CheckResult:
    """Exercise 13-1: ``safe_new_text(decode, ids, start, sent) -> (text, start, sent)`` - the text the new tokens add
    that is safe to send (held while it is empty or ends in U+FFFD), and the window's next state; then, streamed
    through the detokenizer token by token and in chunks, every piece free of U+FFFD and the pieces adding up to the
    whole decode."""
    name = "safe_new_text"
    calls = 0
    tokenizers = (
        (tokenizer, TEXTS, ""),
        (_LeadingSpaceDropped(tokenizer), TEXTS, " (a tokenizer whose text depends on the token before: Llama's kind)"),
        (_Composing(tokenizer), COMPOSED_TEXTS, " (a tokenizer whose decode joins an accent to the letter before it)"),
    )
    for tok, texts, context in tokenizers:
        decode = lambda ids, tok=tok: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        for text in texts:
            for ids, start, sent in _states(tok, text):
                expected = safe_new_text(decode, ids, start, sent)
                try:
                    got, err = call_learner(fn, decode, list(ids), start, sent)
                except NotImplementedError:
                    return not_implemented(name, safe_new_text)
                where = f"streaming {text!r}{context}, after token {len(ids)} (start={start}, sent={sent})"
                if err is not None:
                    return failed(name, f"{where} your code raised {type(err).__name__}: {err}", safe_new_text)
                kind_ok = isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], str)
                if not (kind_ok and all(is_int(x) for x in got[1:])):
                    return failed(
                        name,
                        f"{where} your code returned {short(got)}: return (text, start, sent), two ints after the text",
                        safe_new_text,
                    )
                if tuple(got) != tuple(expected):
                    hint = _text_hint(expected, got, decode, ids, start, sent)
                    return failed(name, f"{where}: expected {expected!r}, got {tuple(got)!r}. {hint}", safe_new_text)
                calls += 1
        if isinstance(tok, _Composing):
            continue  # text already sent cannot be taken back: these streams cannot add up to the composed text
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)
            for chunk in (1, 2, 3):
                try:
                    detok = IncrementalDetokenizer(tok, rule=fn)
                    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
                    rest = detok.flush()
                except Exception as err:  # noqa: BLE001 - any learner error becomes feedback
                    return failed(
                        name,
                        f"streaming {text!r}{context} {chunk} token(s) at a time, your rule raised "
                        f"{type(err).__name__}: {err}",
                        safe_new_text,
                    )
                if any(REPLACEMENT in p for p in pieces) or "".join(pieces) + rest != decode(ids):
                    return failed(
                        name,
                        f"streaming {text!r}{context} {chunk} token(s) at a time, the pieces sent did "
                        "not add up to the text or held a broken character: which tokens does each call "
                        "decode?",
                        safe_new_text,
                    )
    return passed(
        name,
        f"{calls} calls while {len(TEXTS)} texts (accents, CJK, emojis, a special token), with SmolLM2's tokenizer, "
        "one whose text depends on the token before and one that composes accents, streamed token by token match the "
        "rule, and streamed 1, 2 and 3 tokens at a time no piece holds U+FFFD and the pieces add up to the text.",
        fn,
        next_line="The server below streams with your rule.",
    )


# ---- exercise 13-2: cancel a request whose client went away --------------------------------------------------------
@dataclass(frozen=True)
class _Scenario:
    """A request to cancel, beside another one served to the end: ``steps`` engine steps before the cancel; a pool
    of ``blocks`` blocks; with ``swap`` the engine preempts by swapping (the other request comes first, so the
    request to cancel is the one swapped out); ``stopped``: that sample was already ended by a stop string."""

    what: str
    steps: int
    n: int
    stopped: int | None = None
    blocks: int = 48
    swap: bool = False


SCENARIOS = (
    _Scenario("still waiting (never admitted)", 0, 1),
    _Scenario("running, one sample", 2, 1),
    _Scenario("running, three samples forked after its prefill", 2, 3),
    _Scenario("waiting with samples still to fork", 0, 3),
    _Scenario("three samples, one already cancelled by a stop string", 2, 3, stopped=1),
    _Scenario("already finished", 12, 1),
    _Scenario("swapped out to CPU memory", 2, 1, blocks=5, swap=True),
    _Scenario("three samples, two of them swapped out", 2, 3, blocks=6, swap=True),
)


def _tiny_engine(blocks: int = 48, swap: bool = False):
    import torch

    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.memory.sharing import SharingBlockManager
    from lesson_utils.memory.swap import SwapSpace
    from lesson_utils.model import weights_from_hf
    from lesson_utils.model.catalog import random_causal_lm, tiny_config
    from lesson_utils.serving.engine import Engine

    w = weights_from_hf(random_causal_lm(tiny_config("llama"), 13).to(torch.float32))
    manager = SharingBlockManager(blocks, 4, watermark=0.0, enable_prefix_caching=True, max_seq_len=w.max_positions)
    preemption = dict(preemption_mode="swap", swap_space=SwapSpace(16)) if swap else {}
    return Engine(w, PagedKVCache.for_model(w, manager=manager), stop_at_eos=False, **preemption), manager


OTHER = [30, 31, 32, 33, 34, 35, 36]


def _alone() -> list[int]:
    eng, _ = _tiny_engine()
    return eng.generate([OTHER], 6)[0]


def _set_up(case: _Scenario):
    """The engine, its manager, the request to cancel and the other one, ``case.steps`` steps in."""
    eng, manager = _tiny_engine(case.blocks, case.swap)
    seq_args = ([5, 6, 7, 8, 9, 10, 11], 8)
    seq_kw = dict(n=case.n, temperature=1.0 if case.n > 1 else 0.0, seed=3)
    if case.swap:
        other = eng.add_request(list(OTHER), 6)
        seq = eng.add_request(*seq_args, **seq_kw)
    else:
        seq = eng.add_request(*seq_args, **seq_kw)
        other = eng.add_request(list(OTHER), 6)
    for _ in range(case.steps):
        if eng.scheduler.has_work:
            eng.step()
    if case.stopped is not None and len(seq.samples) > case.stopped:
        eng.scheduler.abort(seq.samples[case.stopped])  # its stop string ended it: the server aborted that sample
    if case.swap and not any(x.status is SequenceStatus.SWAPPED for x in seq.samples or [seq]):
        raise RuntimeError(f"the check's set-up '{case.what}' swapped nothing out: the engine's policy changed")
    return eng, manager, seq, other


def _right_after(eng, manager, seq, live_before) -> str | None:
    """What is wrong right after the cancel call, or None."""
    served = [x.seq_id for x in live_before if x.status is not SequenceStatus.ABORTED and x.status not in LIVE]
    if served:
        return f"sample(s) {served} ended some other way than being cancelled"
    if seq.status in LIVE:
        return (
            f"the sample you were given (status {seq.status.value}) is still waiting, running or swapped: which "
            "statuses are live (LIVE), and who aborts a sample?"
        )
    live = [x.seq_id for x in (seq.samples or [seq]) if x.status in LIVE]
    if live:
        return (
            f"sample(s) {live} are still waiting, running or swapped: cancel every sample of the request "
            "(seq.samples), not only the one you were given"
        )
    scheduled = list(eng.scheduler.running) + list(eng.scheduler.waiting) + list(eng.scheduler.swapped)
    tables = set(manager.view.tables())
    if eng.scheduler.swap_space is not None:
        tables |= set(eng.scheduler.swap_space.cpu_tables)
    still = [x.seq_id for x in seq.samples or [seq] if any(y is x for y in scheduled) or x.seq_id in tables]
    if still:
        return (
            f"sample(s) {still} still hold blocks (in GPU or swap memory) or a place in the scheduler right after your "
            "cancel: a client that "
            "left must get its blocks back now, not when its answer would have ended - who takes a sequence out of "
            "the scheduler and frees its table?"
        )
    return None


def _after_the_rest(eng, manager, seq, other, want: list[int], n: int) -> str | None:
    """What is wrong once the engine has served everyone else to the end, or None."""
    try:
        eng.run()
    except Exception as e:  # noqa: BLE001 - an engine left inconsistent by the learner's code
        return (
            f"the engine could not go on after your cancel: {type(e).__name__}: {e}. Did you free blocks by hand "
            "instead of asking the scheduler to abort?"
        )
    if other.output_ids != want:
        return "the other request's tokens changed: a cancel touches only its own request"
    if manager.num_free_blocks != manager.view.num_blocks:
        held = manager.view.num_blocks - manager.num_free_blocks
        return f"{held} block(s) were still held after everything ended: which samples kept theirs?"
    space = eng.scheduler.swap_space
    if space is not None and space.num_free != space.num_blocks:
        return (
            f"{space.num_blocks - space.num_free} swap block(s) in CPU memory were still held after everything "
            "ended: which samples were swapped out when the client left?"
        )
    if len(seq.samples or [seq]) > n:
        return "the request forked more samples after its cancel"
    return None


def check_cancel_request(fn) -> CheckResult:
    """Exercise 13-2: ``cancel_request(engine, seq)`` - every sample of ``seq``'s request still waiting, running or
    swapped is aborted through the scheduler; finished or cancelled ones are left alone; it never raises for a request
    that has ended. Checked on a real engine beside another request, which must get exactly the tokens it gets alone,
    and with every block free once it is done."""
    name = "cancel_request"
    want = _alone()
    for case in SCENARIOS:
        eng, manager, seq, other = _set_up(case)
        live_before = [x for x in (seq.samples or [seq]) if x.status in LIVE]
        other_before, steps_before = other.num_generated, len(eng.stats)
        try:
            _, err = call_learner(fn, eng, seq)
        except NotImplementedError:
            return not_implemented(name, cancel_request)
        where = f"a request {case.what}"
        if err is not None:
            return failed(
                name,
                f"for {where} your code raised {type(err).__name__}: {err}. A cancel never raises: "
                "which samples are still live (their status), and who gives their blocks back?",
                cancel_request,
            )
        if len(eng.stats) != steps_before or other.num_generated != other_before:
            return failed(
                name,
                f"for {where}, your code ran engine steps: a cancel ends the request now, without "
                "serving it (or anyone else) any further",
                cancel_request,
            )
        problem = _right_after(eng, manager, seq, live_before) or _after_the_rest(
            eng, manager, seq, other, want, case.n
        )
        if problem:
            return failed(name, f"for {where}, {problem}", cancel_request)
    return passed(
        name,
        f"in {len(SCENARIOS)} situations (waiting, running, forked, forks pending, one sample already stopped, "
        "finished, swapped out) every live sample was aborted, nothing raised, the other request got exactly its tokens alone, "
        "and every block was free at the end.",
        fn,
        next_line="The server below cancels disconnected clients' requests with your function.",
    )
