"""Every model family the course serves, named once (:data:`FAMILIES`): what the rest of ``model/`` asks of a
family - which forward takes its weights and with which variant, what its config must not ask for, its display name
and its tiny configuration for the ci profile and the tests.

Adding a family is one entry here. ``config_check`` accepts its ``model_type``, ``weights_from_hf`` hands its models to
its forward, ``load_model`` and ``catalog.tiny_config`` build its tiny model - and every attention variant the forwards
do not implement is refused for it by name, whichever spelling its config uses (``tests/model/test_families.py`` adds
a family in a test and finds it everywhere, and a sliding window refused in Mistral's spelling).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """One family: ``model_type`` (the Hugging Face config's), ``display`` (how notices name it), ``forward`` ("opt": the
    compact OPT forward; "llama": the Llama forward), ``qk_norm`` (Qwen3's RMSNorm over each head of q and k, before
    RoPE), ``gated_sliding_window`` (the config's ``sliding_window`` applies only when ``use_sliding_window`` is set, as
    in Qwen2 and Qwen3; elsewhere a window that is set is a window), ``tiny`` (the config fields of its toy model beside
    :func:`~lesson_utils.model.catalog.tiny_config`'s defaults)."""

    model_type: str
    display: str
    forward: str = "llama"
    qk_norm: bool = False
    gated_sliding_window: bool = False
    tiny: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("opt", "OPT", forward="opt"),
        Family("llama", "Llama"),
        Family("qwen2", "Qwen2", gated_sliding_window=True, tiny={"head_dim": None}),  # Qwen2: hidden / heads
        Family("qwen3", "Qwen3", qk_norm=True, gated_sliding_window=True),
    )
}


def family(model_type: str | None) -> Family:
    """The registered family of ``model_type``, or a ValueError naming it and the ones the course serves."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def attention_variants_refused(cfg, fam: Family) -> str | None:
    """Why ``cfg`` asks for attention the course's forwards do not implement - a sliding window in any family's
    spelling, or layers of different attention types - or None. Checked for every family alike."""
    limit = getattr(cfg, "max_position_embeddings", None)
    if getattr(cfg, "use_sliding_window", False):
        return "use_sliding_window=True is not supported: every layer here attends to the whole context"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and not fam.gated_sliding_window and (limit is None or window < limit):
        return (
            f"sliding_window={window} is not supported: every layer here attends to the whole context (a window shorter "
            f"than the model's {limit} positions changes what a token sees)"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        return f"layer_types {other} are not supported: every layer here is full attention"
    if getattr(cfg, "attention_chunk_size", None):
        return f"attention_chunk_size={cfg.attention_chunk_size} is not supported: every layer here is full attention"
    return None
