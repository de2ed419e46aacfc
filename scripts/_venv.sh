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
# torch first, pinned: a bare 'torch' requirement would pull the newest CUDA build (several GB).
# On a machine with a GPU, install the torch build you want before running this; it is kept.
python -c "import torch" 2>/dev/null || python -m pip install "torch==2.13.0"
python -m pip install -r requirements.txt -e ".[test]"
