#!/usr/bin/env bash
# The whole test suite: unit, integration (real Ray + DeepSpeed), end to end (the quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite tests the vLLM engine on vLLM's CPU build: install it too.
export OPD_VLLM=1
scripts/setup.sh
set +e
.venv/bin/python -m pytest -v -rs --durations=15 "$@"
status=$?
set -e
# pytest's 5 means no test ran: that is a failure, not a pass.
if [ "$status" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$status"
