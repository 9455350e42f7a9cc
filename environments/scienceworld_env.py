"""ScienceWorld (Wang et al., 2022) as an opd text environment, on the official Scala engine.

The agent reads a science task ("boil ice cream", "find an animal", ...) and a room description, and
answers with one ScienceWorld command per turn ("open door to kitchen", "focus on thermometer").
All 30 tasks are available, with the engine's own train/dev/test variation splits (opd "train",
"eval" and "test"). Task ids read ``sw-<task_name>-<variation>``, e.g. ``"sw-boil-14"``.

Where this departs from the ``scienceworld`` package's ``ScienceWorldEnv`` wrapper, and why:
    * The JVM runs with ``-XX:hashCode=2`` (every identity hash is 1). The engine keeps objects in
      hash sets keyed by identity hash, so by default the order of listed objects, and even the heat
      flow that sets a thermometer reading, changes from one JVM to the next; with a constant hash
      that order is insertion order and a trajectory is a pure function of task and actions. It
      costs about 1.5x in step time.
    * The engine's gold path (the expert) is not reproducible from run to run even so, and
      generating it takes 0.2-20 s. It is generated once per (task, variation, simplifications)
      and cached as JSON under ``cache_dir``; later resets of that task read the file.
    * ``step`` talks to the engine directly instead of through the wrapper, which also lists every
      valid action-object combination on every step (400-3,000 strings, 40-200 ms).
      ``admissible_actions=True`` turns that list on.
    * Reward is the change in score divided by 100, so an episode's return is (final score - score
      at reset) / 100. As in the wrapper, a negative score (the engine's -100 for a failed task, e.g. focusing on
      the wrong object) ends the episode.

Example:
    >>> env = ScienceWorldTextEnv(task_names=["find-animal"], cache_dir="/tmp/sw-cache")
    >>> obs, info = env.reset(options={"task": "sw-find-animal-150"})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])
    >>> info["score"], info["success"]
    (17, False)
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import gymnasium

from environments.base import TextEnv, check_split

SPLITS: tuple[str, ...] = ("train", "eval", "test")
# Variations per task, in the order of the engine's tasks.json (the paper's task numbering 1-1 ... 10-2).
# Hard-coded so task_ids() needs no JVM; tests check it against the engine.
TASK_MAX_VARIATIONS: dict[str, int] = {
    "boil": 30,
    "melt": 30,
    "freeze": 30,
    "change-the-state-of-matter-of": 30,
    "use-thermometer": 540,
    "measure-melting-point-known-substance": 436,
    "measure-melting-point-unknown-substance": 300,
    "power-component": 20,
    "power-component-renewable-vs-nonrenewable-energy": 20,
    "test-conductivity": 900,
    "test-conductivity-of-unknown-substances": 600,
    "find-living-thing": 300,
    "find-non-living-thing": 300,
    "find-plant": 300,
    "find-animal": 300,
    "grow-plant": 126,
    "grow-fruit": 126,
    "chemistry-mix": 32,
    "chemistry-mix-paint-secondary-color": 36,
    "chemistry-mix-paint-tertiary-color": 36,
    "lifespan-longest-lived": 125,
    "lifespan-shortest-lived": 125,
    "lifespan-longest-lived-then-shortest-lived": 125,
    "identify-life-stages-1": 14,
    "identify-life-stages-2": 10,
    "inclined-plane-determine-angle": 168,
    "inclined-plane-friction-named-surfaces": 1386,
    "inclined-plane-friction-unnamed-surfaces": 162,
    "mendelian-genetics-known-plant": 120,
    "mendelian-genetics-unknown-plant": 480,
}
SIMPLIFICATIONS: frozenset[str] = frozenset({"easy", "teleportAction", "selfWateringFlowerPots", "openContainers",
                                            "openDoors", "noElectricalAction"})
# Commands that neither advance the simulation nor change the world: the expert stays on its path.
FREE_COMMANDS: frozenset[str] = frozenset({"look around", "inventory", "task", "help", "objects"})
_TASK_RE = re.compile(r"sw-([a-z0-9-]+)-(\d+)")
_INVALID_PREFIXES = ("No known action matches that input", "Unknown action")
_AMBIGUOUS_PREFIX = "Ambiguous request"
_JVM_OPTIONS = ["-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=2"]  # see the module docstring


def split_variations(max_variations: int) -> dict[str, list[int]]:
    """The engine's train/dev/test variation split of a task with ``max_variations`` variations.

    A copy of ``PythonInterface.getSets`` (50% / 25% / 25% in contiguous blocks); opd names the
    engine's "dev" split "eval".

    Example:
        >>> {k: len(v) for k, v in split_variations(30).items()}
        {'train': 14, 'eval': 7, 'test': 9}
    """
    small = {1: ([0], [], [0]), 2: ([0], [], [1]), 3: ([0], [1], [2]), 4: ([0, 1], [2], [3])}
    if max_variations in small:
        train, dev, test = small[max_variations]
        return {"train": train, "eval": dev, "test": test}
    size = max_variations // 4
    groups = [list(range(i, min(i + size, max_variations))) for i in range(0, max_variations, size)]
    return {"train": groups[0] + groups[1], "eval": groups[2], "test": [v for g in groups[3:] for v in g]}


def normalize_command(text: Any) -> str:
    """Collapses whitespace and drops one trailing '.'; the engine ignores case itself.

    Example:
        >>> normalize_command("  open door   to kitchen. ")
        'open door to kitchen'
    """
    if not isinstance(text, str):
        return ""
    command = " ".join(text.split())
    return command[:-1].rstrip() if command.endswith(".") else command


def default_cache_dir(name: str) -> Path:
    """``$OPD_ENVS_CACHE_DIR/<name>``, by default ``~/.cache/opd/envs/<name>``."""
    root = os.environ.get("OPD_ENVS_CACHE_DIR") or os.path.join("~", ".cache", "opd", "envs")
    return Path(os.path.expanduser(root)) / name


def write_json_atomic(path: Path, payload: Any) -> None:
    """Writes JSON to a temp file beside ``path``, then renames it: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def launch_jvm(jar_path: str, cwd: str, javaopts: list[str], *, engine: str) -> Any:
    """Starts a JVM serving ``jar_path`` over py4j and returns its ``JavaGateway``.

    Its stdout and stderr go to /dev/null (the engines print debug text on every step).
    """
    from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway

    try:
        port, process = launch_gateway(classpath=jar_path, die_on_exit=True, cwd=cwd, return_proc=True,
                                       javaopts=list(javaopts))
    except Exception as exc:
        raise RuntimeError(f"could not start the {engine} JVM ({exc!r}); it needs Java 17+ on PATH"
                           + (f" accepting {' '.join(javaopts)}" if javaopts else "")) from exc
    return JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port), java_process=process)


def shutdown_jvm(gateway: Any) -> None:
    """Stops a gateway from :func:`launch_jvm` and waits for its JVM to exit (kills it after 10 s)."""
    process = gateway.java_process
    try:
        gateway.shutdown()
    finally:
        # die_on_exit=True: the JVM exits once it reads a line on stdin (py4j issue 320).
        if process.poll() is None:
            try:
                process.stdin.write(b"\n")
                process.stdin.flush()
                process.wait(timeout=10)
            except Exception:
                process.kill()


class GoldPathFollower:
    """Offers the next action of a fixed gold path while the agent stays on it.

    A gold path is made for the world it starts from, so it cannot be re-planned: it advances when
    the agent takes its next action, waits while the agent's command left the world unchanged, and
    is lost (``next_action`` None) once the agent did anything else.

    Example:
        >>> gold = GoldPathFollower(["open door", "go east"])
        >>> gold.update("look around", world_unchanged=True); gold.next_action
        'open door'
        >>> gold.update("Open door.", world_unchanged=False); gold.next_action
        'go east'
        >>> gold.update("go west", world_unchanged=False); gold.next_action is None
        True
    """

    def __init__(self, actions: list[str]) -> None:
        self.actions = list(actions)
        self.index: int | None = 0  # None once the agent left the path

    @property
    def next_action(self) -> str | None:
        """The gold action to take now; None once off the path or past its end."""
        if self.index is None or self.index >= len(self.actions):
            return None
        return self.actions[self.index]

    def update(self, command: str, *, world_unchanged: bool) -> None:
        """Records the agent's ``command``; ``world_unchanged`` says the engine changed nothing."""
        expected = self.next_action
        if expected is None:
            return
        if normalize_command(command).lower() == normalize_command(expected).lower():
            self.index += 1
        elif not world_unchanged:
            self.index = None


class ScienceWorldTextEnv(TextEnv):
    """ScienceWorld: 30 elementary-science tasks in a simulated house, scored 0-100 (official Scala engine, gold-path expert).

    One JVM per env instance, started at the first ``reset`` and stopped by ``close``.

    Args:
        max_turns: Turn budget; reaching it without the task ending truncates. Gold paths take
            3-180 turns (mendelian genetics about 145, some inclined-plane tasks up to 180); 90% of
            eval tasks need at most 100.
        task_names: Tasks to include (default all 30, see ``TASK_MAX_VARIATIONS``); every split
            keeps its official variations of these tasks.
        simplifications: The engine's comma-separated simplifications, e.g. "easy" or
            "teleportAction,openDoors"; "" (default) is the full game.
        expert: Offer ``info["expert_action"]`` (the next gold-path action). Generating a gold
            path takes 0.2-20 s the first time a task is played; later resets read the cache.
        admissible_actions: Add ``info["admissible_actions"]``, every valid action-object
            combination (400-3,000 strings, 40-200 ms per step).
        invalid_action_penalty: Subtracted from the reward of an action the engine cannot parse.
        cache_dir: Where gold paths are cached; default ``default_cache_dir("scienceworld")``.
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    report_keys = ("score",)  # the engine's score at the episode's end (eval/<who>_score)

    def __init__(
        self,
        *,
        max_turns: int = 200,
        task_names: list[str] | tuple[str, ...] | None = None,
        simplifications: str = "",
        expert: bool = True,
        admissible_actions: bool = False,
        invalid_action_penalty: float = 0.0,
        cache_dir: str | os.PathLike | None = None,
        render_mode: str | None = None,
    ) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an integer >= 1")
        names = list(TASK_MAX_VARIATIONS) if task_names is None else list(task_names)
        unknown = [n for n in names if n not in TASK_MAX_VARIATIONS]
        if unknown or not names:
            raise ValueError(
                f"task_names={task_names!r}: unknown or empty; choose from {', '.join(TASK_MAX_VARIATIONS)}"
            )
        if not isinstance(simplifications, str) or not set(filter(None, simplifications.split(","))) <= SIMPLIFICATIONS:
            raise ValueError(f"simplifications={simplifications!r} must be a comma-separated str of "
                             f"{', '.join(sorted(SIMPLIFICATIONS))} (or '' for none)")
        if isinstance(invalid_action_penalty, bool) or not isinstance(invalid_action_penalty, (int, float)) \
                or invalid_action_penalty < 0:
            raise ValueError(f"invalid_action_penalty={invalid_action_penalty!r} must be >= 0 (it is subtracted)")
        super().__init__(max_turns=max_turns, render_mode=render_mode, max_observation_chars=100_000,
                         max_action_chars=1_000)
        self.task_names = tuple(n for n in TASK_MAX_VARIATIONS if n in names)  # canonical order
        self.simplifications = simplifications
        self.expert = bool(expert)
        self.admissible_actions = bool(admissible_actions)
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir("scienceworld")
        self._gateway: Any = None  # py4j JavaGateway, started lazily
        self._server: Any = None  # the engine's PythonInterface
        self._gold = GoldPathFollower([])
        self._pending_choice = False  # the engine asked "which one did you mean?"
        self._score = 0

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids ``sw-<task>-<variation>`` of ``split`` ("train", "eval" = official dev, "test")."""
        check_split(split, SPLITS)
        return [f"sw-{name}-{v}" for name in self.task_names
                for v in split_variations(TASK_MAX_VARIATIONS[name])[split]]

    def parse_task_id(self, task_id: Any) -> tuple[str, int]:
        """(task name, variation) of ``task_id``; ValueError if malformed or not in this env's tasks."""
        match = _TASK_RE.fullmatch(task_id) if isinstance(task_id, str) else None
        if match is None or match.group(1) not in self.task_names:
            raise ValueError(
                f"malformed task id {task_id!r}; expected 'sw-<task>-<variation>', e.g. 'sw-boil-14', "
                f"with a task among {', '.join(self.task_names)}"
            )
        name, variation = match.group(1), int(match.group(2))
        if variation >= TASK_MAX_VARIATIONS[name]:
            raise ValueError(f"task id {task_id!r} is out of range; {name!r} has {TASK_MAX_VARIATIONS[name]} variations")
        return name, variation

    # ----- episode -----
    def _draw_train_task(self) -> str:
        """A task name uniformly, then one of its train variations: tasks with many variations are not favoured."""
        name = self.task_names[int(self.np_random.integers(len(self.task_names)))]
        train = split_variations(TASK_MAX_VARIATIONS[name])["train"]
        return f"sw-{name}-{train[int(self.np_random.integers(len(train)))]}"

    def _start_episode(self, task: str) -> str:
        """Loads ``task``'s world (and its gold path, from the cache or the engine) and looks around."""
        name, variation = self.parse_task_id(task)
        server = self._engine()
        gold = self._load(name, variation) if self.expert else self._load_world(name, variation, gold=False)
        self._gold = GoldPathFollower(gold)
        look = server.step("look around")  # what the official reset shows; it takes no game time
        self._pending_choice = False
        self._score = _score_of(server)
        forms = ", ".join(server.getPossibleActions())
        return (
            f"{server.getTaskDescription().strip()}\n"
            "Answer with one action per turn, e.g. \"look around\" or \"open door to kitchen\". "
            f"Action forms (OBJ is a thing or place you can see): {forms}. "
            "\"objects\" lists what you can refer to.\n\n"
            f"{look.strip()}"
        )

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Sends one command; an unparseable one costs a turn and the penalty, never raises."""
        self._begin_turn()
        command = normalize_command(action)
        reply = self._server.step(command) if command else _INVALID_PREFIXES[0] + "."
        valid = not reply.startswith(_INVALID_PREFIXES)
        # Answering (or cancelling) the engine's "which one?" question changes the world.
        self._gold.update(command, world_unchanged=not self._pending_choice
                          and (not valid or command.lower() in FREE_COMMANDS))
        self._pending_choice = valid and reply.startswith(_AMBIGUOUS_PREFIX)
        score = _score_of(self._server)
        reward = (score - self._score) / 100.0
        self._score = score
        completed = bool(self._server.getCompleted())
        terminated = completed or score < 0
        success = completed and score >= 100
        if terminated:
            self._gold = GoldPathFollower([])  # the episode is over: nothing left to suggest
        if valid:
            obs = reply.strip()
        else:
            reward -= self.invalid_action_penalty
            obs = (f"Invalid action {str(action)[:80]!r}: {reply.strip()} "
                   "Answer with one action, e.g. \"look around\"; \"help\" lists the action forms.")
        truncated = self._end_turn(obs, terminated=terminated)
        return obs, reward, terminated, truncated, self._info(success=success, valid_action=valid)

    def _has_episode(self) -> bool:
        # close() and a copy drop the JVM with the episode in it.
        return self._server is not None and super()._has_episode()

    def close(self) -> None:
        """Stops the JVM (idempotent); the next reset starts a new one."""
        gateway, self._gateway, self._server, self._done = self._gateway, None, None, True
        if gateway is not None:
            shutdown_jvm(gateway)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) starts its own JVM on its first reset.
        state = self.__dict__.copy()
        state.update(_gateway=None, _server=None, _done=True)
        return state

    # ----- engine -----
    def _engine(self) -> Any:
        if self._server is None:
            from scienceworld.constants import BASEPATH, JAR_PATH

            self._gateway = launch_jvm(JAR_PATH, BASEPATH, _JVM_OPTIONS, engine="ScienceWorld")
            self._server = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        return self._server

    def _gold_path_file(self, name: str, variation: int) -> Path:
        import scienceworld

        tag = self.simplifications.replace(",", "+") or "full"
        return self.cache_dir / f"gold-v{scienceworld.__version__}" / tag / f"{name}-{variation}.json"

    def _load(self, name: str, variation: int) -> list[str]:
        """Loads the world and returns its gold path, from the cache or freshly generated."""
        path = self._gold_path_file(name, variation)
        if path.exists():
            self._load_world(name, variation, gold=False)
            return list(json.loads(path.read_text())["gold"])
        gold = self._load_world(name, variation, gold=True)
        write_json_atomic(path, {"task": name, "variation": variation, "simplifications": self.simplifications,
                                 "gold": gold})
        return gold

    def _load_world(self, name: str, variation: int, *, gold: bool) -> list[str]:
        error = self._server.load(name, variation, self.simplifications, gold)
        if error:
            raise ValueError(f"ScienceWorld could not load task {name!r} variation {variation} "
                             f"with simplifications {self.simplifications!r}: {error}")
        return [str(a) for a in self._server.getGoldActionSequence()] if gold else []

    def _state_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"score": self._score}
        if self.expert:
            info["expert_action"] = self._gold.next_action
        if self.admissible_actions:
            info["admissible_actions"] = [str(a) for a in self._server.getValidActionObjectCombinations()]
        return info


def _score_of(server: Any) -> int:
    """The engine's score as an int in [-100, 100] (the engine keeps a fraction)."""
    return int(round(100 * float(server.getScore())))


if "opd/ScienceWorldText-v0" not in gymnasium.registry:
    gymnasium.register(id="opd/ScienceWorldText-v0", entry_point="environments.scienceworld_env:ScienceWorldTextEnv")
