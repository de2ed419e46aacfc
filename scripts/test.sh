#!/usr/bin/env bash
# Install what the tests need into .venv and run them all: unit tests, the drift check between
# solutions/ and notebooks/, every solution notebook executed strictly and every student notebook
# executed top to bottom - in the CI profile (smallest sizes), on CPU.
. "$(dirname "$0")/_venv.sh"
export COURSE_PROFILE=${COURSE_PROFILE:-ci}
python -m pytest -n 2 "$@"
