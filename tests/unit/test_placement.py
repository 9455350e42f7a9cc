"""Placement requests against a cluster's nodes: what fits under each strategy, and the message
for what cannot (naming the role, the resource and what the nodes have). The reservation itself
runs on a real Ray in tests/integration/test_placement.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from opd.runtime.placement import PlacementError, check_feasible, role_requests


def _res(**kw):
    base = dict(teacher_cpus=0.5, rollout_cpus=0.5, trainer_cpus=1.0, teacher_gpus=0.0, rollout_gpus=0.0,
                trainer_gpus=0.0, placement="pack")
    return SimpleNamespace(**{**base, **kw})


def test_the_recipes_shares_become_one_bundle_per_actor():
    requests = role_requests(_res(trainer_gpus=1.0), replicas={"rollout": 2})
    assert [(r.role, r.bundles, r.strategy) for r in requests] == [
        ("teacher", ({"CPU": 0.5},), "pack"),
        ("rollout", ({"CPU": 0.5}, {"CPU": 0.5}), "pack"),
        ("trainer", ({"CPU": 1.0, "GPU": 1.0},), "pack")]
    with pytest.raises(PlacementError, match="resources.placement is 'sideways'"):
        role_requests(_res(placement="sideways"))


def test_a_request_no_node_can_hold_names_the_role_and_the_resource():
    nodes = [{"CPU": 2.0, "memory": 1e9}]
    check_feasible(role_requests(_res()), nodes)  # 0.5 + 0.5 + 1 on one 2-CPU node
    with pytest.raises(PlacementError) as err:
        check_feasible(role_requests(_res(trainer_gpus=1.0)), nodes)
    assert str(err.value) == (
        "the trainer asks for 1 bundle of {CPU: 1, GPU: 1} (resources.trainer_cpus / trainer_gpus, placement: pack) "
        "and no node has enough GPU: the cluster's nodes have {CPU: 2}. Lower the trainer's shares, or add a node "
        "that has them.")


def test_roles_that_fit_alone_but_not_together_are_refused():
    with pytest.raises(PlacementError, match="the roles together ask for more than the cluster has .* the trainer "
                                             "is the first that does not fit"):
        check_feasible(role_requests(_res(teacher_cpus=1.0, rollout_cpus=1.0, trainer_cpus=1.0)), [{"CPU": 2.0}])


@pytest.mark.parametrize("strategy, nodes, fits", [
    ("pack", [{"CPU": 1.0}, {"CPU": 1.0}], True),            # two 1-CPU bundles over two nodes
    ("strict_pack", [{"CPU": 1.0}, {"CPU": 1.0}], False),    # must share one node
    ("strict_pack", [{"CPU": 2.0}], True),
    ("strict_spread", [{"CPU": 2.0}], False),                # needs two nodes
    ("strict_spread", [{"CPU": 1.0}, {"CPU": 1.0}], True),
    ("spread", [{"CPU": 2.0}], True),                        # spread is a preference
])
def test_strategies_decide_what_fits(strategy, nodes, fits):
    requests = [r for r in role_requests(_res(rollout_cpus=1.0, placement=strategy), replicas={"rollout": 2})
                if r.role == "rollout"]
    if fits:
        check_feasible(requests, nodes)
    else:
        with pytest.raises(PlacementError, match=f"the rollout asks for 2 bundles of {{CPU: 1}}.*placement: {strategy}"):
            check_feasible(requests, nodes)
