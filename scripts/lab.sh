#!/usr/bin/env bash
# Install the course into .venv and open it in JupyterLab: your working copy my_notebooks/ (made from notebooks/
# once, never overwritten; solutions/ beside it). Options go to JupyterLab: bash scripts/lab.sh --no-browser --port 8890
. "$(dirname "$0")/_venv.sh"
python -m lesson_utils.model.trained  # the trained model's folder, converted once (about 20 s), then reused
extra=()
if [ "$(id -u)" = "0" ]; then extra+=(--allow-root); fi  # containers and cloud VMs often run as root
# your working copy: my_notebooks/ (git-ignored), made from notebooks/ once; a file there is never overwritten
python -m course_tools.workspace
echo "JupyterLab: stop it with Ctrl+C (twice) in this terminal; options after lab.sh go to JupyterLab (--no-browser --port 8890)"
exec python -m jupyterlab --notebook-dir=. "${extra[@]}" "$@" my_notebooks/00_kv_cache_primer.ipynb
