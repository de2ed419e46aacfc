"""The machinery every exercise checker uses.

A checker runs the learner's code and the course's reference on the same randomized and edge cases and
prints one of three things:

* a pass mark,
* exactly what differed: the input, the expected value, what the learner's code returned,
* "not implemented yet" when the exercise still raises ``NotImplementedError``.

It returns a :class:`CheckResult` whose ``use`` is the learner's implementation when it passed and the
reference otherwise, so the rest of a notebook runs either way ("Run all" never crashes on an unsolved
exercise). A check cell binds it to a name of its own, ``use_NAME = checks.check_NAME(NAME).use``, never to
the exercise's name: rebinding ``NAME`` would put the reference under the learner's name, and running the
check cell again would then check (and pass) the reference. With ``COURSE_STRICT=1`` (set when CI or the
instructor executes the solutions) a failure or an unsolved exercise raises :class:`ExerciseFailed` instead.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable


class ExerciseFailed(AssertionError):
    """Raised in strict mode when an exercise is unsolved or wrong."""


def is_strict() -> bool:
    return os.environ.get("COURSE_STRICT", "").lower() not in ("", "0", "false")


def case_device():
    """Where checkers build their cases: the profile's device, as the lesson's own code will use them (a
    function that only works on CPU tensors must fail its check, not the GPU run after it)."""
    from lesson_utils.core import device_discipline
    from lesson_utils.core.env import get_profile

    if device_discipline.active() is not None:  # a test's device-discipline block: its device stands for the GPU
        return str(device_discipline.DEVICE)
    return get_profile().device


def device_hint(expected: Any, got: Any) -> str:
    """A hint when a returned tensor is on another device than the reference's, else ''."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return ""
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor) and expected.device != got.device:
        return (
            f"your tensor is on {got.device}, but the inputs are on {expected.device}: make new tensors "
            "with device=... (e.g. device=batch.positions.device)"
        )
    return ""


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str
    use: Any = None  # what the notebook should go on with: the learner's code if it passed, else the reference
    implemented: bool = True

    def __bool__(self) -> bool:
        return self.passed


def short(value: Any, limit: int = 300) -> str:
    """repr() cut to a readable length (tensors summarised by shape and dtype)."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            if value.numel() <= 16:
                text = f"tensor({value.tolist()}, dtype={value.dtype})"
            else:
                text = f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
            return text
    except ImportError:  # pragma: no cover
        pass
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def first_difference(expected: Any, got: Any) -> str:
    """Where two tensors of one shape first differ, and by how much at most - what the two ``short`` lines cannot show
    when both print as ``tensor(shape=..., dtype=...)``; "" for anything else (other shapes, other types)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return ""
    if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)) or expected.shape != got.shape:
        return ""
    if expected.numel() == 0:
        return ""
    want, have = expected.detach().cpu().double(), got.detach().cpu().double()
    differs = ~((want == have) | (torch.isnan(want) & torch.isnan(have)))
    if not bool(differs.any()):
        return ""
    index = tuple(int(i) for i in differs.nonzero()[0])
    gap = (want - have).abs()
    largest = float(gap[torch.isfinite(gap)].max()) if bool(torch.isfinite(gap).any()) else float("nan")
    return (
        f"first difference at index {index}: expected {float(want[index]):.6g}, got {float(have[index]):.6g} "
        f"({int(differs.sum())} of {want.numel()} values differ; largest |difference| {largest:.3g})"
    )


MARKS = {"passed": "\u2705", "try again": "\u274c", "not solved": "\u23f3"}  # check mark, cross, hourglass
WIDTH = 96  # characters per line: JupyterLab wraps longer lines mid-word


def wrapped(message: str, width: int = WIDTH) -> str:
    """The message with every line folded at ``width``, continuation lines indented under their line."""
    import textwrap

    out = []
    for line in message.splitlines():
        indent = " " * (len(line) - len(line.lstrip()))
        out.append(
            textwrap.fill(line, width, subsequent_indent=indent + "  ", break_long_words=False, break_on_hyphens=False)
            if line.strip()
            else line
        )
    return "\n".join(out)


def _verdict(message: str) -> str:
    return next((v for v in MARKS if message.startswith(f"[{v}]")), "")


def show_message(message: str) -> None:
    """Print a check result: plain, folded text headless (and in tests); in a live notebook the same text in
    a coloured box with a mark, with the plain text as its fallback."""
    text = wrapped(message)
    from lesson_utils.lab.plotting import is_headless

    shell = None
    if not is_headless():
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:  # pragma: no cover - IPython comes with ipykernel
            shell = None
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        print(text)
        return
    import html

    from IPython.display import display

    verdict = _verdict(message)
    colour = {"passed": "#e8f5e9", "try again": "#ffebee", "not solved": "#fff8e1"}.get(verdict, "#f5f5f5")
    body = (
        f'<div style="background:{colour};padding:6px 10px;border-radius:4px;font-family:monospace;'
        f'white-space:pre-wrap">{MARKS.get(verdict, "")} {html.escape(message)}</div>'
    )
    display({"text/plain": text, "text/html": body}, raw=True)


def _finish(result: CheckResult, quiet: bool) -> CheckResult:
    if not quiet:
        show_message(result.message)
    if is_strict() and not result.passed:
        raise ExerciseFailed(result.message)
    return result


def not_implemented(name: str, reference: Any, quiet: bool = False) -> CheckResult:
    msg = (
        f"[not solved] Exercise '{name}': not implemented yet. Fill in the cell above and run this check "
        f"again. The rest of the notebook uses the course's reference implementation meanwhile."
    )
    return _finish(CheckResult(name, False, msg, use=reference, implemented=False), quiet)


def failed(name: str, detail: str, reference: Any, quiet: bool = False) -> CheckResult:
    msg = (
        f"[try again] Exercise '{name}': {detail}\n"
        f"(The rest of the notebook uses the course's reference implementation until this passes.)"
    )
    return _finish(CheckResult(name, False, msg, use=reference), quiet)


PASSED_NEXT = (
    "From here on the notebook uses your code; cells below that already ran used the course's reference - re-run "
    "them to see yours."
)


def passed(name: str, detail: str, learner: Any, quiet: bool = False, *, next_line: str = PASSED_NEXT) -> CheckResult:
    """``next_line`` says what happens to the learner's code now: by default the notebook uses it from here on; an
    exercise that nothing later runs says so instead (a pass message must be true)."""
    msg = f"[passed] Exercise '{name}': {detail}\n{next_line}"
    return _finish(CheckResult(name, True, msg, use=learner), quiet)


def _raised(name: str, case_text: str, err: BaseException, reference: Any, quiet: bool) -> CheckResult:
    where = traceback.extract_tb(err.__traceback__)[-1]
    return failed(
        name,
        f"on input {case_text} your code raised {type(err).__name__}: {err} (line {where.lineno}: {where.line})",
        reference,
        quiet,
    )


def type_problem(expected: Any, got: Any) -> str:
    """What is wrong with the *kind* of value returned (type, tensor dtype, shape, device), or ''.

    Checked before values are compared: a float tensor that equals a long one still breaks the indexing
    that follows it, and an int that is a float (36864.0) is not a count of bytes.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a torch.Tensor, got {type(got).__name__}"
        if got.dtype != expected.dtype:
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        return device_hint(expected, got)
    if isinstance(expected, bool) or expected is None:
        return "" if type(got) is type(expected) else f"expected {expected!r}, got a {type(got).__name__}"
    if isinstance(expected, numbers.Integral):
        return (
            ""
            if isinstance(got, numbers.Integral) and not isinstance(got, bool)
            else f"expected an int, got {type(got).__name__} {got!r}"
        )
    if isinstance(expected, (tuple, list, dict)) and not isinstance(got, type(expected)):
        return f"expected a {type(expected).__name__}, got {type(got).__name__}"
    if isinstance(expected, (tuple, list)) and len(got) == len(expected):
        for e, g in zip(expected, got):
            problem = type_problem(e, g)
            if problem:
                return problem
    return ""


def default_equal(expected: Any, got: Any) -> bool:
    if type_problem(expected, got):
        return False
    try:
        import torch

        if isinstance(expected, torch.Tensor):
            return bool(torch.equal(expected, got))
    except ImportError:  # pragma: no cover
        pass
    return expected == got


def same_value(a: Any, b: Any) -> bool:
    """Deep equality that understands tensors, dataclasses and namespaces (for "the input did not change")."""
    try:
        import torch

        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and bool(torch.equal(a.cpu(), b.cpu()))
            )
    except ImportError:  # pragma: no cover
        pass
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return all(same_value(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if hasattr(a, "__dict__") and not callable(a):
        return same_value(vars(a), vars(b))
    try:
        import numpy as np

        if isinstance(a, np.ndarray):
            return a.shape == b.shape and bool((a == b).all())
    except ImportError:  # pragma: no cover
        pass
    return a == b


def _safe_explain(explain, case, expected, got) -> str:
    """A checker's hint, or '' when there is none - or when the wrong answer is too strange for it."""
    if explain is None:
        return ""
    try:
        return explain(case, expected, got) or ""
    except Exception:  # noqa: BLE001 - a hint must never turn a wrong answer into a crash
        return ""


def _changed_argument(before: tuple, after: tuple) -> int | None:
    for i, (x, y) in enumerate(zip(before, after)):
        if not same_value(x, y):
            return i
    return None


def call_learner(fn, *args):
    """One call of a learner's function: ``(value, None)``, or ``(None, exception)`` for any error it raised, which
    the checker turns into feedback. ``NotImplementedError`` (an exercise not written yet) goes through, for the
    checker to say so politely (``not_implemented``)."""
    try:
        return fn(*args), None
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - any learner error becomes feedback
        return None, err


def check_function(
    name: str,
    learner: Callable,
    reference: Callable,
    cases: Iterable[tuple],
    *,
    equal: Callable[[Any, Any], bool] = default_equal,
    show_input: Callable[[tuple], str] | None = None,
    explain: Callable[[tuple, Any, Any], str] | None = None,
    quiet: bool = False,
    arg_names: tuple[str, ...] = (),
) -> CheckResult:
    """Call ``learner(*case)`` and ``reference(*case)`` for every case; the first difference is reported.

    The learner gets the case's own objects (the reference a deep copy), and its arguments must be unchanged
    afterwards: every function checked this way is specified not to modify its inputs. The kind of value
    returned is checked before the value (:func:`type_problem`). ``explain(case, expected, got)`` may add a
    hint about the likely mistake; ``arg_names`` name the arguments in messages.
    """
    cases = list(cases)
    show_input = show_input or (lambda case: ", ".join(short(a) for a in case))
    for case in cases:
        shown = show_input(case)
        before = copy.deepcopy(case)
        expected = reference(*copy.deepcopy(case))
        try:
            got = learner(*case)
        except NotImplementedError:
            return not_implemented(name, reference, quiet)
        except Exception as err:  # noqa: BLE001 - any learner error becomes feedback
            return _raised(name, f"({shown})", err, reference, quiet)
        changed = _changed_argument(before, case)
        if changed is not None:
            what = arg_names[changed] if changed < len(arg_names) else f"argument {changed + 1}"
            return failed(
                name,
                f"on input ({shown}) your code changed its input `{what}`; it must leave its inputs "
                "as they were (build a new value instead)",
                reference,
                quiet,
            )
        problem = type_problem(expected, got) if equal is default_equal else ""
        if problem or not equal(expected, got):
            hint = device_hint(expected, got) or _safe_explain(explain, case, expected, got)
            return failed(
                name,
                f"on input ({shown})\n    expected: {short(expected)}\n    got:      {short(got)}"
                + (f"\n    {where}" if (where := first_difference(expected, got)) else "")
                + (f"\n    {problem}" if problem and problem != hint else "")
                + (f"\n    hint: {hint}" if hint else ""),
                reference,
                quiet,
            )
    return passed(name, f"all {len(cases)} cases match the reference (randomized and edge cases).", learner, quiet)


def expect_error(
    name: str, fn: Callable, args: tuple, error: type[BaseException] | tuple, what: str, reference: Any, quiet: bool
) -> CheckResult | None:
    """None when ``fn(*args)`` raises ``error``; otherwise a failed result saying what should have happened."""
    try:
        fn(*args)
    except NotImplementedError:
        return not_implemented(name, reference, quiet)
    except error:
        return None
    except Exception as err:  # noqa: BLE001
        names = error.__name__ if isinstance(error, type) else " or ".join(e.__name__ for e in error)
        return failed(
            name, f"{what}: expected {names}, but your code raised {type(err).__name__}: {err}", reference, quiet
        )
    names = error.__name__ if isinstance(error, type) else " or ".join(e.__name__ for e in error)
    return failed(name, f"{what}: expected a {names}, but your code returned normally", reference, quiet)
