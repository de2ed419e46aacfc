#!/usr/bin/env bash
# Install what the tests need into .venv and run them all: unit tests, the drift check between
# solutions/ and notebooks/, every solution notebook executed strictly and every student notebook
# executed top to bottom - in the CI profile (smallest sizes), on CPU.
. "$(dirname "$0")/_venv.sh"
export COURSE_PROFILE=${COURSE_PROFILE:-ci}
# The trained model's folder is converted (once, about 20 s) while the first tests run, which need no model; a test
# that needs it waits for it on the conversion's file lock, or converts it itself.
python -m lesson_utils.model.trained > /dev/null 2>&1 &
python -m pytest -n 2 "$@"
