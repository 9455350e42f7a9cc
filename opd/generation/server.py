"""A teacher served over HTTP: the engine contract on an OpenAI-compatible completions endpoint.

A large teacher is usually served already, by ``vllm serve`` on its own GPUs, shared by several
jobs. ``teacher.engine: server`` scores against such a server instead of loading the model:

- **Scoring** sends each sequence as token ids (never re-tokenised text) with ``max_tokens: 1``
  and ``prompt_logprobs: k``; the server answers, per prompt position, the logprob of the token
  there and the top-k (vLLM's prompt logprobs, the same numbers as the in-process
  :class:`~opd.generation.vllm_engine.VLLMEngine`'s). ``sampled`` and ``topk`` work; ``full`` and
  ``hidden`` cannot cross this protocol (it stops at a top-k).
- **Layout** (``teacher.server.request``): ``episode`` sends a trajectory as its packed request
  unpacked (:func:`~opd.generation.vllm_engine.scored_sequences`): the trunk once when turns are
  scored on it, and one sequence per branch (the trunk before the turn and the turn's response);
  ``turn`` sends one sequence per turn, the turn's whole context and its response. vLLM skips its
  prefix cache for requests with prompt logprobs, so every sequence is computed in full and the
  layout with fewer tokens is the cheaper (``bench/server_teacher.py`` measures both).
- **Batching**: ``prompts_per_request`` sequences per HTTP request, ``in_flight`` requests at once
  (threads), spread round-robin over the replicas (``urls``).
- **Faults**: a replica that refuses a connection, times out or answers 5xx is set aside for a
  back-off and the request goes to the next; after ``retries`` failed attempts the call raises
  :class:`ServerError` (the run then stops like any failed role). A 4xx answer is the request's
  fault and raises at once, with the server's status and message.
- **Checks** (:func:`check_server`, at the start of a run): every URL answers and serves the
  named model, the server tokenizes as the local tokenizer does, and the replicas agree on a probe.

The API key, when the server wants one, is read from the environment variable that
``teacher.server.api_key_env`` names, in the process that sends the requests: it never enters a
recipe, a spec, a log or ``config.yaml``.

Example:
    >>> engine = ServerEngine(ServerSpec(urls=("http://127.0.0.1:8000",), model="Qwen/Qwen3-32B"))  # doctest: +SKIP
    >>> engine.score([request], mode="topk", top_k=20)  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from opd.generation.base import Completion, SamplingParams, ScoreRequest, TokenScores
from opd.generation.vllm_engine import read_prompt_logprobs, scored_sequences

SERVER_CANNOT = {"full": "the whole distribution (prompt logprobs stop at a top-k)",
                 "hidden": "the teacher's hidden states (the completions API returns logprobs only)"}
LAYOUTS = ("episode", "turn")


class ServerError(RuntimeError):
    """A teacher server that cannot be used: unreachable, refusing, or not what the recipe names.

    Attributes:
        url: the replica concerned (``""`` for all of them).
        status: the HTTP status of the answer, 0 when none came.
    """

    def __init__(self, message: str, url: str = "", status: int = 0):
        super().__init__(message)
        self.url = url
        self.status = status


@dataclass(frozen=True)
class ServerSpec:
    """Where the teacher is served and how to talk to it (the recipe's ``teacher.server``).

    Attributes:
        urls: the replicas' base URLs (``http://host:port``, with or without ``/v1``).
        model: the served model's name (``vllm serve --served-model-name``, else its path).
        api_key_env: the environment variable holding the API key ("": none sent).
        timeout_s: the longest one HTTP request may take before it counts as failed.
        connect_timeout_s: the longest a connection may take (the start's checks use it).
        retries: failed attempts (other replicas first) before a call gives up.
        in_flight: HTTP requests sent at once.
        prompts_per_request: sequences batched in one request.
        request: ``episode`` or ``turn``: how a trajectory is cut into sequences.
        replica_tolerance: the largest difference in logprob between replicas on the start's probe.
    """

    urls: tuple[str, ...]
    model: str
    api_key_env: str = ""
    timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    retries: int = 3
    in_flight: int = 4
    prompts_per_request: int = 8
    request: str = "episode"
    replica_tolerance: float = 0.02

    @classmethod
    def of(cls, server_cfg: Any) -> "ServerSpec":
        """The spec of a recipe's ``teacher.server`` section (:class:`opd.schema.ServerConfig`)."""
        return cls(urls=tuple(str(u) for u in server_cfg.urls), model=str(server_cfg.model),
                   api_key_env=str(server_cfg.api_key_env), timeout_s=float(server_cfg.timeout_s),
                   connect_timeout_s=float(server_cfg.connect_timeout_s), retries=int(server_cfg.retries),
                   in_flight=int(server_cfg.in_flight), prompts_per_request=int(server_cfg.prompts_per_request),
                   request=str(server_cfg.request), replica_tolerance=float(server_cfg.replica_tolerance))


def base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: the server's root, where ``/tokenize`` lives."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class Replicas:
    """The server's replicas, used round-robin. One that fails is set aside for ``COOL_DOWN_S``
    (the others take its requests; it is tried again after); a failed request is retried after
    a back-off doubling from 1 s, ``retries`` times at most, so a call that cannot succeed gives
    up within seconds plus its attempts' timeouts. Once one request has given up, the requests
    still waiting in the same call give up at their next attempt (:meth:`abort`)."""

    COOL_DOWN_S = 10.0

    def __init__(self, spec: ServerSpec):
        if not spec.urls:
            raise ServerError("teacher.server.urls is empty: give the base URL of at least one server")
        self.spec = spec
        self.urls = [base_url(u) for u in spec.urls]
        self._lock = threading.Lock()
        self._next = itertools.count()
        self._down_until = {u: 0.0 for u in self.urls}
        self._aborted: str | None = None
        self.sent = 0  # HTTP requests answered
        self.failed = 0  # attempts that failed and were retried

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.spec.api_key_env:
            key = os.environ.get(self.spec.api_key_env)
            if not key:
                raise ServerError(f"teacher.server.api_key_env names {self.spec.api_key_env!r}, which is not set in "
                                  f"this process's environment (on host {os.uname().nodename}): export it where the "
                                  "run starts (and on every node of a cluster)")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _pick(self) -> str:
        with self._lock:
            first = next(self._next) % len(self.urls)
            order = self.urls[first:] + self.urls[:first]
            now = time.monotonic()
            return next((u for u in order if self._down_until[u] <= now), min(order, key=self._down_until.get))

    def _mark(self, url: str, ok: bool) -> None:
        with self._lock:
            if ok:
                self._down_until[url] = 0.0
                self.sent += 1
            else:
                self.failed += 1
                self._down_until[url] = time.monotonic() + self.COOL_DOWN_S

    def abort(self, reason: str | None) -> None:
        """Make the requests still waiting give up (``reason``), or, with ``None``, let them run again."""
        self._aborted = reason

    def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON answer of ``POST route`` on some replica, retried as set out above."""
        errors: list[str] = []
        for attempt in range(self.spec.retries + 1):
            if attempt:
                time.sleep(min(2.0 ** (attempt - 1), 30.0))
            if self._aborted is not None:
                raise ServerError(self._aborted)
            url = self._pick()
            try:
                answer = request_json(url + route, body, self._headers(), self.spec.timeout_s)
            except ServerError as exc:
                if 400 <= exc.status < 500:
                    raise  # the request's own fault: another replica would refuse it too
                self._mark(url, ok=False)
                errors.append(str(exc))
                continue
            self._mark(url, ok=True)
            return answer
        raise ServerError(f"the teacher server failed {len(errors)} attempts in a row (teacher.server.retries: "
                          f"{self.spec.retries}); the last: {errors[-1]}")


def request_json(url: str, body: dict[str, Any] | None, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """``POST`` (``GET`` without a body) ``url`` and its JSON answer; any failure is a
    :class:`ServerError` that names the URL and, for an HTTP error, its status and the server's
    message."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url} answered HTTP {exc.code}: {_server_message(exc)}", url, exc.code) from None
    except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out, reset
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            raise ServerError(f"{url} did not answer within {timeout_s:g} s", url) from None
        raise ServerError(f"{url} cannot be reached ({reason})", url) from None
    except json.JSONDecodeError:
        raise ServerError(f"{url} answered something that is not JSON: not an OpenAI-compatible server", url) from None


def _server_message(exc: urllib.error.HTTPError) -> str:
    text = exc.read().decode(errors="replace")
    try:
        error = json.loads(text)
        error = error.get("error", error)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:500]
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:500] or exc.reason


class ServerEngine:
    """A teacher on an OpenAI-compatible completions server (see the module docstring)."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.replicas = Replicas(spec)
        self.scored_tokens = 0  # prompt tokens sent for scoring, over the engine's life

    # -- scoring ----------------------------------------------------------------------------
    def score(self, requests: list[ScoreRequest], batch_size: int = 16, mode: str = "sampled", top_k: int = 0,
              batch_tokens: int = 0) -> list[TokenScores]:
        """Scores of each request's targets at temperature 1 (prompt logprobs on the server).
        ``batch_size`` and ``batch_tokens`` are the HF engine's: ``prompts_per_request`` and
        ``in_flight`` batch here."""
        if mode in SERVER_CANNOT:
            raise ValueError(f"a served teacher (teacher.engine: server) cannot return {SERVER_CANNOT[mode]} "
                             f"(supervision.scoring: {mode}); use supervision.scoring: topk, or a teacher on "
                             "teacher.engine: hf")
        k = top_k if mode == "topk" else 0
        split = [scored_sequences(r, self.spec.request) for r in requests]
        flat = [seq for sequences, _ in split for seq in sequences]
        per = max(1, self.spec.prompts_per_request)
        chunks = [flat[i : i + per] for i in range(0, len(flat), per)]

        def send(prompts: list[list[int]]) -> list[list]:
            body = {"model": self.spec.model, "prompt": prompts, "max_tokens": 1, "temperature": 1.0,
                    "prompt_logprobs": k}
            try:
                answer = self.replicas.post("/v1/completions", body)
            except ServerError as exc:
                longest = max(len(p) for p in prompts)
                if exc.status == 400 and "context length" in str(exc):
                    raise ServerError(f"{exc} (opd sent a teacher sequence of {longest} tokens: serve the teacher "
                                      "with a larger vllm serve --max-model-len, or lower rollout.max_context_tokens)",
                                      exc.url, exc.status) from None
                raise
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            return [_json_logprobs(c["prompt_logprobs"]) for c in choices]

        answers = [part for chunk in self._in_flight(send, chunks) for part in chunk]
        self.scored_tokens += sum(len(s) for s in flat)
        results, cursor = [], 0
        for sequences, targets in split:
            results.append(read_prompt_logprobs(answers[cursor : cursor + len(sequences)], sequences, targets, mode, k))
            cursor += len(sequences)
        return results

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``n`` completions per prompt, prompt-major, request ``i`` seeded ``seed + i`` (or
        ``seeds[i]``), as :meth:`VLLMEngine.generate <opd.generation.vllm_engine.VLLMEngine.generate>`.
        The behaviour logprobs are the server's (``vllm serve --logprobs-mode processed_logprobs``
        gives them after temperature, as the in-process engine does; the default is before)."""
        seeds = params.seeds if params.seeds is not None else [params.seed + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"SamplingParams.seeds has {len(seeds)} seeds for {len(prompts)} prompts")

        def send(i: int) -> list[Completion]:
            body = {"model": self.spec.model, "prompt": list(prompts[i]), "max_tokens": params.max_new_tokens,
                    "temperature": params.temperature, "seed": seeds[i], "n": params.n, "logprobs": 0,
                    "stop_token_ids": list(params.stop_token_ids), "stop": list(params.stop),
                    "return_token_ids": True, "skip_special_tokens": False}
            answer = self.replicas.post("/v1/completions", body)
            out = []
            for choice in sorted(answer["choices"], key=lambda c: c["index"]):
                ids = list(choice.get("token_ids") or [])
                logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs", [])][: len(ids)]
                out.append(Completion(ids, logprobs, "stop" if choice.get("finish_reason") == "stop" else "length"))
            return out

        return [c for part in self._in_flight(send, list(range(len(prompts)))) for c in part]

    def _in_flight(self, send, items: list) -> list:
        """``[send(item) for item in items]``, ``in_flight`` at a time; the first failure makes
        the requests still waiting give up (none is sent after it) and is raised."""
        if len(items) <= 1 or self.spec.in_flight <= 1:
            return [send(item) for item in items]
        pool = ThreadPoolExecutor(min(self.spec.in_flight, len(items)))
        try:
            futures = [pool.submit(send, item) for item in items]
            return [future.result() for future in futures]
        except BaseException as exc:
            self.replicas.abort(f"given up beside another request of the same call: {exc}")
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.replicas.abort(None)

    def stream(self, seed: int = 0):
        raise NotImplementedError("a served teacher does not stream; it scores and, for evaluation, generates")

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, state_dict) -> None:
        raise NotImplementedError("a served teacher is frozen; its weights are the server's")

    def state_dict(self):
        raise NotImplementedError("a served teacher's weights are on its server")


def _json_logprobs(prompt_logprobs: list | None) -> list:
    """The server's ``prompt_logprobs`` (per position ``{"id": {"logprob", "rank"}}``, ``None`` at
    position 0) as :func:`read_prompt_logprobs` reads them: ``{id: (logprob, rank)}``."""
    if prompt_logprobs is None:
        raise ServerError("the teacher server answered without prompt_logprobs: serve it with vLLM (vllm serve), "
                          "whose completions API returns them")
    return [None if step is None else {int(t): (float(v["logprob"]), int(v["rank"] or 0)) for t, v in step.items()}
            for step in prompt_logprobs]


PROBE_TEXT = ("You are in the middle of a room. Looking quickly around you, you see a cabinet 4, a desk 1 and "
              "a drawer 12.\nYour task is to: put a clean mug on the desk.\n> go to drawer 12 {\"x\": [1, 2.5]} "
              "héllo 東京 🙂\t  done.")


def check_server(spec: ServerSpec, tokenizer, key: str = "teacher.server") -> dict[str, Any]:
    """The start's checks of a served teacher, each failing within seconds with a
    :class:`ServerError` that names the URL and what was there instead:

    1. every replica answers ``/v1/models`` within ``connect_timeout_s`` and serves ``spec.model``;
    2. the server tokenizes a probe text (and decodes a spread of ids) as ``tokenizer`` does, the
       tokenizer opd renders the teacher's view with (:class:`opd.models.TokenizerMismatchError`
       otherwise, its ``problems`` naming each difference);
    3. the replicas agree: each scores the probe, and one whose logprobs differ from the first's by
       more than ``replica_tolerance`` is named.

    ``key`` is the recipe section the messages name. Returns ``max_model_len`` (the smallest over replicas, 0 if none says), the probe's largest
    logprob difference between replicas, and the seconds the checks took.
    """
    from opd.models import TokenizerMismatchError

    start = time.perf_counter()
    replicas = Replicas(spec)
    headers = replicas._headers()
    lengths = []
    for i, url in enumerate(replicas.urls):
        where = f"{key}.urls.{i} ({url})"
        try:
            listing = request_json(url + "/v1/models", None, headers, spec.connect_timeout_s)
        except ServerError as exc:
            hint = ("is it an OpenAI-compatible server (vllm serve)?" if exc.status
                    else "is the server up, and is the URL right?")
            raise ServerError(f"{where}: {exc}; {hint}", url, exc.status) from None
        served = {m.get("id"): m for m in listing.get("data", []) if isinstance(m, dict)}
        if spec.model not in served:
            raise ServerError(f"{where} serves {sorted(served) or 'no model'}, not {spec.model!r} ({key}.model): "
                              "name one of those, or point the URL at the server of that model", url)
        if served[spec.model].get("max_model_len"):
            lengths.append(int(served[spec.model]["max_model_len"]))
    max_model_len = min(lengths) if lengths else 0
    url = replicas.urls[0]
    probe = _probe_text(tokenizer)
    local_ids = tokenizer.encode(probe, add_special_tokens=False)
    try:
        remote = request_json(url + "/tokenize", {"model": spec.model, "prompt": probe, "add_special_tokens": False},
                              headers, spec.timeout_s)
        spread = _id_spread(tokenizer)
        decoded = [request_json(url + "/detokenize", {"model": spec.model, "tokens": [i]}, headers,
                                spec.timeout_s).get("prompt") for i in spread]
    except ServerError as exc:
        raise ServerError(f"{key}.urls.0 ({url}): its tokenizer cannot be compared with the student's "
                          f"(/tokenize and /detokenize, as vllm serve has them): {exc}", url, exc.status) from None
    problems = []
    if remote.get("tokens") != local_ids:
        first = next((k for k, (a, b) in enumerate(zip(remote.get("tokens", []), local_ids)) if a != b),
                     min(len(remote.get("tokens", [])), len(local_ids)))
        problems.append(f"a probe text gives {len(remote.get('tokens', []))} ids there and {len(local_ids)} here, "
                        f"first differing at position {first} (server {remote.get('tokens', [])[first:first + 4]}, "
                        f"here {local_ids[first:first + 4]})")
    wrong = [(i, d, tokenizer.decode([i])) for i, d in zip(spread, decoded) if d != tokenizer.decode([i])]
    if wrong:
        problems.append("ids decode differently: " + ", ".join(f"{i}: server {d!r}, here {h!r}" for i, d, h in wrong[:4]))
    if problems:
        raise TokenizerMismatchError(f"the teacher served at {url} ({spec.model}) tokenizes differently from the "
                                     f"tokenizer opd renders its view with: {'; '.join(problems)}", problems)
    worst = 0.0
    if len(replicas.urls) > 1:
        body = {"model": spec.model, "prompt": [local_ids], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        reference: list[float] | None = None
        for i, url in enumerate(replicas.urls):
            answer = request_json(url + "/v1/completions", body, headers, spec.timeout_s)
            steps = _json_logprobs(answer["choices"][0]["prompt_logprobs"])
            values = [steps[p][local_ids[p]][0] for p in range(1, len(local_ids))]
            if reference is None:
                reference = values
                continue
            diff = max(abs(a - b) for a, b in zip(reference, values))
            worst = max(worst, diff)
            if diff > spec.replica_tolerance:
                raise ServerError(f"{key}.urls.{i} ({url}) disagrees with {key}.urls.0 "
                                  f"({replicas.urls[0]}) on a probe: logprobs differ by up to {diff:.3g}, above "
                                  f"{key}.replica_tolerance ({spec.replica_tolerance:g}). Replicas that "
                                  "disagree give a noisier signal than the one being learnt: serve the same "
                                  "checkpoint, dtype and settings on every replica", url)
    return {"max_model_len": max_model_len, "replica_difference": worst, "seconds": time.perf_counter() - start}


def _probe_text(tokenizer) -> str:
    """:data:`PROBE_TEXT` with the tokenizer's special tokens in a chat turn, less any character
    the tokenizer cannot take back (a tiny BPE trained on one environment's text)."""
    specials = [t for t in (getattr(tokenizer, "bos_token", None), "<|im_start|>", "<|im_end|>")
                if t and t in tokenizer.get_vocab()]
    text = "".join(specials[:1]) + PROBE_TEXT + "".join(specials[1:])
    kept = "".join(ch for ch in text if tokenizer.decode(tokenizer.encode(ch, add_special_tokens=False)) == ch)
    return kept


def _id_spread(tokenizer, count: int = 24) -> list[int]:
    """``count`` ids spread over the whole vocabulary, the special tokens among them."""
    size = len(tokenizer)
    spread = sorted({round(k * (size - 1) / (count - 1)) for k in range(count)} | set(tokenizer.all_special_ids))
    return spread


class LocalServer:
    """``vllm serve`` of ``model_dir`` on loopback, in a child process: for tests, benchmarks and
    a first try on one machine (a real teacher is served on its own GPUs, docs/served_teacher.md).

    ``with LocalServer(path, "teacher") as server:`` starts it on a free port and waits until it
    answers (``start_timeout_s``); ``server.url`` is its base URL; leaving the block (or
    :meth:`stop`) ends it. On CPU the KV cache is ``kv_cache_gib`` (``VLLM_CPU_KVCACHE_SPACE``).
    """

    def __init__(self, model_dir: str, name: str, max_model_len: int = 2048, dtype: str = "float32",
                 kv_cache_gib: float = 1.0, start_timeout_s: float = 300.0, log_path: str | None = None):
        self.model_dir, self.name, self.max_model_len, self.dtype = model_dir, name, max_model_len, dtype
        self.kv_cache_gib, self.start_timeout_s = kv_cache_gib, start_timeout_s
        self.log_path = log_path
        self.process = None
        self.url = ""

    def start(self) -> "LocalServer":
        """:meth:`launch`, then :meth:`wait` until it answers."""
        return self.launch().wait()

    def launch(self) -> "LocalServer":
        """Start the server's process and return at once (several servers start side by side)."""
        import socket
        import subprocess
        import sys
        import tempfile

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if self.log_path is None:
            self.log_path = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False).name
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}", "VLLM_LOGGING_LEVEL": "WARNING"}
        # `vllm serve` itself fails on the CPU build (its distribution is named vllm-cpu): the module runs.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                   "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
                   "--max-model-len", str(self.max_model_len), "--seed", "0", "--disable-log-stats"]
        try:
            import torch

            if not torch.cuda.is_available():
                command.append("--enforce-eager")
        except ImportError:
            pass
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self._started = time.monotonic()
        return self

    def wait(self) -> "LocalServer":
        """Until the launched server answers ``/v1/models``; :class:`ServerError` (with its log's
        tail) if it exits first or takes longer than ``start_timeout_s``."""
        deadline = self._started + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"vllm serve of {self.model_dir} exited with status {self.process.returncode} "
                                  f"before answering; its log: {self.log_path}\n{self._log_tail()}")
            try:
                request_json(self.url + "/v1/models", None, {}, 2.0)
                return self
            except ServerError:
                time.sleep(0.5)
        self.stop()
        raise ServerError(f"vllm serve of {self.model_dir} did not answer within {self.start_timeout_s:g} s; its log: "
                          f"{self.log_path}\n{self._log_tail()}")

    def _log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(log.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """End the server and its engine process (its whole process group)."""
        import signal
        import subprocess

        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
