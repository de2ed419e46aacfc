"""Lesson 07's exercise 1: settling a step (``update_from_output``), checked by serving two workloads with the
learner's update inside the course's engine and comparing, property by property, with the scheduler's own.

The two workloads: prompts sharing a prefix under tight memory (prefix-cache hits, preemption by recompute), and
the same prompts fed a chunk at a time under a token budget of 6 (a sequence mid-prompt computes tokens but does
not sample). What is compared: every token, the step that produced it and the step each request finished in, the
sequences returned as finished step by step, the logits of every step, the prefix cache's hits and registered
blocks, and the free blocks once everyone is done.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.core.progress import busy
from lesson_utils.core.types import OutOfBlocks, Sequence
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.model_runner import ModelRunner
from lesson_utils.serving.token_budget import ChunkedPrefill

from .core import CheckResult, failed, not_implemented, passed

MAX_STEPS = 400
CHUNK_BUDGET = 6


def reference_update(scheduler, plan, output):
    """The course's settlement (``FCFSScheduler.update_from_output``) with the exercise's signature."""
    return scheduler.update_from_output(plan, output)


class _LogitsRunner(ModelRunner):
    """The model runner, keeping every step's logits: a wrong update can leave the tiny ci model's tokens unchanged
    (its argmax rarely moves) while what the model computed under them is wrong."""

    def __init__(self, w, cache):
        super().__init__(w, cache)
        self.logged: list[tuple[list[int], torch.Tensor]] = []

    def run_feeds(self, feeds):
        out = super().run_feeds(feeds)
        self.logged.append(([f.seq_id for f in feeds], out.float().cpu()))
        return out


@dataclass(frozen=True)
class _After:
    """The state after one step: every request's computed count and tokens, who runs, what the prefix cache holds,
    and what the update returned."""

    computed: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    running: frozenset
    registered: frozenset
    returned: tuple
    statuses: tuple[str, ...]  # every request's SequenceStatus, by name
    finished: tuple[int, ...]  # the scheduler's finished list, in order


@dataclass
class _Run:
    steps: list[_After]
    token_steps: list[list[int]]  # per request: the step that produced each token
    finished_step: list[int | None]
    hits: int  # prompt tokens served from the prefix cache
    logits: list[tuple[list[int], torch.Tensor]]
    free_blocks: int
    num_blocks: int
    timed_out: bool = False


class _YourUpdateRaised(Exception):
    """The learner's update raised (``__cause__``); anything else that fails a step is the engine's."""


class _BadReturn(Exception):
    """The learner's update returned something other than the finished sequences."""


def _reversed(plan):
    """The same plan with its sequences in the opposite order: the sequences that sample are then not the first of
    ``plan.scheduled`` (a prompt chunk that stops short comes first), so ``plan.sampling`` is not 0, 1, ..."""
    n = len(plan.scheduled)
    order = list(range(n))[::-1]
    where = {old: new for new, old in enumerate(order)}
    pairs = sorted((where[i], c) for i, c in zip(plan.sampling, plan.sample_counts))
    return replace(
        plan,
        scheduled=[plan.scheduled[i] for i in order],
        num_tokens=[plan.num_tokens[i] for i in order],
        feeds=[plan.feeds[i] for i in order],
        sampling=[i for i, _ in pairs],
        sample_counts=[c for _, c in pairs],
    )


def _serve(w, update, prompts, num_blocks: int, chunked: bool, ref: _Run | None = None, eos=None) -> _Run:
    """Serve ``prompts`` with ``update`` as the step's third line, recording the state after every step; beside a
    reference run ``ref``, stop at the first step that differs from it or two steps after it ended. With chunks, each
    plan's sequences run in reverse order. ``eos``: the first request stops at this token."""
    manager = SharingBlockManager(num_blocks, 4, max_seq_len=w.max_positions)
    cache = PagedKVCache.for_model(w, manager=manager)

    def step_fn(scheduler, runner, step):  # the lesson's step, with ``update`` as its third line
        plan = scheduler.schedule(step)
        if chunked:
            plan = _reversed(plan)
        output = runner.execute(plan)
        try:
            done = update(scheduler, plan, output)
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001 - reported as the learner's
            raise _YourUpdateRaised() from err
        if not isinstance(done, (list, tuple)) or not all(isinstance(x, Sequence) for x in done):
            raise _BadReturn(f"your update returned {done!r:.100}")
        return plan, done

    engine = Engine(w, cache, step_fn=step_fn, chunked_prefill=ChunkedPrefill(CHUNK_BUDGET) if chunked else None)
    engine.runner = runner = _LogitsRunner(w, cache)
    seqs = [engine.add_request(p, 6) for p in prompts]  # the later prompts share the first's prefix
    seqs[0].eos_token_id = eos  # None: no eos; else the first request ends early on it
    steps = []
    while engine.scheduler.has_work:
        done = engine.step()
        returned = tuple(sorted(s.seq_id for s in done)) if isinstance(done, (list, tuple)) else (repr(done),)
        steps.append(
            _After(
                tuple(s.num_computed for s in seqs),
                tuple(tuple(s.output_ids) for s in seqs),
                frozenset(s.seq_id for s in engine.scheduler.running),
                frozenset(manager.view.cached_blocks().values()),
                returned,
                tuple(s.status.name for s in seqs),
                tuple(s.seq_id for s in engine.scheduler.finished),
            )
        )
        if len(steps) > (MAX_STEPS if ref is None else len(ref.steps) + 2):
            break
        if ref is not None and (len(steps) > len(ref.steps) or steps[-1] != ref.steps[len(steps) - 1]):
            break  # the first difference is found; the rest of the run would only cost time
    return _Run(
        steps,
        [list(s.token_steps) for s in seqs],
        [s.finished_step for s in seqs],
        manager.view.cached_prompt_tokens,
        runner.logged,
        manager.num_free_blocks,
        num_blocks,
        timed_out=engine.scheduler.has_work,
    )


def _prompts(w) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = [w.bos_token_id] + torch.randint(4, w.vocab_size, (12,), generator=g).tolist()
    return [shared + torch.randint(4, w.vocab_size, (n,), generator=g).tolist() for n in (1, 3, 6, 2)]


def _step_difference(s: int, got: _After, ref: _After, where: str) -> str:
    """What differs after step ``s``, as a question; "" when nothing does."""
    if got.computed != ref.computed:
        i = next(i for i, (a, b) in enumerate(zip(got.computed, ref.computed)) if a != b)
        return (
            f"{where}: after step {s} request {i} has computed {got.computed[i]} tokens; expected {ref.computed[i]}. "
            "By how many tokens does each scheduled sequence's computed count advance in a step?"
        )
    if got.tokens != ref.tokens:
        i = next(i for i, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b)
        return (
            f"{where}: after step {s} request {i} has generated {list(got.tokens[i])}; expected {list(ref.tokens[i])}. "
            "Which sequences get a token this step (does one whose prompt chunk stops short?), and from which row "
            "of the logits?"
        )
    if got.running != ref.running:
        return (
            f"{where}: after step {s} sequences {sorted(got.running)} are running; expected {sorted(ref.running)}. "
            "Does every sequence that is finished once this step's tokens are in - at its length limit or on its "
            "end-of-sequence token (seq.is_finished) - leave the running batch (scheduler.finish)?"
        )
    if got.registered != ref.registered:
        return (
            f"{where}: after step {s} the prefix cache holds {len(got.registered)} registered blocks; expected "
            f"{len(ref.registered)}. Is every scheduled sequence's full computed block registered every step - and "
            "before a finished sequence's memory is given back?"
        )
    if got.returned != ref.returned:
        return (
            f"{where}: at step {s} your update returned {list(got.returned)} as finished; expected "
            f"{list(ref.returned)}. In which step does a sequence finish, and what does the update return?"
        )
    if got.statuses != ref.statuses:
        i = next(i for i, (a, b) in enumerate(zip(got.statuses, ref.statuses)) if a != b)
        return (
            f"{where}: after step {s} request {i}'s status is {got.statuses[i]}; expected {ref.statuses[i]}. Who records "
            "that a sequence finished - its status, the step, the scheduler's finished list and its memory - in one "
            "call (scheduler.finish)?"
        )
    if got.finished != ref.finished:
        return (
            f"{where}: after step {s} the scheduler's finished list holds {list(got.finished)}; expected "
            f"{list(ref.finished)}. The engine and the lesson's later cells read it: is every finished sequence handed "
            "to scheduler.finish, once?"
        )
    return ""


def _first_difference(got: _Run, ref: _Run, chunked: bool) -> str:
    """What the learner's run got wrong, as a question; "" when nothing differs."""
    where = (
        f"with prompts fed a chunk at a time (a token budget of {CHUNK_BUDGET} per step)"
        if chunked
        else "with whole prompts that share a prefix"
    )
    for s, (g, r) in enumerate(zip(got.steps, ref.steps)):
        problem = _step_difference(s, g, r, where)
        if problem:
            return problem
    if got.timed_out:
        return (
            f"{where}: still running {len(got.steps)} steps in (the course's engine finished in {len(ref.steps)}): does "
            "every computed count advance, and does every finished sequence leave the running batch (scheduler.finish)?"
        )
    if len(got.steps) != len(ref.steps):
        return f"{where}: serving took {len(got.steps)} steps; expected {len(ref.steps)}. When does a sequence finish?"
    if got.token_steps != ref.token_steps:
        i = next(i for i, (a, b) in enumerate(zip(got.token_steps, ref.token_steps)) if a != b)
        return (
            f"{where}: the tokens are right, but request {i}'s tokens are stamped as produced at steps "
            f"{got.token_steps[i]}; expected {ref.token_steps[i]}. Which step produced a token?"
        )
    if got.finished_step != ref.finished_step:
        return (
            f"{where}: the requests finished at steps {got.finished_step}; expected {ref.finished_step}. Which step "
            "does a finished sequence record?"
        )
    if got.free_blocks != ref.free_blocks:
        return (
            f"{where}: once every request finished {got.num_blocks - got.free_blocks} blocks were still held "
            f"(expected {got.num_blocks - ref.free_blocks}): does every finished sequence give its memory back?"
        )
    for (ids, g), (ref_ids, r) in zip(got.logits, ref.logits):
        if ids != ref_ids or g.shape != r.shape or not torch.allclose(g, r, atol=1e-4, rtol=1e-4):
            return (
                f"{where}: the tokens are right, but the model computed other logits along the way: which sequences "
                "did each step feed, and how far had each computed?"
            )
    return ""


_REFERENCE_RUNS: dict = {}  # (weights, chunked) -> (weights, reference run, eos): the course's runs never change


def _reference(w, prompts, num_blocks: int, chunked: bool) -> tuple[_Run, int]:
    """The course's run of a workload (computed once per weights object: it depends on nothing the learner wrote),
    and the eos token its first request stops on."""
    key = (id(w), chunked)
    if key not in _REFERENCE_RUNS or _REFERENCE_RUNS[key][0] is not w:
        plain = _serve(w, reference_update, prompts, num_blocks, chunked)
        eos = plain.steps[-1].tokens[0][2]  # the first request's third token: it stops there as on eos
        _REFERENCE_RUNS[key] = (w, _serve(w, reference_update, prompts, num_blocks, chunked, eos=eos), eos)
    return _REFERENCE_RUNS[key][1], _REFERENCE_RUNS[key][2]


def check_update_from_output(fn, w) -> CheckResult:
    """Exercise 07-1: the update that settles a step (computed counts, tokens, prefix cache, finished sequences)."""
    name = "update_from_output"
    prompts = _prompts(w)
    checked = []
    for chunked, num_blocks in ((False, 12), (True, 16)):
        try:
            with busy("checking your update: the course's engine, then the same engine with yours"):
                ref, eos = _reference(w, prompts, num_blocks, chunked)
                got = _serve(w, fn, prompts, num_blocks, chunked, ref, eos=eos)
        except NotImplementedError:
            return not_implemented(name, reference_update)
        except _YourUpdateRaised as wrapped:
            err = wrapped.__cause__
            if isinstance(err, NotImplementedError):
                return not_implemented(name, reference_update)
            hint = (
                " (with prompts fed a chunk at a time: which sequences get a token - does one whose prompt chunk "
                "stops short? - and which row of the logits is whose?)"
                if chunked
                else ""
            )
            return failed(name, f"your update raised {type(err).__name__}: {err}{hint}", reference_update)
        except _BadReturn as err:
            return failed(
                name, f"{err}: return the Sequence objects that finished in this step (a list)", reference_update
            )
        except OutOfBlocks as err:
            return failed(
                name,
                f"the engine ran out of blocks ({err}): does every finished sequence give its memory back?",
                reference_update,
            )
        except Exception as err:  # noqa: BLE001 - the engine or scheduler failed the step after the learner's update
            return failed(
                name,
                f"the engine failed the step after your update ({type(err).__name__}: {err}): what state did your "
                "update leave the sequences in - how far has each computed, and what did it append?",
                reference_update,
            )
        problem = _first_difference(got, ref, chunked)
        if problem:
            return failed(name, problem, reference_update)
        checked.append(len(ref.steps))
    return passed(
        name,
        f"the same tokens, token steps, finished sequences per step (returned, their status and the scheduler's "
        f"finished list), logits, prefix-cache hits and free blocks as the "
        f"course's update, over {checked[0]} steps of whole prompts and {checked[1]} steps of prompt chunks.",
        fn,
    )
