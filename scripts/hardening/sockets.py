"""The listening sockets of a local opd run: Ray's processes and the three actors, after one
training step of the tiny recipe. On one machine every address must be loopback.

    .venv/bin/python scripts/hardening/sockets.py [WORK_DIR]

Exits 1 when a socket listens elsewhere.
"""

import sys
import tempfile

from opd.algorithms import vanilla_opd
from opd.algorithms.base import RunContext
from opd.chat import ChatFormat
from opd.config import load_config
from opd.envs import EnvFactory
from opd.models import load_tokenizer
from opd.bootstrap import resolve_model_path
from opd.rollout.vanilla import EpisodeSettings
from opd.runtime.actors import spawn_workers
from opd.runtime.cluster import init_ray, listening_sockets

LOOPBACK = ("127.0.0.1:", "::ffff:127.0.0.1:", "::1:")


def main(work: str) -> int:
    cfg = load_config("tests/data/tiny.yaml", [f"run.output_dir={work}/run", f"student.bootstrap.cache_dir={work}/cache",
                                               f"teacher.bootstrap.cache_dir={work}/cache"])
    student = resolve_model_path(cfg.student, cfg.env, cfg.run.seed + 1, print)
    teacher = resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, print)
    factory = EnvFactory(cfg.env.id, dict(cfg.env.kwargs))
    init_ray(cfg.resources)
    settings = EpisodeSettings(max_new_tokens=cfg.rollout.max_new_tokens)
    ctx = RunContext(cfg, spawn_workers(cfg, student, teacher), factory, factory().unwrapped.task_ids("train"), [],
                     settings, settings, ChatFormat.from_tokenizer(load_tokenizer(student)))
    vanilla_opd.train_step(ctx, 1)
    sockets = listening_sockets()
    for pid, name, address in sockets:
        print(f"{pid:>7}  {name:28s} {address}")
    elsewhere = [s for s in sockets if not s[2].startswith(LOOPBACK)]
    print("every socket on loopback" if not elsewhere else f"NOT ON LOOPBACK: {elsewhere}")
    return 1 if elsewhere else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()))
