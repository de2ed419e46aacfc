"""Lesson 00's table of modern models: KV bytes per token, grouped-query attention's factor, and what fits next
to the weights on a T4 - every figure computed from the configs that ship with the package (``model/catalog``)."""

from __future__ import annotations

from dataclasses import dataclass

from lesson_utils.lab import kv_math

TABLE_MODELS = (
    "facebook/opt-125m",
    "HuggingFaceTB/SmolLM2-135M",
    "Qwen/Qwen3-0.6B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Meta-Llama-3-8B",
)


@dataclass(frozen=True)
class ModelRow:
    """One model's KV geometry and its T4 budget (fp16 weights and KV, vLLM's 90 % utilization)."""

    name: str
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    parameters: int
    bytes_per_token: int
    budget: kv_math.KVBudget | None  # None: the weights alone do not fit the T4

    @property
    def gqa_factor(self) -> int:
        """How many times more KV the same model would keep with multi-head attention (a KV head per query head)."""
        return self.query_heads // self.kv_heads

    @property
    def mha_bytes_per_token(self) -> int:
        return self.bytes_per_token * self.gqa_factor


def kv_table(names=TABLE_MODELS, dtype_bytes: int = 2) -> list[ModelRow]:
    from lesson_utils.model.catalog import shipped_config

    rows = []
    for name in names:
        cfg = shipped_config(name)
        try:
            budget = kv_math.kv_budget(cfg, dtype_bytes)
        except ValueError:  # the weights leave no room
            budget = None
        rows.append(
            ModelRow(
                name=name,
                layers=cfg.num_hidden_layers,
                query_heads=cfg.num_attention_heads,
                kv_heads=kv_math.kv_heads_of(cfg),
                head_dim=kv_math.head_dim_of(cfg),
                parameters=kv_math.count_parameters(cfg),
                bytes_per_token=kv_math.kv_bytes_per_token(cfg, dtype_bytes),
                budget=budget,
            )
        )
    return rows


def format_table(rows: list[ModelRow]) -> str:
    head = (f"{'model':28s} {'layers':>6s} {'q:kv heads':>10s} {'d':>4s} {'GQA':>4s} {'KV/token':>9s} "
            f"{'as MHA':>9s} {'weights':>9s} {'KV tokens on a T4':>18s} {'2,048-token requests':>21s}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        fits = r.budget is not None
        tokens = f"{r.budget.tokens:,}" if fits else "weights do not fit"
        reqs = f"{r.budget.requests_at(2048):,}" if fits else "-"
        lines.append(
            f"{r.name.split('/')[-1]:28s} {r.layers:6d} {f'{r.query_heads}:{r.kv_heads}':>10s} {r.head_dim:4d} "
            f"{f'{r.gqa_factor}x':>4s} {r.bytes_per_token / 1024:7.1f} KiB {r.mha_bytes_per_token / 1024:6.1f} KiB "
            f"{r.parameters * 2 / kv_math.GiB:6.2f} GiB {tokens:>18s} {reqs:>21s}"
        )
    return "\n".join(lines)
