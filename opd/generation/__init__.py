"""Inference engines behind one interface: ``generate``, ``score`` and ``update_weights``.

See :mod:`opd.generation.base` for the contract and :mod:`opd.generation.hf` for the
Hugging Face engine (the CPU default), :mod:`opd.generation.vllm_engine` for vLLM,
:mod:`opd.generation.server` for a teacher served over HTTP. The first two also
offer ``stream()``: continuous batching, where requests join and leave between decode steps
(:mod:`opd.generation.hf_stream` on the HF engine, whose KV caches live in
:mod:`opd.generation.kv_cache`).
"""

from opd.generation.base import Completion, Engine, GenerationStream, SamplingParams, ScoreRequest

__all__ = ["Completion", "Engine", "GenerationStream", "SamplingParams", "ScoreRequest", "make_engine"]


def make_engine(kind: str, path: str, dtype: str = "float32", trust_remote_code: bool = False,
                prefix_cache_mb: float = 0.0, tensor_parallel_size: int = 1, server=None) -> Engine:
    """The engine named ``kind`` (``hf``, ``vllm`` or ``server``) over the model at ``path``.

    ``prefix_cache_mb`` sizes the HF engine's prefix cache (vLLM always runs its own);
    ``tensor_parallel_size`` splits a vLLM model over that many GPUs; ``server`` (a
    :class:`~opd.generation.server.ServerSpec`) is where ``server``'s model is served (``path``
    is not read)."""
    if kind == "hf":
        from opd.generation.hf import HFEngine

        return HFEngine.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                        prefix_cache_mb=prefix_cache_mb)
    if kind == "vllm":
        from opd.generation.vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                          tensor_parallel_size=tensor_parallel_size)
    if kind == "server":
        from opd.generation.server import ServerEngine

        if server is None:
            raise ValueError("engine 'server' needs the server's spec (teacher.server)")
        return ServerEngine(server)
    raise ValueError(f"unknown engine {kind!r}; expected 'hf', 'vllm' or 'server'")
