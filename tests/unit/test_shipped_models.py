"""The tiny models shipped with opd (``opd/bootstrap/shipped_models``): a recipe whose bootstrap section
names one runs on it without a build, its files are checked against the manifest, a stale one is
caught here, and ``bootstrap.shipped: false`` builds as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from opd.bootstrap import existing_model_path, resolve_model_path
from opd.bootstrap.shipped import SHIPPED_DIR, ShippedModelError, read_manifest, ship, shipped_model, shipped_name
from opd.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def roles(recipe: str, cache_dir: Path | None = None):
    """``(role, its model config, env, the seed its build uses)`` of ``recipe``."""
    cfg = load_config(str(ROOT / recipe))
    for role, offset in (("teacher", 0), ("student", 1)):
        model = getattr(cfg, role)
        if cache_dir is not None:
            model.bootstrap.cache_dir = str(cache_dir)
        yield role, model, cfg.env, cfg.run.seed + offset


def test_every_shipped_model_is_still_what_its_recipes_ask_for():
    """A change to a recipe's bootstrap settings or to the cache key leaves its shipped model
    unused: scripts/ship_models.py ships it again."""
    manifest = read_manifest()
    assert manifest, "nothing is shipped: run scripts/ship_models.py"
    for name, entry in manifest.items():
        for label in entry["recipes"]:
            recipe, role = label.split()
            (model, env, seed), = [(m, e, s) for r, m, e, s in roles(recipe) if r == role]
            assert shipped_name(model.bootstrap, env, seed) == name, f"{label}: run scripts/ship_models.py {recipe}"
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(entry["files"])
        assert entry["built"]["threads"] == "2"


def test_the_quickstart_runs_on_its_shipped_models_without_a_build(tmp_path):
    cache = tmp_path / "cache"
    lines: list[str] = []
    paths = {role: resolve_model_path(model, env, seed, lines.append)
             for role, model, env, seed in roles("recipes/quickstart.yaml", cache)}
    assert {Path(p).parent for p in paths.values()} == {SHIPPED_DIR}
    assert paths["teacher"] != paths["student"]
    assert not cache.exists()  # nothing built, nothing cached
    assert len(lines) == 2 and all("is shipped with opd" in line and "bootstrap.shipped: false" in line
                                   for line in lines)
    for role, model, env, seed in roles("recipes/quickstart.yaml", cache):
        assert existing_model_path(model, env, seed) == Path(paths[role])
        # Off, the same recipe builds in (and reads from) its cache as before.
        model.bootstrap.shipped = False
        assert shipped_model(model.bootstrap, env, seed) is None
        assert existing_model_path(model, env, seed) is None


def test_a_shipped_file_that_changed_is_named_with_its_hash(tmp_path):
    (_, model, env, seed), _ = roles("recipes/quickstart.yaml")
    name = shipped_name(model.bootstrap, env, seed)
    root = tmp_path / "shipped"
    root.mkdir()
    shutil.copytree(SHIPPED_DIR / name, root / name)
    shutil.copy(SHIPPED_DIR / "manifest.json", root / "manifest.json")
    assert shipped_model(model.bootstrap, env, seed, root) == root / name
    weights = root / name / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(ShippedModelError, match=r"model.safetensors changed \(sha256 [0-9a-f]{16}, the manifest "
                                                r"says [0-9a-f]{16}\).*bootstrap.shipped: false"):
        shipped_model(model.bootstrap, env, seed, root)
    weights.unlink()
    with pytest.raises(ShippedModelError, match="model.safetensors missing"):
        shipped_model(model.bootstrap, env, seed, root)


def test_ship_copies_a_build_and_names_its_hashes(tmp_path):
    (_, model, env, seed), _ = roles("recipes/quickstart.yaml")
    built = SHIPPED_DIR / shipped_name(model.bootstrap, env, seed)  # any model directory does
    boot = OmegaConf.merge(model.bootstrap, {"sft_steps": 7})  # another recipe: another name
    target = ship(built, boot, env, seed, "recipes/mine.yaml teacher", root=tmp_path)
    assert target.name == shipped_name(boot, env, seed) != built.name
    entry = read_manifest(tmp_path)[target.name]
    assert entry["recipes"] == ["recipes/mine.yaml teacher"]
    assert shipped_model(boot, env, seed, tmp_path) == target
    assert sorted(entry["files"]) == sorted(p.name for p in built.iterdir())
