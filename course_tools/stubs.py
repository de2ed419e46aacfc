"""The student copy's stubs: every ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region of a solution cell
replaced by a ``raise NotImplementedError`` named after the function that encloses it (:func:`stub_solutions`)."""

from __future__ import annotations

import re

from course_tools.course_config import BuildError

BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)#+[ \t]*BEGIN SOLUTION\b.*$")


END_RE = re.compile(r"^(?P<indent>[ \t]*)#+[ \t]*END SOLUTION\b.*$")


DEF_RE = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?def[ \t]+(?P<name>\w+)[ \t]*\(")


def stub_solutions(source: str, where: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION region of a code cell by a NotImplementedError stub.

    The stub keeps the indentation of the BEGIN marker and names the nearest enclosing ``def``.
    Raises BuildError (mentioning ``where``) on unbalanced or nested markers or a region outside a def.
    """
    lines = source.split("\n")
    out: list[str] = []
    begin: int | None = None
    for number, line in enumerate(lines):
        if BEGIN_RE.match(line):
            if begin is not None:
                raise BuildError(
                    f"{where}: nested BEGIN SOLUTION at line {number + 1} "
                    f"(the one at line {begin + 1} has no END SOLUTION yet)"
                )
            begin = number
            indent = BEGIN_RE.match(line).group("indent")
            name = _enclosing_def(lines, number, indent)
            if name is None:
                raise BuildError(
                    f"{where}: BEGIN SOLUTION at line {number + 1} is not inside a function; "
                    "exercises must be function bodies (def NAME(...):)"
                )
            out.append(f"{indent}# YOUR CODE HERE (exercise: {name})")
            out.append(f"{indent}raise NotImplementedError(\"Exercise '{name}' is not solved yet\")")
        elif END_RE.match(line):
            if begin is None:
                raise BuildError(f"{where}: END SOLUTION at line {number + 1} without a BEGIN SOLUTION")
            begin = None
        elif begin is None:
            out.append(line)
    if begin is not None:
        raise BuildError(f"{where}: BEGIN SOLUTION at line {begin + 1} has no END SOLUTION")
    return "\n".join(out)


def _enclosing_def(lines: list[str], marker_line: int, indent: str) -> str | None:
    width = len(indent.expandtabs(4))
    for line in reversed(lines[:marker_line]):
        match = DEF_RE.match(line)
        if match and len(match.group("indent").expandtabs(4)) < width:
            return match.group("name")
    return None
