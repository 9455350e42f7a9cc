"""Where each role's actors run: one Ray placement group per role, its bundles from the recipe's
``resources`` section, reserved before any actor starts.

Ray's default for a request no node can satisfy is to wait for ever (an autoscaler might add a
node). A run here checks each role's bundles against the nodes the cluster has first and refuses
an impossible request at once, naming the role, the resource and what the nodes offer; a request
the cluster could satisfy but whose resources are in use (another job's actors) waits
``resources.placement_timeout_s`` and then fails the same way.

``resources.placement`` is each role's strategy, Ray's placement-group strategies in lower case:
``pack`` (the role's bundles on as few nodes as fit, the default), ``spread`` (on as many as
possible), ``strict_pack`` (one node, or fail), ``strict_spread`` (one node per bundle, or fail).
A role has one bundle per actor; today that is one actor per role.

Example:
    >>> requests = role_requests(cfg.resources)  # doctest: +SKIP
    >>> groups = reserve(requests, timeout_s=60)  # doctest: +SKIP
    >>> ray.remote(Worker).options(**actor_options(groups["trainer"]))  # doctest: +SKIP
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from opd.runtime.errors import RunError
from opd.schema import ResourcesConfig

ROLES = ("teacher", "rollout", "trainer")
STRATEGIES = ("pack", "spread", "strict_pack", "strict_spread")


class PlacementError(RunError):
    """A role's resources cannot be reserved on the cluster; the message names the role."""


@dataclass(frozen=True)
class RoleRequest:
    """One role's placement group: a bundle per actor and the strategy."""

    role: str
    bundles: tuple[dict[str, float], ...]
    strategy: str = "pack"
    keys: str = ""  # the recipe keys that ask for it ("": resources.<role>_cpus / <role>_gpus)

    def describe(self) -> str:
        """``1 bundle of {CPU: 1, GPU: 1}``, as the messages name it."""
        kinds = {tuple(sorted(b.items())) for b in self.bundles}
        shown = "; ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in kind) + "}" for kind in sorted(kinds))
        return f"{len(self.bundles)} bundle{'s' if len(self.bundles) != 1 else ''} of {shown}"


def role_requests(resources: ResourcesConfig, replicas: dict[str, int] | None = None) -> list[RoleRequest]:
    """The three roles' requests from the recipe's ``resources`` (``<role>_cpus``,
    ``<role>_gpus``, ``placement``); ``replicas`` actors per role (default one)."""
    strategy = str(getattr(resources, "placement", "pack")).lower()
    if strategy not in STRATEGIES:
        raise PlacementError(f"resources.placement is {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    requests = []
    for role in ROLES:
        bundle = {"CPU": float(getattr(resources, f"{role}_cpus"))}
        gpus = float(getattr(resources, f"{role}_gpus"))
        if gpus > 0:
            bundle["GPU"] = gpus
        count = int((replicas or {}).get(role, 1))
        requests.append(RoleRequest(role, tuple(dict(bundle) for _ in range(count)), strategy))
    return requests


def _fits(bundle: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _take(bundle: dict[str, float], free: dict[str, float]) -> None:
    for k, v in bundle.items():
        free[k] = free.get(k, 0.0) - v


def _place(bundles: tuple[dict[str, float], ...], strategy: str, free: list[dict[str, float]]) -> bool:
    """Whether ``bundles`` fit the nodes' ``free`` resources under ``strategy`` (first fit,
    largest bundles first); on success ``free`` is reduced by them."""
    trial = [dict(node) for node in free]
    order = sorted(bundles, key=lambda b: -sum(b.values()))
    if strategy == "strict_pack":
        total: dict[str, float] = {}
        for b in order:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        node = next((n for n in trial if _fits(total, n)), None)
        if node is None:
            return False
        _take(total, node)
    else:
        used: set[int] = set()
        for b in order:
            candidates = [i for i, n in enumerate(trial) if _fits(b, n)]
            if strategy == "strict_spread":
                candidates = [i for i in candidates if i not in used]
            if not candidates:
                return False
            _take(b, trial[candidates[0]])
            used.add(candidates[0])
    free[:] = trial
    return True


def check_feasible(requests: list[RoleRequest], nodes: list[dict[str, float]]) -> None:
    """Refuse requests that ``nodes`` (each alive node's total resources) can never hold, alone or
    together.

    Raises:
        PlacementError: naming the role, what it asks for, the resource that is short and what
            the nodes have.
    """
    have = "; ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(n.items()) if k in ("CPU", "GPU")) + "}"
                     for n in nodes) or "none"
    for request in requests:
        if not _place(request.bundles, request.strategy, [dict(n) for n in nodes]):
            short = sorted({k for b in request.bundles for k, v in b.items()
                            if not any(n.get(k, 0.0) + 1e-9 >= v for n in nodes)})
            what = f"no node has enough {', '.join(short)}" if short else (
                f"the nodes cannot hold them under placement '{request.strategy}'")
            raise PlacementError(
                f"the {request.role} asks for {request.describe()} ("
                f"{request.keys or f'resources.{request.role}_cpus / {request.role}_gpus'}, placement: "
                f"{request.strategy}) and {what}: the cluster's nodes have {have}. "
                f"Lower the {request.role}'s shares, or add a node that has them.")
    free = [dict(n) for n in nodes]
    for request in requests:
        if not _place(request.bundles, request.strategy, free):
            asked = "; ".join(f"{r.role}: {r.describe()}" for r in requests)
            raise PlacementError(f"the roles together ask for more than the cluster has ({asked}; the nodes have "
                                 f"{have}); the {request.role} is the first that does not fit. Lower the shares "
                                 "in resources, or add a node.")


def cluster_nodes() -> list[dict[str, float]]:
    """Each alive node's total resources (``CPU``, ``GPU``, ...)."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def reserve(requests: list[RoleRequest], timeout_s: float) -> dict[str, Any]:
    """A ready placement group per role, checked first (:func:`check_feasible`), then waited for
    at most ``timeout_s``.

    Raises:
        PlacementError: a request the cluster can never satisfy (at once), or one still not
            placed after ``timeout_s`` (its resources held by others); nothing stays reserved.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_feasible(requests, cluster_nodes())
    run = uuid.uuid4().hex[:8]  # names are unique within a Ray job, and one driver may run several recipes
    groups = {r.role: placement_group(list(r.bundles), strategy=r.strategy.upper(), name=f"opd-{r.role}-{run}")
              for r in requests}
    start = time.monotonic()
    pending = {role: group.ready() for role, group in groups.items()}
    ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=timeout_s)
    late = [role for role, ref in pending.items() if ref not in ready]
    if late:
        for group in groups.values():
            remove_placement_group(group)
        asked = ", ".join(f"the {r.role} ({r.describe()})" for r in requests if r.role in late)
        raise PlacementError(f"{asked} not placed after {time.monotonic() - start:.0f} s "
                             f"(resources.placement_timeout_s): the cluster has the resources, but they are in use "
                             f"(`ray status` shows by what). Free them, or raise the timeout.")
    return groups


def release(groups: list[Any]) -> None:
    """Remove ``groups`` (best effort: a group already gone, or Ray already shut down, is fine)."""
    import contextlib

    import ray
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():
        return
    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)


def actor_options(group: Any, bundle_index: int = 0) -> dict[str, Any]:
    """The ``.options(...)`` that put an actor in ``group``'s bundle ``bundle_index``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=bundle_index)}


def group_nodes(groups: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Where each role's bundles landed: ``{role: [{"node_id", "node_ip"}, ...]}`` (one entry per
    bundle, in order), from Ray's placement-group table."""
    import ray
    from ray.util.placement_group import placement_group_table

    ips = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    out: dict[str, list[dict[str, str]]] = {}
    for role, group in groups.items():
        table = placement_group_table(group)
        nodes = table.get("bundles_to_node_id", {})
        out[role] = [{"node_id": nodes.get(i, ""), "node_ip": ips.get(nodes.get(i, ""), "")} for i in sorted(nodes)]
    return out
