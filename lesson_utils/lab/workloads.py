"""Seeded synthetic request streams.

No data set can be downloaded where the course runs headless, so request lengths are drawn from
log-normal distributions (right-skewed, like real chat traffic) whose location is *calibrated* so that,
after vLLM-benchmark-style filtering, the mean lengths match the paper's Fig. 11:

* ShareGPT: input 161.31, output 337.99 tokens
* Alpaca:   input  19.31, output  58.45 tokens

Filtering (as vLLM's benchmark): drop prompts or outputs under 4 tokens, prompts over 1024, and
prompt + output over 2048. Arrivals are a Poisson process (exponential gaps), as in the paper's §6.1.
The spreads (``sigma``) are our assumption: the paper publishes means, not shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from lesson_utils.core.types import Request

MIN_LEN = 4


MAX_PROMPT = 1024


MAX_TOTAL = 2048


@dataclass(frozen=True)
class LengthProfile:
    """Target means (from the paper) and assumed log-normal spreads of a data set's lengths."""

    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float
    output_sigma: float


SHAREGPT = LengthProfile("ShareGPT", prompt_mean=161.31, output_mean=337.99, prompt_sigma=1.0, output_sigma=0.9)


ALPACA = LengthProfile("Alpaca", prompt_mean=19.31, output_mean=58.45, prompt_sigma=0.6, output_sigma=0.8)


def _keep(prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    return (prompt >= MIN_LEN) & (output >= MIN_LEN) & (prompt <= MAX_PROMPT) & (prompt + output <= MAX_TOTAL)


@lru_cache(maxsize=None)
def _calibrated_mus(profile: LengthProfile) -> tuple[float, float]:
    """Log-normal locations whose filtered means hit the profile's targets (bisection, fixed draws)."""
    z = np.random.default_rng(12345).standard_normal((2, 100_000))

    def means(mu_p: float, mu_o: float) -> tuple[float, float]:
        p = np.round(np.exp(mu_p + profile.prompt_sigma * z[0]))
        o = np.round(np.exp(mu_o + profile.output_sigma * z[1]))
        keep = _keep(p, o)
        return p[keep].mean(), o[keep].mean()

    mu_p, mu_o = np.log(profile.prompt_mean), np.log(profile.output_mean)
    for _ in range(3):  # the two marginals interact only through the total-length filter
        lo, hi = mu_p - 3, mu_p + 3
        for _ in range(25):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if means(mid, mu_o)[0] < profile.prompt_mean else (lo, mid)
        mu_p = (lo + hi) / 2
        lo, hi = mu_o - 3, mu_o + 3
        for _ in range(25):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if means(mu_p, mid)[1] < profile.output_mean else (lo, mid)
        mu_o = (lo + hi) / 2
    return float(mu_p), float(mu_o)


def sample_lengths(profile: LengthProfile, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) length pairs that pass the filter, as int arrays."""
    if n < 1:
        raise ValueError(f"need at least one request, got n={n}")
    mu_p, mu_o = _calibrated_mus(profile)
    rng = np.random.default_rng(seed)
    prompts, outputs = [], []
    have = 0
    while have < n:
        p = np.round(np.exp(rng.normal(mu_p, profile.prompt_sigma, 2 * n))).astype(int)
        o = np.round(np.exp(rng.normal(mu_o, profile.output_sigma, 2 * n))).astype(int)
        keep = _keep(p, o)
        prompts.append(p[keep])
        outputs.append(o[keep])
        have += int(keep.sum())
    return np.concatenate(prompts)[:n], np.concatenate(outputs)[:n]


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> np.ndarray:
    """Arrival times (seconds, starting near 0) of a Poisson process; ``inf`` rate means all at 0."""
    if rate_per_s <= 0:
        raise ValueError(f"the arrival rate must be positive, got {rate_per_s}")
    if np.isinf(rate_per_s):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, n)
    return np.cumsum(gaps) - gaps[0]


def synthetic_stream(
    profile: LengthProfile, n: int, rate_per_s: float, seed: int = 0, scale: float = 1.0
) -> list[Request]:
    """A seeded stream of ``n`` requests with ``profile``'s lengths and Poisson arrivals.

    ``scale`` shrinks every length (for small CPU runs) while keeping the distribution's shape;
    lengths never go below 1.
    """
    prompt, output = sample_lengths(profile, n, seed)
    if scale != 1.0:
        prompt = np.maximum(1, np.round(prompt * scale)).astype(int)
        output = np.maximum(1, np.round(output * scale)).astype(int)
    arrivals = poisson_arrivals(n, rate_per_s, seed + 1)
    return [
        Request(req_id=i, arrival_s=float(t), prompt_len=int(p), output_len=int(o))
        for i, (t, p, o) in enumerate(zip(arrivals, prompt, output))
    ]


def sharegpt_like(n: int, rate_per_s: float = float("inf"), seed: int = 0, scale: float = 1.0) -> list[Request]:
    """ShareGPT-like lengths (long prompts, long answers)."""
    return synthetic_stream(SHAREGPT, n, rate_per_s, seed, scale)


def alpaca_like(n: int, rate_per_s: float = float("inf"), seed: int = 0, scale: float = 1.0) -> list[Request]:
    """Alpaca-like lengths (short instructions, short answers)."""
    return synthetic_stream(ALPACA, n, rate_per_s, seed, scale)


def shared_system_prompt_stream(
    n: int,
    system_prompt_len: int,
    rate_per_s: float = float("inf"),
    seed: int = 0,
    profile: LengthProfile = ALPACA,
    vocab_size: int = 50272,
    share_fraction: float = 1.0,
) -> list[Request]:
    """Requests of which ``share_fraction`` start with the same ``system_prompt_len``-token system prompt.

    Every request gets token ids: the system prompt's ids are identical across the requests that share
    it; the user part is random. Ids avoid OPT's special tokens (0-3).
    """
    if system_prompt_len < 1:
        raise ValueError(f"system_prompt_len must be at least 1, got {system_prompt_len}")
    if not 0.0 <= share_fraction <= 1.0:
        raise ValueError(f"share_fraction must lie in [0, 1], got {share_fraction}")
    rng = np.random.default_rng(seed + 2)
    system = rng.integers(4, vocab_size, system_prompt_len).tolist()
    requests = synthetic_stream(profile, n, rate_per_s, seed)
    out = []
    for r in requests:
        user = rng.integers(4, vocab_size, r.prompt_len).tolist()
        shares = bool(rng.random() < share_fraction)
        ids = (system + user) if shares else user
        out.append(
            replace(
                r,
                prompt_len=len(ids),
                prompt_ids=ids,
                shared_prefix_len=system_prompt_len if shares else 0,
            )
        )
    return out


def with_token_ids(requests: list[Request], vocab_size: int, seed: int = 0) -> list[Request]:
    """Copies of ``requests`` with random prompt ids (4 .. vocab_size-1) of the right lengths."""
    rng = np.random.default_rng(seed + 3)
    return [
        replace(r, prompt_ids=rng.integers(4, vocab_size, r.prompt_len).tolist()) if r.prompt_ids is None else r
        for r in requests
    ]


def describe(requests: list[Request]) -> dict[str, float]:
    """Means and spread of a stream, to print beside the paper's numbers."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return {
        "requests": len(requests),
        "prompt_mean": float(p.mean()),
        "output_mean": float(o.mean()),
        "prompt_p90": float(np.percentile(p, 90)),
        "output_p90": float(np.percentile(o, 90)),
        "arrival_span_s": float(span),
    }


def multi_prefix_stream(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    rate_per_s: float = float("inf"),
    seed: int = 0,
    zipf_s: float = 1.1,
    profile: LengthProfile = ALPACA,
    vocab_size: int = 50272,
) -> list[Request]:
    """Requests that each start with one of ``num_prefixes`` shared prefixes (system prompts, documents),
    chosen with Zipf popularity (prefix ``k`` with weight ``1 / (k + 1) ** zipf_s``); user parts are random."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("need at least one prefix of at least one token")
    rng = np.random.default_rng(seed + 4)
    prefixes = [rng.integers(4, vocab_size, prefix_len).tolist() for _ in range(num_prefixes)]
    weights = 1.0 / (np.arange(num_prefixes) + 1) ** zipf_s
    choice = rng.choice(num_prefixes, size=n, p=weights / weights.sum())
    out = []
    for r, k in zip(synthetic_stream(profile, n, rate_per_s, seed), choice):
        ids = prefixes[k] + rng.integers(4, vocab_size, r.prompt_len).tolist()
        out.append(
            replace(r, prompt_len=len(ids), prompt_ids=ids, shared_prefix_len=prefix_len, tags={"prefix": int(k)})
        )
    return out


def system_prompt_stream(
    n: int,
    rate_per_s: float,
    *,
    max_model_len: int,
    system_prompt_len: int,
    vocab_size: int,
    bos_token_id: int,
    scale: float = 1.0,
    share_fraction: float = 0.5,
    profile: LengthProfile = SHAREGPT,
    seed: int = 0,
) -> list[Request]:
    """Lesson 07's workload: ``profile``-like lengths (times ``scale``), Poisson arrivals, and a share of the
    requests behind one system prompt. Each prompt is ``[bos] + system prompt (if shared) + user part``, at most
    ``max_model_len // 2`` tokens (the user part is cut), and each output at most what the model's length limit
    leaves. ``shared_prefix_len`` counts the bos and the system prompt. Ids avoid OPT's special tokens (0-3)."""
    if system_prompt_len < 0 or 1 + system_prompt_len >= max_model_len // 2:
        raise ValueError(
            f"a system prompt of {system_prompt_len} tokens leaves no room for a user prompt under a "
            f"{max_model_len // 2}-token prompt limit"
        )
    rng = np.random.default_rng(seed + 5)
    system = rng.integers(4, vocab_size, system_prompt_len).tolist()
    out = []
    for r in synthetic_stream(profile, n, rate_per_s, seed, scale):
        shares = bool(rng.random() < share_fraction)
        head = [bos_token_id] + (system if shares else [])
        user = rng.integers(4, vocab_size, r.prompt_len).tolist()
        ids = (head + user)[: max(len(head) + 1, max_model_len // 2)]
        output = max(1, min(r.output_len, max_model_len - len(ids)))
        out.append(
            replace(
                r, prompt_len=len(ids), output_len=output, prompt_ids=ids, shared_prefix_len=len(head) if shares else 0
            )
        )
    return out
