"""A local Ray from :func:`opd.runtime.cluster.init_ray` is reachable from this machine only, by
token, and its workers import installed code before the working directory's.

The Ray session runs in a fresh interpreter (this file run as a script): the test session may
hold a Ray of its own, and the check needs a working directory of its own. That directory holds
an ``opd/`` and an ``omegaconf.py`` that raise on import, and a user module ``my_user_mod.py``.
The probe starts Ray there with ``RAY_AUTH_MODE=disabled`` in its environment (which opd must
override), starts an actor and a task, and prints one JSON report that the tests below read.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SHADOW = 'raise ImportError("imported from the working directory")\n'


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "opd").mkdir()
    (cwd / "opd" / "__init__.py").write_text(SHADOW)
    (cwd / "omegaconf.py").write_text(SHADOW)
    (cwd / "my_user_mod.py").write_text("VALUE = 42\n")
    token = tmp_path_factory.mktemp("token") / "auth_token"
    token.write_text("0123456789abcdef" * 4)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN_PATH=str(token))
    result = subprocess.run([sys.executable, __file__], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_listening_socket_is_on_loopback(report):
    sockets = report["sockets"]
    exposed = [s for s in sockets if not is_loopback(s[2].rpartition(":")[0])]
    assert exposed == [], f"listening beyond loopback: {exposed}"
    # Not vacuous: each kind of process that must listen was seen listening.
    names = {name for _, name, _ in sockets}
    pids = {pid for pid, _, _ in sockets}
    for kind in ("gcs_server", "raylet", "ray::RuntimeEnvAgent", "ray::Probe"):
        assert kind in names, f"no listening socket of {kind} in {sockets}"
    assert report["driver_pid"] in pids, f"the driver's core worker does not listen: {sockets}"
    # Ray names this address in its errors and hands it to every process it starts.
    assert report["node_ip"] == "127.0.0.1"
    assert report["gcs_address"].startswith("127.0.0.1:")


def test_token_authentication_is_on_and_enforced(report):
    assert report["driver_token_auth"] and report["actor"]["token_auth"]
    assert report["clients"]["wrong token"].startswith("AuthenticationError"), report["clients"]
    assert report["clients"]["no token"].startswith("AuthenticationError"), report["clients"]
    assert report["clients"]["the session's token"] == "connected", report["clients"]


def test_workers_import_installed_code_before_the_working_directory(report):
    for where in ("actor", "task"):
        imports = report[where]
        assert imports["opd"].startswith(report["real_opd"]), imports
        assert imports["omegaconf"] == report["real_omegaconf"], imports
        assert imports["my_user_mod"] == 42, imports
    assert report["actor"]["cwd"] == report["cwd"]  # relative paths still mean the driver's directory


# ---- the probe: runs in its own interpreter, in the prepared working directory ----

CLIENT = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"probe", None, timeout=10)
    print("connected")
except Exception as err:
    print(type(err).__name__, err)
"""


def _imports() -> dict:
    import importlib

    out = {"cwd": os.getcwd()}
    for name in ("opd", "omegaconf", "my_user_mod"):
        try:
            module = importlib.import_module(name)
            out[name] = getattr(module, "VALUE", None) or module.__file__
        except Exception as err:  # the report says which import failed and how
            out[name] = repr(err)
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    out["token_auth"] = is_token_auth_enabled()
    return out


def _client(gcs_address: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    result = subprocess.run([sys.executable, "-c", CLIENT, gcs_address], env={**base, **env}, capture_output=True,
                            text=True, timeout=120)
    return (result.stdout.strip().splitlines() or [result.stderr[-300:]])[-1]


def _probe() -> None:
    import time
    from types import SimpleNamespace

    import omegaconf
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    import opd
    from opd.runtime.cluster import init_ray, listening_sockets

    init_ray(SimpleNamespace(num_cpus=2))
    try:

        @ray.remote
        class Probe:
            def imports(self):
                return _imports()

        # Like opd's own actors: a runtime_env of its own, merged with the job's.
        actor = Probe.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
        report = {"actor": ray.get(actor.imports.remote()), "task": ray.get(ray.remote(_imports).remote())}
        gcs = ray.get_runtime_context().gcs_address
        token_path = os.environ["RAY_AUTH_TOKEN_PATH"]
        report["clients"] = {
            "wrong token": _client(gcs, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token"),
            "no token": _client(gcs, RAY_AUTH_MODE="disabled"),
            "the session's token": _client(gcs, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path),
        }
        time.sleep(2)  # the agents bind their ports while the workers start; let the last ones land
        report.update(sockets=listening_sockets(), driver_pid=os.getpid(), node_ip=ray.util.get_node_ip_address(),
                      gcs_address=gcs, driver_token_auth=is_token_auth_enabled(), cwd=os.getcwd(),
                      real_opd=str(Path(opd.__file__).parent), real_omegaconf=omegaconf.__file__)
    finally:
        ray.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    _probe()
