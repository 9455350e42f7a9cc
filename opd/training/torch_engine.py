"""``trainer.engine: torch``: the student's optimizer loop in plain PyTorch, for one rank.

:class:`TorchEngine` answers the calls :class:`opd.training.trainer.StudentTrainer` makes on a
DeepSpeed engine (``backward``, ``step``, ``module``, ``device``, the accumulation boundary, the
global gradient norm, the learning rate, checkpoints) with the same arithmetic DeepSpeed does on
one rank: each micro-batch's loss divided by the accumulation steps before its backward, and at
the boundary the global gradient-norm clip, the AdamW update, the scheduler's step and zeroed
gradients. So a run gives the same updates with either engine (a test compares them), and a
machine with only torch and transformers (no DeepSpeed, no Ray) can train: ``run.backend: local``
with ``trainer.engine: torch`` is what ``scripts/gpu_check.py`` runs on a bare GPU machine.

What it does not do: more than one rank, and therefore ZeRO (which partitions state across ranks;
on one rank every stage holds everything, so ``trainer.zero_stage`` has no effect here). With
``student.dtype: bfloat16`` the weights and AdamW's state stay float32 and the forward and backward
run under ``torch.autocast`` in bfloat16, the usual mixed precision (DeepSpeed's bf16 mode keeps
float32 master weights too, with its own bookkeeping).

Its checkpoint is a directory of safetensors (the weights, every optimizer-state tensor) and one
JSON file (step counts, the scheduler's and the optimizer's scalar state): nothing is pickled.

Example:
    >>> engine = TorchEngine(model, optimizer, scheduler, accumulation_steps=2, grad_clip_norm=1.0)  # doctest: +SKIP
    >>> engine.backward(loss); engine.step()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE_FILES = ("model.safetensors", "optimizer.safetensors", "state.json")


def grad_norm(module: torch.nn.Module) -> float:
    """The global 2-norm of ``module``'s gradients (before any clipping)."""
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


class TorchEngine:
    """A model, its AdamW and scheduler behind the subset of DeepSpeed's engine interface the
    trainer uses."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, accumulation_steps: int, grad_clip_norm: float,
                 autocast_dtype: torch.dtype | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.module = model.to(self.device)
        self.optimizer = optimizer
        self.lr_scheduler = scheduler
        self.accumulation_steps = max(1, int(accumulation_steps))
        self.grad_clip_norm = float(grad_clip_norm)
        self.autocast_dtype = autocast_dtype
        self.boundary = True
        self.global_grad_norm: float | None = None
        self.global_steps = 0

    # -- the forward and the update ----------------------------------------------------------
    def autocast(self):
        """The context the forward runs in: bfloat16 autocast, or nothing for float32. Code that
        applies a piece of the model by hand (the trainer's LM head) enters it too."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.autocast():
            return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundary = bool(is_boundary)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss / accumulation_steps`` into the gradients, as DeepSpeed's ``backward`` does."""
        (loss / self.accumulation_steps).backward()

    def step(self) -> None:
        """At the accumulation boundary: clip, update, advance the schedule, zero the gradients."""
        if not self.boundary:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.grad_clip_norm > 0:
            self.global_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm))
        else:
            self.global_grad_norm = grad_norm(self.module)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    def get_global_grad_norm(self) -> float | None:
        return self.global_grad_norm

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, directory: str, tag: str, client_state: dict[str, Any],
                        exclude_frozen_parameters: bool = False) -> None:
        """``directory/tag/``: the weights (the trained ones only, with
        ``exclude_frozen_parameters``, as DeepSpeed's flag of that name) and the optimizer's
        tensors as safetensors, the rest as JSON (the caller makes the checkpoint's appearance
        atomic)."""
        out = Path(directory) / tag
        out.mkdir(parents=True, exist_ok=True)
        frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad} \
            if exclude_frozen_parameters else set()
        weights = {k: v.detach().contiguous() for k, v in self.module.state_dict().items() if k not in frozen}
        save_file(_untied(weights), str(out / "model.safetensors"))
        tensors, scalars = _split_optimizer_state(self.optimizer.state_dict())
        save_file(tensors, str(out / "optimizer.safetensors"))
        state = {"global_steps": self.global_steps, "client_state": client_state, "optimizer": scalars,
                 "lr_scheduler": self.lr_scheduler.state_dict()}
        (out / "state.json").write_text(json.dumps(state))

    def load_checkpoint(self, directory: str, tag: str) -> tuple[str | None, dict[str, Any]]:
        """Restore what :meth:`save_checkpoint` wrote; ``(None, {})`` when there is none."""
        src = Path(directory) / tag
        if not all((src / name).is_file() for name in STATE_FILES):
            return None, {}
        state = json.loads((src / "state.json").read_text())
        weights = load_file(str(src / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.module.load_state_dict(weights, strict=False)
        # A tied head's second name, and the frozen weights a LoRA checkpoint leaves out.
        frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
        missing = [k for k in missing if k not in _aliases(self.module.state_dict()) and k not in frozen]
        if missing or unexpected:
            raise ValueError(f"{src / 'model.safetensors'}: weights do not match the model "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        tensors = load_file(str(src / "optimizer.safetensors"), device=str(self.device))
        self.optimizer.load_state_dict(_join_optimizer_state(tensors, state["optimizer"]))
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_steps = int(state["global_steps"])
        return str(src), state["client_state"]


def _aliases(weights: dict[str, torch.Tensor]) -> set[str]:
    """The names of ``weights`` whose tensor an earlier name already holds (a tied LM head)."""
    seen: set[int] = set()
    aliases = set()
    for name, tensor in weights.items():
        if tensor.numel() and tensor.data_ptr() in seen:
            aliases.add(name)
        seen.add(tensor.data_ptr())
    return aliases


def _untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` without the second name of a tied tensor (safetensors refuses shared storage);
    loading ties it again."""
    aliases = _aliases(weights)
    return {name: tensor for name, tensor in weights.items() if name not in aliases}


def _split_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's ``state_dict`` as flat tensors (``state.{param}.{key}``) and the JSON rest."""
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _join_optimizer_state(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = tensor
    for index, values in rest["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": rest["param_groups"]}
