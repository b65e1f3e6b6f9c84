"""Train Medusa heads for a target on this CPU (``specdecode train medusa``).

Same data as the EAGLE head (``specdecode train data``: the target's own answers to our
training prompts, and local code), same draft vocabulary rule and held-out prompts. The
target runs once over every sequence and we keep, per token, its final normalised hidden
state and its argmax (``eagle.extract_features`` without capture layers). Head i at
position p learns the target's distribution at position p+i (over the draft vocabulary,
soft cross-entropy, weighted 0.8^(i-1)): the token the target would put at p+1+i after
the tokens actually there, wherever that token is part of the answer (so rows inside the
prompt train too when their label lies in the answer). Only the K residual blocks train; the norm and the output
rows are the target's, frozen. Checkpoints every few minutes, resumable.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..proposers.medusa import MedusaConfig, MedusaHeads
from .eagle import (ChainTally, batches, check_common_settings, data_fingerprint, draft_vocabulary, extract_features,
                    split_items, trainable_sequences, training_runtime)
from .loop import Checkpoint, learning_rate

HEAD_DECAY = 0.8


def check_medusa_settings(heads: int, draft_vocab: int, minutes: float, lr: float, batch_tokens: int,
                          max_length: int) -> None:
    if not 1 <= heads <= 8:
        raise ConfigError(f"--heads must be in 1..8, got {heads}")
    check_common_settings(draft_vocab, minutes, lr, batch_tokens, max_length)


def padded(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of (sequence, record) as final states [B, T, H], the target's argmax [B, T],
    positions whose prediction trains [B, T] (from the last prompt token on, or every
    position of a corpus chunk) and positions that exist [B, T]."""
    length = max(len(s.ids) for s, _ in batch)
    hidden_size = batch[0][1]["final"].shape[-1]
    final = torch.zeros(len(batch), length, hidden_size)
    argmax = torch.full((len(batch), length), -1, dtype=torch.int64)
    trained = torch.zeros(len(batch), length, dtype=torch.bool)
    present = torch.zeros(len(batch), length, dtype=torch.bool)
    for b, (sequence, record) in enumerate(batch):
        n = len(sequence.ids)
        final[b, :n] = record["final"].float()
        argmax[b, :n] = record["argmax"].long()
        trained[b, max(sequence.trained_from, 0) : n] = True
        present[b, :n] = True
    return final, argmax, trained, present


class MedusaTrainer:
    def __init__(self, heads: MedusaHeads, lr: float):
        self.heads = heads
        self.t2d = torch.full((heads.config.target_vocab_size,), -1, dtype=torch.int64)
        self.t2d[heads.d2t] = torch.arange(heads.d2t.numel())
        self.optimizer = torch.optim.AdamW(heads.blocks.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def batch_loss(self, batch: list) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The weighted loss, and per head i (1..K) which rows p agree with the target's
        argmax at p+i and which count ([B, T - i] bool each)."""
        final, argmax, trained, present = padded(batch)
        length = final.shape[1]
        states = self.heads.states(final)  # [B, T, K, H]
        rows = self.heads.rows
        total = torch.zeros(())
        agreement = []
        for i in range(1, self.heads.config.num_heads + 1):
            span = max(length - i, 0)
            target_ids = argmax[:, i : i + span]
            # row p's label is token p+1+i, an answer token where p+i >= trained_from: the rows
            # before the answer train too (the first draft of a request reads the prompt's end)
            mask = trained[:, i : i + span] & present[:, i : i + span]
            in_vocab = mask & (self.t2d[target_ids.clamp(min=0)] >= 0)
            logits = self.heads.logits(states[:, :span, i - 1][in_vocab])  # [n, N]
            with torch.no_grad():
                target_probs = (final[:, i : i + span][in_vocab] @ rows.T).softmax(-1)
            per_row = F.cross_entropy(logits, target_probs, reduction="none")
            total = total + HEAD_DECAY ** (i - 1) * per_row.sum() / max(per_row.numel(), 1)
            correct = torch.zeros_like(mask)
            correct[in_vocab] = self.heads.d2t[logits.detach().argmax(-1)] == target_ids[in_vocab]
            agreement.append((correct, mask))
        return total, agreement

    def step(self, batch: list, lr: float) -> tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.heads.train()
        loss, agreement = self.batch_loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.heads.blocks.parameters(), 1.0)
        self.optimizer.step()
        correct, mask = agreement[0]
        return float(loss.detach()), float((correct & mask).sum()) / max(int(mask.sum()), 1)


@torch.no_grad()
def evaluate_medusa(trainer: MedusaTrainer, items: list, batch_tokens: int) -> dict:
    """On held-out greedy answers (the tokens after p are the target's own greedy choices,
    so head i's guess is accepted exactly when it equals the target's argmax at p+i): each
    head's agreement, and τ of greedy chains of k = 1..K drafts (rows p with all K heads
    inside the answer), the leading run of agreeing heads plus the target's own token."""
    trainer.heads.eval()
    tally = ChainTally(trainer.heads.config.num_heads)
    for batch in batches([item for item in items if item[0].greedy], batch_tokens, 0):
        tally.add(trainer.batch_loss(batch)[1])
    return tally.report("agreement_per_head")


def train_medusa(target, data_dir: Path, out: Path, heads: int = 3, draft_vocab: int = 8192, minutes: float = 20.0,
                 lr: float = 1e-3, batch_tokens: int = 4096, corpus_tokens: int = 200_000, max_length: int = 768,
                 seed: int = 0, log=print) -> dict:
    """The whole recipe; returns the evaluation report (also written to OUT/report.json)."""
    from tqdm import tqdm

    from .data import check_data_target, target_identity

    check_medusa_settings(heads, draft_vocab, minutes, lr, batch_tokens, max_length)
    runtime, cfg, max_length = training_runtime(target, max_length, "Medusa heads", log)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    sequences = trainable_sequences(Path(data_dir), corpus_tokens, max_length, cfg.vocab_size)
    identity = target_identity(target)
    check_data_target(Path(data_dir), identity)
    config = MedusaConfig(cfg.hidden_size, heads, cfg.vocab_size, min(draft_vocab, cfg.vocab_size), cfg.rms_norm_eps)
    medusa = MedusaHeads(config)
    medusa.set_draft_vocab(draft_vocabulary(sequences, config.draft_vocab_size, cfg.vocab_size, target.eos_token_ids))
    weights = runtime.weights
    medusa.bind(weights.norm, weights.lm_head.dequantize())

    trainer = MedusaTrainer(medusa, lr)
    settings = {"lr": lr, "batch_tokens": batch_tokens, "corpus_tokens": corpus_tokens, "max_length": max_length,
                "seed": seed, "target": identity, "data": data_fingerprint([(s, None) for s in sequences if not s.held_out])}
    checkpoint = Checkpoint(out / "checkpoint.pt", medusa, trainer.optimizer, config.__dict__, medusa.d2t, settings,
                            kind="Medusa heads")
    checkpoint.resume(log, "--heads and --draft-vocab", "data")  # before the feature pass, as train_eagle
    with tqdm(total=sum(len(s.ids) for s in sequences), unit="tok", desc="target states") as bar:
        features_dir = out / "features" / hashlib.sha1(f"{identity}|final".encode()).hexdigest()[:12]
        records = extract_features(runtime, sequences, (), features_dir, bar.update)
    train_items, eval_items, seen, described = split_items(sequences, records)
    log(f"{described}; {heads} heads, draft vocabulary {config.draft_vocab_size} of {cfg.vocab_size}")

    checkpoint.train(minutes, lambda epoch: batches(train_items, batch_tokens, seed + epoch),
                     lambda batch, progress, steps: trainer.step(batch, learning_rate(lr, steps, progress)))
    state = checkpoint.state

    report = evaluate_medusa(trainer, eval_items, batch_tokens)
    report.update({"held_out_sharing_trained_text": seen,
                   "train_minutes": round(state["seconds"] / 60, 1), "epochs": state["epoch"], "steps": state["steps"],
                   "train_tokens": sum(len(s.ids) for s, _ in train_items),
                   "parameters": sum(p.numel() for p in medusa.blocks.parameters())})
    medusa.save(out, {"target": getattr(getattr(target, "source", None), "name", None), "report": report,
                      "recipe": {"heads": heads, "draft_vocab": config.draft_vocab_size, **settings}})
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

