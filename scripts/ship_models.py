"""Build the tiny bootstrapped models of the CPU recipes at the top of ``recipes/`` and ship them
with opd (``opd/bootstrap/shipped_models/``, :mod:`opd.bootstrap.shipped`): each role's model is built
here from scratch (``bootstrap.shipped: false``; a model already in this machine's cache is
reused) and copied with its files' hashes into the manifest.

    .venv/bin/python scripts/ship_models.py                       # every top-level CPU recipe
    .venv/bin/python scripts/ship_models.py recipes/quickstart.yaml

Models that start from a pretrained one (``bootstrap.init``) are not shipped: they are the size
of that model. Run it after a change that alters a recipe's models (``CACHE_VERSION``, the
recipe's bootstrap settings); ``tests/unit/test_shipped_models.py`` fails until it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shipped_roles(recipe: Path):
    """``(role, its bootstrap section with shipped off, env, seed)`` for each role of ``recipe``
    that builds a tiny model from scratch."""
    from omegaconf import OmegaConf

    from opd.config import load_config

    cfg = load_config(str(recipe))
    for role, offset in (("teacher", 0), ("student", 1)):
        boot = getattr(cfg, role).bootstrap
        if boot is None or boot.init:
            continue
        boot = OmegaConf.merge(boot, {"shipped": False})
        yield role, boot, cfg.env, boot.seed if boot.seed is not None else cfg.run.seed + offset


def main() -> None:
    from opd.bootstrap.build import build_bootstrap_model
    from opd.bootstrap.shipped import SHIPPED_DIR, ship

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", type=Path)
    args = parser.parse_args()
    recipes = args.recipes or sorted(ROOT.glob("recipes/*.yaml"))
    for recipe in recipes:
        for role, boot, env, seed in shipped_roles(recipe):
            built = Path(build_bootstrap_model(boot, env, seed, log=print))
            label = f"{recipe.resolve().relative_to(ROOT)} {role}"
            target = ship(built, boot, env, seed, label)
            size = sum(f.stat().st_size for f in target.iterdir()) / 2**20
            print(f"shipped {label}: {target.relative_to(ROOT)} ({size:.1f} MiB)")
    total = sum(f.stat().st_size for f in SHIPPED_DIR.rglob("*") if f.is_file()) / 2**20
    print(f"{SHIPPED_DIR.relative_to(ROOT)} holds {total:.1f} MiB")


if __name__ == "__main__":
    main()
