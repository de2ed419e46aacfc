"""What a step would cost on a T4, predicted from bytes and FLOPs at the datasheet's peaks - never a measurement.

The lessons that say "on a GPU a decode step is memory-bound" cite these numbers instead of the slogan: the time to
read every fp16 weight once, the time to read the step's K/V, the time for the weights' multiply-adds, and, for the
framework's share, the launch cost per operator at which launching a step's operators would take as long as reading
its weights. A step takes at least the largest of the first three; launches, Python and attention's arithmetic come
on top (lesson 07 measures them on the device it runs on).
"""

from __future__ import annotations

from dataclasses import dataclass

T4_BYTES_PER_S = 320e9  # a T4's memory bandwidth (datasheet; ../shared/reference/colab-and-triton.md)
T4_FP16_FLOPS = 65e12  # its fp16 tensor-core peak (datasheet)
# What launching one operator may cost a T4's host (an assumed range, not a datasheet figure: a few microseconds per
# kernel launch from eager PyTorch; CUDA graphs and fused kernels - what production engines use - remove most of it).
LAUNCH_COSTS_S = (2e-6, 5e-6, 10e-6)


def t4_step_roofline_s(num_params: int, tokens_fed: int) -> tuple[float, float]:
    """(seconds to read every fp16 weight once, seconds for the weights' multiply-adds: 2 FLOPs per parameter per
    token) for a step feeding ``tokens_fed`` tokens, at a T4's peaks. The step takes at least the larger."""
    return 2 * num_params / T4_BYTES_PER_S, 2 * num_params * tokens_fed / T4_FP16_FLOPS


def compute_bound_from_tokens(dtype_bytes: int = 2) -> float:
    """Tokens per step above which a T4 spends longer on the weights' multiply-adds than on reading them: per token
    a step does 2 FLOPs per parameter and reads each parameter once, so the crossing is at FLOPS / bandwidth x
    bytes per parameter / 2, whatever the model's size (about 200 tokens in fp16)."""
    return T4_FP16_FLOPS / T4_BYTES_PER_S * dtype_bytes / 2


@dataclass(frozen=True)
class T4DecodePrediction:
    """A decode step of ``sequences`` sequences, each attending over ``context`` tokens and feeding ``fed`` tokens
    (1 for a decode, ``k + 1`` for a verify step of ``k`` drafts), on a T4 (seconds)."""

    sequences: int
    context: int
    weights_s: float  # reading every fp16 weight once
    kv_s: float  # reading every sequence's K/V once
    flops_s: float  # the weights' multiply-adds for every token fed
    operators: float  # operator launches per step (as measured on this device's engine)
    break_even_launch_s: float  # per launch, the launches take as long as reading the weights
    fed: int = 1  # tokens fed per sequence

    @property
    def bound_s(self) -> float:
        """The least the step can take: reading weights and K/V, or the multiply-adds, whichever is longer."""
        return max(self.weights_s + self.kv_s, self.flops_s)

    def step_s(self, launch_s: float) -> float:
        """The step with its launches: the GPU works while the host launches, so the step takes the longer of its device
        work (the bound above) and ``operators`` launches of ``launch_s`` each, one after another from one host thread."""
        return max(self.bound_s, self.operators * launch_s) if self.operators else self.bound_s

    def tokens_per_s(self, launch_s: float = 0.0) -> float:
        """Output tokens per second of a step of ``sequences`` decodes, with ``launch_s`` per operator launch."""
        return self.sequences / self.step_s(launch_s)

    def text(self) -> str:
        step = "a decode step of" if self.fed == 1 else f"a verify step feeding {self.fed} tokens each for"
        return (
            f"PREDICTED for a T4 (datasheet peaks, not measured): {step} {self.sequences} sequence(s) at "
            f"{self.context}-token contexts reads the fp16 weights in {self.weights_s * 1e3:.2f} ms and the K/V in "
            f"{self.kv_s * 1e3:.3f} ms; the weights' multiply-adds take {self.flops_s * 1e3:.3f} ms. Its "
            f"{self.operators:.0f} operator launches take longer than reading the weights if each costs more than "
            f"{self.break_even_launch_s * 1e6:.1f} µs"
        )


def t4_decode(
    num_params: int, kv_bytes_per_token: int, sequences: int, context: int, operators: float, fed: int = 1
) -> T4DecodePrediction:
    """The :class:`T4DecodePrediction` of one decode step (``kv_bytes_per_token`` of the cache's dtype); ``fed`` > 1:
    a verify step, each sequence feeding its newest token and ``fed - 1`` drafts (more multiply-adds, the same weights
    and K/V read; the drafts' own K/V and attention arithmetic are left out, small beside the weights)."""
    if sequences < 1 or fed < 1:
        raise ValueError(f"a step feeds at least one token of one sequence, got {sequences} sequences x {fed}")
    weights_s, flops_s = t4_step_roofline_s(num_params, sequences * fed)
    kv_s = sequences * context * kv_bytes_per_token / T4_BYTES_PER_S
    return T4DecodePrediction(
        sequences, context, weights_s, kv_s, flops_s, operators, weights_s / max(operators, 1), fed
    )


def speculation_speedup(
    plain: T4DecodePrediction, verify: T4DecodePrediction, tokens_per_verify: float, launch_s: float = 0.0
) -> float:
    """Predicted tokens/s of verify steps over plain decode steps of the same sequences on a T4: each verification
    yields ``tokens_per_verify`` tokens (kept drafts and the target's own) in ``verify.step_s``, each plain step one in
    ``plain.step_s``. Below 1, speculation slows serving down. The proposer's own time is left out."""
    if plain.fed != 1:
        raise ValueError("plain must be a decode step (fed = 1)")
    if verify.sequences != plain.sequences or verify.context != plain.context:
        raise ValueError("compare a verify step with a plain step of the same sequences and contexts")
    if tokens_per_verify < 1:
        raise ValueError(f"a verification yields at least the target's own token, got {tokens_per_verify}")
    return tokens_per_verify * plain.step_s(launch_s) / verify.step_s(launch_s)


# ---- the launch term, counted on the course's engine and read from the numbers --------------------------------------
LAUNCH_NOTE = (
    "CUDA graphs (one launch replays a whole captured step) and fused kernels (one kernel where eager PyTorch "
    "launches several), which production engines use, remove most of this launch term"
)


def count_decode_operators(w, sequences: int, prompt_tokens: int = 0, prompt_len: int = 8, cache=None) -> int:
    """The operators one real step of the course's engine launches for weights ``w``: ``sequences`` sequences each
    decoding one token (their prompts of ``prompt_len`` tokens prefilled in a first, uncounted step), beside a new
    prompt of ``prompt_tokens`` tokens when it is > 0 (a chunked-prefill step's work). The cache (by default a paged
    one) is built as a GPU builds it: every decode through one batched gather, not one sequence at a time; ``cache``:
    another one with room for the step (built the same way), e.g. lesson 07's naive engine's. Costs two steps, one of
    them profiled."""
    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.lab.step_profile import count_step_operators
    from lesson_utils.memory.block_table import blocks_needed
    from lesson_utils.serving.engine import Engine

    if sequences < 1:
        raise ValueError(f"count a step of at least one decoding sequence, got {sequences}")
    block = 16
    blocks = sequences * blocks_needed(prompt_len + 4, block) + blocks_needed(prompt_tokens + 4, block) + 2
    if cache is None:
        cache = PagedKVCache.for_model(w, blocks, block, batched_decode=True)
    engine = Engine(w, cache, stop_at_eos=False)
    token = w.bos_token_id if w.bos_token_id is not None else 1
    for _ in range(sequences):
        engine.add_request([token] * prompt_len, 4)
    engine.step()  # the prompts; the counted step decodes every sequence
    if prompt_tokens:
        engine.add_request([token] * prompt_tokens, 2)  # prefilled whole in the counted step, beside the decodes
    return count_step_operators(engine)


def launch_step_s(bound_s: float, operators: float, launch_s: float) -> float:
    """A step's predicted time with its launches: the longer of its device work ``bound_s`` and ``operators`` launches
    of ``launch_s`` each from one host thread (:meth:`T4DecodePrediction.step_s`'s rule, for any step)."""
    return max(bound_s, operators * launch_s)


def launch_reading(bound_s: float, operators: float) -> str:
    """Which term sets a step's predicted time over the assumed launch costs :data:`LAUNCH_COSTS_S`, computed from the
    numbers: launch-bound at every cost, at none, or from a cost inside the range."""
    lo, hi = LAUNCH_COSTS_S[0], LAUNCH_COSTS_S[-1]
    if not operators:
        return "no operators counted: the launch term is left out"
    edge = bound_s / operators  # per launch, the launches take as long as the device work
    if edge < lo:
        return (
            f"launch-bound at every assumed cost (from {edge * 1e6:.2f} µs per launch): in eager PyTorch the host's "
            "launches, not the bytes, would set this step's time"
        )
    if edge >= hi:
        return (
            f"bound by its bytes and FLOPs at every assumed cost (the launches hide behind the device's work up to "
            f"{edge * 1e6:.1f} µs each)"
        )
    return (
        f"launch-bound above {edge * 1e6:.1f} µs per launch, inside the assumed {lo * 1e6:.0f}-{hi * 1e6:.0f} µs: which "
        "side a T4 falls on, only a GPU run can say"
    )


def launches_text(prediction: T4DecodePrediction) -> str:
    """Tokens per second of ``prediction`` without launches and at each assumed launch cost, with its operator count."""
    costs = ", ".join(f"{prediction.tokens_per_s(c):,.0f} at {c * 1e6:.0f} µs" for c in LAUNCH_COSTS_S)
    return (
        f"{prediction.tokens_per_s():,.0f} tokens/s without launches; with its {prediction.operators:.0f} operator "
        f"launches {costs} per launch (an assumed range)"
    )
