"""A user-style loss module (imported by dotted path inside the Ray trainer) that returns NaN."""


def nan_loss(batch, cfg):
    return batch.student_logprobs_BT.sum() * float("nan"), {"always": 1.0}
