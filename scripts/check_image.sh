#!/usr/bin/env bash
# The CPU image, built and run (CI runs this after the test suite): scripts/build_images.sh builds
# opd:cpu, whose set-up (scripts/setup.sh in a container that reaches the package registry and
# nothing else) is the proof that the install needs nothing of this machine's; then, inside it, as
# its non-root user, the quickstart for a few steps (its bootstrap cache and run directory on
# mounted volumes) and the unit tests.
#
#   scripts/check_image.sh [STEPS]       # 3 steps by default
#
# Between runs on one machine the engine keeps the base image, the layer of locked packages (rebuilt
# only when a lock changes) and pip's build cache; the bootstrap cache is this machine's
# (~/.cache/opd/bootstrap), where the test suite's quickstart has built the same models. A clean
# machine builds everything. Where no Docker daemon answers and Podman is missing, and we are root,
# Podman is installed from Debian's packages (and mmdebstrap, where the base must be made here).
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-3}"
# Debian's packages for what is missing, where we are root (a docker CLI with no daemon behind it,
# as some machines have, counts as missing: Podman builds the image then).
apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "check_image: needs $* (apt-get install $*, as root)" >&2
    exit 1
  fi
  echo "check_image: $* (apt) to build the image"
  log="$(mktemp)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; } >"$log" 2>&1 \
    || { tail -n 5 "$log" >&2; exit 1; }
  rm -f "$log"
}
engine="${OPD_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then engine=docker; else engine=podman; fi
fi
if [ "$engine" = podman ] && ! command -v podman >/dev/null 2>&1; then apt_install podman runc mmdebstrap; fi
export OPD_ENGINE="$engine"
# The public base where it can be pulled, else one made from Debian's packages.
base_args=()
if ! "$engine" pull -q docker.io/library/python:3.11-slim-bookworm >/dev/null 2>&1; then
  base_args=(--local-base)
  if ! command -v mmdebstrap >/dev/null 2>&1; then apt_install mmdebstrap; fi
fi
start=$(date +%s)
scripts/build_images.sh "${base_args[@]}" 2>&1 | grep -E "^(build_images|setup):|^(STEP|Error)" || { echo "check_image: the build failed" >&2; exit 1; }
echo "check_image: built in $(( $(date +%s) - start )) s; $("$engine" images --format '{{.Size}}' opd:cpu | head -n 1)"

run_args=()
if [ "$engine" = podman ]; then
  if command -v runc >/dev/null 2>&1; then run_args=(--runtime runc); fi
fi
container=(run --rm)
if [ "$engine" = podman ]; then container+=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096); fi
work="$(mktemp -d /tmp/opd-image-check.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/runs" "$work/bootstrap"
# A copy of this machine's bootstrap cache (the test suite's quickstart built the same models, under
# the same keys: the torch release and the CPU's kernels name them, not the build of torch), owned
# by the image's user (uid 10001); the machine's own cache is left as it is.
if [ -d "$HOME/.cache/opd/bootstrap" ]; then cp -r "$HOME/.cache/opd/bootstrap/." "$work/bootstrap/"; fi
chown -R 10001:10001 "$work/runs" "$work/bootstrap" 2>/dev/null || chmod -R a+rwX "$work/runs" "$work/bootstrap"
echo "check_image: the quickstart, $steps steps, inside opd:cpu"
"$engine" "${run_args[@]}" "${container[@]}" -v "$work/bootstrap:/home/opd/.cache/opd/bootstrap" \
  -v "$work/runs:/home/opd/opd/runs" opd:cpu \
  bash -c "id && opd train recipes/quickstart.yaml run.total_steps=$steps run.save_every_steps=$steps run.eval_episodes=20" \
  > "$work/quickstart.log" 2>&1 || { tail -n 40 "$work/quickstart.log" >&2; exit 1; }
grep -E "^uid=|building the|opd summary|student after" "$work/quickstart.log" || true
python3 -c "
import json, sys
summary = json.load(open(sys.argv[1]))
assert summary['steps'] == int(sys.argv[2]), summary
print('check_image: summary.json:', {k: summary[k] for k in ('teacher_success', 'student_success_before', 'student_success_after', 'steps')})
" "$work/runs/quickstart/summary.json" "$steps"
echo "check_image: the unit tests inside opd:cpu"
set +e
"$engine" "${run_args[@]}" "${container[@]}" opd:cpu python -m pytest -q -p no:cacheprovider tests/unit > "$work/unit.log" 2>&1
status=$?
set -e
tail -n 1 "$work/unit.log"
[ "$status" = 0 ] || { grep -E "^(FAILED|ERROR) " "$work/unit.log" >&2; echo "check_image: the unit tests failed inside the image" >&2; exit 1; }
echo "check_image: done in $(( $(date +%s) - start )) s"
