"""Placement on a real Ray: each role's actor starts in its own placement group; a request the
cluster can never hold is refused at once (Ray alone would wait for ever), and one whose
resources are held by others fails after ``resources.placement_timeout_s``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from opd.runtime.placement import PlacementError, reserve, role_requests

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from opd.runtime.cluster import init_ray

    ray.shutdown()
    init_ray(SimpleNamespace(num_cpus=2))
    yield ray
    ray.shutdown()


def _res(**kw):
    base = dict(teacher_cpus=0.5, rollout_cpus=0.5, trainer_cpus=1.0, teacher_gpus=0.0, rollout_gpus=0.0,
                trainer_gpus=0.0, placement="pack")
    return SimpleNamespace(**{**base, **kw})


def test_each_role_is_reserved_and_its_actor_runs_in_its_group(local_ray):
    from ray.util.placement_group import remove_placement_group

    from opd.runtime.placement import actor_options

    groups = reserve(role_requests(_res()), timeout_s=30)
    assert sorted(groups) == ["rollout", "teacher", "trainer"]

    @local_ray.remote(num_cpus=1.0)
    class Probe:
        def group_id(self):
            return local_ray.util.get_current_placement_group().id.hex()

    probe = Probe.options(**actor_options(groups["trainer"])).remote()
    assert local_ray.get(probe.group_id.remote(), timeout=60) == groups["trainer"].id.hex()
    local_ray.kill(probe)
    for group in groups.values():
        remove_placement_group(group)


def test_an_impossible_request_fails_at_once_naming_the_role(local_ray):
    start = time.monotonic()
    with pytest.raises(PlacementError) as err:
        reserve(role_requests(_res(trainer_gpus=1.0)), timeout_s=600)
    took = time.monotonic() - start
    print(f"refused after {took:.2f} s: {err.value}")
    assert str(err.value).startswith("the trainer asks for 1 bundle of {CPU: 1, GPU: 1}")
    assert "no node has enough GPU: the cluster's nodes have {CPU: 2" in str(err.value)
    # Refused by the check, not after the 600 s wait: that would say "not placed after".
    assert "not placed after" not in str(err.value)


def test_resources_held_by_others_fail_after_the_timeout_and_nothing_stays_reserved(local_ray):
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    hog = placement_group([{"CPU": 2.0}])
    local_ray.get(hog.ready(), timeout=60)
    try:
        with pytest.raises(PlacementError, match=r"not placed after \d+ s \(resources.placement_timeout_s\): the "
                                                 r"cluster has the resources, but they are in use"):
            reserve(role_requests(_res()), timeout_s=2)
    finally:
        remove_placement_group(hog)
    states = {v["name"]: v["state"] for v in placement_group_table().values() if v["name"].startswith("opd-")}
    assert states and set(states.values()) == {"REMOVED"}, states
