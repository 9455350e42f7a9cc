"""Inference engines behind one interface: ``generate``, ``score`` and ``update_weights``.

See :mod:`opd.generation.base` for the contract and :mod:`opd.generation.hf` for the
Hugging Face engine (the CPU default), :mod:`opd.generation.vllm_engine` for vLLM.
"""

from opd.generation.base import Completion, Engine, SamplingParams, ScoreRequest

__all__ = ["Completion", "Engine", "SamplingParams", "ScoreRequest", "make_engine"]


def make_engine(kind: str, path: str, dtype: str = "float32", trust_remote_code: bool = False) -> Engine:
    """The engine named ``kind`` (``hf`` or ``vllm``) over the model at ``path``."""
    if kind == "hf":
        from opd.generation.hf import HFEngine

        return HFEngine.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    if kind == "vllm":
        from opd.generation.vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    raise ValueError(f"unknown engine {kind!r}; expected 'hf' or 'vllm'")
