"""Starting Ray for a run: a local Ray that only this machine's user can reach, or a join.

Security posture of a local run (no ``RAY_ADDRESS``):

- **Loopback only.** Every TCP socket of the session (GCS, raylet, the driver's and workers'
  core workers, the agents, the autoscaler's metrics port) listens on 127.0.0.1, and errors name
  127.0.0.1. Ray's servers bind to all interfaces (or to the node's IP) unless the node's IP is
  a loopback address, and ``ray.init(_node_ip_address="127.0.0.1")`` alone does not keep it one
  on Linux: Ray swaps it for the machine's routable IP unless it runs "local only", as it does
  on macOS and Windows (see :func:`_local_only`). The dashboard is off.
- **Token authentication on**, set explicitly (``RAY_AUTH_MODE=token``): every gRPC and HTTP
  call to the session must carry the token (see :func:`_ensure_token_file`).
- **Installed code first in the workers.** Ray puts the driver's working directory (and the
  script's directory) at the front of every worker's ``sys.path``, so a folder holding an
  ``opd/`` or an ``omegaconf.py`` would replace the real ones inside the actors. The workers
  here look in those directories last (:func:`_installed_first_hook`): a user's module there
  (``my_losses.py``, named by dotted path in a recipe) still imports, but cannot shadow an
  installed package or opd itself.

With ``RAY_ADDRESS`` set the driver joins that cluster as it is: its addresses and its
authentication belong to whoever started it (:func:`join_ray`). ``ray start --head`` turns token
authentication on and writes the token to ``~/.ray/auth_token``, but a client that names an
address gets no token unless ``RAY_AUTH_MODE=token`` is set (Ray then retries for 30 s and raises
a ``ConnectionError``). So a join of a cluster on this machine, with ``RAY_AUTH_MODE`` unset and a
token at hand, sends the token; a remote cluster gets it only when the user sets the mode (the
token is a secret: it goes where the user sends it). A join that fails says what to set. The
workers' import order is the same.

**A quiet console.** The actors' output still reaches the driver (``log_to_driver``), so an
actor's own error lines and prints are shown; what is switched off is other tools' chatter:
transformers' and the hub's progress bars in the workers ("Loading weights", "Writing model
shards": ``HF_HUB_DISABLE_PROGRESS_BARS``, :data:`QUIET_WORKER_ENV`, in the job's runtime env, so
a joined cluster's workers get it too), and Ray's one-time advice on its log de-duplication
(identical lines from several actors are still merged into one, marked ``[repeated Nx across
cluster]``). Ray's notice that token authentication is on is printed only when ``RAY_AUTH_MODE``
is unset at ``ray.init``; :func:`init_ray` sets it first. A variable the user set keeps its value.

Example:
    >>> init_ray(cfg.resources)  # doctest: +SKIP
    >>> [s for s in listening_sockets() if not s[2].startswith("127.0.0.1:")]  # doctest: +SKIP
    []
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from opd.schema import ResourcesConfig

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Set in every worker unless the user set them: each actor loads and saves models, and
# transformers draws a progress bar for each ("Loading weights", "Writing model shards").
QUIET_WORKER_ENV = (
    ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),  # read by transformers' own bars too, at import
    ("TRANSFORMERS_VERBOSITY", "error"),
    ("TOKENIZERS_PARALLELISM", "false"),  # else a warning from each worker that forks
)


def init_ray(resources: ResourcesConfig) -> None:
    """Start a local Ray on loopback with token authentication, or join ``RAY_ADDRESS``'s cluster.

    Args:
        resources: the recipe's ``resources`` section; ``num_cpus`` is the local Ray's CPU count
            (0: all of this machine's).

    Raises:
        RuntimeError: the installed Ray cannot run a local session on loopback with token
            authentication (too old, or its internals moved); the message says what to install.
    """
    import ray

    if ray.is_initialized():
        return
    _skip_dedup_advice()
    runtime_env = worker_runtime_env()
    if os.environ.get("RAY_ADDRESS"):
        join_ray(os.environ["RAY_ADDRESS"], runtime_env)
        return
    _enable_token_auth()
    with _local_only(), _ports_of_our_own():
        # address="local": always a new session of our own, never one that `ray start` left
        # behind on this machine (ray.init() with no address would join that one).
        ray.init(address="local", num_cpus=resources.num_cpus or os.cpu_count(), include_dashboard=False,
                 _node_ip_address=LOOPBACK, runtime_env=runtime_env, log_to_driver=True, configure_logging=False)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray {ray.__version__} started on {node_ip}, not on {LOOPBACK}: its services would be "
                           "reachable from the network, so the run stops. opd's switch for a loopback-only Ray "
                           "(ray._private.ray_constants.ENABLE_RAY_CLUSTER) no longer works with this Ray; install "
                           "the Ray opd was tested with (pip install 'ray==2.60.0').")


def join_ray(address: str, runtime_env: dict[str, Any]) -> None:
    """Join the running cluster at ``address`` (``RAY_ADDRESS``), with its token when it is on
    this machine and one is at hand (see the module docstring).

    Raises:
        ConnectionError: the cluster could not be joined; the message names the address, Ray's
            reason and, where authentication may be why, what to set.
    """
    import ray

    token_sent = False
    if os.environ.get("RAY_AUTH_MODE") is None and is_this_machine(address) and _token_at_hand():
        from ray._private.authentication.authentication_token_setup import _enable_token_auth as enable

        enable()  # RAY_AUTH_MODE=token for this process and the Ray processes it starts
        token_sent = True
        log.info("joining the Ray cluster at %s with token authentication (the token of this machine's user)", address)
    # Ray rewrites a loopback address to this machine's routable IP (see _local_only). A head
    # started the usual way (`ray start --head`, with or without --node-ip-address=127.0.0.1)
    # listens on every interface and registered its node under that routable IP: Ray's own
    # rewrite is then what joins it. Only a head kept on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    # or a Ray of opd's own) is not reachable there: this driver then joins as a loopback node too.
    routable_open = _listening(_routable(address))
    loopback_head = _is_loopback(address) and _listening(address) and not routable_open
    if not address.startswith("ray://") and not loopback_head and not routable_open:
        raise ConnectionError(f"could not join the Ray cluster at RAY_ADDRESS={address}: nothing accepts connections "
                              f"there. Start the head (`ray start --head --port {_host_port(address)[1]}`) or correct "
                              "RAY_ADDRESS; unset it to run on a Ray of opd's own on this machine.")
    try:
        with _local_only() if loopback_head else contextlib.nullcontext():
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True,
                     **({"_node_ip_address": LOOPBACK} if loopback_head else {}))
    except (ConnectionError, RuntimeError) as err:
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        mode = os.environ.get("RAY_AUTH_MODE")
        if token_sent or (mode or "").lower() == "token":
            advice = ("The token sent may not be the cluster's: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the "
                      "head node's token (`ray get-auth-token` there, or its ~/.ray/auth_token).")
        else:
            advice = ("If the cluster uses token authentication (`ray start` turns it on), set RAY_AUTH_MODE=token "
                      "and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the head node's token (`ray get-auth-token` "
                      "there, or its ~/.ray/auth_token).")
        raise ConnectionError(f"could not join the Ray cluster at RAY_ADDRESS={address}: {cause}. Check that the head "
                              f"is running there (`ray status --address {address}`). {advice} Unset RAY_ADDRESS to "
                              "run on a Ray of opd's own on this machine.") from err


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 6379


def _is_loopback(address: str) -> bool:
    import ipaddress
    import socket

    try:
        return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                   for info in socket.getaddrinfo(_host_port(address)[0], None))
    except (OSError, ValueError):
        return False


def _routable(address: str) -> str:
    """``address`` as Ray will dial it: a loopback host becomes this machine's routable IP."""
    if not _is_loopback(address):
        return address
    import ray

    return f"{ray.util.get_node_ip_address()}:{_host_port(address)[1]}"


def _listening(address: str, timeout_s: float = 5.0) -> bool:
    """Whether something accepts TCP connections at ``host:port`` within ``timeout_s``."""
    import socket

    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def is_this_machine(address: str) -> bool:
    """Whether ``address`` (``host:port``, or ``ray://host:port``) names this machine: a loopback
    host, this host's name, or one of its interfaces' addresses."""
    import socket

    host = _host_port(address)[0]
    if host in ("localhost", socket.gethostname(), socket.getfqdn()) or _is_loopback(address):
        return True
    try:
        import psutil

        resolved = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)}
        own = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except (ImportError, OSError):
        return False
    return bool(resolved & own)


def _token_at_hand() -> bool:
    """Whether a Ray token is set (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``) or saved
    (``~/.ray/auth_token``, which ``ray start`` writes)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).expanduser().is_file()


def worker_runtime_env() -> dict[str, Any]:
    """The job's ``runtime_env``: the driver's import path for the workers, installed code first,
    and the libraries' progress bars off (:data:`QUIET_WORKER_ENV`).

    ``PYTHONPATH`` is the driver's ``sys.path`` in order, with the working directory (and ``''``)
    moved to the end, after site-packages; the setup hook keeps the directories Ray itself puts
    first (the working directory and the script's directory) behind installed code.
    """
    cwd = os.path.abspath(os.getcwd())
    later = {cwd, os.path.realpath(cwd)}
    if sys.argv and sys.argv[0]:
        later.add(os.path.dirname(os.path.realpath(sys.argv[0])))
    entries = [p for p in sys.path if p and os.path.abspath(p) not in later]
    quiet = {name: os.environ.get(name, default) for name, default in QUIET_WORKER_ENV}
    return {"env_vars": {**quiet, "PYTHONPATH": os.pathsep.join([*entries, cwd])},
            "worker_process_setup_hook": _installed_first_hook(sorted(later))}


def _skip_dedup_advice() -> None:
    """Spend Ray's once-per-process advice on its log de-duplication ("(Ray deduplicates logs by
    default. Set RAY_DEDUP_LOGS=0 ...)"), which it appends to the first merged line; the merging
    itself, and every line an actor prints, stay as they are."""
    from ray.util.debug import log_once

    log_once("log_dedup_warning")  # the key of ray._private.ray_logging._warn_once


def listening_sockets() -> list[tuple[int, str, str]]:
    """``(pid, process name, "ip:port")`` of each listening TCP socket of this Ray session.

    The session's processes are this driver and every process under it (the GCS, raylet,
    agents, log monitor and workers of a local Ray), plus those ``ray`` records for this node.
    A security check for users: on a local run every address starts with ``127.0.0.1:`` (or
    ``::ffff:127.0.0.1:``, IPv4 loopback on an IPv6 socket). Joining a cluster, only this
    driver's own sockets are here. psutil comes with DeepSpeed and accelerate (and Ray ships a
    copy).
    """
    import psutil
    import ray

    me = psutil.Process()
    procs = {me.pid: me, **{p.pid: p for p in me.children(recursive=True)}}
    node = ray._private.worker.global_worker.node if ray.is_initialized() else None
    for infos in (node.all_processes.values() if node is not None else ()):
        for info in infos:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(info.process.pid)
                procs.update({p.pid: p for p in [root, *root.children(recursive=True)]})
    found = []
    for pid, proc in sorted(procs.items()):
        with contextlib.suppress(psutil.Error):  # a worker may exit while we look
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((pid, proc.name(), f"{conn.laddr.ip}:{conn.laddr.port}"))
    return found


def _enable_token_auth() -> None:
    """Turn token authentication on for the session this process starts.

    ``RAY_AUTH_MODE=token`` in this process's environment reaches every Ray process it starts;
    Ray reads it once, at ``import ray``, so its cached config is re-read here. The token is the
    first of: ``RAY_AUTH_TOKEN`` (the token itself), ``RAY_AUTH_TOKEN_PATH`` (a file holding it),
    ``~/.ray/auth_token``. Anyone connecting (``ray.init(address=...)``, ``ray status``, the jobs
    API) must run with ``RAY_AUTH_MODE=token`` and that token, which Ray sends as
    ``authorization: Bearer <token>``.
    """
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth as enable
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError as err:
        raise RuntimeError("opd starts its local Ray with token authentication, which needs Ray 2.52 or newer "
                           "(pip install 'ray>=2.52').") from err
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        log.warning("RAY_AUTH_MODE=%s ignored: opd's local Ray always uses token authentication.",
                    os.environ["RAY_AUTH_MODE"])
    _ensure_token_file()
    enable()
    if not is_token_auth_enabled():
        raise RuntimeError("Ray did not turn token authentication on (RAY_AUTH_MODE=token); install the Ray opd "
                           "was tested with (pip install 'ray==2.60.0').")


def _ensure_token_file() -> None:
    """Create ``~/.ray/auth_token`` readable by its owner only, when no token is set anywhere.

    Ray would create the same file itself, but with the default umask (0644 here): readable by
    every user of the machine who can reach the directory.
    """
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # 256 bits, as Ray's own generator


@contextlib.contextmanager
def _local_only() -> Iterator[None]:
    """Let ``ray.init(_node_ip_address="127.0.0.1")`` keep 127.0.0.1 as the node's IP.

    ``ray._private.services.resolve_ip_for_localhost`` replaces a loopback address with the
    machine's routable IP unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false (Ray's
    local-only mode, the default on macOS and Windows). ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    sets it too, but only before ``import ray``. The node's IP then decides every bind: the GCS,
    raylet and core workers listen on it, and the agents and metrics servers bind to loopback
    when it is loopback, to all interfaces otherwise. The switch is put back after start-up, so
    a later join of a real cluster from this process resolves addresses as usual.
    """
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@contextlib.contextmanager
def _ports_of_our_own() -> Iterator[None]:
    """Free ports for the servers a local Ray binds to a fixed port by default, so that two runs
    started at once on one machine do not clash: the dashboard agent's HTTP server (52365,
    ``RayParams``'s default, which ``ray.init`` does not let a caller set), the dashboard's and
    the autoscaler monitor's metrics servers (44227 and 44217: ``DASHBOARD_METRIC_PORT`` and
    ``AUTOSCALER_METRIC_PORT``, read by the processes Ray starts). The second run's agent
    otherwise retried for 3 s and ran without its HTTP service, its metrics servers not at all.
    Put back after start-up."""
    import inspect

    from ray._private.parameter import RayParams

    init = RayParams.__init__
    names = [n for n, p in inspect.signature(init).parameters.items() if p.default is not inspect.Parameter.empty]
    before_defaults = init.__defaults__
    if before_defaults is not None and "dashboard_agent_listen_port" in names and len(names) == len(before_defaults):
        defaults = list(before_defaults)
        defaults[names.index("dashboard_agent_listen_port")] = _free_port()
        init.__defaults__ = tuple(defaults)
    env = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")
    before_env = {name: os.environ.get(name) for name in env}
    os.environ.update({name: str(_free_port()) for name in env if before_env[name] is None})
    try:
        yield
    finally:
        init.__defaults__ = before_defaults
        for name, value in before_env.items():
            if value is None:
                os.environ.pop(name, None)


def _free_port() -> int:
    """A TCP port free on loopback now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _installed_first_hook(later: list[str]) -> Callable[[], None]:
    """A worker setup hook that puts the directories ``later`` behind installed code.

    Ray inserts the driver's working directory and script directory at ``sys.path[0]`` of each
    worker, at its first task (after this hook has run), so reordering ``sys.path`` here would
    be undone. The hook adds an import finder in front instead: a top-level import is resolved
    as usual but without ``later``; only a name found nowhere else comes from ``later``. An
    editable install of opd (found by its own finder, after every ``sys.path`` entry) is
    covered too. Submodules follow their package.

    The hook is a closure, so Ray pickles it by value and the worker unpickles it without
    importing opd (which a working directory holding an ``opd/`` could replace): everything it
    uses is imported inside it.
    """

    def install_installed_first_finder() -> None:
        import importlib.machinery
        import os
        import sys
        import threading

        deferred = frozenset(later)
        busy = threading.local()  # names being resolved on this thread: a finder that asks again

        class InstalledFirst:
            """Resolves a top-level import with ``deferred`` left out of ``sys.path``."""

            @staticmethod
            def find_spec(name, path=None, target=None):
                names = busy.__dict__.setdefault("names", set())
                if path is not None or name in names:
                    return None
                names.add(name)
                try:
                    trusted = [p for p in sys.path if os.path.abspath(p or os.curdir) not in deferred]
                    for finder in sys.meta_path:
                        if finder is InstalledFirst:
                            continue
                        if finder is importlib.machinery.PathFinder:
                            spec = finder.find_spec(name, trusted, target)
                        else:
                            find = getattr(finder, "find_spec", None)
                            spec = find(name, None, target) if find is not None else None
                        if spec is not None:
                            return spec
                    return None  # nowhere but `deferred`: the usual search finds it there
                finally:
                    names.discard(name)

        sys.meta_path.insert(0, InstalledFirst)

    return install_installed_first_finder
