"""User-style loss modules for the loss check's tests (imported by dotted path, as a user's are)."""


def needs_scale(batch, cfg):
    """A user's loss with a bug: it reads a key the recipe does not give it."""
    scale = cfg["scale"]
    return batch.student_logprobs_BT.sum() * scale, {}


def returns_a_float(batch, cfg):
    return 0.5, {}


def detached(batch, cfg):
    return batch.student_logprobs_BT.detach().mean(), {}


def reads_every_field(batch, cfg):
    """Touches what a loss may read, as the recipe's batches carry it."""
    total = batch.student_logprobs_BT.sum() + batch.student_logprobs_NV.dense().mean()
    total = total + batch.teacher_logprobs_BT.sum() + batch.advantage_B.sum() + batch.reference_logprobs_BT.sum()
    if cfg.get("topk"):
        total = total + batch.teacher_topk_logprobs_BTK.clamp(min=-50).sum() + batch.teacher_tail_logprob_BT.sum()
    if batch.teacher_full_logprobs_NV is not None:
        total = total + batch.teacher_full_logprobs_BTV.mean() + batch.teacher_full_logprobs_NV.values_NV.mean()
    return total, {"tokens": float(batch.totals["tokens"])}
