"""An ALFWorld expert that knows only what the agent has seen: it searches, then does the task.

The planner (``expert="planner"``) knows what is inside every closed receptacle and walks straight
to the object; a model that imitates it learns to guess, since nothing in its context says where
the object is. :class:`SearchExpert` plays from the agent's view instead: the receptacles the reset
lists, the goal, the admissible commands at each step (``show_admissible``), and common sense about
where things are kept (the receptacle types ALFRED lets hold an object type). It visits the
receptacles that may hold what it needs, in the order the reset lists them, opening closed ones;
once it has seen the object it takes it, heats, cools or cleans it, and puts it in the first
receptacle of the goal type (or, for ``look_at_obj_in_light``, carries it to the desk lamp and
turns the lamp on). A model can learn that policy from its context.

Its state is what the agent learnt from its own steps: where it stands, which receptacles it has
visited, the objects it saw and where, what it holds and what it has done. :meth:`observe` reads
each step's result from the commands the engine admitted; :meth:`action` gives the next command,
one of the admissible ones, or None when it has run out of places to look or the room lacks a
receptacle the task needs by name (1 of 240 generated train games, none of 48 eval games;
``docs/envs/alfworld.md``).

Example:
    >>> expert = SearchExpert("pick_and_place_simple", "Mug", "Shelf", "",
    ...                       ["cabinet 1", "countertop 1", "shelf 1"], {"Mug": {"Cabinet", "CounterTop", "Shelf"}})
    >>> expert.action(["go to cabinet 1", "go to countertop 1", "go to shelf 1", "look"])
    'go to cabinet 1'
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_INTRO_RE = re.compile(r"Looking quickly around you, you see (.+?)\.\s*$", re.MULTILINE)
_TAKE_RE = re.compile(r"take (.+) from (.+)")
_MOVE_RE = re.compile(r"move (.+) to (.+)")
_USE_RE = re.compile(r"use (.+)")
# The appliance each processing task type uses, and its verb (ALFWorld's heat/cool/clean commands).
PROCESS = {
    "pick_heat_then_place_in_recep": ("heat", "microwave"),
    "pick_cool_then_place_in_recep": ("cool", "fridge"),
    "pick_clean_then_place_in_recep": ("clean", "sinkbasin"),
}
LAMP = "desklamp"


def receptacles_in(intro: str) -> list[str]:
    """The receptacles a reset observation lists, in its order.

    >>> receptacles_in("You are in the middle of a room. Looking quickly around you, you see a cabinet 2, "
    ...                "a countertop 1, and a fridge 1.\\n\\nYour task is to: ...")
    ['cabinet 2', 'countertop 1', 'fridge 1']
    """
    match = _INTRO_RE.search(intro)
    if match is None:
        raise ValueError("the reset observation lists no receptacles ('Looking quickly around you, you see ...')")
    items = re.split(r",\s*(?:and\s+)?|\s+and\s+", match.group(1))
    return [re.sub(r"^(?:a|an)\s+", "", item.strip()) for item in items if item.strip()]


def kind(name: str) -> str:
    """The type of a thing the engine names: ``"sinkbasin 2"`` -> ``"sinkbasin"``."""
    return name.rsplit(" ", 1)[0]


class SearchExpert:
    """The expert of one episode; see the module docstring.

    Args:
        task_type: ALFWorld's ``task_type`` (``traj_data.json``).
        object_target, parent_target, toggle_target: ALFRED's ``pddl_params`` (THOR type names).
        receptacles: What the reset lists (:func:`receptacles_in`).
        holders: THOR object type -> THOR receptacle types that may hold it.
    """

    def __init__(self, task_type: str, object_target: str, parent_target: str, toggle_target: str,
                 receptacles: list[str], holders: Mapping[str, Iterable[str]]) -> None:
        self.task_type = task_type
        self.target = object_target.lower()
        self.goal = parent_target.lower()
        self.process = PROCESS.get(task_type)
        self.look = task_type == "look_at_obj_in_light"
        self.receptacles = list(receptacles)
        lower = {k.lower(): {r.lower() for r in v} for k, v in holders.items()}
        self._places = {self.target: lower.get(self.target, set()), LAMP: lower.get(toggle_target.lower() or LAMP, set())}
        self.at: str | None = None
        self.visited: set[str] = set()
        self.seen: dict[str, str] = {}  # object -> the receptacle it was last seen in
        self.lamp_at: tuple[str, str] | None = None  # (lamp, its receptacle) once seen
        self.holding: str | None = None
        self.processed: set[str] = set()
        self.delivered: set[str] = set()

    # ----- what the agent learns from a step -----
    def observe(self, command: str, feedback: str, admissible: list[str]) -> None:
        """Updates the state after the engine ran ``command`` (admitted) and answered ``feedback``.

        Receptacles that share a spot with the one the agent went to are not a "go to" away (the
        engine does not offer it): their contents are takeable from here, and a closed one can be
        opened from here, so an open one beside the agent counts as visited.
        """
        if command.startswith("go to ") and feedback.startswith("You arrive"):
            self.at = command[len("go to "):]  # visited once seen into (below): a closed one needs opening
        elif command.startswith("open ") and feedback.startswith("You open"):
            self.visited.add(command[len("open "):])
        elif command.startswith("take ") and feedback.startswith("You pick up"):
            self.holding = _TAKE_RE.fullmatch(command).group(1)
            self.seen.pop(self.holding, None)
        elif command.startswith("move ") and feedback.startswith("You move"):
            match = _MOVE_RE.fullmatch(command)
            if match and self.holding == match.group(1) and kind(match.group(2)) == self.goal:
                self.delivered.add(self.holding)
                self.seen[self.holding] = match.group(2)
            self.holding = None
        elif self.process and self.holding and command.startswith(f"{self.process[0]} {self.holding} with "):
            self.processed.add(self.holding)
        if self.at is None:
            return
        allowed = set(admissible)
        beside = {r for r in self.receptacles if f"go to {r}" not in allowed}  # here, or at the same spot
        self.visited |= {r for r in beside if f"open {r}" not in allowed}
        takeable = {m.group(1): m.group(2) for m in map(_TAKE_RE.fullmatch, admissible) if m}
        if self.holding is None:  # with full hands nothing is takeable, so absence says nothing
            for thing in [o for o, r in self.seen.items() if r in beside and o not in takeable]:
                del self.seen[thing]  # taken or moved since
        self.seen.update(takeable)
        lamps = [m.group(1) for m in map(_USE_RE.fullmatch, admissible) if m and kind(m.group(1)) == LAMP]
        if lamps:
            self.lamp_at = (lamps[0], self.at)

    # ----- the next command -----
    def action(self, admissible: list[str]) -> str | None:
        """The next command (an admissible one), or None when there is nowhere left to look."""
        allowed = set(admissible)
        command = self._intended(allowed)
        return command if command in allowed else None

    def _intended(self, allowed: set[str]) -> str | None:
        held = self.holding
        if held is not None:
            if self.process and held not in self.processed:
                verb, appliance = self.process
                return self._at(self._first(appliance), f"{verb} {held} with {self._first(appliance)}", allowed)
            if self.look:
                if self.lamp_at is None:
                    return self._search(LAMP, allowed)
                lamp, place = self.lamp_at
                return self._at(place, f"use {lamp}", allowed)
            place = self._first(self.goal)
            if f"open {place}" in allowed:
                return f"open {place}"
            return self._at(place, f"move {held} to {place}", allowed)
        wanted = sorted(o for o, r in self.seen.items() if kind(o) == self.target and o not in self.delivered)
        if not wanted:
            return self._search(self.target, allowed)
        take = next((f"take {o} from {self.seen[o]}" for o in wanted if f"take {o} from {self.seen[o]}" in allowed), None)
        return take or f"go to {self.seen[wanted[0]]}"

    def _at(self, place: str | None, command: str, allowed: set[str]) -> str | None:
        """``command`` if it can be done from here, else the way to ``place``."""
        return command if command in allowed or place is None else f"go to {place}"

    def _first(self, receptacle_type: str) -> str | None:
        return next((r for r in self.receptacles if kind(r) == receptacle_type), None)

    def _search(self, thing: str, allowed: set[str]) -> str | None:
        """Open the next closed receptacle here that may hold ``thing``, else go to the next one."""
        places = self._places[thing]
        for receptacle in self.receptacles:
            if receptacle in self.visited or kind(receptacle) not in places:
                continue
            if f"open {receptacle}" in allowed:
                return f"open {receptacle}"
            if f"go to {receptacle}" in allowed:
                return f"go to {receptacle}"
        return None
