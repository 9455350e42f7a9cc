"""A user-style loss module (imported by dotted path inside the Ray trainer) that returns NaN."""


def nan_loss(batch, cfg):
    return batch.student_logprobs_BT.sum() * float("nan"), {"always": 1.0}


_calls = 0


def fails_on_fifth_call(batch, cfg):
    """Reverse KL until its fifth call (step 3 of the tiny recipe, two micro-batches a step),
    then a bug: how a user's loss breaks mid-run, inside the trainer actor."""
    global _calls
    _calls += 1
    if _calls >= 5:
        raise RuntimeError("boom: this loss has a bug")
    from opd.losses import resolve_loss

    return resolve_loss("reverse_kl")(batch, cfg)
