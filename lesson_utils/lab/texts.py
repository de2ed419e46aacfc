"""A short English text shipped with the course (written for it), for lessons that need real words offline:
lesson 10's perplexity and teacher-forced accuracy. :func:`token_ids` tokenizes it with whatever tokenizer the
run has (OPT's, or the byte-level fallback) and repeats it to any length."""

from __future__ import annotations

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


def token_ids(tokenizer, n: int, vocab_size: int, *, offset: int = 0) -> list[int]:
    """``n`` token ids of :data:`SHORT_TEXT` (no bos), starting ``offset`` tokens in and wrapping around; every id
    below ``vocab_size`` (a tiny test model's vocabulary may be smaller than the tokenizer's)."""
    try:
        ids = tokenizer.encode(SHORT_TEXT, add_special_tokens=False)  # Hugging Face tokenizers
    except TypeError:
        ids = tokenizer.encode(SHORT_TEXT, add_bos=False)  # the course's byte-level fallback
    ids = [i for i in ids if i < vocab_size]
    if not ids:
        raise ValueError("the tokenizer gives no ids inside the model's vocabulary")
    return [ids[(offset + k) % len(ids)] for k in range(n)]
