#!/usr/bin/env bash
# A two-container Ray cluster of opd's CPU image on this machine (docs/docker.md, "A cluster of
# images"): a head and a worker container on the host's network (loopback), token authentication
# on, one CPU on the head and two on the worker for three roles of one CPU each, so that the roles
# must land on both; `ray job submit` runs a short recipe
# on it with the run directory and the bootstrapped models on a volume both containers mount.
# It prints each role's node and container, the job's exit status and the run directory, then
# stops both containers.
#
#   scripts/build_images.sh && scripts/container_cluster.sh [IMAGE] [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
image="${1:-opd:cpu}"
shift || true
engine="${OPD_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then engine=docker; else engine=podman; fi
fi
engine_args=()
run_args=(--network host --shm-size 1g)
if [ "$engine" = podman ]; then  # see scripts/build_images.sh
  if command -v runc >/dev/null 2>&1; then engine_args+=(--runtime runc); fi
  run_args+=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
fi
# Two ports that were free a moment ago, held together so that they differ: Ray's and its job server's.
read -r port dashboard < <(python3 -c '
import socket
held = [socket.socket() for _ in range(2)]
for s in held:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in held))')
shared="$(mktemp -d /tmp/opd-cluster.XXXXXX)"
chmod 777 "$shared"  # the image's user (uid 10001) writes the run directory and the models there
token="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"  # this cluster's, in no image
auth=(-e RAY_AUTH_MODE=token -e "RAY_AUTH_TOKEN=$token")
head="opd-head-$port"
worker="opd-worker-$port"
cleanup() { "$engine" "${engine_args[@]}" rm -f "$head" "$worker" >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "cluster: the head ($head), Ray on 127.0.0.1:$port, its job server on 127.0.0.1:$dashboard"
"$engine" "${engine_args[@]}" run -d --name "$head" "${run_args[@]}" "${auth[@]}" -v "$shared:/shared" "$image" \
  ray start --head --node-ip-address 127.0.0.1 --port "$port" --num-cpus 1 --resources '{"container_head": 1}' \
  --include-dashboard true \
  --dashboard-host 127.0.0.1 --dashboard-port "$dashboard" --disable-usage-stats --block >/dev/null
for _ in $(seq 120); do
  "$engine" "${engine_args[@]}" exec "${auth[@]}" "$head" ray status --address "127.0.0.1:$port" >/dev/null 2>&1 && break
  sleep 1
done
echo "cluster: the worker ($worker)"
"$engine" "${engine_args[@]}" run -d --name "$worker" "${run_args[@]}" "${auth[@]}" -v "$shared:/shared" "$image" \
  ray start --address "127.0.0.1:$port" --node-ip-address 127.0.0.1 --num-cpus 2 --resources '{"container_worker": 1}' \
  --disable-usage-stats --block >/dev/null
for _ in $(seq 120); do
  nodes=$("$engine" "${engine_args[@]}" exec "${auth[@]}" "$head" python -c \
    "import ray; ray.init(address='127.0.0.1:$port', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null \
    | tail -n 1 || true)
  [ "$nodes" = 2 ] && break
  sleep 1
done
[ "$nodes" = 2 ] || { echo "cluster: the worker did not join" >&2; "$engine" "${engine_args[@]}" logs "$worker" | tail -20 >&2; exit 1; }
# Which container each node is: each was started with a resource of its container's name.
"$engine" "${engine_args[@]}" exec "${auth[@]}" "$head" python -c "
import ray
ray.init(address='127.0.0.1:$port', logging_level='ERROR')
for n in ray.nodes():
    print('cluster: node', n['NodeID'][:16], 'is the', 'head' if 'container_head' in n['Resources'] else 'worker', 'container')
" 2>/dev/null | grep "^cluster:"

echo "cluster: ray job submit -- opd train tests/data/tiny.yaml (the run directory and the models in /shared)"
set +e
"$engine" "${engine_args[@]}" exec -e RAY_AUTH_MODE=token "${auth[@]}" "$head" \
  ray job submit --address "http://127.0.0.1:$dashboard" -- \
  opd train /home/opd/opd/tests/data/tiny.yaml run.output_dir=/shared/runs/tiny run.total_steps=2 \
  run.save_every_steps=1 student.bootstrap.cache_dir=/shared/cache teacher.bootstrap.cache_dir=/shared/cache \
  resources.teacher_cpus=1 resources.rollout_cpus=1 resources.trainer_cpus=1 resources.torch_threads=1 "$@"
status=$?
set -e
echo "cluster: ray job submit exited $status"
if [ -f "$shared/runs/tiny/summary.json" ]; then
  python3 -c "
import json, sys
summary = json.load(open(sys.argv[1]))
print('cluster: steps', summary['steps'], '; roles:', '; '.join(f\"{role} on node {n['node_id'][:16]}\" for role, nodes in summary['placement'].items() for n in nodes))
" "$shared/runs/tiny/summary.json"
  ls "$shared/runs/tiny" "$shared/runs/tiny/checkpoints"
fi
echo "cluster: the shared volume: $shared"
exit "$status"
