"""The bootstrap's SFT: the model it starts from and the loop that fine-tunes it.

Cross-entropy on the response tokens of the rows (:mod:`opd.bootstrap.rows`), AdamW with a
linear warm-up and cosine decay to 0, on :data:`~opd.bootstrap.cache.BOOTSTRAP_THREADS` threads
(:func:`fixed_threads`) so that the same recipe gives the same weights on any machine with the
same torch and CPU kernels.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Callable

import torch

from opd.losses import sft as sft_loss
from opd.models import load_model, smollm2_model_dir, tiny_qwen3
from opd.progress import Progress
from opd.schema import BootstrapConfig
from opd.training.trainer import lr_multiplier, student_logprobs_at, token_logprobs
from opd.trajectory import TokenBatch

SFT_BATCH_TOKENS = 4096  # padded tokens per forward of the bootstrap SFT


@contextlib.contextmanager
def fixed_threads(n: int):
    """torch's intra-op threads set to ``n`` inside, put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def initial_model(boot: BootstrapConfig, tokenizer, seed: int):
    """The model the bootstrap's SFT starts from: a tiny Qwen3 shaped by ``boot.arch`` and seeded by
    ``seed``, or with ``boot.init`` a pretrained one (``"smollm2"``: SmolLM2-135M-Instruct, made
    offline; else a model directory), cut to its first ``boot.init_layers`` transformer blocks when
    that is set (the embeddings, the final norm and the LM head are kept). A pretrained start
    brings what a model trained from scratch here lacks, such as copying a name from the prompt."""
    if not boot.init:
        return tiny_qwen3(tokenizer, boot.arch, seed=seed)
    model = load_model(smollm2_model_dir() if boot.init == "smollm2" else os.path.expanduser(boot.init))
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(f"key 'bootstrap.init' names a model with {model.get_input_embeddings().num_embeddings} "
                         f"embeddings, fewer than the tokenizer's {len(tokenizer)} tokens; set 'bootstrap.tokenizer' "
                         "to that model's own tokenizer.")
    if boot.init_layers:
        blocks = model.model.layers
        if not 0 < boot.init_layers <= len(blocks):
            raise ValueError(f"key 'bootstrap.init_layers' is {boot.init_layers}; {boot.init} has {len(blocks)} "
                             "transformer blocks (0 keeps them all).")
        model.model.layers = blocks[:boot.init_layers]
        model.config.num_hidden_layers = boot.init_layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:boot.init_layers]
    return model


def sft(model, rows: list[dict], pad_id: int, boot: BootstrapConfig, seed: int, log: Callable[[str], None]) -> None:
    """Cross-entropy on response tokens, AdamW with linear warm-up (a twentieth of the steps) and
    cosine decay to 0: the trainer's schedule (:func:`opd.training.trainer.lr_multiplier`).

    With a real tokenizer (``boot.tokenizer``: SmolLM2's 49k vocabulary) the LM head runs only on
    the positions that predict a response token, as the trainer's does: a tiny model's head over
    49k ids at every position of a long prompt is most of its step (on SQL's episodes, about
    8 in 9 positions are prompt). A trained BPE's few hundred ids keep the full head at every
    position: cheap at that size, and the same loss rounded as those models were built."""
    at_targets = bool(boot.tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=boot.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(boot.sft_steps // 20, boot.sft_steps, "cosine", min_lr_ratio=0.0))
    rng = random.Random(seed)
    with Progress(log, "SFT step", boot.sft_steps, prefix="bootstrap") as progress:
        for step in range(boot.sft_steps):
            # Whole episodes and single turns mix in a batch: forwards of similar lengths (the loss
            # normalised over the whole batch) give its gradient without padding turns to episodes.
            batch = TokenBatch.from_rows(rng.sample(rows, min(boot.batch_size, len(rows))), pad_id).with_totals()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.zeros(())
            for micro in batch.micro_batches(len(batch), SFT_BATCH_TOKENS):
                logprobs_BT = (student_logprobs_at(model, micro, micro.loss_mask_BT > 0)[0] if at_targets
                               else token_logprobs(model, micro))
                part, _ = sft_loss(micro.with_student(logprobs_BT), {})
                part.backward()
                loss += part.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.advance(step + 1, f"loss {loss.item():.4f}")
        progress.finish(f"loss {loss.item():.4f}" if boot.sft_steps else "")
