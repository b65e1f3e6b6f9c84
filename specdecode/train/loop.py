"""What every drafter's training shares: a timed loop over shuffled batches with a warm-up
and cosine learning rate, and a checkpoint that resumes it (refused when it trains another
shape, vocabulary or recipe)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..config import SpecDecodeError

SAVE_EVERY_SECONDS = 300
WARM_UP_STEPS = 50


def learning_rate(lr: float, steps: int, progress: float) -> float:
    """Linear warm-up over the first steps, then a cosine from lr down to lr / 10 over the
    time budget (``progress`` in [0, 1])."""
    return lr * min(1.0, (steps + 1) / WARM_UP_STEPS) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Checkpoint:
    """``path`` holds a module's weights, its optimizer, the loop's state and what it trains
    (``config``: the module's shape, ``d2t``: its draft vocabulary, ``settings``: the recipe)."""

    def __init__(self, path: Path, module: torch.nn.Module, optimizer, config: dict, d2t: torch.Tensor,
                 settings: dict, kind: str = "drafter"):
        self.path, self.module, self.optimizer = path, module, optimizer
        self.config, self.d2t, self.settings, self.kind = config, d2t, settings, kind
        self.state = {"epoch": 0, "batch": 0, "seconds": 0.0, "steps": 0}

    def resume(self, log, shape_flags: str = "--draft-vocab", vocabulary_from: str = "data") -> None:
        """Continue from the file if there is one (else start at zero). ``shape_flags``: the
        flags that set the module's shape; ``vocabulary_from``: what chooses its vocabulary."""
        if not self.path.is_file():
            return
        saved = torch.load(self.path, weights_only=False)
        if saved.get("kind", self.kind) != self.kind:  # (found in review: Medusa's head count read as EAGLE's shape)
            raise SpecDecodeError(f"{self.path} trains {saved['kind']}, not {self.kind}; use another --out")
        if saved["config"] != self.config:
            named = ", ".join(f"{k} {v!r} -> {self.config.get(k)!r}" for k, v in saved["config"].items()
                              if self.config.get(k) != v)
            raise SpecDecodeError(f"{self.path} trains a head of another shape ({named}); resume with the same "
                                  f"{shape_flags}, or use another --out")
        if not torch.equal(saved["d2t"], self.d2t):
            raise SpecDecodeError(f"{self.path} trains another draft vocabulary (chosen from other {vocabulary_from}); "
                                  f"resume with the same {vocabulary_from}, or use another --out")
        before = saved.get("settings", self.settings)  # checkpoints older than a field: that field unchecked
        differ = {k: (before[k], v) for k, v in self.settings.items() if k in before and before[k] != v}
        if differ:
            named = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in differ.items())
            raise SpecDecodeError(f"{self.path} was trained with other settings ({named}); "
                                  "resume with the same ones, or use another --out")
        self.module.load_state_dict(saved["head"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = saved["state"]
        state = self.state
        log(f"resumed from {self.path}: epoch {state['epoch']}, batch {state['batch']}, {state['seconds'] / 60:.1f} min")

    def save(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        torch.save({"kind": self.kind, "config": self.config, "settings": self.settings, "d2t": self.d2t, "head": self.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "state": self.state}, temporary)
        temporary.rename(self.path)

    def train(self, minutes: float, groups_for_epoch, step) -> None:
        """Run ``step(batch, lr_progress, steps) -> (loss, top1)`` over ``groups_for_epoch(epoch)``
        until ``minutes`` of training have passed (resumed runs count their earlier time),
        saving every few minutes and at the end; a progress bar shows loss and top-1."""
        from tqdm import tqdm

        state, budget = self.state, minutes * 60.0
        started, last_save = time.perf_counter() - state["seconds"], time.perf_counter()
        bar = tqdm(total=round(budget), unit="s", desc="training", initial=round(min(state["seconds"], budget)))
        recent: list[float] = []
        while state["seconds"] < budget:
            for batch in groups_for_epoch(state["epoch"])[state["batch"]:]:
                loss, top1 = step(batch, min(state["seconds"] / budget, 1.0), state["steps"])
                state["batch"] += 1
                state["steps"] += 1
                recent = (recent + [top1])[-50:]
                now = time.perf_counter()
                bar.update(min(round(now - started), round(budget)) - bar.n)
                bar.set_postfix(epoch=state["epoch"], loss=f"{loss:.3f}", top1=f"{sum(recent) / len(recent):.2f}")
                state["seconds"] = now - started
                if now - last_save > SAVE_EVERY_SECONDS:
                    self.save()
                    last_save = now
                if state["seconds"] >= budget:
                    break
            else:
                state["epoch"] += 1
                state["batch"] = 0
        bar.close()
        self.save()
