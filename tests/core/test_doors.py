"""The doors between the engine's parts, written down and held (issue 44, item 5).

* a block manager's public surface is exactly its written doors: the scheduler's
  (:class:`~lesson_utils.core.types.MemoryManager`), its read-only accounting (``view``:
  :class:`~lesson_utils.memory.doors.ManagerView`) and its single-block door (``blocks``:
  :class:`~lesson_utils.memory.doors.BlockDoor`) - at most 15 members, every one in a protocol;
* every manager and every cache an engine serves has every member of its door (no ``getattr`` probing);
* outside ``memory/`` nothing - package, tests, solution notebooks - reads a manager's internals or uses a member
  that is not on its doors (an AST check); the engine floors (``serving/``, ``disagg/``) ask a cache for nothing
  beyond :class:`~lesson_utils.cache.seam.ServingCache`.

The one exemption: ``tests/checkers/``, whose wrong answers imitate a learner reaching past the doors.
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from lesson_utils.cache.seam import KVCache, ServingCache
from lesson_utils.core.types import AccountingView, MemoryManager
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.doors import BlockDoor, ManagerView
from lesson_utils.memory.reservation import ContiguousReservationManager
from lesson_utils.memory.sharing import SharingBlockManager

ROOT = Path(__file__).resolve().parents[2]
MAX_SURFACE = 15


def protocol_members(proto) -> set[str]:
    """The members a Protocol writes down: its methods, properties and annotated attributes (its bases' too)."""
    names = set()
    for cls in proto.__mro__:
        if cls in (object,) or cls.__module__ == "typing":
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")}
        names |= {n for n in getattr(cls, "__annotations__", {}) if not n.startswith("_")}
    return names


def public_members(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


SCHEDULER_DOOR = protocol_members(MemoryManager)  # every manager, contiguous ones included
MANAGER_DOOR = SCHEDULER_DOOR | {"blocks"}  # a block manager adds its single-block door
VIEW_DOOR = public_members(ManagerView)
BLOCK_DOOR = public_members(BlockDoor)
CACHE_DOOR = protocol_members(ServingCache)


# ---- the surface -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [BlockManager, SharingBlockManager])
def test_a_block_managers_public_surface_is_its_written_doors(cls):
    surface = public_members(cls(8, 4))
    assert surface == MANAGER_DOOR, (
        f"public but in no protocol: {sorted(surface - MANAGER_DOOR)}; written but missing: "
        f"{sorted(MANAGER_DOOR - surface)}"
    )
    assert len(surface) <= MAX_SURFACE, f"{cls.__name__} has {len(surface)} public members: {sorted(surface)}"


@pytest.mark.parametrize("cls", [BlockManager, SharingBlockManager, ContiguousReservationManager])
def test_every_manager_has_every_member_of_every_door(cls):
    m = cls(8, 4) if cls is not ContiguousReservationManager else cls(64, "max", max_seq_len=32)
    assert (MANAGER_DOOR if isinstance(m, BlockManager) else SCHEDULER_DOOR) <= public_members(m)
    assert protocol_members(AccountingView) <= VIEW_DOOR
    for name in sorted(VIEW_DOOR):  # the view answers every question for every manager (or refuses by name)
        member = getattr(m.view, name)
        if callable(member) and not inspect.signature(member).parameters:
            try:
                member()
            except ValueError as e:
                assert "no blocks" in str(e), (cls.__name__, name, e)


def test_every_cache_an_engine_serves_has_every_member_of_its_door():
    from lesson_utils.cache.int8_paged import Int8PagedKVCache
    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.cache.reserved import ReservedKVCache
    from lesson_utils.cache.triton_paged import TritonPagedKVCache, UnifiedTritonKVCache

    for cls in (PagedKVCache, TritonPagedKVCache, UnifiedTritonKVCache, Int8PagedKVCache):
        cache = cls(1, 1, 4, BlockManager(4, 2))
        assert CACHE_DOOR <= public_members(cache), (cls.__name__, sorted(CACHE_DOOR - public_members(cache)))
    reserved = ReservedKVCache(1, 1, 4, ContiguousReservationManager(16, "max", max_seq_len=8))
    assert CACHE_DOOR <= public_members(reserved)
    assert reserved.save_blocks([]) == [] and reserved.slot_tensors == ()
    with pytest.raises(ValueError, match="keeps no blocks"):
        reserved.copy_block(0, 1)
    assert protocol_members(KVCache) < CACHE_DOOR


# ---- the crossings -----------------------------------------------------------------------------------------
def _is_manager(node: ast.AST) -> bool:
    """``manager``, ``mgr``, ``decode_mgr``, ``x.manager``, ``self.manager`` - a memory manager by its name."""
    if isinstance(node, ast.Name):
        return node.id in ("manager", "mgr") or node.id.endswith(("_manager", "_mgr"))
    return isinstance(node, ast.Attribute) and node.attr == "manager"


def _is_cache(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "cache"
    return isinstance(node, ast.Attribute) and node.attr == "cache"


INTERNALS = {"_tables", "_allocator", "_pool"}  # a manager's parts, whatever the variable is called


def doors_bypassed(source: str, where: str = "<source>", caches: bool = False) -> list[str]:
    """Every place in ``source`` that uses a manager beyond its doors (or, with ``caches``, a cache beyond
    ``ServingCache``): a member no protocol writes down, a private one, a manager's parts."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        obj, attr = node.value, node.attr
        self_like = isinstance(obj, ast.Name) and obj.id in ("self", "cls")
        if attr in INTERNALS and not self_like:
            found.append(f"{where}:{node.lineno}: reaches a manager's .{attr}")
        elif _is_manager(obj) and attr not in MANAGER_DOOR:
            found.append(f"{where}:{node.lineno}: manager.{attr} is on none of its doors")
        elif isinstance(obj, ast.Attribute) and _is_manager(obj.value) and obj.attr in ("view", "blocks"):
            door = VIEW_DOOR if obj.attr == "view" else BLOCK_DOOR
            if attr not in door:
                found.append(f"{where}:{node.lineno}: manager.{obj.attr}.{attr} is not on that door")
        elif caches and _is_cache(obj) and attr not in CACHE_DOOR:
            found.append(f"{where}:{node.lineno}: cache.{attr} is not on the serving door (cache.seam.ServingCache)")
    return found


def _code_of_notebook(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    lines = []
    for c in cells:
        if c["cell_type"] == "code":
            src = "".join(c["source"])
            lines += [ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


def _sources():
    for p in sorted((ROOT / "lesson_utils").rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[1] != "memory":
            yield str(rel), p.read_text(), rel.parts[1] in ("serving", "disagg")
    for p in sorted((ROOT / "tests").rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[1] != "checkers" and p.name != "test_doors.py":
            yield str(rel), p.read_text(), False
    for p in sorted((ROOT / "solutions").glob("*.ipynb")):
        yield str(p.relative_to(ROOT)), _code_of_notebook(p), False


def test_nothing_outside_memory_goes_past_the_doors():
    bad = []
    for where, source, caches in _sources():
        bad += doors_bypassed(source, where, caches)
    assert bad == [], "use the written doors (memory/doors.py, core.types, cache.seam):\n" + "\n".join(bad)


def test_the_door_rule_can_fail():
    assert doors_bypassed("engine.manager._tables[3]") != []
    assert doors_bypassed("m._allocator.allocate()") != []  # the parts, whatever the name
    assert doors_bypassed("manager.ensure_capacity(1, 4)") != []  # not on the scheduler's door
    assert doors_bypassed("decode_mgr.view.tables_now()[0]") == []
    assert doors_bypassed("decode_mgr.view.allocate(seq)") != []  # the view changes nothing
    assert doors_bypassed("manager.blocks.adopt(1, [2], 3)") == []
    assert doors_bypassed("manager.blocks.fork(1, 2)") != []
    assert doors_bypassed("self.cache.k_cache[0]", caches=True) != []
    assert doors_bypassed("self.cache.slot_tensors[0].k[0]", caches=True) == []
    assert doors_bypassed("self._tables[3].blocks; self._allocator.free(b)") == []  # a manager's own code
