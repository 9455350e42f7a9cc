"""What the Ray workers get besides the import path: the libraries' progress bars off (a user's
own setting wins), and Ray's once-per-run advice on log de-duplication spent before it prints.
(An actor's errors still reach the console: tests/integration/test_ray_deepspeed.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

from opd.runtime.cluster import QUIET_WORKER_ENV, _skip_dedup_advice, worker_runtime_env


def test_the_workers_get_the_progress_bars_off_and_the_import_path(monkeypatch):
    for name, _ in QUIET_WORKER_ENV:
        monkeypatch.delenv(name, raising=False)
    env_vars = worker_runtime_env()["env_vars"]
    assert env_vars["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert env_vars["TRANSFORMERS_VERBOSITY"] == "error" and env_vars["TOKENIZERS_PARALLELISM"] == "false"
    assert env_vars["PYTHONPATH"].endswith(os.path.abspath(os.getcwd()))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user asked for them
    assert worker_runtime_env()["env_vars"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_that_environment_turns_off_transformers_loading_and_saving_bars():
    # "Loading weights" and "Writing model shards" are transformers.utils.logging.tqdm bars.
    env = {k: v for k, v in os.environ.items() if k not in dict(QUIET_WORKER_ENV)}
    probe = "import transformers.utils.logging as l; print(l.is_progress_bar_enabled())"
    shown = [subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                            check=True).stdout.strip() for extra in ({}, dict(QUIET_WORKER_ENV))]
    assert shown == ["True", "False"]


def test_rays_dedup_advice_is_spent_before_it_prints():
    from ray._private.ray_logging import _warn_once

    _skip_dedup_advice()
    assert _warn_once() == ""  # a merged line keeps "[repeated Nx across cluster]", without the advice


def test_a_local_ray_gets_free_ports_for_its_fixed_port_servers_and_they_are_put_back(monkeypatch):
    """Issue 51, item 5: the agent's port (RayParams' default) and the metrics servers' ports (the
    environment the processes Ray starts read) are free ones during start-up, as before after."""
    import inspect

    from ray._private.parameter import RayParams

    from opd.runtime.cluster import _ports_of_our_own

    monkeypatch.delenv("DASHBOARD_METRIC_PORT", raising=False)
    monkeypatch.setenv("AUTOSCALER_METRIC_PORT", "45000")  # a user's own choice is kept

    def agent_port() -> int:
        return inspect.signature(RayParams.__init__).parameters["dashboard_agent_listen_port"].default

    assert agent_port() == 52365
    with _ports_of_our_own():
        assert agent_port() != 52365 and RayParams().dashboard_agent_listen_port == agent_port()
        assert int(os.environ["DASHBOARD_METRIC_PORT"]) not in (44227, agent_port())
        assert os.environ["AUTOSCALER_METRIC_PORT"] == "45000"
    assert agent_port() == 52365 and "DASHBOARD_METRIC_PORT" not in os.environ
    assert os.environ["AUTOSCALER_METRIC_PORT"] == "45000"
