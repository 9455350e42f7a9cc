"""The student trainer: a DeepSpeed engine (or, with ``trainer.engine: torch``, the plain-PyTorch
:class:`~opd.training.torch_engine.TorchEngine` on one rank) over the student model, the recipe's
losses, exact checkpoints and a safetensors HF export.

On CPU DeepSpeed runs with its CPU accelerator and the gloo backend, one rank per trainer; on
GPU the same code gets the CUDA accelerator and NCCL. The optimizer is torch's AdamW handed to
DeepSpeed (DeepSpeed's own CPU Adam needs a compiler toolchain at run time), in its fused form
where the device has one (one kernel per tensor: on CPU 2-6x faster than the per-op loop, which
made the update of a 135M-parameter student a large share of a step). With ZeRO stage 0 and a
single rank, DeepSpeed's gradient all-reduce (flatten every gradient, reduce over one rank, copy
back) changes nothing and is skipped.

The losses read the student's logprobs only where they train: on ``loss_mask_BT`` and the named
masks of ``masks_BT``, and the full distribution only when a loss can use it (the batch carries the
teacher's top-k or full scores, or a term asks for the ``topk`` / ``full`` estimator). So when
every term is a built-in of :mod:`opd.losses`, the trainer runs the LM head and the log-softmax
at those positions only (:func:`student_logprobs_at`): on multi-turn rows, where most tokens are
observations, the vocabulary-wide log-softmax over every position was a large share of a step
(``bench/mfu.py``, ``docs/performance.md``). A user's loss may read any position, so with one in
the recipe every position is computed, as :func:`student_logprobs` does.

A micro-batch whose loss is NaN or infinite contributes no gradient: its loss is replaced by a
zero that keeps the graph, and the step reports ``nonfinite_loss``. The driver stops the run
after ``trainer.max_nonfinite_steps`` such steps in a row, with the last checkpoint intact.

Example:
    >>> trainer = StudentTrainer(TrainerSpec(cfg.trainer, (("reverse_kl", 1.0, {}),), "path/to/student",
    ...                                      episodes_per_step=32))  # doctest: +SKIP
    >>> metrics = trainer.train_step(token_batch)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from opd.generation.base import TokenScores
from opd.generation.packed import causal_forward, head_hidden_at, packed_forward
from opd.losses import combined_loss, needs_reference, resolve_loss
from opd.models import WireWeights, cpu_copy, load_model, load_tokenizer, save_model
from opd.process import configure_role_process
from opd.schema import TrainerConfig
from opd.training import lora
from opd.training.checkpoint import CheckpointError, check_pickles, safe_torch_load
from opd.training.torch_engine import TorchEngine, grad_norm
from opd.trajectory import HeadRows, LinearHead, TokenBatch, TokenRows

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # model classes already warned about (once each)
GROUP_FILE = "trainer.json"  # in a checkpoint: the trainer group's shape ({"ranks", "zero_stage"})


def init_distributed(rank: int = 0, world_size: int = 1, rendezvous: str | None = None) -> None:
    """This process as rank ``rank`` of a ``world_size``-process torch.distributed group, as
    DeepSpeed needs: gloo on CPU, NCCL on GPU.

    One rank needs no rendezvous: it meets itself in an in-memory store. A group meets at
    ``rendezvous`` (:func:`opd.runtime.actors.rendezvous_point`): ``file://PATH`` when every rank is on one node,
    ``tcp://IP:PORT`` (rank 0's node) across nodes. A file store listens on nothing; on one node
    gloo's own connections between ranks are kept on the loopback interface too.
    """
    import deepspeed

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", str(rank)), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(world_size)),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "0")):
        # LOCAL_RANK 0: Ray gives each rank its own GPU (CUDA_VISIBLE_DEVICES), seen as device 0.
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available() and os.environ.get("OPD_DS_SHM_COMM") != "1":
        # DeepSpeed would JIT-compile its shared-memory allreduce op here (minutes of C++ on a
        # small machine) although gloo does the job; OPD_DS_SHM_COMM=1 brings it back.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if torch.distributed.is_initialized():
        return
    # DeepSpeed's ZeRO calls torch.distributed.all_gather_into_tensor / reduce_scatter_tensor,
    # which torch now warns about on every call: a wall of the same lines from every rank.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world_size == 1:
        # One rank meets itself in an in-memory store: no file left behind, no port opened.
        # DeepSpeed then wraps the group torch already has.
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        return
    if rendezvous is None:
        raise ValueError(f"a group of {world_size} trainer ranks needs a rendezvous (file:// or tcp://)")
    if rendezvous.startswith("file://"):
        loopback = loopback_interface()
        if loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    deepspeed.init_distributed(dist_backend=backend, verbose=False, init_method=rendezvous, rank=rank,
                               world_size=world_size)


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux), or ``None``."""
    try:
        import psutil

        for name, addresses in psutil.net_if_addrs().items():
            if any(a.address == "127.0.0.1" for a in addresses):
                return name
    except (ImportError, OSError):
        pass
    return None


def rank_rows(lengths: list[int], ranks: int) -> list[list[int]]:
    """Rows split among ``ranks``: longest first, each to the rank with the fewest tokens so far
    (ties to the lower rank), each rank's rows in batch order. Deterministic, so every rank
    computes the same split.

    Example:
        >>> rank_rows([5, 1, 4, 2], 2)
        [[0, 1], [2, 3]]
    """
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(rows) for rows in out]


def student_logprobs(model, batch: TokenBatch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's logprobs at ``temperature``: ``[B, T]`` of each token given the tokens before
    it (0 at t = 0), and ``[B, T, V]`` over the vocabulary (zeros at t = 0).

    ``temperature`` is the rollout's sampling temperature, so that the trained policy is the one
    that sampled the tokens (the behaviour logprobs are of ``softmax(logits / temperature)``).
    """
    if batch.branch_ids_BT is None:
        logits_BTV = causal_forward(model, batch.input_ids_BT, batch.attention_mask_BT).float()
    else:  # packed rows: a trunk and branches, one forward (see TokenBatch.branch_ids_BT)
        logits_BTV = packed_forward(model, batch.input_ids_BT, batch.position_ids_BT, batch.branch_ids_BT,
                                    batch.attention_mask_BT.bool()).float()
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1] / temperature, dim=-1)
    picked_BT = logp_BTV.gather(2, batch.input_ids_BT[:, 1:, None]).squeeze(2)
    zeros_B1V = torch.zeros_like(logp_BTV[:, :1])
    return torch.cat([zeros_B1V[..., 0], picked_BT], dim=1), torch.cat([zeros_B1V, logp_BTV], dim=1)


def student_logprobs_at(model, batch: TokenBatch, positions_BT: torch.Tensor, temperature: float = 1.0,
                        full_vocab: bool = False, chunk_rows: int = 0) -> tuple[torch.Tensor, TokenRows | HeadRows | None]:
    """:func:`student_logprobs` at ``positions_BT`` (bool ``[B, T]``) only: ``[B, T]``, equal to
    its values there and 0 elsewhere (where they carry no gradient), and, with ``full_vocab``, the
    distribution over the vocabulary at those positions (``[N, V]``; else ``None``).

    The transformer runs on every token (each position's hidden state feeds the later ones), but
    the LM head and the log-softmax over the vocabulary only on the ``N`` hidden states that
    predict a selected token: ``[N, V]`` in place of ``[B, T, V]``, forward and backward. With
    ``chunk_rows`` > 0 and more than that many positions, not even ``[N, V]``: the logprobs are
    computed ``chunk_rows`` positions at a time and recomputed in the backward pass, and the
    distribution is :class:`~opd.trajectory.HeadRows` (the hidden states and the head, read chunk
    by chunk by the built-in losses) in place of :class:`~opd.trajectory.TokenRows`. A model
    whose head is not a plain linear map of the decoder's output (soft-capped or scaled logits)
    falls back to :func:`student_logprobs`, with a warning.
    """
    positions_BT = positions_BT.bool().clone()
    positions_BT[:, 0] = False  # nothing predicts the first token
    # A trained token's predictor is the position just before it in the row (packed rows too).
    b_N, t_N = positions_BT.nonzero(as_tuple=True)
    found = head_hidden_at(model, batch.input_ids_BT, batch.attention_mask_BT, b_N, t_N - 1,
                           batch.position_ids_BT, batch.branch_ids_BT)
    if found is None:
        name = type(getattr(model, "module", model)).__name__
        if name not in _WARNED:
            _WARNED.add(name)
            log.warning("%s: the LM head is not a plain linear map of the decoder's output; the student's logprobs "
                        "are computed at every position", name)
        picked_BT, full_BTV = student_logprobs(model, batch, temperature)
        picked_BT = torch.where(positions_BT, picked_BT, 0.0)
        return picked_BT, TokenRows.from_dense(full_BTV, positions_BT) if full_vocab else None
    hidden_NH, head, vocab_size = found
    target_N = batch.input_ids_BT[b_N, t_N]
    n = int(hidden_NH.shape[0])
    if chunk_rows <= 0 or n <= chunk_rows:
        logp_NV = torch.log_softmax(head(hidden_NH).float() / temperature, dim=-1)
        picked_N = logp_NV.gather(1, target_N[:, None]).squeeze(1)
        rows = TokenRows(positions_BT, logp_NV) if full_vocab else None
    else:
        lazy = HeadRows(TokenRows(positions_BT, hidden_NH), head, temperature, chunk_rows, vocab_size)

        def picked(start: int) -> torch.Tensor:  # run again in the backward pass (checkpoint)
            part = slice(start, start + chunk_rows)
            return lazy.rows(part).gather(1, target_N[part, None]).squeeze(1)

        picked_N = torch.cat([checkpoint(picked, start, use_reentrant=False) for start in range(0, n, chunk_rows)])
        rows = lazy if full_vocab else None
    return picked_N.new_zeros(positions_BT.shape).index_put((b_N, t_N), picked_N), rows


def vocab_chunk_rows(setting: int, vocab_size: int) -> int:
    """Scored tokens per chunk of the exact losses (``trainer.vocab_chunk_tokens``): the setting,
    or for 0 as many as make 128 MiB of float32 ``[chunk, V]`` rows; 0 (no chunks) for -1.

    Example:
        >>> vocab_chunk_rows(0, 151_936), vocab_chunk_rows(512, 151_936), vocab_chunk_rows(-1, 151_936)
        (220, 512, 0)
    """
    if setting < 0:
        return 0
    return int(setting) if setting > 0 else max(1, 2**25 // max(1, int(vocab_size)))


def trained_positions_BT(batch: TokenBatch) -> torch.Tensor:
    """``[B, T]`` bool: the tokens some loss trains on, ``loss_mask_BT`` and every named mask."""
    positions_BT = batch.loss_mask_BT > 0
    for mask_BT in (batch.masks_BT or {}).values():
        positions_BT = positions_BT | (mask_BT > 0)
    return positions_BT


def reads_trained_positions_only(terms: list[tuple[str, float, dict]]) -> bool:
    """Whether every term is a built-in of :mod:`opd.losses`, which read the student's logprobs
    on :func:`trained_positions_BT` only; a user's loss may read any position."""
    return all(getattr(resolve_loss(name), "__module__", "") == "opd.losses" for name, _, _ in terms)


def needs_student_distribution(batch: TokenBatch, terms: list[tuple[str, float, dict]]) -> bool:
    """Whether a built-in loss may read ``student_logprobs_NV``: only an exact (``topk`` /
    ``full``) estimator does, which ``auto`` picks when the batch carries the teacher's top-k or
    full scores (PivotOPD's recovery rows carry top-k targets), and a term may name explicitly."""
    exact = ("topk", "full")
    return (batch.teacher_topk_ids_BTK is not None or batch.teacher_full_logprobs_NV is not None
            or any((args or {}).get("estimator") in exact for _, _, args in terms))


def token_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    """``[B, T]`` logprob of each token given the tokens before it (0 at t = 0), temperature 1."""
    return student_logprobs(model, batch)[0]


def lr_multiplier(warmup_steps: int, total_steps: int, schedule: str = "constant", min_lr_ratio: float = 0.1):
    """Step -> learning-rate factor: linear warm-up over ``warmup_steps``, then ``constant``, or
    ``cosine`` decay to ``min_lr_ratio`` at ``total_steps``.

    Example:
        >>> factor = lr_multiplier(warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.0)
        >>> factor(0), factor(1), factor(10)
        (0.5, 0.9755282581475768, 0.0)
    """
    warmup = max(1, int(warmup_steps))
    cosine = schedule == "cosine"
    floor = float(min_lr_ratio)
    total = max(1, int(total_steps))

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup)
        if not cosine:
            return ramp
        return ramp * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total)))

    return factor


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux ``VmHWM``) in MiB; 0 where it is not reported."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_has_bf16_kernels() -> bool:
    """Whether oneDNN has bfloat16 matmul kernels for this CPU (they need AVX-512, or Arm's BF16).
    Without them PyTorch's bfloat16 matrix products take a generic path, far slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def adamw(params: list[torch.nn.Parameter], **kwargs) -> torch.optim.AdamW:
    """torch's AdamW, fused where the parameters' device supports it (CPU and CUDA do), else
    its per-op loop. The two give the same update to float rounding."""
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(params, **kwargs)


def accumulate_metrics(sums: dict[str, float], weights: dict[str, float], metrics: dict[str, float],
                       micro_tokens: float, scale: float) -> None:
    """Fold one micro-batch's loss metrics into the step's.

    ``loss/*`` values are already scaled to add up to the batch's loss over the engine's
    gradient division ``scale`` (accumulation steps times ranks); ``*/tokens`` counts add up;
    every other diagnostic is a token mean, averaged with weight its term's ``tokens`` if it
    reports them (a loss on its own mask), else the micro-batch's response tokens: ``sums`` holds
    the weighted sums and ``weights`` their weights (:func:`finish_metrics` divides).
    """
    for k, v in metrics.items():
        if k.startswith("loss/"):
            sums[k] = sums.get(k, 0.0) + v / scale
        elif k.endswith("/tokens"):
            sums[k] = sums.get(k, 0.0) + v
        else:
            term = k.split("/", 1)[0]
            w = metrics.get(f"{term}/tokens", micro_tokens) if "/" in k else micro_tokens
            w = max(w, 1e-9)  # a micro-batch with no tokens still counts once when none has any
            sums[k] = sums.get(k, 0.0) + v * w
            weights[k] = weights.get(k, 0.0) + w


def merge_metrics(parts: list[tuple[dict[str, float], dict[str, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """The ``(sums, weights)`` of :func:`accumulate_metrics` from several ranks, added up."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for part_sums, part_weights in parts:
        for k, v in part_sums.items():
            sums[k] = sums.get(k, 0.0) + v
        for k, v in part_weights.items():
            weights[k] = weights.get(k, 0.0) + v
    return sums, weights


def finish_metrics(sums: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """The step's metrics: the weighted diagnostics divided by their weights."""
    return {**sums, **{k: sums[k] / w if w > 0 else 0.0 for k, w in weights.items()}}


@dataclass(frozen=True)
class TrainerSpec:
    """What a trainer rank is built from (:func:`opd.runtime.workers.role_specs` makes it from a
    recipe); every rank of a group gets the same.

    Attributes:
        trainer: the recipe's ``trainer`` section.
        loss_terms: ``(name, weight, args)`` of each term of the recipe's ``losses``.
        model_dir: the student's starting weights and tokenizer.
        episodes_per_step: ``rollout.episodes_per_step`` (with ``trainer.micro_batch_size``, the
            accumulation steps DeepSpeed is configured with).
        dtype, trust_remote_code: the student's.
        torch_threads: torch's intra-op threads in the trainer's process (0: every core).
        total_steps: ``run.total_steps``, the learning-rate schedule's length.
        temperature: ``rollout.temperature``; the trained policy is softmax(logits / temperature).
        lora: ``student.lora`` (:class:`opd.schema.LoraConfig`); with a rank above 0 the trainer
            trains LoRA adapters only (:mod:`opd.training.lora`).
    """

    trainer: TrainerConfig
    loss_terms: tuple[tuple[str, float, dict], ...]
    model_dir: str
    episodes_per_step: int
    dtype: str = "float32"
    trust_remote_code: bool = False
    torch_threads: int = 0
    total_steps: int = 1
    temperature: float = 1.0
    lora: Any = None  # the student's LoraConfig (student.lora): adapters only train when its rank is > 0


class StudentTrainer:
    """Owns the training engine (DeepSpeed's, or :class:`~opd.training.torch_engine.TorchEngine`).
    Plain class; :mod:`opd.runtime.actors` hosts it in Ray, :mod:`opd.runtime.local` in the driver.

    A trainer group (``resources.trainer_ranks`` > 1) is ``world_size`` of these, rank ``rank``
    each, one DeepSpeed engine over them that meet at ``rendezvous`` (:func:`init_distributed`).
    Every rank is handed the whole batch and trains its share of the rows (:func:`rank_rows`),
    normalised by the whole batch's totals, so the averaged gradient is the one-rank gradient.
    Every call (a step, a checkpoint, the export of weights) is made on every rank at once.
    """

    def __init__(self, spec: TrainerSpec, rank: int = 0, world_size: int = 1, rendezvous: str | None = None):
        configure_role_process(spec.torch_threads)
        trainer_cfg, loss_terms, model_dir, dtype = spec.trainer, list(spec.loss_terms), spec.model_dir, spec.dtype
        trust_remote_code, temperature = spec.trust_remote_code, spec.temperature
        self.rank, self.world_size = int(rank), int(world_size)
        self.engine_kind = str(getattr(trainer_cfg, "engine", "deepspeed"))
        self.loss_terms = loss_terms
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts score at 1
        self.micro_batch_size = int(trainer_cfg.micro_batch_size)
        self.micro_batch_tokens = int(trainer_cfg.micro_batch_tokens)
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code)
        # The torch engine keeps float32 weights and runs bfloat16 under autocast (see its module).
        weights_dtype = "float32" if self.engine_kind == "torch" else dtype
        model = load_model(model_dir, dtype=weights_dtype, trust_remote_code=trust_remote_code).train()
        self.model_dir = model_dir
        self.lora = spec.lora if spec.lora is not None and int(spec.lora.rank) > 0 else None
        if self.lora is not None:  # only the adapters train, and only they are in the optimizer
            model = lora.wrap(model, self.lora)
        optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=float(trainer_cfg.learning_rate),
                          betas=(float(trainer_cfg.adam_beta1), float(trainer_cfg.adam_beta2)),
                          weight_decay=float(trainer_cfg.weight_decay))
        # The scheduler lives in the engine's checkpoint, so a resumed run continues its schedule.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(
            trainer_cfg.warmup_steps, spec.total_steps, trainer_cfg.lr_schedule, trainer_cfg.min_lr_ratio))
        if dtype == "bfloat16" and not torch.cuda.is_available() and not cpu_has_bf16_kernels():
            log.warning("student.dtype=bfloat16 on a CPU without oneDNN's bfloat16 matmul kernels (no AVX-512): "
                        "its matrix products take a slow path (about 10x float32's here); float32 is faster "
                        "(docs/performance.md)")
        # A loss anchored to the starting weights (reference_kl) gets their logprobs from a
        # frozen copy; a resumed run still loads the starting weights here, not the checkpoint's.
        # A LoRA student's starting weights are its own with the adapters off: no copy.
        self.reference = None
        if needs_reference(loss_terms) and self.lora is None:
            self.reference = load_model(model_dir, dtype=dtype, trust_remote_code=trust_remote_code).eval()
            self.reference.requires_grad_(False)
        accumulation_steps = max(1, spec.episodes_per_step // (self.micro_batch_size * self.world_size))
        self.zero_stage = int(trainer_cfg.zero_stage)
        if self.engine_kind == "torch" and self.world_size > 1:
            raise ValueError(f"trainer.engine=torch trains on one rank; resources.trainer_ranks={self.world_size} "
                             "needs trainer.engine=deepspeed")
        if self.engine_kind == "torch":
            self.zero_stage = 0  # one rank holds everything: ZeRO has nothing to partition
            self.engine = TorchEngine(model, optimizer, scheduler, accumulation_steps, trainer_cfg.grad_clip_norm,
                                      autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None)
        else:
            self.engine = self._deepspeed_engine(model, optimizer, scheduler, accumulation_steps, trainer_cfg, dtype,
                                                 rendezvous)
        if self.reference is not None:
            self.reference.to(self.engine.device)
        self.gather_logprobs = reads_trained_positions_only(loss_terms)
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", 0) or model.config.vocab_size)
        self.chunk_rows = vocab_chunk_rows(int(getattr(trainer_cfg, "vocab_chunk_tokens", 0)), self.vocab_size)
        self.teacher_head: LinearHead | None = None  # scoring: hidden (set_teacher_head)
        self.steps = 0

    def _deepspeed_engine(self, model, optimizer, scheduler, accumulation_steps: int, trainer_cfg: TrainerConfig,
                          dtype: str, rendezvous: str | None):
        """DeepSpeed's engine over ``model`` on this trainer's group (gloo on CPU, NCCL on GPU).
        The batch sizes only satisfy DeepSpeed's check: the boundaries are set by hand."""
        import deepspeed

        init_distributed(self.rank, self.world_size, rendezvous)
        ds_config = {
            "train_batch_size": self.micro_batch_size * accumulation_steps * self.world_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": accumulation_steps,
            "gradient_clipping": float(trainer_cfg.grad_clip_norm),
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if dtype == "bfloat16":
            ds_config["bf16"] = {"enabled": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
        if self.zero_stage == 0 and torch.distributed.get_world_size() == 1:
            # Stage 0 reduces every gradient at the boundary: a flatten and a copy back of the whole
            # model for a sum over one rank. (ZeRO 1-3 move the gradients into their partitions as
            # they reduce, so they keep it.)
            engine.enable_backward_allreduce = False
        return engine

    def _student_logprobs(self, model, micro: TokenBatch, full_vocab: bool = True):
        """``model``'s logprobs on ``micro``: where the losses read them (see the module
        docstring), else at every position."""
        if self.gather_logprobs:
            full_vocab = full_vocab and needs_student_distribution(micro, self.loss_terms)
            return student_logprobs_at(model, micro, trained_positions_BT(micro), self.temperature, full_vocab,
                                       self.chunk_rows)
        return student_logprobs(model, micro, self.temperature)

    def set_teacher_head(self, head: LinearHead) -> None:
        """Keep the teacher's output head (``scoring: hidden``): the batches then carry the
        teacher's final hidden states only, and this head turns them into its distribution, a
        chunk at a time (:class:`~opd.trajectory.HeadRows`). Sent once per run by the driver."""
        if head.vocab_size != self.vocab_size:
            raise ValueError(f"scoring: hidden: the teacher's output head has {head.vocab_size} outputs and the "
                             f"student's {self.vocab_size}; the two vocabularies must be the same (or use "
                             "supervision.scoring: topk)")
        self.teacher_head = LinearHead(head.weight.to(self.engine.device),
                                       None if head.bias is None else head.bias.to(self.engine.device))

    def _with_teacher_head(self, micro: TokenBatch) -> TokenBatch:
        rows = micro.teacher_full_logprobs_NV
        if not isinstance(rows, HeadRows):
            return micro
        if self.teacher_head is None:
            raise ValueError("the batch carries the teacher's hidden states (scoring: hidden) and this trainer was "
                             "never sent the teacher's output head (StudentTrainer.set_teacher_head)")
        if rows.hidden.values_NV.shape[-1] != self.teacher_head.hidden_size:
            raise ValueError(f"scoring: hidden: the teacher's hidden states have {rows.hidden.values_NV.shape[-1]} "
                             f"features and its output head takes {self.teacher_head.hidden_size}")
        return replace(micro, teacher_full_logprobs_NV=replace(rows, head=self.teacher_head, chunk_rows=self.chunk_rows,
                                                               vocab_size=self.teacher_head.vocab_size))

    def train_step(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer update over ``batch`` (this rank's share of it, split into micro-batches);
        every rank returns the whole step's metrics."""
        start = time.perf_counter()
        metrics_sum: dict[str, float] = {}
        weights: dict[str, float] = {}  # diagnostics averaged over micro-batches, by their token counts
        nonfinite = 0
        # Normalisers of the whole batch: the micro-batch losses then add up to the batch's loss.
        # DeepSpeed divides each micro-batch loss by its configured accumulation steps, and the
        # ranks' gradients by their number, which the losses undo with ``totals["micro_batches"]``
        # and ``totals["ranks"]``; the boundary is set by hand, so a batch may hold any number of
        # rows (per-turn rows, extra recovery rows), not only episodes_per_step.
        gas = self.engine.gradient_accumulation_steps()
        batch = batch.with_totals(micro_batches=gas, ranks=self.world_size)
        scale = gas * self.world_size
        # Micro-batches of rows of similar lengths (longest first), each cut to its own longest
        # row and capped at micro_batch_tokens padded tokens: rows of very different lengths then
        # pad only against their neighbours. The gradient is unchanged (every loss is normalised
        # over the whole batch, see above).
        mine = batch
        if self.world_size > 1:
            share = rank_rows(batch.attention_mask_BT.sum(1).tolist(), self.world_size)[self.rank]
            mine = batch.select_rows(torch.tensor(share or [0], dtype=torch.long))
        micro_batches = mine.micro_batches(self.micro_batch_size, self.micro_batch_tokens)
        idle = [False] * len(micro_batches)
        if self.world_size > 1:
            # Every rank runs as many forwards and backwards as the busiest (ZeRO-3 gathers the
            # parameters in each forward, and reduces gradients in each backward, all ranks
            # together); a rank with fewer rows runs idle micro-batches that add no gradient.
            most = self._all_max(len(micro_batches))
            idle = [not share] * len(micro_batches) + [True] * (most - len(micro_batches))
            micro_batches = micro_batches + [micro_batches[0]] * (most - len(micro_batches))
        for m, micro in enumerate(micro_batches):
            self.engine.set_gradient_accumulation_boundary(m == len(micro_batches) - 1)
            micro = self._with_teacher_head(micro.to(self.engine.device))
            if self.reference is not None or (self.lora is not None and needs_reference(self.loss_terms)):
                with torch.no_grad(), self._adapters_off():
                    reference = self.reference if self.reference is not None else self.engine
                    reference_BT = self._student_logprobs(reference, micro, full_vocab=False)[0]
                micro = replace(micro, reference_logprobs_BT=reference_BT)
            micro = micro.with_student(*self._student_logprobs(self.engine, micro))
            if idle[m]:
                self.engine.backward(micro.student_logprobs_BT.sum() * 0.0)
                continue
            loss, metrics = combined_loss(micro, self.loss_terms)
            if not torch.isfinite(loss):
                nonfinite += 1
                # Keep the graph so DeepSpeed's accumulation stays in step; contribute no gradient.
                loss = micro.student_logprobs_BT.sum() * 0.0
            self.engine.backward(loss)
            accumulate_metrics(metrics_sum, weights, metrics, float(micro.loss_mask_BT.sum()), scale)
            metrics_sum["loss"] = metrics_sum.get("loss", 0.0) + float(loss.detach()) / scale
        # DeepSpeed at ZeRO 0 clips the gradients on the parameters but keeps no norm: measure it
        # here (after the boundary's all-reduce every rank holds the averaged gradients).
        own_norm = grad_norm(self.engine.module) if self.engine_kind == "deepspeed" and self.zero_stage == 0 else None
        self.engine.step()
        self.steps += 1
        metrics_sum["nonfinite_loss"] = float(nonfinite)
        peak = peak_rss_mb()
        if self.world_size > 1:
            parts: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(parts, (metrics_sum, weights, peak))
            peak = max(part[2] for part in parts)
            metrics_sum, weights = merge_metrics([part[:2] for part in parts])
        metrics_sum = finish_metrics(metrics_sum, weights)
        metrics_sum["nonfinite_loss"] = float(metrics_sum["nonfinite_loss"] > 0)
        metrics_sum["grad_norm"] = float(own_norm if own_norm is not None else self.engine.get_global_grad_norm() or 0.0)
        metrics_sum["train_tokens"] = float(batch.loss_mask_BT.sum())
        metrics_sum["train_rows"] = float(len(batch))
        metrics_sum["train_row_tokens"] = float(batch.attention_mask_BT.sum())  # what the forward computes
        metrics_sum["learning_rate"] = float(self.engine.get_lr()[0])
        metrics_sum["time/train_inner_s"] = time.perf_counter() - start
        # The largest trainer rank's peak resident memory so far (on the local backend that process
        # is the driver, which resets the peak at each step's start).
        metrics_sum["memory/trainer_peak_rss_mb"] = peak
        return metrics_sum

    def train_built(self, build, trajs, args: tuple, *score_parts: list[TokenScores]) -> dict[str, float]:
        """:meth:`train_step` on ``build(trajs, scores, *args)``, built here: ``scores`` are the
        teacher replicas' ``score_parts`` in order, joined (``None`` without any). Under Ray each
        part arrives as an object ref the actor call resolves, straight from its teacher."""
        scores = [s for part in score_parts for s in part] if score_parts else None
        return self.train_step(build(trajs, scores, *args))

    def _all_max(self, value: int) -> int:
        """The largest of the ranks' ``value``."""
        tensor = torch.tensor([value], dtype=torch.long, device=self.engine.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    # -- weights ----------------------------------------------------------------------------
    def _adapters_off(self):
        """A context in which a LoRA student is its starting weights (the adapters bypassed)."""
        return self.engine.module.disable_adapter() if self.lora is not None else contextlib.nullcontext()

    def _full_parameters(self, trained_only: bool = False):
        """A context in which the module holds its full parameters (ZeRO-3 partitions them): all,
        or with ``trained_only`` the ones that train (a LoRA student's adapters)."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        params = [p for p in self.engine.module.parameters() if p.requires_grad or not trained_only]
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def export_weights(self, copy: bool = True) -> "dict[str, torch.Tensor] | lora.LoraUpdate | None":
        """Full (gathered) weights on CPU, keyed like the HF model's ``state_dict``; a tied tensor
        is one tensor under both names (:func:`opd.models.cpu_copy`), sent once, and the dict
        crosses Ray's object store as zero-copy buffers (:class:`opd.models.WireWeights`). A LoRA
        student sends its adapters only (:class:`opd.training.lora.LoraUpdate`). Rank 0 answers; the
        other ranks return ``None`` (under ZeRO-3 they must take part in the gather).
        ``copy=False`` answers views of the live weights where they are on the CPU and whole (not
        gathered for the answer, as ZeRO-3's are): for a caller that reads them before the next
        step (a weight sync; Ray pickles an actor's answer as the method returns)."""
        if self.lora is not None:
            with self._full_parameters(trained_only=True):
                return lora.adapter_update(self.engine.module) if self.rank == 0 else None
        with self._full_parameters():
            views = not copy and self.zero_stage != 3  # gathered weights are freed when the context ends
            return WireWeights(cpu_copy(self.engine.module.state_dict(), clone=not views)) if self.rank == 0 else None

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def state_dirname(self) -> str:
        """The checkpoint's subdirectory for the engine's state: ``ds`` (DeepSpeed) or ``torch``."""
        return "torch" if self.engine_kind == "torch" else "ds"

    def save_checkpoint(self, directory: str) -> None:
        """The engine's state (weights, optimizer, scheduler) under ``ds/`` (DeepSpeed, one shard
        per rank under ZeRO) or ``torch/`` (safetensors and JSON), the group's shape in
        ``trainer.json``, and an HF export under ``hf/`` (safetensors), written by rank 0 from the
        gathered weights. A LoRA student's state holds its adapters (not the frozen weights),
        ``hf/`` the merged model and ``adapter/`` the adapters as :mod:`peft` saves them. The
        caller makes the directory's appearance atomic."""
        directory = Path(directory)
        self.engine.save_checkpoint(str(directory / self.state_dirname), tag="state", client_state={"steps": self.steps},
                                    exclude_frozen_parameters=self.lora is not None)
        with self._full_parameters():
            if self.rank == 0:
                if self.lora is not None:  # the merged model, and the adapters alone
                    lora.save_merged(self.engine.module, self.tokenizer, directory / "hf")
                    lora.save_adapter(self.engine.module, directory / lora.ADAPTER_DIR, self.model_dir)
                else:
                    save_model(self.engine.module, self.tokenizer, directory / "hf")
                (directory / GROUP_FILE).write_text(json.dumps({"ranks": self.world_size,
                                                                "zero_stage": self.zero_stage}))
        if self.world_size > 1:
            torch.distributed.barrier()  # every rank's files are on disk before the caller seals them

    def load_checkpoint(self, directory: str) -> None:
        """Load ``directory``'s engine state with no pickled code run: every DeepSpeed file is
        opened weights-only against an allow-list first (:func:`opd.training.checkpoint.check_pickles`),
        and DeepSpeed's own loads are forced weights-only too; the torch engine's state has no
        pickles at all.

        Raises:
            CheckpointError: a file holds something other than tensors and DeepSpeed's data
                classes, or is unreadable, or the checkpoint was written by the other engine; the
                engine is left as it was.
        """
        state_dir = Path(directory) / self.state_dirname
        other = Path(directory) / ("ds" if self.state_dirname == "torch" else "torch")
        group = Path(directory) / GROUP_FILE
        written = json.loads(group.read_text()) if group.is_file() else {"ranks": 1, "zero_stage": self.zero_stage}
        if state_dir.is_dir() and self.engine_kind == "deepspeed" and (
                int(written["ranks"]) != self.world_size and max(self.zero_stage, int(written["zero_stage"])) > 0):
            raise CheckpointError(f"{directory}: this checkpoint was written by {written['ranks']} trainer rank(s) "
                                  f"under ZeRO stage {written['zero_stage']}, each holding a shard; the recipe asks for "
                                  f"{self.world_size}. Resume with resources.trainer_ranks={written['ranks']}, or start "
                                  f"a new run from its weights ({Path(directory) / 'hf'}).")
        if not state_dir.is_dir() and other.is_dir():
            written_by = "deepspeed" if other.name == "ds" else "torch"
            raise CheckpointError(f"{directory}: this checkpoint was written with trainer.engine={written_by} and the "
                                  f"recipe says trainer.engine={self.engine_kind}; resume with "
                                  f"trainer.engine={written_by}")
        if self.engine_kind == "torch":
            try:
                path, client = self.engine.load_checkpoint(str(state_dir), tag="state")
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{state_dir}: unreadable torch-engine state ({type(exc).__name__}: {exc})") from exc
        else:
            check_pickles(state_dir)
            with safe_torch_load():
                path, client = self.engine.load_checkpoint(str(state_dir), tag="state",
                                                           load_module_strict=self.lora is None)
        if path is None:
            raise CheckpointError(f"{state_dir}: the {self.engine_kind} engine found no state to load (tag 'state')")
        self.steps = int((client or {}).get("steps", 0))
