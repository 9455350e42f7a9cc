"""Procedural ALFWorld games: PDDL problems for the six ALFWorld task types over real floor plans.

A generated game is what ``alfworld-generate`` writes for an ALFRED trajectory: a ``game.tw-pddl``
(the official ``alfred.pddl`` domain, the official ``alfred.twl2`` grammar with the goal sentence
filled in, and a PDDL problem) plus a ``traj_data.json`` carrying the task type and targets.

Where the rooms come from:
    The alfworld package ships, for each of the 120 AI2-THOR floor plans, the object types present
    (``layouts/FloorPlanN-objects.json``) and every receptacle instance with the pose the agent
    interacts from (``layouts/FloorPlanN-openable.json``). A generated room keeps those receptacles
    and their locations, adds the static receptacles the scene has but that file omits (stove
    burners, coffee machine, toaster, toilet ...) at invented locations, and scatters a sample of
    the scene's portable object types over receptacles that ALFRED allows to hold them
    (``constants.VAL_RECEPTACLE_OBJECTS``). Object properties (cleanable, heatable, coolable,
    sliceable, openable) come from the same constants; goals and goal sentences from
    ``goal_library.gdict``.

Departures from the official data, and why:
    * Object positions are sampled, not recorded from a THOR rollout, so there is no ALFRED
      trajectory or human annotation behind a task; the goal sentence is the official template.
    * Decorative objects that only ever sit on the floor (paintings, windows, light switches) are
      left out: no task uses them and they only lengthen observations.
    * The target never starts inside a receptacle of the goal type, nor inside the appliance the
      task needs (sink, microwave, fridge), so every task needs at least pick-up and put-down.
    * ``look_at_obj_in_light`` uses desk lamps only: the official goal needs the lamp to sit in a
      receptacle, and official floor-lamp games are all marked unsolvable.

Splits: "train" draws rooms from ``constants.TRAIN_SCENE_NUMBERS`` (96 floor plans) and "eval"
from ``constants.TEST_SCENE_NUMBERS`` (6 kitchens, 6 living rooms, 6 bedrooms, 6 bathrooms never
used in train), so the two are disjoint by content, like ALFWorld's valid_unseen. "eval_seen"
draws new tasks in the train rooms, like valid_seen. The split name is part of the sampler's
seed, so each split's tasks are independent draws.

Example:
    >>> task = sample_task("eval", 3, split_seed=0)
    >>> task.task_type, task.description
    ('pick_heat_then_place_in_recep', 'heat some apple and put it in sinkbasin')
    >>> game = game_data(task)  # {"pddl_domain", "grammar", "pddl_problem"}
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass

# Task-id slug -> official ALFWorld task_type (index in this tuple order = index % 6 in task ids).
TASK_TYPES: dict[str, str] = {
    "pick_and_place": "pick_and_place_simple",
    "look_at_obj_in_light": "look_at_obj_in_light",
    "pick_clean_then_place": "pick_clean_then_place_in_recep",
    "pick_heat_then_place": "pick_heat_then_place_in_recep",
    "pick_cool_then_place": "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place": "pick_two_obj_and_place",
}
# The appliance a task type needs; its receptacle type is neither goal nor start for the target.
_APPLIANCE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable"),
}
_LAMP = "DeskLamp"
_LAMP_SURFACES = ("SideTable", "Desk", "Dresser", "Shelf", "CoffeeTable", "DiningTable", "CounterTop", "TVStand")
_BASINS = {"Sink": "SinkBasin", "Bathtub": "BathtubBasin"}  # openable.json names the fixture, PDDL the basin
_SYNTHETIC_COUNTS = {"StoveBurner": 4}  # instances of a static receptacle the layout file lacks; default 1
_MAX_DISTRACTOR_TYPES = 10  # portable non-target types per room: keeps observations and steps short
_VARY_DROP, _VARY_ADD = 0.35, 0.25  # vary_rooms: the chance a room loses a receptacle type / gains one
_GRID = 0.25  # AI2-THOR agent step (constants.AGENT_STEP_SIZE): location ids are in grid units


@dataclass(frozen=True)
class Receptacle:
    id: str  # THOR-style id, e.g. "Cabinet|+00.68|+00.50|-02.20"; "Sink|...|SinkBasin" for basins
    type: str  # e.g. "Cabinet", "SinkBasin"
    location: str  # e.g. "loc|0|-5|2|30" (x, z in grid steps, rotation / 90, camera horizon)


@dataclass(frozen=True)
class PlacedObject:
    id: str  # e.g. "Apple|-01.23|+00.95|+00.40"
    type: str
    receptacle: str  # id of the receptacle holding it


@dataclass(frozen=True)
class GeneratedTask:
    """One generated game: the room, where everything is, and the goal.

    Attributes:
        task_id: e.g. ``"alfgen-pick_heat_then_place-eval-00003"``.
        task_type: Official ALFWorld task type, e.g. ``"pick_heat_then_place_in_recep"``.
        scene: AI2-THOR floor plan number (1-30 kitchens, 201-230 living rooms, 301-330
            bedrooms, 401-430 bathrooms).
        object_target / parent_target / toggle_target: ALFRED's ``pddl_params`` ("" if unused).
        description: The goal sentence shown after "Your task is to: ".
    """

    task_id: str
    task_type: str
    scene: int
    object_target: str
    parent_target: str
    toggle_target: str
    description: str
    agent_location: str
    receptacles: tuple[Receptacle, ...]
    objects: tuple[PlacedObject, ...]


# ----- the alfworld package's data (imported lazily so that importing opd never needs alfworld) -----
def _constants():
    try:
        import alfworld.gen.constants as constants
    except ImportError as exc:
        raise ImportError(
            "ALFWorld needs the 'alfworld' package (with TextWorld's PDDL support): pip install alfworld==0.4.2"
        ) from exc
    return constants


@functools.lru_cache(maxsize=1)
def _catalog() -> dict:
    """Derived constant tables (static receptacle types, portable types, allowed holders)."""
    c = _constants()
    static = set(c.RECEPTACLES) - set(c.MOVABLE_RECEPTACLES)
    holders: dict[str, set[str]] = {}
    for rtype, contents in c.VAL_RECEPTACLE_OBJECTS.items():
        if rtype in static:
            for otype in contents:
                holders.setdefault(otype, set()).add(rtype)
    portable = {o for o in holders if o in c.OBJECTS and o not in static}
    return {
        "static": static,
        "holders": holders,  # object type -> static receptacle types that may hold it
        "portable": portable,
        "otypes": sorted((set(c.OBJECTS) | set(c.MOVABLE_RECEPTACLES)) - static),
        "rtypes": sorted(static),
        "openable": set(c.OPENABLE_CLASS_LIST),
        "movable": set(c.MOVABLE_RECEPTACLES),
        "actions": {k: set(v) for k, v in c.VAL_ACTION_OBJECTS.items()},
    }


def split_scenes(split: str) -> tuple[int, ...]:
    """Floor plans a split draws rooms from: ALFRED's test scenes for "eval", its train scenes otherwise."""
    c = _constants()
    if split in ("train", "eval_seen"):
        return tuple(c.TRAIN_SCENE_NUMBERS)
    if split == "eval":
        return tuple(c.TEST_SCENE_NUMBERS)
    raise ValueError(f"unknown split {split!r}; valid splits: 'train', 'eval', 'eval_seen'")


def room_type(scene: int) -> str:
    return next(name for name, numbers in _constants().SCENE_TYPE.items() if scene in numbers)


@functools.lru_cache(maxsize=256)
def scene_inventory(scene: int) -> tuple[tuple[Receptacle, ...], frozenset[str]]:
    """(receptacles with a recorded interaction pose, object types present) of a floor plan."""
    layouts = os.path.join(os.path.dirname(_constants().__file__), "layouts")
    with open(os.path.join(layouts, f"FloorPlan{scene}-openable.json")) as f:
        poses = json.load(f)
    with open(os.path.join(layouts, f"FloorPlan{scene}-objects.json")) as f:
        types = frozenset(json.load(f))
    receptacles = []
    for rid, (x, z, rotation, horizon) in sorted(poses.items()):
        prefix = rid.split("|")[0]
        rtype = _BASINS.get(prefix, prefix)
        rid = f"{rid}|{rtype}" if prefix in _BASINS else rid
        location = f"loc|{round(x / _GRID)}|{round(z / _GRID)}|{int(rotation) // 90 % 4}|{int(horizon)}"
        receptacles.append(Receptacle(rid, rtype, location))
    return tuple(receptacles), types


# ----- sampling -----
def sample_task(split: str, index: int, split_seed: int = 0, vary_rooms: bool = False) -> GeneratedTask:
    """The task at ``index`` of ``split``: a pure function of its arguments.

    The task type cycles with the index (``index % 6``, in ``TASK_TYPES`` order), so any prefix of a
    split is balanced over the six types. ``vary_rooms`` furnishes each room anew (see
    :func:`_vary_furniture`), so that which receptacles a room has is read from its listing, not
    remembered from its floor plan.
    """
    slug = list(TASK_TYPES)[index % len(TASK_TYPES)]
    task_type = TASK_TYPES[slug]
    task_id = f"alfgen-{slug}-{split}-{index:05d}"
    # A string seed goes through sha512: stable across processes and Python hash seeds.
    rng = random.Random(f"opd-alfgen/{split_seed}/{split}/{index}")
    scenes = [s for s in split_scenes(split) if room_type(s) in _constants().GOALS_VALID[task_type]]
    rng.shuffle(scenes)
    for scene in scenes:
        task = _sample_in_scene(task_id, task_type, scene, rng, vary_rooms)
        if task is not None:
            return task
    raise RuntimeError(f"no floor plan in split {split!r} can host a {task_type} task")


def _room_receptacles(scene: int, rng: random.Random, vary: bool = False) -> list[Receptacle]:
    cat = _catalog()
    recorded, types = scene_inventory(scene)
    receptacles = list(recorded)
    present = {r.type for r in receptacles}
    used_locations, taken = {r.location for r in receptacles}, {r.id for r in receptacles}
    for rtype in sorted(t for t in types if t in cat["static"] and t not in present):
        for _ in range(_SYNTHETIC_COUNTS.get(rtype, 1)):
            location = _fresh_location(rng, used_locations)
            receptacles.append(Receptacle(_fresh_id(rtype, rng, taken), rtype, location))
    return _vary_furniture(scene, receptacles, rng) if vary else receptacles


@functools.lru_cache(maxsize=8)
def _furniture_of(kind: str) -> tuple[str, ...]:
    """Receptacle types found in the train floor plans of a room type ("Kitchen", "Bathroom", ...)."""
    cat = _catalog()
    found: set[str] = set()
    for scene in _constants().TRAIN_SCENE_NUMBERS:
        if room_type(scene) == kind:
            recorded, types = scene_inventory(scene)
            found |= {r.type for r in recorded} | (set(types) & cat["static"])
    return tuple(sorted(found))


def _vary_furniture(scene: int, receptacles: list[Receptacle], rng: random.Random) -> list[Receptacle]:
    """The room with its furniture changed: each receptacle type it has leaves with probability
    ``_VARY_DROP`` (at least two stay), and each other type that rooms of its kind have comes with
    probability ``_VARY_ADD`` (1-3 of it, at new locations). The task is then sampled in that room as
    in any other; a room that cannot host it is skipped like a floor plan that cannot."""
    present = sorted({r.type for r in receptacles})
    kept = {t for t in present if rng.random() >= _VARY_DROP}
    if len(kept) < 2:
        kept = set(rng.sample(present, min(2, len(present))))
    out = [r for r in receptacles if r.type in kept]
    used_locations, taken = {r.location for r in receptacles}, {r.id for r in receptacles}
    for rtype in _furniture_of(room_type(scene)):
        if rtype in present or rng.random() >= _VARY_ADD:
            continue
        for _ in range(_SYNTHETIC_COUNTS.get(rtype, rng.randint(1, 3))):
            out.append(Receptacle(_fresh_id(rtype, rng, taken), rtype, _fresh_location(rng, used_locations)))
    return out


def _sample_in_scene(task_id: str, task_type: str, scene: int, rng: random.Random,
                     vary_rooms: bool = False) -> GeneratedTask | None:
    cat = _catalog()
    receptacles = _room_receptacles(scene, rng, vary_rooms)
    _, types = scene_inventory(scene)
    rtypes_present = {r.type for r in receptacles}
    holds = {o: cat["holders"][o] & rtypes_present for o in sorted(types & cat["portable"])}
    holds = {o: h for o, h in holds.items() if h}

    appliance, ability = _APPLIANCE.get(task_type, ("", ""))
    if appliance and appliance not in rtypes_present:
        return None
    lamp_surfaces = sorted(rtypes_present & set(_LAMP_SURFACES))
    if task_type == "look_at_obj_in_light" and (_LAMP not in types or not lamp_surfaces):
        return None

    # (object type, goal receptacle type, receptacle types the target may start in)
    options: list[tuple[str, str, list[str]]] = []
    for otype, holders in holds.items():
        if ability and otype not in cat["actions"][ability]:
            continue
        if task_type == "look_at_obj_in_light":
            options.append((otype, "", sorted(holders)))
            continue
        for parent in sorted(holders - {appliance}):
            start = sorted(holders - {parent, appliance})
            if start:
                options.append((otype, parent, start))
    if not options:
        return None
    object_target, parent_target, start_types = rng.choice(options)

    taken: set[str] = set()
    objects: list[PlacedObject] = []

    def place(otype: str, count: int, allowed_types: list[str]) -> None:
        hosts = [r for r in receptacles if r.type in allowed_types]
        for _ in range(count):
            objects.append(PlacedObject(_fresh_id(otype, rng, taken), otype, rng.choice(hosts).id))

    n_targets = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 3)
    place(object_target, n_targets, start_types)
    toggle_target = ""
    if task_type == "look_at_obj_in_light":
        toggle_target = _LAMP
        place(_LAMP, 1, lamp_surfaces)
    distractors = [o for o in holds if o != object_target]
    for otype in sorted(rng.sample(distractors, min(_MAX_DISTRACTOR_TYPES, len(distractors)))):
        place(otype, rng.randint(1, 2), sorted(holds[otype]))

    templates = _goal_library().gdict[task_type]["templates"]
    description = rng.choice(templates).format(
        obj=object_target.lower(), recep=parent_target.lower(), toggle=toggle_target.lower(), mrecep=""
    )
    agent_location = _fresh_location(rng, {r.location for r in receptacles})
    return GeneratedTask(
        task_id=task_id,
        task_type=task_type,
        scene=scene,
        object_target=object_target,
        parent_target=parent_target,
        toggle_target=toggle_target,
        description=description,
        agent_location=agent_location,
        receptacles=tuple(sorted(receptacles, key=lambda r: r.id)),
        objects=tuple(sorted(objects, key=lambda o: o.id)),
    )


def _fresh_id(otype: str, rng: random.Random, taken: set[str]) -> str:
    while True:
        x, y, z = (rng.uniform(-3.0, 3.0), rng.uniform(0.0, 2.0), rng.uniform(-3.0, 3.0))
        oid = f"{otype}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}"
        if oid not in taken:
            taken.add(oid)
            return oid


def _fresh_location(rng: random.Random, used: set[str]) -> str:
    while True:
        x, z, rotation = rng.randint(-12, 12), rng.randint(-12, 12), rng.randint(0, 3)
        location = f"loc|{x}|{z}|{rotation}|{rng.choice((0, 30, 45, 60))}"
        if location not in used:
            used.add(location)
            return location


def _goal_library():
    import alfworld.gen.goal_library as goal_library

    return goal_library


# ----- rendering the official file formats -----
_PDDL_CHARS = {"-": "_minus_", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"}


def pddl_name(thor_id: str) -> str:
    """THOR id -> PDDL symbol, exactly as ALFWorld mangles it ("Apple|+00.10" -> "Apple_bar__plus_00_dot_10").

    ``AlfredDemangler`` reverses this and numbers instances per type ("apple 1").
    """
    return "".join(_PDDL_CHARS.get(ch, ch) for ch in thor_id)


def render_problem(task: GeneratedTask) -> str:
    """The PDDL problem in the layout of ALFWorld's ``initial_state.pddl`` files."""
    cat = _catalog()
    by_id = {r.id: r for r in task.receptacles}
    objects = [(pddl_name(o.id), o) for o in task.objects]
    receptacles = [(pddl_name(r.id), r) for r in task.receptacles]
    locations = sorted({r.location for r in task.receptacles} | {task.agent_location})
    object_types = sorted({o.type for o in task.objects})
    receptacle_types = sorted({r.type for r in task.receptacles})

    declarations = ["agent1 - agent"]
    declarations += [f"{t}Type - otype" for t in cat["otypes"]]
    declarations += [f"{t}Type - rtype" for t in cat["rtypes"]]
    declarations += [f"{name} - object" for name, _ in objects]
    declarations += [f"{name} - receptacle" for name, _ in receptacles]
    declarations += [f"{pddl_name(loc)} - location" for loc in locations]

    facts = [f"(atLocation agent1 {pddl_name(task.agent_location)})"]
    for name, r in receptacles:
        facts.append(f"(receptacleType {name} {r.type}Type)")
        facts.append(f"(receptacleAtLocation {name} {pddl_name(r.location)})")
        if r.type in cat["openable"]:
            facts.append(f"(openable {name})")
    for rtype in receptacle_types:
        allowed = _constants().VAL_RECEPTACLE_OBJECTS.get(rtype, set())
        facts += [f"(canContain {rtype}Type {otype}Type)" for otype in object_types if otype in allowed]
    actions = cat["actions"]
    for name, o in objects:
        facts.append(f"(objectType {name} {o.type}Type)")
        facts.append(f"(inReceptacle {name} {pddl_name(o.receptacle)})")
        facts.append(f"(objectAtLocation {name} {pddl_name(by_id[o.receptacle].location)})")
        if o.type in actions["Toggleable"]:
            facts.append(f"(toggleable {name})")
        else:
            facts.append(f"(pickupable {name})")
        if o.type in cat["movable"]:
            facts.append(f"(isReceptacleObject {name})")
        for ability, predicate in (("Cleanable", "cleanable"), ("Heatable", "heatable"),
                                   ("Coolable", "coolable"), ("Sliceable", "sliceable")):
            if o.type in actions[ability]:
                facts.append(f"({predicate} {name})")

    goal = _goal_library().gdict[task.task_type]["pddl"].format(
        obj=task.object_target, recep=task.parent_target, toggle=task.toggle_target, mrecep=""
    )
    goal = goal.replace(" # ", " - ")  # goal_library writes typed variables as "?r # receptacle"
    indent = "\n        "
    # The goal template ends with the ")" that closes "(define".
    return (
        f"(define (problem plan_{pddl_name(task.task_id)})\n(:domain alfred)\n(:objects{indent}"
        + indent.join(declarations)
        + f"\n        )\n(:init{indent}"
        + indent.join(facts)
        + "\n        )\n"
        + goal
    )


def game_data(task: GeneratedTask) -> dict:
    """The ``game.tw-pddl`` payload (without ``solvable``/``walkthrough``, which the planner adds)."""
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    with open(ALFRED_TWL2_PATH) as f:
        grammar = f.read()
    return {
        "pddl_domain": domain,
        "grammar": grammar.replace("UNKNOWN GOAL", task.description),
        "pddl_problem": render_problem(task),
    }


def traj_data(task: GeneratedTask) -> dict:
    """The subset of ALFRED's ``traj_data.json`` that ALFWorld reads, plus the generator's provenance."""
    return {
        "task_id": task.task_id,
        "task_type": task.task_type,
        "scene": {"floor_plan": f"FloorPlan{task.scene}", "scene_num": task.scene},
        "pddl_params": {
            "object_target": task.object_target,
            "parent_target": task.parent_target,
            "toggle_target": task.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        },
        "turk_annotations": {"anns": [{"task_desc": task.description}]},
        "generator": "opd alfgen",
    }
