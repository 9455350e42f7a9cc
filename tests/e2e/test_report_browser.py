"""``opd report``'s page in a real browser: Debian's headless Chromium, driven by Selenium,
opens the ``report.html`` of a real two-step run (``opd train`` through Ray and DeepSpeed) from a
``file://`` URL, picks a training step and an episode with the page's own controls, and finds
that episode's text and its coloured token spans in the DOM, with no console error.

It needs ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (``apt-get install chromium
chromium-driver``; ``scripts/test.sh`` installs them when it runs as root) and skips, saying so,
without them. Selenium is pointed at both, so Selenium Manager downloads nothing. Each test saves
screenshots under its pytest tmp dir (the first also into the run directory) and prints where.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from opd.evaluation.html_report import RATIO_STEPS, ratio_bucket, ratio_palette, write_html_report
from opd.evaluation.trajectories import read_episodes
from opd.evaluation.trajectories import write_episodes
from tests.unit.test_html_report import HOSTILE, episode_row, make_run_dir

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"


def _missing() -> str | None:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return (f"{CHROMIUM} or {CHROMEDRIVER} is missing: apt-get install chromium chromium-driver "
                "(scripts/test.sh does it when run as root)")
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed in this environment: pip install 'selenium>=4.11'"
    return None


# CI sets OPD_REQUIRE_BROWSER=1 (.ci/run): there a missing browser is a failure, not a skip.
_REQUIRED = os.environ.get("OPD_REQUIRE_BROWSER") == "1"
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_missing() is not None and not _REQUIRED, reason=_missing() or "")]


def test_the_browser_is_there_when_ci_requires_it():
    assert _missing() is None, _missing()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="opd-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real run directory: two steps of the tiny recipe, a training sample every step."""
    import ray

    from opd.cli import main

    run = tmp_path_factory.mktemp("report") / "run"
    cache = tmp_path_factory.getbasetemp() / "cache"  # shared with the integration tests' runs
    try:
        assert main(["train", str(TINY), f"run.output_dir={run}", "run.trajectory_every_steps=1", "run.total_steps=2",
                     f"student.bootstrap.cache_dir={cache}", f"teacher.bootstrap.cache_dir={cache}"]) == 0
    finally:
        ray.shutdown()
    return run


def _open(driver, report: Path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")  # drop what an earlier page logged
    driver.get(report.resolve().as_uri())
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode-view .turn"))


def _choose(driver, file_name: str, episode: int):
    """Pick a file and an episode with the page's controls, as a person would."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    option = driver.find_element(By.CSS_SELECTOR, f'#file-select option[data-name="{file_name}"]')
    Select(driver.find_element(By.ID, "file-select")).select_by_value(option.get_attribute("value"))
    Select(driver.find_element(By.ID, "episode-select")).select_by_value(str(episode))
    WebDriverWait(driver, 10).until(lambda d: f"episode {episode}," in d.find_element(
        By.CSS_SELECTOR, "#episode-view h3").text)


def _severe(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _screenshots(driver, directory: Path, stem: str) -> list[Path]:
    from selenium.webdriver.common.by import By

    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(int(height), 8000))
    driver.execute_script("window.scrollTo(0, 0)")
    page, viewer = directory / f"{stem}.png", directory / f"{stem}_viewer.png"
    driver.save_screenshot(str(page))
    driver.find_element(By.ID, "viewer").screenshot(str(viewer))
    driver.set_window_size(1400, 1000)
    assert page.stat().st_size > 10_000 and viewer.stat().st_size > 5_000
    return [page, viewer]


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r}, {g}, {b}, 1)"


def _three(x: float) -> str:
    return f"{round(x, 3) + 0.0:.3f}"


def test_the_viewer_shows_the_chosen_training_episode_token_by_token(browser, trained_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    report = write_html_report(trained_run)
    print(f"\nreport: {report} ({report.stat().st_size / 1024:.0f} KiB)")
    _open(browser, report)
    assert browser.title == "opd report: tiny"
    assert browser.find_elements(By.CSS_SELECTOR, 'figure[data-panel="Success"] svg')
    assert browser.find_elements(By.CSS_SELECTOR, 'figure[data-panel="Step time"] svg rect')

    episode = read_episodes(trained_run / "trajectories" / "train_step_2.parquet")[1]
    _choose(browser, "train_step_2.parquet", 1)
    Select(browser.find_element(By.ID, "scale-select")).select_by_value("fixed")  # the colours Python bucketed
    view = browser.find_element(By.ID, "episode-view")
    text = view.get_attribute("textContent")
    assert f"train · step 2: episode 1, task {episode['task']}" in text
    assert episode["turns"][-1]["observation"] in text  # the final observation, verbatim
    assert [c.get_attribute("textContent") for c in view.find_elements(By.CSS_SELECTOR, "code.action-text")] == \
        [turn["action"] for turn in episode["turns"]]
    cards = view.find_elements(By.CSS_SELECTOR, ".turn")
    assert len(cards) == len(episode["turns"])

    # Every response token of turn 0 is a span whose title holds both logprobs, coloured by their ratio.
    turn = episode["turns"][0]
    spans = cards[0].find_elements(By.CSS_SELECTOR, ".response span.tok")
    assert len(spans) == len(turn["response_tokens"]) and len(turn["teacher_logprobs"]) == len(spans)
    palette = ratio_palette()
    for span, b, t in zip(spans, turn["behaviour_logprobs"], turn["teacher_logprobs"]):
        title = span.get_attribute("title")
        assert f"student (behaviour) logprob {_three(b)}" in title and f"teacher logprob {_three(t)}" in title, title
        assert span.value_of_css_property("background-color") == \
            _rgb(palette[ratio_bucket(round(b, 3), round(t, 3)) + RATIO_STEPS])
    assert len(cards[0].find_elements(By.CSS_SELECTOR, ".response .action span.tok")) == \
        turn["action_end"] - turn["action_start"]

    # The previous/next buttons move through the file.
    browser.find_element(By.ID, "next-episode").click()
    assert "episode 2," in view.find_element(By.CSS_SELECTOR, "h3").text
    # A held-out evaluation is not scored by the teacher: its tokens are neutral, said so on hover.
    _choose(browser, "eval_student_step_2.parquet", 0)
    neutral = browser.find_elements(By.CSS_SELECTOR, "#episode-view span.tok.nt")
    assert neutral and "teacher logprob n/a" in neutral[0].get_attribute("title")

    _choose(browser, "train_step_2.parquet", 1)
    assert _severe(browser) == []
    shots = _screenshots(browser, tmp_path, "report")
    # Kept as the test's artifacts: in the run directory and in test-artifacts/ (OPD_TEST_ARTIFACTS), which
    # outlives pytest's rotating tmp dirs.
    artifacts = Path(os.environ.get("OPD_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    for shot in shots:
        shutil.copy(shot, trained_run / f"{shot.stem}_screenshot.png")
        shutil.copy(shot, artifacts / f"{shot.stem}_screenshot.png")
    print("screenshots:", *shots, *(artifacts / f"{s.stem}_screenshot.png" for s in shots), sep="\n  ")


def test_script_tags_in_an_observation_stay_text(browser, tmp_path):
    from selenium.webdriver.common.by import By

    run = make_run_dir(tmp_path, episodes=3, observation=HOSTILE)
    _open(browser, write_html_report(run))
    _choose(browser, "train_step_2.parquet", 1)
    assert browser.execute_script("return window.pwned === undefined")
    view = browser.find_element(By.ID, "episode-view")
    assert HOSTILE in view.get_attribute("textContent")
    assert view.find_elements(By.CSS_SELECTOR, ".turn.mark-pivot .badge.pivot")  # PivotOPD's mark, as a badge
    assert "↵" in view.find_element(By.CSS_SELECTOR, "span.tok").get_attribute("textContent")  # a newline token, visible
    assert browser.find_element(By.CSS_SELECTOR, "table.pass-at-k").is_displayed()
    assert browser.execute_script("return document.querySelector('img.plot').naturalWidth") > 0
    assert _severe(browser) == []
    print("screenshots:", *_screenshots(browser, tmp_path, "hostile"), sep="\n  ")


def test_a_late_step_is_coloured_relative_to_its_file_and_the_largest_disagreement_is_found(browser, tmp_path):
    """Issue 54, item 6: at step 150 every log-ratio is near 0.01 and the fixed scale (±3 nats)
    is white. ``auto`` stretches the colours to the file's largest ratio; "largest disagreement"
    scrolls to the token the teacher finds least likely; the episode picker's label is not cut."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    run = make_run_dir(tmp_path, episodes=3)
    late = [episode_row(150, i, teacher=(-1.01, -0.99, -1.0 - 0.02 * (i + 1)), success=i == 0) for i in range(3)]
    write_episodes(run / "trajectories" / "train_step_150.parquet", late)
    _open(browser, write_html_report(run))
    _choose(browser, "train_step_150.parquet", 1)
    view = browser.find_element(By.ID, "episode-view")
    palette = ratio_palette()
    colours = [s.value_of_css_property("background-color") for s in view.find_elements(By.CSS_SELECTOR, "span.tok")]
    # The file's largest |ratio| is 0.06 (episode 2): episode 1's -0.04 token is two thirds of the way to red.
    assert colours[2] == _rgb(palette[RATIO_STEPS + round(-0.04 / (0.06 / RATIO_STEPS))]) != _rgb(palette[RATIO_STEPS])
    assert "this file's largest" in browser.find_element(By.ID, "scale-low").text
    Select(browser.find_element(By.ID, "scale-select")).select_by_value("fixed")
    fixed = [s.value_of_css_property("background-color") for s in view.find_elements(By.CSS_SELECTOR, "span.tok")]
    assert set(fixed) == {_rgb(palette[RATIO_STEPS])}  # what the trial saw: white
    Select(browser.find_element(By.ID, "scale-select")).select_by_value("episode")
    tokens = view.find_elements(By.CSS_SELECTOR, "span.tok")
    assert tokens[2].value_of_css_property("background-color") == _rgb(palette[0])  # its own largest: full red

    browser.find_element(By.ID, "jump-disagreement").click()
    found = view.find_elements(By.CSS_SELECTOR, "span.tok.found")
    assert len(found) == 1 and abs(float(found[0].get_attribute("data-ratio")) + 0.04) < 1e-9
    assert browser.find_element(By.ID, "jump-note").text == "turn 1: log-ratio -0.040"

    # The picker shows the outcome and the turns first, and is wide enough for its whole label.
    picker = browser.find_element(By.ID, "episode-select")
    label = Select(picker).first_selected_option.text
    assert label.startswith("#1 · ✗ truncated · 2 turns · reward 1.000"), label
    assert browser.execute_script(
        "var s = arguments[0], c = document.createElement('canvas').getContext('2d');"
        "c.font = getComputedStyle(s).font; return c.measureText(s.options[s.selectedIndex].text).width < s.clientWidth;",
        picker), label
    assert _severe(browser) == []
    print("screenshots:", *_screenshots(browser, tmp_path, "late_step"), sep="\n  ")
