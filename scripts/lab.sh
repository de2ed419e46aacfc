#!/usr/bin/env bash
# Install the course into .venv and open it in JupyterLab (student notebooks; solutions beside them).
. "$(dirname "$0")/_venv.sh"
exec python -m jupyterlab --notebook-dir=. notebooks/00_kv_cache_primer.ipynb "$@"
