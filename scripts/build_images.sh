#!/usr/bin/env bash
# Build opd's images from the repository root: the CPU image (opd:cpu), and the GPU image (opd:gpu)
# with --gpu. With Docker where it is installed, else with Podman (docs/docker.md).
#
#   scripts/build_images.sh                  # opd:cpu, on the Dockerfiles' public base (docker.io/library/python:3.11-slim-bookworm)
#   scripts/build_images.sh --gpu            # opd:cpu and opd:gpu
#   scripts/build_images.sh --only-gpu       # opd:gpu alone
#   scripts/build_images.sh --local-base     # where no image registry can be reached: a Debian 12 base
#                                            # made from Debian's packages (mmdebstrap), as close to the
#                                            # public one as they allow (docs/docker.md says what differs)
#
# pip inside a build reaches the package registry; a machine whose network needs its own CA bundle
# (pip's configured cert, PIP_CERT, or SSL_CERT_FILE) hands it to the build as a secret, mounted for
# the install step only and never written into an image. OPD_ENGINE=docker|podman picks the engine.
set -euo pipefail
cd "$(dirname "$0")/.."
images=(cpu)
local_base=0
for arg in "$@"; do
  case "$arg" in
    --gpu) images=(cpu gpu) ;;
    --only-gpu) images=(gpu) ;;
    --local-base) local_base=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "build_images: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

engine="${OPD_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null 2>&1; then engine=podman
  else
    echo "build_images: neither Docker nor Podman is installed (apt-get install podman runc, or Docker's own packages)" >&2
    exit 1
  fi
fi
engine_args=()
build_args=()
if [ "$engine" = podman ]; then
  # crun, Podman's default runtime, fails on a host with cgroups in hybrid mode, and the default
  # open-files and process limits can exceed what an unprivileged runtime may set: runc and lower
  # limits work on both.
  if command -v runc >/dev/null 2>&1; then engine_args+=(--runtime runc); fi
  build_args+=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096 --network host)
fi

cert="${PIP_CERT:-}"
if [ -z "$cert" ] && command -v python3 >/dev/null 2>&1; then
  cert="$(python3 -m pip config get global.cert 2>/dev/null || true)"
fi
cert="${cert:-${SSL_CERT_FILE:-}}"
if [ -n "$cert" ] && [ -s "$cert" ]; then
  build_args+=(--secret "id=pipcert,src=$cert")
fi

if [ "$local_base" = 1 ]; then
  base="localhost/opd-base:bookworm"
  if [ -z "$("$engine" images -q "$base" 2>/dev/null)" ]; then
    command -v mmdebstrap >/dev/null 2>&1 || { echo "build_images: --local-base needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
    tarball="$(mktemp --suffix .tar)"
    trap 'rm -f "$tarball"' EXIT
    echo "build_images: a Debian 12 base from Debian's packages ($base)"
    # The public base's Python from Debian instead (3.11.2; python:3.11-slim-bookworm builds its
    # 3.11.x from source), with its venv module and `python` naming it as there (sdists' builds call
    # it); ca-certificates, which the public base carries too.
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates bookworm "$tarball"
    "$engine" import --quiet "$tarball" "$base" >/dev/null
  fi
  build_args+=(--build-arg "BASE=$base")
fi

for image in "${images[@]}"; do
  echo "build_images: opd:$image with $engine (docker/Dockerfile.$image)"
  start=$(date +%s)
  "$engine" "${engine_args[@]}" build "${build_args[@]}" -f "docker/Dockerfile.$image" -t "opd:$image" .
  echo "build_images: opd:$image built in $(( $(date +%s) - start )) s"
done
