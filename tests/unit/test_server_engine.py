"""The served teacher's parts that need no server: how a packed trajectory becomes the plain
sequences a completions server scores, and the HTTP client's failures (a port nothing listens on,
a missing API key). The protocol itself is tested against real ``vllm serve`` processes in
tests/integration/test_server_teacher.py."""

from __future__ import annotations

import socket
import time

import pytest

from opd.generation.server import ServerEngine, ServerError, ServerSpec, base_url
from opd.generation.vllm_engine import scored_sequences
from opd.supervision.teacher_view import naive_requests, pack_trajectory
from tests.unit.test_chat import ten_turn_trajectory


def _expand(request, layout):
    """Per target: the context the server sees before it and the token it scores."""
    sequences, where = scored_sequences(request, layout)
    return [(sequences[s][:p], sequences[s][p]) for s, p in where], sum(len(s) for s in sequences)


@pytest.mark.parametrize("view", ["state_grounded", "full"])
def test_both_layouts_score_each_token_in_its_turns_own_context(tokenizer, fmt, view):
    traj = ten_turn_trajectory(tokenizer, fmt)
    reference = [(req.input_ids[:i], req.input_ids[i]) for req in naive_requests(traj, view, fmt)
                 for i in req.target_index]
    packed = pack_trajectory(traj, view, fmt)
    episode, episode_tokens = _expand(packed, "episode")
    turn, turn_tokens = _expand(packed, "turn")
    assert episode == reference and turn == reference
    # turn: exactly the naive per-turn sequences; episode: never more tokens, far fewer on a shared trunk.
    assert scored_sequences(packed, "turn")[0] == [r.input_ids for r in naive_requests(traj, view, fmt)]
    if view == "full":
        assert episode_tokens * 3 < turn_tokens
    else:
        assert episode_tokens == turn_tokens


def test_an_unknown_layout_is_refused(tokenizer, fmt):
    with pytest.raises(ValueError, match="unknown sequence layout 'batch'"):
        scored_sequences(pack_trajectory(ten_turn_trajectory(tokenizer, fmt), "full", fmt), "batch")


def test_base_urls_lose_a_trailing_v1():
    assert base_url("http://h:8000/v1/") == base_url("http://h:8000") == "http://h:8000"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_is_down_gives_up_after_its_retries_with_the_url(tokenizer, fmt):
    url = f"http://127.0.0.1:{_free_port()}"
    engine = ServerEngine(ServerSpec((url,), "teacher", retries=2))
    started = time.perf_counter()
    with pytest.raises(ServerError, match=rf"failed 3 attempts in a row \(teacher.server.retries: 2\).*{url}.*cannot be "
                                          "reached"):
        engine.score([pack_trajectory(ten_turn_trajectory(tokenizer, fmt), "full", fmt)])
    seconds = time.perf_counter() - started
    assert 3.0 <= seconds < 10  # back-offs of 1 and 2 s, no more
    assert engine.replicas.failed == 3 and engine.replicas.sent == 0


def test_a_missing_api_key_names_the_variable_not_a_key(monkeypatch):
    monkeypatch.delenv("OPD_TEST_TEACHER_KEY", raising=False)
    engine = ServerEngine(ServerSpec((f"http://127.0.0.1:{_free_port()}",), "teacher", api_key_env="OPD_TEST_TEACHER_KEY"))
    with pytest.raises(ServerError, match="teacher.server.api_key_env names 'OPD_TEST_TEACHER_KEY', which is not set"):
        engine.replicas.post("/v1/completions", {})
    monkeypatch.setenv("OPD_TEST_TEACHER_KEY", "secret-value")
    assert engine.replicas._headers()["Authorization"] == "Bearer secret-value"


def test_a_served_teacher_neither_trains_nor_streams():
    engine = ServerEngine(ServerSpec(("http://127.0.0.1:1",), "teacher"))
    for call in (lambda: engine.update_weights({}), engine.state_dict, engine.stream):
        with pytest.raises(NotImplementedError, match="served teacher"):
            call()
