"""Checkers for lesson 06 (swapping and preemption)."""

from __future__ import annotations

import copy
import itertools
from dataclasses import fields

from lesson_utils.core.types import Request, Sequence
from lesson_utils.memory import swap
from lesson_utils.serving import scheduler as S

from .core import CheckResult, failed, not_implemented, passed, same_value


def check_swap_mapping(fn) -> CheckResult:
    """Exercise 06-1: destination blocks and copies for a swap, shared blocks copied once."""
    name = "swap_mapping"
    cases = [
        ("one sequence", [[7, 2, 9]], 100),
        ("two forked samples sharing their first two blocks", [[4, 5, 8], [4, 5, 11]], 100),
        ("a block already moved by an earlier sequence of this swap", [[3], [3, 6]], 100),
        ("destinations allocated from block 0 (0 is a block id like any other)", [[5, 6], [5, 8]], 0),
    ]
    for what, tables, first_dst in cases:
        ref_counter, got_counter = itertools.count(first_dst), itertools.count(first_dst)
        ref_already, got_already = {}, {}
        for table in tables:
            want = swap.swap_mapping(list(table), ref_counter.__next__, ref_already)
            given = list(table)
            try:
                got = fn(given, got_counter.__next__, got_already)
            except NotImplementedError:
                return not_implemented(name, swap.swap_mapping)
            except Exception as err:  # noqa: BLE001
                return failed(
                    name,
                    f"case '{what}', table {table}: your code raised {type(err).__name__}: {err}",
                    swap.swap_mapping,
                )
            if not (isinstance(got, tuple) and len(got) == 2):
                return failed(name, f"return (destination_blocks, copies), got {got!r}", swap.swap_mapping)
            if given != table:
                return failed(
                    name,
                    f"case '{what}': the source table {table} became {given}: the mapping reads the "
                    "sequence's blocks, it must not change them",
                    swap.swap_mapping,
                )
            dst, copies = list(got[0]), list(got[1])
            if dst != want[0] or copies != want[1]:
                hint = ""
                if len(copies) > len(want[1]):
                    hint = "more copies than needed: what does `already` tell you about a block?"
                    if first_dst == 0:
                        hint += " (and is block 0 'already moved' in your test of it?)"
                elif len(copies) < len(want[1]):
                    hint = "fewer copies than destinations allocated: which K/V would be lost?"
                elif any((d, s) in want[1] for s, d in copies):
                    hint = "the right pairs, the wrong way round: which block is copied from?"
                return failed(
                    name,
                    f"case '{what}', table {table} (destinations are allocated as {first_dst}, {first_dst + 1}, ...)\n"
                    f"    expected: blocks {want[0]}, copies {want[1]}\n    got:      blocks {dst}, copies {copies}"
                    + (f"\n    hint: {hint}" if hint else ""),
                    swap.swap_mapping,
                )
            if got_already != ref_already:
                return failed(
                    name,
                    f"case '{what}': after table {table}, `already` is {got_already}; expected {ref_already} (remember each move)",
                    swap.swap_mapping,
                )
    return passed(name, "blocks map like the reference and shared blocks are copied once.", fn)


def _seq(i, admitted, prompt=10):
    return Sequence(Request(i, 0.0, prompt, 20), admitted_step=admitted, num_generated=i + 1)


def check_choose_victim(fn) -> CheckResult:
    """Exercise 06-2: the most recently admitted running sequence is preempted."""
    name = "choose_victim"
    cases = [
        ("admitted in order", [_seq(0, 1), _seq(1, 2), _seq(2, 5)], 2),
        ("the newest is not last in the list", [_seq(0, 3), _seq(1, 9), _seq(2, 4)], 1),
        ("the longest sequence is the oldest", [_seq(0, 0, prompt=500), _seq(1, 7, prompt=3)], 1),
        ("two admitted in the same step: the later in the batch", [_seq(0, 2), _seq(1, 6), _seq(2, 6)], 2),
        (
            "a tie in the same step where the earlier one is the longer",
            [_seq(0, 1), _seq(1, 6, prompt=90), _seq(2, 6, prompt=4)],
            2,
        ),
        ("a single running sequence", [_seq(0, 4)], 0),
    ]
    for what, running, want in cases:
        given = list(running)
        try:
            got = fn(given)
        except NotImplementedError:
            return not_implemented(name, S.most_recently_admitted)
        except Exception as err:  # noqa: BLE001
            return failed(
                name, f"case '{what}': your code raised {type(err).__name__}: {err}", S.most_recently_admitted
            )
        if given != running:
            return failed(
                name,
                f"case '{what}': the running list changed (now {len(given)} sequences): choose the victim, "
                "the scheduler removes it",
                S.most_recently_admitted,
            )
        if got is not running[want]:
            desc = ", ".join(f"seq {s.seq_id} (admitted at step {s.admitted_step}, {s.len} tokens)" for s in running)
            got_desc = f"seq {got.seq_id}" if isinstance(got, Sequence) else repr(got)
            return failed(
                name,
                f"case '{what}': running = [{desc}]\n    expected: seq {running[want].seq_id}\n    got:      {got_desc}"
                "\n    hint: which of them arrived in the batch most recently? Length does not decide it.",
                S.most_recently_admitted,
            )
    return passed(name, f"picks the most recently admitted sequence in all {len(cases)} cases.", fn)


def check_reset_for_recompute(fn) -> CheckResult:
    """Exercise 06-3: a preempted sequence forgets its cached K/V and keeps all its tokens."""
    name = "reset_for_recompute"
    seq = Sequence(
        Request(3, 0.0, 5, 20, prompt_ids=[2, 9, 9, 9, 9]),
        num_generated=4,
        output_ids=[7, 8, 9, 10],
        num_computed=8,
        admitted_step=2,
        first_token_step=3,
        token_steps=[3, 4, 5, 6],
    )
    seq.preemptions = 2  # preempted twice before: this is the third
    kept = {
        f.name: copy.deepcopy(getattr(seq, f.name))
        for f in fields(seq)
        if f.name not in ("num_computed", "preemptions")
    }
    try:
        fn(seq)
    except NotImplementedError:
        return not_implemented(name, S.reset_for_recompute)
    except Exception as err:  # noqa: BLE001
        return failed(name, f"your code raised {type(err).__name__}: {err}", S.reset_for_recompute)
    problems = []
    if seq.num_computed != 0:
        problems.append(
            f"num_computed is {seq.num_computed}: how many of this sequence's tokens are still in the cache once it "
            "is preempted by recompute?"
        )
    if seq.output_ids != [7, 8, 9, 10] or seq.num_generated != 4:
        problems.append(
            f"its output became {seq.output_ids} ({seq.num_generated} generated); recompute keeps every token "
            "generated so far - only their K/V are recomputed"
        )
    if seq.request.prompt_ids != [2, 9, 9, 9, 9]:
        problems.append("the prompt changed")
    if seq.preemptions != 3:
        problems.append(f"preemptions is {seq.preemptions}; it was 2 before this preemption (expected 3)")
    changed = [
        k
        for k, v in kept.items()
        if not same_value(v, getattr(seq, k)) and k not in ("output_ids", "num_generated", "request")
    ]
    if changed:
        problems.append(
            f"{', '.join(changed)} changed ({', '.join(f'{k}: {kept[k]!r} -> {getattr(seq, k)!r}' for k in changed)}): "
            "the steps at which it was admitted and produced its tokens are its history - the latencies are measured "
            "from them, and a preemption does not undo them"
        )
    if problems:
        return failed(
            name,
            "after resetting a sequence with a 5-token prompt and 4 generated tokens (num_computed 8, preempted twice before): "
            + "; ".join(problems),
            S.reset_for_recompute,
        )
    return passed(name, "the sequence keeps its tokens and will be prefilled again.", fn)
