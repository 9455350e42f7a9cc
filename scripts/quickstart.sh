#!/usr/bin/env bash
# The CPU quickstart: set up, then state-grounded OPD on text FrozenLake (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/opd train recipes/quickstart.yaml "$@"
