"""Tests of the clinical work-up simulator (environments.clinical): contract, exact posterior,
rewards, metrics, expert and splits. Everything runs the real simulator; nothing is mocked."""

from __future__ import annotations

import itertools
import json
import math
import pickle

import numpy as np
import pytest

from environments.clinical import (
    SETTINGS,
    ClinicalWorkupEnv,
    decision_confidence,
    entropy_bits,
    load_setting,
    lookahead_q_values,
    parse_action,
    values_of_information,
)
from opd.envs import EnvFactory, check_env, list_envs, make_env

ENV_ID = "opd/ClinicalWorkup-v0"
SMALL = {"n_train_tasks": 50, "n_eval_tasks": 10}
# Two conditions, one free finding, one question (3 answers) and one test: small enough to enumerate by hand.
TINY = {
    "name": "tiny", "title": "tiny case", "intro": "A tiny patient.",
    "conditions": [{"name": "well", "text": "well", "risk": "low", "prior": 0.7},
                   {"name": "sick", "text": "sick", "risk": "high", "prior": 0.3}],
    "decisions": [{"name": "wait", "text": "wait", "utility": {"well": 1.0, "sick": -4.0}},
                  {"name": "treat", "text": "treat", "utility": {"well": -0.2, "sick": 1.0}}],
    "findings": [
        {"name": "looks", "kind": "presentation", "label": "Looks", "answers": ["fine", "pale"],
         "likelihood": {"well": [0.8, 0.2], "sick": [0.3, 0.7]}},
        {"name": "pain", "kind": "ask", "cost": 0.02, "label": "Pain", "answers": ["none", "some", "severe"],
         "likelihood": {"well": [0.6, 0.3, 0.1], "sick": [0.1, 0.3, 0.6]}},
        {"name": "lab", "kind": "test", "cost": 0.1, "label": "Lab", "answers": ["normal", "high"],
         "values": {"unit": " u", "step": 0.5, "ranges": [[1, 3], [3.5, 9]]},
         "likelihood": {"well": [0.9, 0.1], "sick": [0.2, 0.8]}},
    ],
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("clinical") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def run_episode(env, task: str, policy) -> tuple[list[str], list[float], dict]:
    obs, info = env.reset(seed=0, options={"task": task})
    actions, rewards = [], []
    while True:
        action = policy(env, info)
        obs, reward, terminated, truncated, info = env.step(action)
        actions.append(action)
        rewards.append(reward)
        if terminated or truncated:
            return actions, rewards, info


def expert(env, info) -> str:
    return info["expert_action"]


def commit_now(env, info) -> str:
    """Commit-immediately baseline: the best decision given only the free presentation findings."""
    s = env.unwrapped.setting
    return "commit " + s.decisions[int((s.utility_DH @ env.unwrapped.belief).argmax())]


def brute_force_posterior(setting, evidence: dict[str, int]) -> np.ndarray:
    """P(h | evidence) from the full joint table over the condition and EVERY finding's answer."""
    joint = setting.prior_H.copy()
    for f in setting.findings:  # joint[h, a_1, ..., a_k] = P(h) prod_i P(a_i | h)
        joint = joint[..., None] * f.likelihood_AH.T.reshape((-1,) + (1,) * (joint.ndim - 1) + (len(f.answers),))
    index = tuple(evidence.get(f.name, slice(None)) for f in setting.findings)
    marginal = joint[(slice(None), *index)].reshape(len(setting.conditions), -1).sum(axis=1)
    return marginal / marginal.sum()


# ----- contract -----
@pytest.mark.parametrize("setting", SETTINGS)
def test_check_env_passes_for_each_setting(setting) -> None:
    check_env(make_env(ENV_ID, setting=setting, **SMALL))
    check_env(make_env(ENV_ID, setting=setting, reward="outcome_info_gain", max_turns=3, **SMALL), n_steps=12, seed=3)


def test_check_env_passes_with_defaults_and_lists_description() -> None:
    check_env(ENV_ID)
    assert dict(list_envs())[ENV_ID].startswith("Clinical work-up simulator: ask, test, then commit")


def test_factory_pickles_and_builds_the_setting() -> None:
    factory = EnvFactory(ENV_ID, {"setting": "titration", "max_turns": 5, **SMALL})
    env = pickle.loads(pickle.dumps(factory))()
    obs, info = env.reset(seed=1)
    assert obs.startswith("Clinical work-up: dosing titration.") and "You have 5 turns." in obs
    assert info["task"].startswith("clin-titration-train-") and info["setting"] == "titration"


def test_trajectory_is_deterministic_and_pinned() -> None:
    def trace(env):
        obs, info = env.reset(seed=7, options={"task": "clin-diagnostic-eval-00003"})
        out = [obs]
        for action in ("ask pain_character", "test d_dimer", "ask pain_character", "nonsense", "commit discharge"):
            out.append(env.step(action))
        return out

    a, b = trace(ClinicalWorkupEnv(**SMALL)), trace(ClinicalWorkupEnv(**SMALL))
    assert repr(a) == repr(b)
    assert a[1][0] == "Pain character: sharp, worse on breathing in. Turns left: 11."
    assert a[3][0] == "(asked before) Pain character: sharp, worse on breathing in. Turns left: 9."
    assert a[2][0].startswith("D-dimer: ") and a[2][0].endswith(" ng/mL (normal). Turns left: 10.")
    assert [step[1] for step in a[1:]] == pytest.approx([-0.02, -0.08, -0.02, -0.1, 1.0])
    assert a[-1][4]["value"] == pytest.approx(1.0 - 0.12) and a[-1][4]["success"]
    seeds = [ClinicalWorkupEnv(**SMALL).reset(seed=s)[1]["task"] for s in range(5)]
    assert seeds == [ClinicalWorkupEnv(**SMALL).reset(seed=s)[1]["task"] for s in range(5)] and len(set(seeds)) > 1


@pytest.mark.parametrize("bad", ["", "@@ not an action @@", "ask", "ask ecg", "test cough", "commit", "commit home",
                                 "ask cough and commit discharge", None, 42])
def test_bad_action_is_an_observation(bad) -> None:
    env = ClinicalWorkupEnv(**SMALL)
    env.reset(options={"task": "clin-diagnostic-eval-00000"})
    obs, reward, terminated, truncated, info = env.step(bad)
    assert obs.startswith(f"Invalid action '{str(bad)[:40]}'. Reply with exactly one action") and obs.endswith("Turns left: 11.")
    assert (reward, terminated, truncated, info["valid_action"], info["questions_asked"]) == (-0.1, False, False, False, 0)
    assert info["expert_action"] is not None and json.loads(json.dumps(info)) == info


def test_action_parsing_is_lenient_about_case_quotes_and_separators() -> None:
    s = load_setting("diagnostic")
    d_dimer = s.finding_index("d_dimer")
    assert parse_action("  Test D-dimer. ", s) == ("test", d_dimer) == parse_action("`test d dimer`", s)
    assert parse_action("'COMMIT acs_pathway'", s) == ("commit", s.decisions.index("acs_pathway"))
    assert parse_action("ask age_group", s) is None  # presentation findings are not actions


# ----- exact posterior and rewards -----
def test_posterior_matches_hand_enumeration_on_tiny_case(tiny_path) -> None:
    env = ClinicalWorkupEnv(setting=tiny_path, n_train_tasks=20, n_eval_tasks=5)
    s = env.setting
    for task in env.task_ids("eval"):
        env.reset(options={"task": task})
        patient = env.task_patient(task)
        seen = {"looks": patient.answers[0]}
        for name in ("pain", "lab"):
            # P(h | seen) = sum over unseen answers of P(h) prod P(a | h), normalized; loops, no shortcuts.
            mass = [0.0, 0.0]
            for h, answers in itertools.product(range(2), itertools.product(range(2), range(3), range(2))):
                if all(answers[s.finding_index(n)] == a for n, a in seen.items()):
                    mass[h] += s.prior_H[h] * math.prod(f.likelihood_AH[a, h] for f, a in zip(s.findings, answers))
            assert env.belief == pytest.approx(np.array(mass) / sum(mass), abs=1e-12)
            env.step(f"{s.findings[s.finding_index(name)].kind} {name}")
            seen[name] = patient.answers[s.finding_index(name)]


@pytest.mark.parametrize("setting", SETTINGS)
def test_posterior_matches_full_joint_enumeration(setting) -> None:
    env = ClinicalWorkupEnv(setting=setting, **SMALL)
    s = env.setting
    _, info = env.reset(options={"task": env.task_ids("eval")[1]})
    for action in info["admissible_actions"][:4]:
        assert env.belief == pytest.approx(brute_force_posterior(s, env._evidence), abs=1e-12)
        env.step(action)


@pytest.mark.parametrize("setting", SETTINGS)
def test_info_gain_reward_is_the_entropy_drop(setting) -> None:
    coef = 0.5
    env = ClinicalWorkupEnv(setting=setting, reward="outcome_info_gain", info_gain_coef=coef, **SMALL)
    plain = ClinicalWorkupEnv(setting=setting, **SMALL)
    s = env.setting
    for task in env.task_ids("eval")[:4]:
        _, info = env.reset(options={"task": task})
        plain.reset(options={"task": task})
        h_start = entropy_bits(brute_force_posterior(s, env._evidence))
        actions = info["admissible_actions"][::3][:3]
        actions.insert(1, actions[0])  # a repeat earns no credit
        total = 0.0
        for action in actions + [commit_now(env, info)]:
            before = entropy_bits(brute_force_posterior(s, env._evidence))
            _, reward, terminated, _, info = env.step(action)
            _, plain_reward, *_ = plain.step(action)
            drop = before - entropy_bits(brute_force_posterior(s, env._evidence))
            assert info["info_gain_bits"] == pytest.approx(drop, abs=1e-12)
            assert reward == pytest.approx(plain_reward + coef * drop, abs=1e-12)
            if not terminated:
                cost = s.findings[parse_action(action, s)[1]].cost
                assert plain_reward == pytest.approx(-cost)
            total += reward
        assert info["info_gain_bits_total"] == pytest.approx(h_start - entropy_bits(env.belief), abs=1e-12)
        assert total == pytest.approx(info["value"] + coef * info["info_gain_bits_total"], abs=1e-12)


def test_value_of_information_matches_enumeration_over_answers() -> None:
    s = load_setting("refill")
    belief_H = brute_force_posterior(s, {"age_group": 1, "refill_timing": 2})
    best_now = max(float(u @ belief_H) for u in s.utility_DH)
    for i, f in enumerate(s.findings):
        expected = sum(max(float(u @ (f.likelihood_AH[a] * belief_H)) for u in s.utility_DH) for a in range(len(f.answers)))
        assert values_of_information(s, belief_H)[i] == pytest.approx(expected - best_now, abs=1e-12)
    available = np.array([f.kind != "presentation" for f in s.findings])
    q1, q2 = (lookahead_q_values(s, belief_H, available, d) for d in (1, 2))
    assert (q2[available] >= q1[available] - 1e-12).all() and np.isneginf(q2[~available]).all()


# ----- episodes and metrics -----
def test_commit_reports_metrics_and_flags_premature_and_unsafe() -> None:
    env = ClinicalWorkupEnv(setting="refill", **SMALL)
    s = env.setting
    for task in env.task_ids("eval"):
        patient = env.task_patient(task)
        if s.risks[patient.condition] == "high":
            break
    env.reset(options={"task": task})
    confidence = decision_confidence(s, env.belief)
    obs, reward, terminated, truncated, info = env.step("commit refill")
    assert (terminated, truncated, info["success"], info["valid_action"]) == (True, False, False, True)
    assert reward == info["value"] == s.utility_DH[0, patient.condition] <= -4
    assert info["unsafe"] and info["risk_level"] == "high" and info["decision"] == "refill"
    assert info["optimal_decision"] in ("hold_and_same_day_review", "stop_and_emergency")
    assert info["premature_commitment"] == (confidence < 0.8) and info["questions_asked"] == 0
    assert "the best decision was " + info["optimal_decision"] in obs and info["expert_action"] is None
    assert json.loads(json.dumps(info)) == info
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("commit refill")


def test_asking_everything_then_committing_is_never_premature() -> None:
    env = ClinicalWorkupEnv(setting="titration", max_turns=20, **SMALL)
    for task in env.task_ids("eval"):
        _, info = env.reset(options={"task": task})
        for action in [a for a in info["admissible_actions"] if not a.startswith("commit")]:
            _, _, _, _, info = env.step(action)
        _, _, _, _, info = env.step(commit_now(env, info))
        assert not info["premature_commitment"] and info["questions_asked"] == 8


def test_turn_budget_truncates_with_timeout_value() -> None:
    env = ClinicalWorkupEnv(setting="diagnostic", max_turns=2, timeout_value=-3.0, **SMALL)
    _, info = env.reset(options={"task": "clin-diagnostic-eval-00002"})
    assert info["expert_action"] is not None
    env.step("ask pain_pattern")
    obs, reward, terminated, truncated, info = env.step("test troponin")
    assert (terminated, truncated, info["success"], info["decision"], info["premature_commitment"]) == (False, True, False, None, False)
    assert reward == pytest.approx(-0.1 - 3.0) and info["value"] == pytest.approx(-3.0 - 0.12)
    assert obs.endswith("The turn budget is used up without a decision.")
    one_turn = ClinicalWorkupEnv(max_turns=1, **SMALL)
    assert one_turn.reset(options={"task": "clin-diagnostic-eval-00002"})[1]["expert_action"].startswith("commit ")


@pytest.mark.parametrize("setting", SETTINGS)
def test_expert_beats_commit_immediately_on_eval_split(setting) -> None:
    env = ClinicalWorkupEnv(setting=setting)
    results = {name: [run_episode(env, t, policy)[2] for t in env.task_ids("eval")]
               for name, policy in (("expert", expert), ("now", commit_now))}
    mean = {name: {k: float(np.mean([i[k] for i in infos])) for k in ("value", "success", "premature_commitment", "questions_asked")}
            for name, infos in results.items()}
    assert mean["expert"]["value"] > mean["now"]["value"] + 0.3
    assert mean["expert"]["success"] >= 0.8 and mean["now"]["success"] <= 0.45
    assert mean["expert"]["premature_commitment"] <= 0.1 < 0.75 <= mean["now"]["premature_commitment"]
    assert 2.5 <= mean["expert"]["questions_asked"] <= 5 and mean["now"]["questions_asked"] == 0
    assert all(i["decision"] is not None for i in results["expert"])  # never runs out of turns
    high = [i for i in results["expert"] if i["risk_level"] == "high"]
    assert len(high) >= 20 and np.mean([i["success"] for i in high]) >= 0.65
    # high_risk_value: the value on exactly those cases, absent (None) on the others
    assert all(i["high_risk_value"] == i["value"] for i in high)
    assert all(i["high_risk_value"] is None for i in results["expert"] if i["risk_level"] != "high")


def test_expert_trajectory_pinned() -> None:
    env = ClinicalWorkupEnv(**SMALL)
    actions, rewards, info = run_episode(env, "clin-diagnostic-eval-00003", expert)
    assert actions == ["ask pain_character", "ask breathlessness", "ask leg_swelling", "commit discharge"]
    assert rewards == pytest.approx([-0.02, -0.02, -0.02, 1.0]) and info["value"] == pytest.approx(0.94)


# ----- splits -----
@pytest.mark.parametrize("setting", SETTINGS)
def test_splits_sized_disjoint_by_content_deterministic_and_unskewed(setting) -> None:
    a, b = ClinicalWorkupEnv(setting=setting), ClinicalWorkupEnv(setting=setting)
    train, eval_ = a.task_ids("train"), a.task_ids("eval")
    assert (len(train), len(eval_)) == (2000, 200) and train[17] == f"clin-{setting}-train-00017"
    assert train == b.task_ids("train") and eval_ == b.task_ids("eval")
    train_p, eval_p = [a.task_patient(t) for t in train], [a.task_patient(t) for t in eval_]
    assert len(set(train_p)) == 2000 and len(set(eval_p)) == 200 and not set(train_p) & set(eval_p)
    assert eval_p == [b.task_patient(t) for t in eval_]
    # Dropping duplicate patients must not distort the case mix: train conditions follow the prior.
    freq = np.bincount([p.condition for p in train_p], minlength=len(a.setting.conditions)) / 2000
    assert np.abs(freq - a.setting.prior_H).max() < 0.04
    # The first eval patients do not depend on the train size; another split_seed gives others.
    assert ClinicalWorkupEnv(setting=setting, **SMALL).task_patient(eval_[3]) == eval_p[3]
    assert ClinicalWorkupEnv(setting=setting, split_seed=1, **SMALL).task_patient(eval_[3]) != eval_p[3]


def test_small_content_space_still_gives_distinct_disjoint_splits(tiny_path) -> None:
    # The tiny case has only 2 x 2 x 3 x 17 = 204 distinct patients, so draws collide often.
    env = ClinicalWorkupEnv(setting=tiny_path, n_train_tasks=120, n_eval_tasks=40)
    train = [env.task_patient(t) for t in env.task_ids("train")]
    eval_ = [env.task_patient(t) for t in env.task_ids("eval")]
    assert len(set(train)) == 120 and len(set(eval_)) == 40 and not set(train) & set(eval_)
    with pytest.raises(ValueError, match="too few distinct tiny patients for 200 train tasks"):
        ClinicalWorkupEnv(setting=tiny_path, n_train_tasks=200, n_eval_tasks=40).task_ids("train")


def test_shown_values_lie_in_their_answer_band() -> None:
    env = ClinicalWorkupEnv(setting="titration")
    s = env.setting
    inr = s.finding_index("inr")
    for task in env.task_ids("eval"):
        p = env.task_patient(task)
        low, high = s.findings[inr].value_ranges[p.answers[inr]]
        assert low <= float(p.values[inr]) <= high and p.values[s.finding_index("bruising")] == ""


# ----- errors -----
@pytest.mark.parametrize("task", ["clin-refill-eval-00000", "clin-diagnostic-test-00001", "clin-diagnostic-eval-00010",
                                  "fl4-eval-00000", 3])
def test_bad_task_id_raises_naming_it(task) -> None:
    with pytest.raises(ValueError, match=repr(task)):
        ClinicalWorkupEnv(**SMALL).reset(options={"task": task})


def test_unknown_split_raises() -> None:
    with pytest.raises(ValueError, match="unknown split 'test'.*'train', 'eval'"):
        ClinicalWorkupEnv(**SMALL).task_ids("test")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"setting": "surgery"}, "unknown setting 'surgery'"),
    ({"reward": "info_gain"}, "reward='info_gain'"),
    ({"max_turns": 0}, "max_turns=0"),
    ({"info_gain_coef": -1}, "info_gain_coef=-1"),
    ({"premature_threshold": 0}, "premature_threshold=0"),
    ({"timeout_value": float("nan")}, "timeout_value=nan"),
])
def test_bad_kwarg_raises_naming_it(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ClinicalWorkupEnv(**kwargs)


def test_malformed_setting_file_raises_naming_the_entry(tmp_path) -> None:
    broken = json.loads(json.dumps(TINY))
    broken["findings"][1]["likelihood"]["sick"] = [0.5, 0.5, 0.5]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="finding 'pain' needs, per condition, 3 likelihoods > 0 summing to 1"):
        ClinicalWorkupEnv(setting=str(path))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.pop("title"), r"missing or malformed entry \(KeyError\('title'\)\)"),
    (lambda d: d["findings"][2]["likelihood"].update(sick=[0.2, 0.8, 0.0]), "finding 'lab' needs 2 likelihoods"),
    (lambda d: d["decisions"][0]["utility"].update(sick="bad"), "missing or malformed entry"),
    (lambda d: d["decisions"][1]["utility"].update(well=1.0), r"exactly one best decision; ties for \['well'\]"),
])
def test_setting_file_errors_name_the_file_and_entry(tmp_path, edit, message) -> None:
    broken = json.loads(json.dumps(TINY))
    edit(broken)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=f"setting file '{path}'.*{message}"):
        ClinicalWorkupEnv(setting=str(path))


@pytest.mark.parametrize("setting", SETTINGS)
def test_reward_kwargs_change_the_rewards_only_so_one_bootstrap_serves_both(setting) -> None:
    # The bootstrap keeps reward_kwargs out of its cache key: the expert's episodes must then be
    # the same text, action for action, under either reward, with only the rewards differing.
    from types import SimpleNamespace

    from opd.bootstrap.cache import data_kwargs

    def expert_episodes(**reward):
        env, out = ClinicalWorkupEnv(setting=setting, **SMALL, **reward), []
        for task in env.task_ids("train")[:8]:
            obs, info = env.reset(options={"task": task})
            texts, rewards, done = [obs], [], False
            while not done:
                texts.append(info["expert_action"])
                obs, reward, terminated, truncated, info = env.step(texts[-1])
                texts.append(obs)
                rewards.append(reward)
                done = terminated or truncated
            out.append((texts, rewards))
        return out

    plain, shaped = expert_episodes(), expert_episodes(reward="outcome_info_gain", info_gain_coef=0.3)
    assert [texts for texts, _ in plain] == [texts for texts, _ in shaped]
    assert [rewards for _, rewards in plain] != [rewards for _, rewards in shaped]
    assert ClinicalWorkupEnv.reward_kwargs == {"reward", "info_gain_coef"}
    cfg = SimpleNamespace(id=ENV_ID, module="", kwargs={"setting": setting, "reward": "outcome_info_gain",
                                                        "info_gain_coef": 0.3, "max_turns": 6})
    assert data_kwargs(cfg) == {"setting": setting, "max_turns": 6}


@pytest.mark.parametrize("setting", SETTINGS)
def test_state_line_is_the_finding_not_the_instructions_or_turn_count(setting) -> None:
    # A ``think: plan`` target states the state line; the default (the last line) would be the
    # reset's answer format and every step's "Turns left", which a reasoning model then copies.
    env = ClinicalWorkupEnv(setting=setting, **{**SMALL, "max_turns": 2})
    obs, info = env.reset(options={"task": env.task_ids("eval")[0]})
    presentation = obs.splitlines()[1]
    assert ClinicalWorkupEnv.state_line(obs) == presentation and not presentation.startswith("Clinical work-up")
    assert "Reply with" in obs.splitlines()[-1]  # what the default would have taken
    obs, *_, info = env.step(info["expert_action"])
    assert "Turns left: 1." in obs
    finding = ClinicalWorkupEnv.state_line(obs)
    assert finding == obs.removesuffix(" Turns left: 1.") and "Turns left" not in finding
    obs, *_ = env.step("order pizza")  # invalid, and the budget is used up
    assert ClinicalWorkupEnv.state_line(obs) == "Invalid action 'order pizza'."
