"""A real multi-node Ray cluster on this machine: Ray's own ``ray.cluster_utils.Cluster`` starts a
head and two more nodes, each a separate raylet with its own object store (as Ray's test suite
does), all on loopback with token authentication. ``opd train`` joins it through ``RAY_ADDRESS``;
with one CPU per node and one per role, the three roles must land on three different nodes. A
short run then trains, syncs the weights across nodes (through the object stores) and
checkpoints; the run's summary records where each role ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny.yaml"


@pytest.fixture(scope="module")
def three_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from opd.runtime.cluster import LOOPBACK, _enable_token_auth, _local_only

    ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE",)}
    _enable_token_auth()  # the nodes start with token authentication, as opd's own Ray does
    with _local_only():  # every node on 127.0.0.1
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK,
                                                                "include_dashboard": False})
        for _ in range(2):
            cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_roles_on_three_nodes_train_sync_and_checkpoint(three_nodes, tmp_path, monkeypatch):
    import ray

    from opd.cli import main
    from opd.training.checkpoint import latest_checkpoint

    monkeypatch.setenv("RAY_ADDRESS", three_nodes.address)
    run_dir = tmp_path / "run"
    args = [f"run.output_dir={run_dir}", f"student.bootstrap.cache_dir={tmp_path / 'cache'}",
            f"teacher.bootstrap.cache_dir={tmp_path / 'cache'}", "run.total_steps=2", "run.save_every_steps=1",
            "resources.teacher_cpus=1", "resources.rollout_cpus=1", "resources.trainer_cpus=1"]
    assert main(["train", str(TINY), *args]) == 0

    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    placement = {role: [n["node_id"] for n in found] for role, found in summary["placement"].items()}
    print("roles on nodes:", json.dumps(summary["placement"], indent=1))
    assert sorted(placement) == ["rollout", "teacher", "trainer"]
    assert all(len(ids) == 1 and ids[0] in nodes for ids in placement.values())
    assert len({ids[0] for ids in placement.values()}) == 3, placement  # one role per node

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "time/weight_sync_s" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["time/weight_sync_s"] > 0 and r["train_tokens"] > 0 for r in trained)
    path, state = latest_checkpoint(run_dir)
    assert state["step"] == 2 and (path / "hf" / "model.safetensors").is_file()


def test_a_trainer_group_across_nodes_meets_over_tcp_and_replicas_spread(three_nodes, tmp_path, monkeypatch):
    """Two trainer ranks under ZeRO-3 on two nodes (their rendezvous is TCP on rank 0's node, as
    across machines) and two rollout replicas on two nodes: two steps train, sync to both
    replicas and write one optimizer shard per rank."""
    from opd.cli import main
    from opd.training.checkpoint import latest_checkpoint

    monkeypatch.setenv("RAY_ADDRESS", three_nodes.address)
    run_dir = tmp_path / "run"
    args = [f"run.output_dir={run_dir}", f"student.bootstrap.cache_dir={tmp_path / 'cache'}",
            f"teacher.bootstrap.cache_dir={tmp_path / 'cache'}", "run.total_steps=2", "run.save_every_steps=1",
            "resources.placement=strict_spread", "resources.trainer_ranks=2", "resources.rollout_replicas=2",
            "resources.teacher_cpus=0.25", "resources.rollout_cpus=0.25", "resources.trainer_cpus=0.5",
            "trainer.zero_stage=3"]
    assert main(["train", str(TINY), *args]) == 0

    summary = json.loads((run_dir / "summary.json").read_text())
    print("roles on nodes:", json.dumps(summary["placement"], indent=1))
    trainer_nodes = [n["node_id"] for n in summary["placement"]["trainer"]]
    rollout_nodes = [n["node_id"] for n in summary["placement"]["rollout"]]
    assert len(trainer_nodes) == 2 and len(set(trainer_nodes)) == 2
    assert len(rollout_nodes) == 2 and len(set(rollout_nodes)) == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "time/weight_sync_s" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["time/weight_sync_s"] > 0 and r["train_tokens"] > 0 and r["loss"] == r["loss"] for r in trained)
    path, state = latest_checkpoint(run_dir)
    assert state["step"] == 2 and (path / "hf" / "model.safetensors").is_file()
    assert len(list((path / "ds" / "state").glob("*optim_states.pt"))) == 2


@pytest.fixture
def four_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from opd.runtime.cluster import LOOPBACK, _enable_token_auth, _local_only

    ray.shutdown()
    saved = os.environ.get("RAY_AUTH_MODE")
    _enable_token_auth()
    with _local_only():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK,
                                                                "include_dashboard": False})
        workers = [cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK) for _ in range(3)]
    cluster.wait_for_nodes()
    try:
        yield cluster, workers
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def test_a_node_lost_mid_run_is_replaced_by_the_nodes_left(four_nodes, tmp_path, monkeypatch, capsys):
    """Issue 51, item 2: a worker node hosting a role is removed once checkpoint step_2 is complete;
    the role's actor dies with it, the run places every role again on the nodes left (one is
    spare) and resumes from step_2: all 10 steps logged once, the roles on live nodes at the end."""
    import threading
    import time

    import ray

    from opd.cli import main

    cluster, workers = four_nodes
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("COLUMNS", "400")
    run_dir = tmp_path / "run"
    removed: list[str] = []

    def remove_a_node_with_a_role() -> None:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        used = {node for pg in ray.util.placement_group_table().values() if pg.get("state") == "CREATED"
                for node in (pg.get("bundles_to_node_id") or {}).values()}
        node = next(w for w in workers if w.node_id in used)
        cluster.remove_node(node)
        removed.append(node.node_id)

    remover = threading.Thread(target=remove_a_node_with_a_role, daemon=True)
    remover.start()
    args = [f"run.output_dir={run_dir}", f"student.bootstrap.cache_dir={tmp_path / 'cache'}",
            f"teacher.bootstrap.cache_dir={tmp_path / 'cache'}", "run.total_steps=10", "run.save_every_steps=1",
            "run.keep_checkpoints=10", "resources.teacher_cpus=1", "resources.rollout_cpus=1",
            "resources.trainer_cpus=1"]
    assert main(["train", str(TINY), *args]) == 0
    remover.join(timeout=10)
    out = " ".join(capsys.readouterr().out.split())
    with capsys.disabled():  # what the run said, for -s
        print(f"removed node {removed[0][:8] if removed else None}:", out[max(0, out.find("actor died") - 40):][:400])
    assert removed, "no node was removed (the run ended first)"
    assert "actor died" in out and "restarting every role from step_" in out, out[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "time/step_s" in r] == list(range(1, 11))  # each once
    placement = json.loads((run_dir / "summary.json").read_text())["placement"]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert all(found[0]["node_id"] in alive and found[0]["node_id"] != removed[0] for found in placement.values())
    with capsys.disabled():
        print("roles on nodes at the end:", {role: found[0]["node_id"][:8] for role, found in placement.items()})
