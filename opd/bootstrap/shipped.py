"""Tiny models shipped with opd: the bootstrapped teachers and students of the CPU recipes at the
top of ``recipes/``, so that a first run trains at once instead of building them (the
quickstart's two took 5.4 minutes, the prompt dataset's 21.5), and every machine starts from the
same weights.

A shipped model lives in ``opd/bootstrap/shipped_models/<policy>-<recipe key>/`` with the SHA-256 of
each file in ``manifest.json``. Its recipe key is the bootstrap key without the build environment
(:func:`opd.bootstrap.cache.bootstrap_key` with ``build=False``): it names what the recipe asks
for, whatever machine reads it; the manifest records the machine that built it (torch release,
CPU kernels). A ``bootstrap`` section that matches one uses it in place, its files checked
against the manifest; ``bootstrap.shipped: false`` builds the model here instead (the studies'
path, and what ``scripts/ship_models.py`` does before it ships).

Example:
    >>> shipped_model(cfg.teacher.bootstrap, cfg.env, seed=0)  # doctest: +SKIP
    PosixPath('.../opd/bootstrap/shipped_models/expert-5f2c...')
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from opd.bootstrap.cache import bootstrap_key, build_environment
from opd.schema import BootstrapConfig, EnvConfig

SHIPPED_DIR = Path(__file__).with_name("shipped_models")
MANIFEST = "manifest.json"


class ShippedModelError(RuntimeError):
    """A shipped model whose files are not the ones its manifest names."""


def shipped_name(boot: BootstrapConfig, env_cfg: EnvConfig, seed: int) -> str:
    """The directory name a shipped copy of the model ``boot`` describes has."""
    return f"{boot.policy}-{bootstrap_key(boot, env_cfg, seed, build=False)}"


def read_manifest(root: Path = SHIPPED_DIR) -> dict[str, dict]:
    """``{directory name: {"files": {name: sha256}, "built": {...}, "recipe": ...}}``; empty where
    nothing is shipped."""
    path = root / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shipped_model(boot: BootstrapConfig, env_cfg: EnvConfig, seed: int, root: Path = SHIPPED_DIR) -> Path | None:
    """The shipped model ``boot`` describes (its files checked), or None where none is shipped
    or ``boot.shipped`` is off.

    Raises:
        ShippedModelError: a file missing or changed, named with the hash the manifest expects.
    """
    if not getattr(boot, "shipped", True):
        return None
    name = shipped_name(boot, env_cfg, seed)
    entry = read_manifest(root).get(name)
    if entry is None:
        return None
    directory = root / name
    for file, expected in sorted(entry["files"].items()):
        found = file_sha256(directory / file) if (directory / file).is_file() else "missing"
        if found != expected:
            raise ShippedModelError(
                f"the shipped model {directory} has {file} {'missing' if found == 'missing' else 'changed'} "
                f"(sha256 {found[:16]}, the manifest says {expected[:16]}); reinstall opd (git checkout "
                f"{SHIPPED_DIR.relative_to(SHIPPED_DIR.parents[2])}), or set bootstrap.shipped: false to build the "
                "model here")
    return directory


def ship(built: Path, boot: BootstrapConfig, env_cfg: EnvConfig, seed: int, recipe: str,
         root: Path = SHIPPED_DIR) -> Path:
    """Copy the model built in ``built`` (on this machine, from ``boot``) into ``root`` under its
    recipe key, and name its files' hashes, this machine's build and ``recipe`` in the manifest."""
    name = shipped_name(boot, env_cfg, seed)
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    files = {}
    for source in sorted(p for p in built.iterdir() if p.is_file()):
        shutil.copy2(source, target / source.name)
        files[source.name] = file_sha256(target / source.name)
    manifest = read_manifest(root)
    recipes = sorted({*manifest.get(name, {}).get("recipes", []), recipe})
    manifest[name] = {"files": files, "built": build_environment(), "recipes": recipes}
    (root / MANIFEST).write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return target
