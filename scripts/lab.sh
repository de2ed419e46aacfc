#!/usr/bin/env bash
# Install the course into .venv and open it in JupyterLab (student notebooks; solutions beside them).
. "$(dirname "$0")/_venv.sh"
extra=()
if [ "$(id -u)" = "0" ]; then extra+=(--allow-root); fi  # containers and cloud VMs often run as root
exec python -m jupyterlab --notebook-dir=. "${extra[@]}" "$@" notebooks/00_kv_cache_primer.ipynb
