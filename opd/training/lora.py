"""LoRA students (``student.lora``): the adapters the trainer trains, and how they reach the
rollout engines.

Only the adapters train: the trainer wraps the student in :mod:`peft` (:func:`wrap`), its
optimizer holds the adapters' parameters only, and a loss's frozen reference is the same model
with the adapters switched off (no second copy). A weight sync sends the adapters, not the
model: :func:`adapter_update` gathers each adapted layer's ``A`` and ``B`` (``r x in`` and
``out x r``, a few MB where the model is GBs) as a :class:`LoraUpdate`; each rollout replica keeps
the starting weights of the adapted layers (:class:`LoraMerger`, read once from the student's
directory) and loads ``W0 + scale * B @ A`` into its engine in place, so generation runs on plain
merged weights at full speed. The HF engine takes the adapted layers alone; vLLM reloads whole
layers (its fused q/k/v and gate/up), so its replica keeps every starting weight and reloads
them all (a copy within its process: what crosses from the trainer is still the adapters).

A checkpoint holds the adapters and their optimizer state (the frozen weights are not written
again), the adapter directory (``adapter/``, loadable with ``peft``) and the merged model
(``hf/``, loadable anywhere a model is), which ``opd export`` writes out as both.

Example:
    >>> from opd.schema import LoraConfig
    >>> model = wrap(base_model, LoraConfig(rank=16, alpha=32.0))  # doctest: +SKIP
    >>> update = adapter_update(model)  # doctest: +SKIP
    >>> LoraMerger(student_dir).merged(update)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_DIR = "adapter"


@dataclass
class LoraUpdate:
    """What a weight sync sends for a LoRA student: per adapted weight (its name in the model's
    ``state_dict``), the factors ``A`` ``[r, in]`` and ``B`` ``[out, r]`` and the scale, so that
    the weight is ``W0 + scale * B @ A``."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in self.factors.values())


def peft_config(lora) -> Any:
    """:mod:`peft`'s ``LoraConfig`` for the recipe's ``student.lora``."""
    from peft import LoraConfig as PeftLoraConfig

    targets = list(lora.target_modules)
    return PeftLoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                          target_modules="all-linear" if targets == ["all-linear"] else targets, bias="none",
                          task_type="CAUSAL_LM")


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers, its output head excepted: what
    ``student.lora.target_modules`` may name."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def check_target_modules(model: torch.nn.Module, targets: list[str]) -> None:
    """Raises:
        ValueError: a target the model has no linear layer of, naming the ones it has."""
    if list(targets) == ["all-linear"]:
        return
    have = linear_module_names(model)
    unknown = [t for t in targets if t not in have]
    if unknown:
        raise ValueError(f"student.lora.target_modules names {unknown}, which {type(model).__name__} has no linear layer "
                         f"of; it has {have} (or say [all-linear])")


def check_model_dir(model_dir: str, targets: list[str], trust_remote_code: bool = False) -> None:
    """:func:`check_target_modules` on the model at ``model_dir``, built on the meta device (no
    weights read)."""
    if list(targets) == ["all-linear"]:
        return
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    check_target_modules(model, targets)


def wrap(model: torch.nn.Module, lora, seed: int = 0) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``lora.target_modules`` (a :mod:`peft` model): only the
    adapters require gradients. ``A`` is drawn from a private generator seeded ``seed`` (``B``
    starts at zero, so the model starts as it was), so every rank and every process of a run
    starts from the same adapters.

    Raises:
        ValueError: a target module the model does not have (naming those it has).
    """
    from peft import get_peft_model

    check_target_modules(model, list(lora.target_modules))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(lora))


def _lora_layers(model: torch.nn.Module):
    """``(state_dict name of the adapted weight, layer)`` for each LoRA layer of a peft model."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            yield f"{name}.weight", module


def adapter_update(model: torch.nn.Module) -> LoraUpdate:
    """The adapters' factors and scales, as CPU copies (under ZeRO-3, call it with the
    parameters gathered)."""
    factors = {}
    for name, layer in _lora_layers(model):
        a = layer.lora_A["default"].weight.detach().to("cpu", copy=True)
        b = layer.lora_B["default"].weight.detach().to("cpu", copy=True)
        factors[name] = (a, b, float(layer.scaling["default"]))
    return LoraUpdate(factors)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's ``state_dict`` (the names of the model before wrapping) with every
    adapted weight merged, ``W0 + scale * B @ A``, without touching the live weights."""
    base = model.get_base_model()
    deltas = {name: layer for name, layer in _lora_layers(model)}
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        if plain in deltas:
            value = value + deltas[plain].get_delta_weight("default").to(value.dtype)
        out[plain] = value
    return out


def save_merged(model: torch.nn.Module, tokenizer, directory: Path) -> None:
    """The merged model as a plain HF directory (config, safetensors, tokenizer): what loads in
    transformers and vLLM without :mod:`peft`."""
    directory.mkdir(parents=True, exist_ok=True)
    model.get_base_model().save_pretrained(str(directory), state_dict=merged_state_dict(model), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))


def save_adapter(model: torch.nn.Module, directory: Path, base_model_dir: str) -> None:
    """The adapter directory :mod:`peft` loads (``PeftModel.from_pretrained(base, directory)``),
    its base named as ``base_model_dir``."""
    model.save_pretrained(str(directory), safe_serialization=True)
    config_file = directory / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(base_model_dir)
    config_file.write_text(json.dumps(config, indent=2))


class LoraMerger:
    """A rollout replica's side of a LoRA weight sync: the starting weights of the adapted layers
    (read from the student's directory at the first update, kept) and the merge."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.base: dict[str, torch.Tensor] = {}

    def _load(self, names: list[str] | None) -> None:
        """The starting weights ``names`` (every one for ``None``), read once."""
        from safetensors import safe_open

        if names is not None and not set(names) - set(self.base):
            return
        for file in sorted(Path(self.model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key not in self.base and (names is None or key in names):
                        self.base[key] = f.get_tensor(key)
        missing = set(names or ()) - set(self.base)
        if missing:
            raise KeyError(f"{self.model_dir} holds no weights {sorted(missing)[:5]} for the LoRA adapters' layers")

    def merged(self, update: LoraUpdate, whole: bool = False) -> dict[str, torch.Tensor]:
        """``{name: W0 + scale * B @ A}`` for every adapted weight, in the starting weights' dtype;
        with ``whole``, every other starting weight beside them (an engine that reloads whole
        layers, as vLLM's fused ones are, needs them all)."""
        self._load(None if whole else list(update.factors))
        out = dict(self.base) if whole else {}
        for name, (a, b, scale) in update.factors.items():
            w0 = self.base[name]
            out[name] = (w0.float() + scale * (b.float() @ a.float())).to(w0.dtype)
        return out
