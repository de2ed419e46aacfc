"""Every kind of engine the course builds, named once (:data:`ENGINE_KINDS`).

An engine kind is a combination of the engine's axes: the cache's storage format and attention backend
(:mod:`~lesson_utils.cache.formats`, :mod:`~lesson_utils.cache.backends`), its memory manager (paged, paged with the
prefix cache, lesson 01-02's contiguous reservations), its token policy (whole prompts, or lesson 08's chunks) and,
for a kind kept short of memory, how it preempts (lesson 06). The GPU checks (``course_tools.gpu_checks``) and every
test that loops over engine kinds read this registry, so a new kind - a new format or backend, say - is one entry
here and is then served by all of them (``tests/serving/test_engine_kinds.py`` proves it). A lab helper: it builds managers, which no engine floor does.

Sizes are the caller's: :meth:`EngineKind.build` takes the blocks of a normal kind and of a short one, the token
budget of a chunked one, and whether the manager must fork (parallel samples, beams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lesson_utils.cache.backends import DecodeKernelBackend, GatherBackend, UnifiedKernelBackend
from lesson_utils.cache.formats import FloatFormat, Int8Format
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.cache.reserved import ReservedKVCache
from lesson_utils.core.device_discipline import acts_as_gpu
from lesson_utils.core.types import MemoryManager
from lesson_utils.memory.block_manager import BlockManager
from lesson_utils.memory.reservation import ContiguousReservationManager
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.memory.swap import SwapSpace
from lesson_utils.serving.engine import Engine
from lesson_utils.serving.token_budget import ChunkedPrefill

BACKENDS: dict[str, Callable[[], object]] = {
    "gather": lambda: GatherBackend(batched_decode=False),
    "batched gather": lambda: GatherBackend(batched_decode=True),
    "decode kernel": DecodeKernelBackend,
    "unified kernel": UnifiedKernelBackend,
}
# a storage format by name, for a model's weights ``w`` (its dtype; an int8 cache's per-layer NaN check would be a
# sync per layer on a GPU: off there, where a NaN is refused when the logits are read)
FORMATS: dict[str, Callable] = {
    "fp": lambda w: FloatFormat(w.dtype),
    "int8": lambda w: Int8Format(w.dtype, check_finite=not acts_as_gpu(w.device)),
}
MEMORY = ("paged", "prefix cache", "contiguous")
PREEMPTION = (None, "recompute", "swap")


@dataclass(frozen=True)
class EngineKind:
    """One engine kind: ``format`` ("fp", "int8"), ``backend`` (a key of :data:`BACKENDS`), ``memory`` ("paged",
    "prefix cache", "contiguous"), ``chunked`` (lesson 08's token budget) and ``preemption`` (None, or "recompute" /
    "swap" for a kind that is kept short of memory so that it preempts)."""

    name: str
    format: str = "fp"
    backend: str = "gather"
    memory: str = "paged"
    chunked: bool = False
    preemption: str | None = None

    def __post_init__(self):
        problems = [
            (what, value, allowed)
            for what, value, allowed in (
                ("format", self.format, tuple(FORMATS)),
                ("backend", self.backend, tuple(BACKENDS)),
                ("memory", self.memory, MEMORY),
                ("preemption", self.preemption, PREEMPTION),
            )
            if value not in allowed
        ]
        if problems:
            what, value, allowed = problems[0]
            raise ValueError(f"engine kind {self.name!r}: {what} {value!r} is not one of {allowed}")
        if self.memory == "contiguous" and (self.format, self.backend, self.chunked) != ("fp", "gather", False):
            raise ValueError(f"engine kind {self.name!r}: contiguous reservations serve floats through the gather only")

    @property
    def exact(self) -> bool:
        """Token-identical to HF under the identity rule (a quantized format is compared under a bound instead)."""
        return self.format == "fp"

    @property
    def kernels(self) -> bool:
        """Its attention runs Triton kernels (slow in the interpreter: tests give it smaller cases)."""
        return self.backend in ("decode kernel", "unified kernel")

    @property
    def paged(self) -> bool:
        return self.memory != "contiguous"

    @property
    def short(self) -> bool:
        """Kept short of memory, so that it preempts."""
        return self.preemption is not None

    def manager(self, w, num_blocks: int, block_size: int, *, forking: bool = False, max_seq_len: int | None = None):
        """Its memory manager: ``num_blocks`` blocks of ``block_size`` (a contiguous one: as many slots), sharing blocks
        when ``forking`` (parallel samples, beams) or when it is the prefix cache's."""
        limit = w.max_positions if max_seq_len is None else max_seq_len
        if self.memory == "contiguous":
            return ContiguousReservationManager(num_blocks * block_size, "max", max_seq_len=limit)
        if self.memory == "prefix cache" or forking:
            return SharingBlockManager(
                num_blocks, block_size, max_seq_len=limit, enable_prefix_caching=self.memory == "prefix cache"
            )
        return BlockManager(num_blocks, block_size, max_seq_len=limit)

    def cache(self, w, manager: MemoryManager):
        """Its cache on ``manager``, on ``w``'s device and in its dtype."""
        if self.memory == "contiguous":
            return ReservedKVCache.for_model(w, manager)
        return PagedKVCache.for_model(
            w, manager=manager, format=FORMATS[self.format](w), backend=BACKENDS[self.backend]()
        )

    def build(
        self,
        w,
        *,
        num_blocks: int = 40,
        block_size: int = 4,
        short_blocks: int = 9,
        budget: int = 6,
        swap_blocks: int = 60,
        forking: bool = False,
        max_seq_len: int | None = None,
        **engine_kw,
    ) -> Engine:
        """A fresh engine of this kind for ``w``: ``num_blocks`` (``short_blocks`` for a short kind) of ``block_size``;
        a chunked kind's token budget ``budget``; a swapping kind's swap space ``swap_blocks``. ``engine_kw`` go to
        :class:`~lesson_utils.serving.engine.Engine` (``stop_at_eos``, ``speculation``, ...)."""
        manager = self.manager(
            w, short_blocks if self.short else num_blocks, block_size, forking=forking, max_seq_len=max_seq_len
        )
        if self.chunked:
            engine_kw.setdefault("chunked_prefill", ChunkedPrefill(budget))
        if self.preemption == "swap":
            engine_kw.setdefault("preemption_mode", "swap")
            engine_kw.setdefault("swap_space", SwapSpace(swap_blocks))
        return Engine(w, self.cache(w, manager), **engine_kw)


ENGINE_KINDS: tuple[EngineKind, ...] = (
    EngineKind("paged"),
    EngineKind("paged (batched decode)", backend="batched gather"),
    EngineKind("Triton decode kernel", backend="decode kernel"),
    EngineKind("prefix cache", memory="prefix cache"),
    EngineKind("naive", memory="contiguous"),
    EngineKind("chunked (gather)", chunked=True),
    EngineKind("chunked (unified kernel)", backend="unified kernel", chunked=True),
    EngineKind("recompute", preemption="recompute"),
    EngineKind("swap", preemption="swap"),
    EngineKind("int8", format="int8"),
    EngineKind("int8 (decode kernel)", format="int8", backend="decode kernel"),
    EngineKind("int8 (unified kernel)", format="int8", backend="unified kernel", chunked=True),
)


def engine_kind(name: str) -> EngineKind:
    """The registered kind called ``name`` (a clear error for another name)."""
    for kind in ENGINE_KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"no engine kind {name!r}; the kinds are {[k.name for k in ENGINE_KINDS]}")


def engine_kinds(**traits) -> list[EngineKind]:
    """The registered kinds whose traits (``exact``, ``kernels``, ``paged``, ``short``, ``chunked``, ``format``, ...)
    have the values given, in registry order."""
    return [k for k in ENGINE_KINDS if all(getattr(k, t) == v for t, v in traits.items())]
