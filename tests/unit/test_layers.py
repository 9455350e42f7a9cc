"""The layers of docs/architecture.md hold: no module of opd (or of the environments) imports from
a layer above its own.

Every import counts, at module level or inside a function, ``TYPE_CHECKING`` blocks included: a
late import is still a dependency. A new package must be given a layer here (and in
docs/architecture.md) before its first test run passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top; a module may import from its own layer and the layers below. The names are
# module prefixes: "opd.generation" covers opd.generation and everything under it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("data", ("opd", "opd.schema", "opd.trajectory", "opd.chat", "opd.optional", "opd.progress", "opd.process", "opd.wire")),
    ("engines and environments", ("opd.models", "opd.envs", "opd.mixture", "opd.generation", "environments")),
    ("rollout, supervision and losses", ("opd.rollout", "opd.supervision", "opd.losses", "opd.curriculum")),
    ("training", ("opd.training",)),
    ("algorithms, evaluation and bootstrap", ("opd.algorithms", "opd.evaluation", "opd.bootstrap")),
    ("config", ("opd.config",)),
    ("runtime", ("opd.runtime",)),
    ("cli", ("opd.cli",)),
]


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (by its longest matching prefix), or None."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``path``, relative imports resolved; ``from a
    import b`` counts as ``a.b`` (a submodule, or a name whose layer is ``a``'s)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def upward_imports(root: Path, packages: tuple[str, ...] = ("opd", "environments")) -> tuple[list[str], list[str]]:
    """``(violations, unplaced)``: each import of a module from a higher layer, as
    ``file:line: a (layer) imports b (layer)``, and each module no layer covers."""
    violations, unplaced = [], []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            own = layer_of(module)
            if own is None:
                unplaced.append(module)
                continue
            for line, target in imported_modules(path, module):
                theirs = layer_of(target)
                if theirs is not None and theirs > own:
                    violations.append(f"{path.relative_to(root)}:{line}: {module} ({LAYERS[own][0]}) imports {target} "
                                      f"({LAYERS[theirs][0]}), a layer above")
    return violations, unplaced


def test_every_module_has_a_layer():
    _, unplaced = upward_imports(ROOT)
    assert not unplaced, f"give these modules a layer in LAYERS and docs/architecture.md: {unplaced}"


def test_no_module_imports_from_a_layer_above():
    violations, _ = upward_imports(ROOT)
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("statement", [
    "from opd.runtime.driver import train",  # rollout -> runtime, at module level
    "def f():\n    from opd.algorithms import step\n",  # a late import counts too
    "from ..runtime import actors",  # relative
    "import opd.cli",
])
def test_the_check_catches_an_upward_import(tmp_path, statement):
    for package in ("opd", "opd/rollout", "opd/runtime", "environments"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "opd" / "rollout" / "loop.py").write_text(statement + "\n")
    (tmp_path / "opd" / "runtime" / "actors.py").write_text("from opd.rollout import loop\n")  # downward: fine
    violations, unplaced = upward_imports(tmp_path)
    assert not unplaced
    assert len(violations) == 1 and violations[0].startswith("opd/rollout/loop.py:"), violations
    assert "opd.rollout.loop (rollout, supervision and losses) imports" in violations[0]


def test_environments_stay_below_opd_above_the_contract(tmp_path):
    (tmp_path / "opd").mkdir()
    (tmp_path / "environments").mkdir()
    (tmp_path / "environments" / "game.py").write_text("from opd.envs import make_env\nfrom opd.rollout import vanilla\n")
    violations, _ = upward_imports(tmp_path)
    assert [v.split(": ", 1)[0] for v in violations] == ["environments/game.py:2"]


# The modules that talk to Ray; everything else runs where Ray is not installed.
RAY_MODULES = {"opd.runtime.cluster", "opd.runtime.placement", "opd.runtime.actors"}


def _module_graph(root: Path) -> dict[str, set[str]]:
    """Each module of opd and the environments, and the modules (of those) it imports."""
    paths = {module_name(p, root): p for package in ("opd", "environments") for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        targets = set()
        for _, target in imported_modules(path, module):
            while target and target not in paths:  # "from a import name": the module is a
                target = target.rpartition(".")[0]
            if target:
                targets.add(target)
        graph[module] = targets
    return graph


def test_ray_is_imported_by_the_ray_modules_only():
    found = []
    for package in ("opd", "environments"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = module_name(path, ROOT)
            found += [f"{module}:{line}" for line, target in imported_modules(path, module)
                      if (target == "ray" or target.startswith("ray.")) and module not in RAY_MODULES]
    assert found == [], f"only {sorted(RAY_MODULES)} import ray: {found}"


@pytest.mark.parametrize("module", ["opd.runtime.local", "opd.runtime.offline", "opd.runtime.workers",
                                    "opd.training.trainer"])
def test_the_paths_without_ray_never_reach_a_ray_module(module):
    graph, seen, todo = _module_graph(ROOT), set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += graph.get(current, ())
    assert seen & RAY_MODULES == set(), f"{module} reaches {sorted(seen & RAY_MODULES)}"
