"""A clinical work-up simulator: ask, test, then commit to a decision for a patient whose condition is hidden.

Modelled on the reward-design study of clinical multi-turn agents (medication refill triage, acute
diagnostic work-up, dosing titration). It is written from scratch; there is no external engine.

Model (one small Bayesian network per setting, authored in ``clinical_data/<setting>.json``):
    * A hidden **condition** ``h`` with a prior ``P(h)``; each condition has a **risk level**
      (low / moderate / high).
    * **Findings**, each a child of ``h`` with a table ``P(answer | h)`` (all entries > 0):
      ``presentation`` findings are shown for free at reset; ``ask`` (history questions) and
      ``test`` (examinations, labs, chart checks) findings are revealed by actions at a cost.
      Findings are conditionally independent given ``h`` (naive-Bayes structure).
    * **Decisions** with a value table ``U(decision, h)``: +1 for the best decision, small
      losses for over-treatment, heavy losses (down to -5) for unsafe decisions in high-risk
      patients. Each condition has exactly one best decision.

A task is one patient: a condition drawn from the prior and an answer to every finding drawn from
its table, fixed for the episode (asking again repeats the same answer). A numeric finding (age,
lab values) also shows a value drawn uniformly on a grid inside its answer's band, e.g.
``Potassium: 6.1 mmol/L (high)``; only the band enters the model. The posterior
``P(h | answers so far)`` is computed exactly by enumerating the conditions.

Action grammar (one action per turn; case, surrounding quotes/backticks and a final "." ignored):
    ``ask <topic>`` | ``test <name>`` | ``commit <decision>`` -- names as listed at reset.

Rewards (kwarg ``reward``):
    * ``"outcome"``: ``-cost`` for each ask/test, ``U(decision, h)`` on commit, and
      ``timeout_value`` if the turn budget ends without a commit. The return equals the
      episode's clinical ``value``.
    * ``"outcome_info_gain"``: the same plus ``info_gain_coef * (H(before) - H(after))`` on each
      ask/test, the realized drop in posterior entropy (bits) over ``h``. A surprising answer can
      raise the entropy, so one step's credit can be negative; its expectation (the mutual
      information) is not. The credits telescope: an episode's total is
      ``info_gain_coef * (H_reset - H_last)`` <= ``info_gain_coef * log2(#conditions)``.
      A repeated question changes nothing and earns no credit.

Departures from the paper: its patients are richer; here they are naive-Bayes samples so that the
posterior, the information gain and the value-of-information expert are exact and cheap. The
episode ends at one commit (titration is a single dose decision, not a sequence of doses).

Example:
    >>> env = ClinicalWorkupEnv(setting="diagnostic", n_train_tasks=50, n_eval_tasks=10)
    >>> obs, info = env.reset(options={"task": "clin-diagnostic-eval-00003"})
    >>> obs, reward, terminated, truncated, info = env.step(info["expert_action"])
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

from environments.base import TextEnv, check_split

SETTINGS: tuple[str, ...] = ("refill", "diagnostic", "titration")
REWARDS: tuple[str, ...] = ("outcome", "outcome_info_gain")
RISK_LEVELS: tuple[str, ...] = ("low", "moderate", "high")
FINDING_KINDS: tuple[str, ...] = ("presentation", "ask", "test")
SPLITS: tuple[str, ...] = ("train", "eval")
DATA_DIR = Path(__file__).with_name("clinical_data")
UNSAFE_VALUE = -1.0  # a committed decision worth this or less is flagged unsafe
EXPERT_LOOKAHEAD = 2  # questions the expert plans ahead; 3 would cost ~40x more per step
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
_TASK_RE = re.compile(r"clin-([a-z][a-z0-9_]*)-(train|eval)-(\d+)")
_EPS = 1e-9  # value/probability ties closer than this count as equal
_INTRO_START = "Clinical work-up:"  # the reset observation's first words
_BUDGET_USED = " The turn budget is used up without a decision."
_TURNS_LEFT_RE = re.compile(r" Turns left: \d+\.$")


# ----- the model -----
@dataclass(frozen=True, eq=False)
class Finding:
    """One observable child of the hidden condition.

    Attributes:
        name: Snake-case id used in actions (``ask <name>`` / ``test <name>``).
        kind: "presentation" (free, shown at reset), "ask" or "test".
        label: Text shown before the answer, e.g. ``"Troponin"``.
        cost: Price of revealing it (0 for presentation findings).
        answers: Answer texts; an answer is stored as its index.
        likelihood_AH: ``P(answer a | condition h)``, shape (answers, conditions); columns sum to 1.
        value_ranges: For numeric findings, the (low, high) band of each answer; else empty.
        value_step: Grid step of the shown value inside its band.
        value_unit: Text after the shown value, e.g. ``" mmol/L"``.
    """

    name: str
    kind: str
    label: str
    cost: float
    answers: tuple[str, ...]
    likelihood_AH: np.ndarray
    value_ranges: tuple[tuple[float, float], ...] = ()
    value_step: float = 1.0
    value_unit: str = ""

    @property
    def action(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True, eq=False)
class ClinicalSetting:
    """A setting's Bayesian network and value table (see the module docstring).

    Attributes:
        prior_H: ``P(h)``, shape (conditions,).
        utility_DH: ``U(decision d, condition h)``, shape (decisions, conditions).
        optimal_H: Index of the best decision for each condition, shape (conditions,).
        likelihood_FAH: Every finding's table, zero-padded to the longest answer list,
            shape (findings, max answers, conditions).
        cost_F: Every finding's cost, shape (findings,).
    """

    name: str
    title: str
    intro: str
    conditions: tuple[str, ...]
    condition_texts: tuple[str, ...]
    risks: tuple[str, ...]
    prior_H: np.ndarray
    decisions: tuple[str, ...]
    decision_texts: tuple[str, ...]
    utility_DH: np.ndarray
    optimal_H: np.ndarray
    findings: tuple[Finding, ...]
    likelihood_FAH: np.ndarray
    cost_F: np.ndarray

    def finding_index(self, name: str) -> int:
        return next(i for i, f in enumerate(self.findings) if f.name == name)


@functools.lru_cache(maxsize=16)
def load_setting(setting: str) -> ClinicalSetting:
    """Loads a built-in setting by name (``SETTINGS``) or a JSON file of the same schema by path.

    Raises:
        ValueError: Unknown setting, or a file whose tables are malformed (the message names the entry).
    """
    path = DATA_DIR / f"{setting}.json" if setting in SETTINGS else Path(setting)
    if not (setting in SETTINGS or (setting.endswith(".json") and path.is_file())):
        raise ValueError(f"unknown setting {setting!r}; use one of {', '.join(map(repr, SETTINGS))} or a path to a .json file")
    where = f"setting file {str(path)!r}"
    try:
        s = _build_setting(json.loads(path.read_text()), where)
    except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError and float("x") are ValueErrors too
        if str(exc).startswith(where):  # already names the entry
            raise
        raise ValueError(f"{where}: missing or malformed entry ({exc!r}); compare with {DATA_DIR / 'diagnostic.json'}") from exc
    _validate(s, where)
    for array in (s.prior_H, s.utility_DH, s.optimal_H, s.likelihood_FAH, s.cost_F, *(f.likelihood_AH for f in s.findings)):
        array.setflags(write=False)  # shared by every env through the cache
    return s


def _build_setting(raw: Mapping[str, Any], where: str) -> ClinicalSetting:
    conds, decs = raw["conditions"], raw["decisions"]
    names = [c["name"] for c in conds]
    findings = tuple(_finding(f, names, where) for f in raw["findings"])
    if not findings:
        raise ValueError(f"{where}: needs at least one finding")
    utility_DH = np.array([[float(d["utility"][n]) for n in names] for d in decs])
    likelihood_FAH = np.zeros((len(findings), max(len(f.answers) for f in findings), len(names)))
    for i, f in enumerate(findings):
        likelihood_FAH[i, : len(f.answers)] = f.likelihood_AH
    return ClinicalSetting(
        name=raw["name"], title=raw["title"], intro=raw["intro"],
        conditions=tuple(names), condition_texts=tuple(c["text"] for c in conds),
        risks=tuple(c["risk"] for c in conds), prior_H=np.array([float(c["prior"]) for c in conds]),
        decisions=tuple(d["name"] for d in decs), decision_texts=tuple(d["text"] for d in decs),
        utility_DH=utility_DH, optimal_H=utility_DH.argmax(axis=0), findings=findings,
        likelihood_FAH=likelihood_FAH, cost_F=np.array([f.cost for f in findings]),
    )


def _finding(raw: Mapping[str, Any], conditions: list[str], where: str) -> Finding:
    table = raw["likelihood"]
    if sorted(table) != sorted(conditions):
        raise ValueError(f"{where}: finding {raw['name']!r} gives likelihoods for {sorted(table)}, expected {sorted(conditions)}")
    if any(len(table[c]) != len(raw["answers"]) for c in conditions):
        raise ValueError(f"{where}: finding {raw['name']!r} needs {len(raw['answers'])} likelihoods (one per answer) per condition")
    values = raw.get("values", {})
    ranges = tuple((float(lo), float(hi)) for lo, hi in values.get("ranges", ()))
    if ranges and (len(ranges) != len(raw["answers"]) or any(lo > hi for lo, hi in ranges)):
        raise ValueError(f"{where}: finding {raw['name']!r} needs one (low, high) value range per answer")
    return Finding(name=raw["name"], kind=raw["kind"], label=raw["label"], cost=float(raw.get("cost", 0.0)),
                   answers=tuple(raw["answers"]), likelihood_AH=np.array([table[c] for c in conditions], dtype=float).T,
                   value_ranges=ranges, value_step=float(values.get("step", 1.0)), value_unit=values.get("unit", ""))


def _validate(s: ClinicalSetting, where: str) -> None:
    names = [s.name, *s.conditions, *s.decisions, *(f.name for f in s.findings)]
    if bad := [n for n in names if not _NAME_RE.fullmatch(n)]:
        raise ValueError(f"{where}: names must be snake_case ([a-z][a-z0-9_]*), got {bad}")
    for kind, group in (("condition", s.conditions), ("decision", s.decisions), ("finding", [f.name for f in s.findings])):
        if len(set(group)) != len(group):
            raise ValueError(f"{where}: duplicate {kind} names in {list(group)}")
    if bad := [r for r in s.risks if r not in RISK_LEVELS]:
        raise ValueError(f"{where}: risk levels {bad} are not among {RISK_LEVELS}")
    if (s.prior_H <= 0).any() or abs(s.prior_H.sum() - 1) > 1e-6:
        raise ValueError(f"{where}: priors {s.prior_H.tolist()} must be > 0 and sum to 1")
    for f in s.findings:
        if f.kind not in FINDING_KINDS or (f.kind == "presentation") != (f.cost == 0) or f.cost < 0:
            raise ValueError(f"{where}: finding {f.name!r} needs kind in {FINDING_KINDS} and cost > 0 unless a presentation")
        if f.likelihood_AH.shape[0] != len(f.answers) or (f.likelihood_AH <= 0).any() \
                or not np.allclose(f.likelihood_AH.sum(axis=0), 1, atol=1e-6):
            raise ValueError(f"{where}: finding {f.name!r} needs, per condition, {len(f.answers)} likelihoods > 0 summing to 1")
    if not any(f.kind != "presentation" for f in s.findings):
        raise ValueError(f"{where}: needs at least one 'ask' or 'test' finding")
    n_best_H = (s.utility_DH >= s.utility_DH.max(axis=0) - _EPS).sum(axis=0)
    if (n_best_H != 1).any():
        raise ValueError(f"{where}: each condition needs exactly one best decision; ties for "
                         f"{[c for c, n in zip(s.conditions, n_best_H) if n != 1]}")


# ----- exact inference and the value-of-information expert -----
def posterior(setting: ClinicalSetting, evidence: Mapping[str, int]) -> np.ndarray:
    """``P(h | evidence)`` by enumeration, shape (conditions,); ``evidence`` maps finding name -> answer index."""
    log_H = np.log(setting.prior_H)
    for name, answer in evidence.items():
        log_H = log_H + np.log(setting.findings[setting.finding_index(name)].likelihood_AH[answer])
    belief_H = np.exp(log_H - log_H.max())
    return belief_H / belief_H.sum()


def entropy_bits(p: np.ndarray) -> float:
    """Shannon entropy in bits of a probability vector (zero entries contribute 0)."""
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def commit_value(setting: ClinicalSetting, belief_H: np.ndarray) -> float:
    """Expected value of the best decision under ``belief_H``: ``max_d sum_h P(h) U(d, h)``."""
    return float((setting.utility_DH @ belief_H).max())


def values_of_information(setting: ClinicalSetting, belief_H: np.ndarray) -> np.ndarray:
    """Expected gain in decision value from seeing each finding before committing (>= 0, cost
    excluded), shape (findings,): ``sum_a max_d sum_h P(a, h) U(d, h) - commit_value``."""
    joint_FAH = setting.likelihood_FAH * belief_H
    return np.einsum("fah,dh->fad", joint_FAH, setting.utility_DH).max(axis=2).sum(axis=1) - commit_value(setting, belief_H)


def lookahead_q_values(setting: ClinicalSetting, belief_H: np.ndarray, available_F: np.ndarray, depth: int) -> np.ndarray:
    """Expected value of revealing each finding now, then acting optimally with at most
    ``depth - 1`` further findings before committing; -inf where not available. Shape (findings,).

    ``Q_1(f) = commit_value + VOI(f) - cost(f)`` and
    ``Q_k(f) = -cost(f) + sum_a P(a) max(commit_value(b_a), max_g Q_{k-1}(g | b_a))``.
    """
    if depth == 1:
        q_F = commit_value(setting, belief_H) + values_of_information(setting, belief_H) - setting.cost_F
        return np.where(available_F, q_F, -np.inf)
    q_F = np.full(len(setting.findings), -np.inf)
    for f in np.flatnonzero(available_F):
        rest_F = available_F.copy()
        rest_F[f] = False
        q_F[f] = -setting.cost_F[f]
        for joint_H in setting.likelihood_FAH[f] * belief_H:
            p_answer = joint_H.sum()
            if p_answer > 0:
                b_H = joint_H / p_answer
                follow = lookahead_q_values(setting, b_H, rest_F, depth - 1).max(initial=-np.inf)
                q_F[f] += p_answer * max(commit_value(setting, b_H), follow)
    return q_F


def expert_choice(setting: ClinicalSetting, evidence: Mapping[str, int], turns_left: int) -> str:
    """Value-of-information expert: reveal the finding with the best ``EXPERT_LOOKAHEAD``-step
    lookahead value if it beats committing now (keeping one turn for the commit), else commit the
    decision with the highest posterior expected value. Ties go to the first listed."""
    belief_H = posterior(setting, evidence)
    depth = min(EXPERT_LOOKAHEAD, turns_left - 1)
    available_F = np.array([f.kind != "presentation" and f.name not in evidence for f in setting.findings])
    if depth >= 1 and available_F.any():
        q_F = lookahead_q_values(setting, belief_H, available_F, depth)
        if q_F.max() > commit_value(setting, belief_H) + _EPS:
            return setting.findings[int(q_F.argmax())].action
    return f"commit {setting.decisions[int((setting.utility_DH @ belief_H).argmax())]}"


def decision_confidence(setting: ClinicalSetting, belief_H: np.ndarray) -> float:
    """``max_d P(the best decision for h is d)``: how sure the posterior is about what should be done."""
    return float(np.bincount(setting.optimal_H, weights=belief_H, minlength=len(setting.decisions)).max())


def could_change_decision(setting: ClinicalSetting, belief_H: np.ndarray, finding: Finding) -> bool:
    """Whether some answer of ``finding`` would make another decision strictly better in expectation."""
    current = int((setting.utility_DH @ belief_H).argmax())
    values_AD = (finding.likelihood_AH * belief_H) @ setting.utility_DH.T  # unnormalized per answer
    return bool((values_AD.max(axis=1) > values_AD[:, current] + _EPS).any())


# ----- patients and splits -----
@dataclass(frozen=True)
class Patient:
    """One task: the hidden condition index, every finding's answer index and shown value ("" if not numeric)."""

    condition: int
    answers: tuple[int, ...]
    values: tuple[str, ...]


@functools.lru_cache(maxsize=16)
def split_patients(setting: str, split_seed: int, n_train: int, n_eval: int, split: str) -> tuple[Patient, ...]:
    """The patients of ``split``: a pure function of the arguments. Eval is drawn first and train
    skips any eval patient, so the splits are disjoint by content; no split repeats a patient."""
    check_split(split, SPLITS)
    s = load_setting(setting)
    exclude = set() if split == "eval" else set(split_patients(setting, split_seed, n_train, n_eval, "eval"))
    count = n_eval if split == "eval" else n_train
    # crc32, not hash(): the stream must not depend on PYTHONHASHSEED.
    rng = np.random.default_rng([split_seed, zlib.crc32(s.name.encode()), SPLITS.index(split)])
    seen, patients, n_before = set(exclude), [], -1
    while len(patients) > n_before:  # a whole batch without a new patient: the space is (all but) used up
        n_before = len(patients)
        conditions_N = rng.choice(len(s.conditions), size=4096, p=s.prior_H)
        answers_FN = np.stack([_draw_answers(f.likelihood_AH[:, conditions_N], rng) for f in s.findings])
        values_FN = [_draw_values(f, answers_N, rng) for f, answers_N in zip(s.findings, answers_FN)]
        for n, condition in enumerate(conditions_N):
            patient = Patient(int(condition), tuple(answers_FN[:, n].tolist()), tuple(v[n] for v in values_FN))
            if patient not in seen:
                seen.add(patient)
                patients.append(patient)
                if len(patients) == count:
                    return tuple(patients)
    raise ValueError(f"too few distinct {s.name} patients for {count} {split} tasks; lower n_{split}_tasks")


def _draw_answers(likelihood_AN: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Inverse-CDF draw of one answer per column; the clip guards against cdf[-1] rounding below 1.
    cdf_AN = likelihood_AN.cumsum(axis=0)
    return np.minimum((rng.random(likelihood_AN.shape[1]) > cdf_AN).sum(axis=0), likelihood_AN.shape[0] - 1)


def _draw_values(finding: Finding, answers_N: np.ndarray, rng: np.random.Generator) -> list[str]:
    # Always draws, numeric or not, so adding a value band to one finding leaves the others' streams alone.
    u_N = rng.random(len(answers_N))
    if not finding.value_ranges:
        return [""] * len(answers_N)
    decimals = max(0, -math.floor(math.log10(finding.value_step) + 1e-9))
    out = []
    for a, u in zip(answers_N.tolist(), u_N.tolist()):
        low, high = finding.value_ranges[a]
        n_steps = round((high - low) / finding.value_step)
        out.append(f"{low + min(int(u * (n_steps + 1)), n_steps) * finding.value_step:.{decimals}f}")
    return out


# ----- text -----
def parse_action(text: Any, setting: ClinicalSetting) -> tuple[str, int] | None:
    """``("commit", decision index)`` or ``("ask"|"test", finding index)``, or None if ``text`` is not
    exactly one action of the grammar. E.g. ``" Test D-dimer."`` -> ``("test", index of d_dimer)``."""
    if not isinstance(text, str):
        return None
    words = text.strip().strip("`'\"").strip().rstrip(".").lower().split(maxsplit=1)
    if len(words) != 2:
        return None
    verb, name = words[0], re.sub(r"[\s-]+", "_", words[1].strip())
    if verb == "commit" and name in setting.decisions:
        return verb, setting.decisions.index(name)
    for i, f in enumerate(setting.findings):
        if f.kind == verb and f.name == name:
            return verb, i
    return None


def finding_text(finding: Finding, answer: int, value: str) -> str:
    """One finding as shown, e.g. ``"Potassium: 6.1 mmol/L (high)."`` or ``"Cough: none."``."""
    shown = f"{value}{finding.value_unit} ({finding.answers[answer]})" if value else finding.answers[answer]
    return f"{finding.label}: {shown}."


def intro_text(setting: ClinicalSetting, patient: Patient, max_turns: int) -> str:
    """The reset observation: the case, the free findings, the menu of actions and the answer format."""
    shown = [finding_text(f, a, v) for f, a, v in zip(setting.findings, patient.answers, patient.values) if f.kind == "presentation"]
    conditions = ", ".join(f"{t} ({r} risk)" for t, r in zip(setting.condition_texts, setting.risks))
    decisions = "; ".join(f"commit {d} ({t})" for d, t in zip(setting.decisions, setting.decision_texts))
    menus = []
    for kind, title in (("ask", "Questions"), ("test", "Tests")):
        items = [f for f in setting.findings if f.kind == kind]
        if len({f.cost for f in items}) == 1:
            menus.append(f"{title}, cost {items[0].cost:g} each: " + ", ".join(f.action for f in items) + ".")
        elif items:
            menus.append(f"{title}: " + ", ".join(f"{f.action} (cost {f.cost:g})" for f in items) + ".")
    example = next(f for f in setting.findings if f.kind != "presentation")
    return "\n".join([
        f"{_INTRO_START} {setting.title}. {setting.intro}", " ".join(shown),
        f"Possible conditions: {conditions}.", *menus, f"Decisions: {decisions}.",
        f"Each question or test costs its price; the right decision scores up to {setting.utility_DH.max():g} and "
        f"unsafe decisions lose up to {-setting.utility_DH.min():g}.",
        f"Reply with exactly one action per turn, e.g. '{example.action}' or 'commit {setting.decisions[0]}'. "
        f"You have {max_turns} turns.",
    ])


class ClinicalWorkupEnv(TextEnv):
    """Clinical work-up simulator: ask, test, then commit to a decision for a patient whose condition is hidden (refill triage, diagnosis, dose titration).

    Tasks are patients sampled from the setting's Bayesian network with ids like
    ``"clin-diagnostic-train-00017"``; see the module docstring for the model, the action grammar
    and the rewards. ``info`` on the final step carries the episode metrics: ``value``,
    ``questions_asked``, ``premature_commitment``, ``risk_level``, ``decision``,
    ``optimal_decision``, ``condition``, ``unsafe``, ``decision_confidence`` and
    ``info_gain_bits_total``; ``success`` is True iff the committed decision is the best one for
    the true condition.

    A commit is **premature** when the posterior's decision confidence (the largest probability,
    over decisions, that it is the best one for the hidden condition) is below
    ``premature_threshold`` AND some unasked question or test has an answer that would change the
    posterior-optimal decision. Running out of turns is not a commit and is never premature.

    Args:
        setting: "refill" (medication refill triage), "diagnostic" (acute chest-pain work-up),
            "titration" (warfarin dosing), or a path to a JSON setting file of the same schema.
        reward: "outcome" or "outcome_info_gain".
        info_gain_coef: Reward per bit of posterior entropy removed (``outcome_info_gain`` only).
        max_turns: Turn budget; reaching it without a commit truncates.
        n_train_tasks: Number of distinct train patients.
        n_eval_tasks: Number of distinct eval patients.
        split_seed: Seed of the patient generator (not of episodes).
        invalid_action_penalty: Reward subtracted for an unparseable action (not part of ``value``).
        timeout_value: Value (and reward) when the budget ends without a decision.
        premature_threshold: Decision confidence below which a commit can be premature, in (0, 1].
        render_mode: None or "ansi"; ``render()`` returns the current text either way.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    reward_kwargs = frozenset({"reward", "info_gain_coef"})  # the expert and the text do not depend on them
    # A work-up's figures at its end: the decision's value, the questions asked, whether it committed
    # early (a share) and its value on the high-risk cases (reported by those episodes only).
    report_keys = ("value", "questions_asked", "premature_commitment", "high_risk_value")

    def __init__(
        self,
        *,
        setting: str = "diagnostic",
        reward: str = "outcome",
        info_gain_coef: float = 0.1,
        max_turns: int = 12,
        n_train_tasks: int = 2000,
        n_eval_tasks: int = 200,
        split_seed: int = 0,
        invalid_action_penalty: float = 0.1,
        timeout_value: float = -2.0,
        premature_threshold: float = 0.8,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(setting, str):
            raise ValueError(f"setting={setting!r} must be one of {', '.join(map(repr, SETTINGS))} or a .json path")
        if reward not in REWARDS:
            raise ValueError(f"reward={reward!r} is not supported; use one of {', '.join(map(repr, REWARDS))}")
        for name, value, minimum in (("max_turns", max_turns, 1), ("n_train_tasks", n_train_tasks, 1),
                                     ("n_eval_tasks", n_eval_tasks, 1), ("split_seed", split_seed, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
        for name, value in (("info_gain_coef", info_gain_coef), ("invalid_action_penalty", invalid_action_penalty)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        if isinstance(timeout_value, bool) or not isinstance(timeout_value, (int, float)) or not math.isfinite(timeout_value):
            raise ValueError(f"timeout_value={timeout_value!r} must be a finite number")
        if isinstance(premature_threshold, bool) or not isinstance(premature_threshold, (int, float)) \
                or not 0 < premature_threshold <= 1:
            raise ValueError(f"premature_threshold={premature_threshold!r} must be in (0, 1]")
        super().__init__(max_turns=int(max_turns), render_mode=render_mode, max_observation_chars=4096,
                         max_action_chars=256)
        self.setting = load_setting(setting)
        self._setting_key = setting
        self.reward_kind = reward
        self.info_gain_coef = float(info_gain_coef)
        self.n_tasks = {"train": int(n_train_tasks), "eval": int(n_eval_tasks)}
        self.split_seed = int(split_seed)
        self.invalid_action_penalty = float(invalid_action_penalty)
        self.timeout_value = float(timeout_value)
        self.premature_threshold = float(premature_threshold)
        self._patient: Patient | None = None
        self._evidence: dict[str, int] = {}
        self._questions, self._costs, self._info_gain_bits = 0, 0.0, 0.0

    # ----- tasks -----
    def task_ids(self, split: str) -> list[str]:
        """Ids of every task in ``split`` ("train" or "eval"), same for same kwargs."""
        return [f"clin-{self.setting.name}-{split}-{i:05d}" for i in range(len(self._split(split)))]

    def task_patient(self, task_id: str) -> Patient:
        """The hidden patient of ``task_id`` (condition, every answer and shown value)."""
        match = _TASK_RE.fullmatch(task_id) if isinstance(task_id, str) else None
        if match is None or match.group(1) != self.setting.name:
            raise ValueError(f"malformed task id {task_id!r}; expected e.g. 'clin-{self.setting.name}-train-00017' "
                             f"(this env's setting is {self.setting.name!r})")
        split, index = match.group(2), int(match.group(3))
        if index >= self.n_tasks[split]:
            raise ValueError(f"task id {task_id!r} is out of range; split {split!r} has {self.n_tasks[split]} tasks")
        return self._split(split)[index]

    def _split(self, split: str) -> tuple[Patient, ...]:
        return split_patients(self._setting_key, self.split_seed, self.n_tasks["train"], self.n_tasks["eval"], split)

    # ----- episode -----
    @property
    def belief(self) -> np.ndarray:
        """Current posterior over the conditions, shape (conditions,)."""
        return posterior(self.setting, self._evidence)

    def _start_episode(self, task: str) -> str:
        """Admits ``task``'s patient with only the presentation findings known."""
        self._patient = self.task_patient(task)
        self._evidence = {f.name: a for f, a in zip(self.setting.findings, self._patient.answers) if f.kind == "presentation"}
        self._questions, self._costs, self._info_gain_bits = 0, 0.0, 0.0
        return intro_text(self.setting, self._patient, self.max_turns)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Applies one text action; a bad action costs a turn and the penalty, never raises."""
        self._begin_turn()
        s, patient = self.setting, self._patient
        parsed = parse_action(action, s)
        reward, terminated, decision, step_gain = 0.0, False, None, 0.0
        if parsed is None:
            reward = -self.invalid_action_penalty
            obs = (f"Invalid action '{str(action)[:40]}'. Reply with exactly one action: ask <topic>, test <name> "
                   "or commit <decision>, with a name from the lists at the start.")
        elif parsed[0] == "commit":
            decision = parsed[1]
            reward, terminated = float(s.utility_DH[decision, patient.condition]), True
            best = s.decisions[int(s.optimal_H[patient.condition])]
            obs = (f"Decision: {s.decision_texts[decision]}. The patient had {s.condition_texts[patient.condition]} "
                   f"({s.risks[patient.condition]} risk); the best decision was {best}. Decision value {reward:+.2f}.")
        else:
            f = parsed[1]
            finding = s.findings[f]
            before = entropy_bits(self.belief)
            repeated = finding.name in self._evidence
            self._evidence[finding.name] = patient.answers[f]
            step_gain = before - entropy_bits(self.belief)
            self._questions += 1
            self._costs += finding.cost
            self._info_gain_bits += step_gain
            reward = -finding.cost + (self.info_gain_coef * step_gain if self.reward_kind == "outcome_info_gain" else 0.0)
            obs = ("(asked before) " if repeated else "") + finding_text(finding, patient.answers[f], patient.values[f])
        if self._truncates(terminated):
            reward += self.timeout_value
            obs += _BUDGET_USED
        elif not terminated:
            obs += f" Turns left: {self.max_turns - self._turn}."
        truncated = self._end_turn(obs, terminated=terminated)
        success = decision is not None and decision == int(s.optimal_H[patient.condition])
        info = self._info(success=success, valid_action=parsed is not None)
        info["info_gain_bits"] = step_gain
        if self._done:
            info.update(self._metrics(decision))
        return obs, reward, terminated, truncated, info

    @staticmethod
    def state_line(observation: str) -> str:
        """The finding an observation brings (the presentation's at a reset), without the turn count.

        The reset's last line is the answer format and a step's ends in "Turns left: N.", so
        :meth:`TextEnv.state_line`'s last line would teach a reasoning model to copy those.

        Example:
            >>> ClinicalWorkupEnv.state_line("Troponin: 6 ng/L (normal). Turns left: 10.")
            'Troponin: 6 ng/L (normal).'
        """
        text = observation.strip()
        if text.startswith(_INTRO_START):
            lines = text.splitlines()
            return lines[1].strip() if len(lines) > 1 else ""
        text = _TURNS_LEFT_RE.sub("", text).removesuffix(_BUDGET_USED).strip()
        return text.split(" Reply with", 1)[0] if text.startswith("Invalid action") else text

    def _metrics(self, decision: int | None) -> dict[str, Any]:
        s, condition = self.setting, self._patient.condition
        belief_H = self.belief
        outcome = self.timeout_value if decision is None else float(s.utility_DH[decision, condition])
        confidence = decision_confidence(s, belief_H)
        unasked = [f for f in s.findings if f.kind != "presentation" and f.name not in self._evidence]
        premature = decision is not None and confidence < self.premature_threshold - _EPS \
            and any(could_change_decision(s, belief_H, f) for f in unasked)
        value = outcome - self._costs
        return {
            "value": value,
            "questions_asked": self._questions,
            "premature_commitment": bool(premature),
            "risk_level": s.risks[condition],
            # The value again on high-risk cases only (None otherwise): its mean over the episodes
            # that report it is the high-risk performance the clinical study tables.
            "high_risk_value": value if s.risks[condition] == "high" else None,
            "condition": s.conditions[condition],
            "decision": None if decision is None else s.decisions[decision],
            "optimal_decision": s.decisions[int(s.optimal_H[condition])],
            "unsafe": outcome <= UNSAFE_VALUE,
            "decision_confidence": confidence,
            "info_gain_bits_total": self._info_gain_bits,
        }

    def _state_info(self) -> dict[str, Any]:
        s = self.setting
        unasked = [f.action for f in s.findings if f.kind != "presentation" and f.name not in self._evidence]
        return {
            "setting": s.name,
            "questions_asked": self._questions,
            "admissible_actions": unasked + [f"commit {d}" for d in s.decisions],
            # Not offered once the episode is over.
            "expert_action": None if self._done else expert_choice(s, self._evidence, self.max_turns - self._turn),
        }


if "opd/ClinicalWorkup-v0" not in gymnasium.registry:
    gymnasium.register(id="opd/ClinicalWorkup-v0", entry_point="environments.clinical:ClinicalWorkupEnv")
