"""Train an EAGLE-3-style head for a target on this CPU (``specdecode train eagle``).

1. Draft vocabulary: the N most frequent tokens of the training data (answers and corpus),
   plus the end-of-sequence tokens.
2. Features: the target runs over every training sequence once (teacher forcing) and we
   keep, per token, the states the head reads (inputs of the capture layers), the final
   normalised hidden state (the target's distribution restricted to the draft vocabulary
   is recomputed from it with the target's own head rows) and the target's argmax token.
   Stored in shards under ``OUT/features``; resumable.
3. Training: soft cross-entropy against the target's distribution over the draft
   vocabulary, on rows whose target argmax is in that vocabulary, unrolled ``ttt_steps``
   steps on the head's own outputs (step j weighted 0.8^j). Checkpoints every few minutes
   and at the end; resumes from ``OUT/checkpoint.pt``.
4. Evaluation on held-out prompts (``prompts.held_out``: of each category, the prompts of
   one templated filler in 20 (the function, topic or passage a filler's templates share)
   and one written prompt in 20 never train), less those whose prompt shares a run of
   ``SHARED_RUN`` tokens with a trained sequence (a passage trained under another
   category's templates, or in the corpus): first-token agreement and the mean accepted
   length tau of greedy chain drafts, k = 1..S.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ConfigError, SpecDecodeError
from ..proposers.eagle_head import EagleConfig, EagleHead
from .data import read_records
from .prompts import held_out
from .loop import Checkpoint, learning_rate

HELD_OUT_EVERY = 20  # one written prompt, and one templated filler, in 20 per category held out (prompts.held_out)
SHARD_TOKENS = 65536
STEP_DECAY = 0.8
EVAL_STEPS = 7  # the held-out report: chains of k = 1..7 drafts


SHARED_RUN = 48  # prompt tokens a held-out sequence may not share with trained text (the chat template's system
# prompt and a task template together take fewer: about 40 on the shipped set)


@dataclass
class Sequence:
    ids: list[int]
    trained_from: int  # positions >= this predict a token that is trained (answer tokens)
    held_out: bool
    greedy: bool = False  # the target's own greedy answer: its argmax is the next token
    evaluated: bool = True  # held out and unseen: its prompt shares no SHARED_RUN tokens with trained text


def _runs(ids: list[int], n: int) -> set[int]:
    """A hash of every run of ``n`` tokens in ``ids``."""
    import numpy as np

    if len(ids) < n:
        return set()
    tokens = np.asarray(ids, dtype=np.uint64)
    hashes = np.zeros(len(ids) - n + 1, dtype=np.uint64)
    for offset in range(n):  # wraps modulo 2**64, as intended
        hashes = hashes * np.uint64(1_000_003) + tokens[offset:len(ids) - n + 1 + offset]
    return set(hashes.tolist())


def mark_unseen(sequences: list[Sequence], run: int = SHARED_RUN) -> None:
    """Held-out sequences whose prompt shares a run of ``run`` tokens with a trained
    sequence (prompt, answer or corpus) are not evaluated: held out by filler within a
    category, a passage was still trained under another category's templates (extraction
    and summarization read the same docstrings) or in the corpus (its source file), and
    those sequences agreed with the target on 61% of first tokens against 41% for the
    others (found in review)."""
    trained: set[int] = set()
    for sequence in sequences:
        if not sequence.held_out:
            trained |= _runs(sequence.ids, run)
    for sequence in sequences:
        if sequence.held_out:
            sequence.evaluated = not (_runs(sequence.ids[:sequence.trained_from + 1], run) & trained)


def training_sequences(data_dir: Path, corpus_tokens: int, max_length: int,
                       vocab_size: int | None = None) -> list[Sequence]:
    """Answers (prompt + answer, loss on the answer) and corpus chunks (loss everywhere)."""
    answers_path = data_dir / "answers.jsonl"
    if not answers_path.is_file():
        raise SpecDecodeError(f"{answers_path} not found: build it with `specdecode train data --out {data_dir}`")
    sequences = []
    answer_fields = {"prompt_id": str, "prompt_ids": list, "answer_ids": list, "temperature": (int, float)}
    for record in read_records(answers_path, answer_fields, vocab_size):
        if not record["answer_ids"]:
            continue
        ids = (record["prompt_ids"] + record["answer_ids"])[:max_length]
        sequences.append(Sequence(ids, len(record["prompt_ids"]) - 1, held_out(record["prompt_id"], HELD_OUT_EVERY),
                                  record["temperature"] == 0))
    corpus_path = data_dir / "corpus.jsonl"
    taken = 0
    if corpus_path.is_file() and corpus_tokens > 0:
        for record in read_records(corpus_path, {"ids": list}, vocab_size):
            if taken >= corpus_tokens:
                break
            ids = record["ids"][:max_length]
            sequences.append(Sequence(ids, 0, False))
            taken += len(ids)
    # a sequence with no position left to train (an answer cut off by --max-length) is left
    # out: it trained nothing, and a run of them alone trained on loss 0 (found in review)
    sequences = [s for s in sequences if len(s.ids) >= 3 and s.trained_from <= len(s.ids) - 2]
    mark_unseen(sequences)
    return sequences


def trainable_sequences(data_dir: Path, corpus_tokens: int, max_length: int, vocab_size: int) -> list[Sequence]:
    """``training_sequences``, refused when none of them trains."""
    sequences = training_sequences(data_dir, corpus_tokens, max_length, vocab_size)
    if not any(not s.held_out for s in sequences):
        raise SpecDecodeError(f"{data_dir} gives no training sequence of 3 tokens or more with a token to train "
                              f"(with --max-length {max_length}, which cuts answers after their prompts, and "
                              f"--corpus-tokens {corpus_tokens}); build more with `specdecode train data` or "
                              "raise --max-length")
    return sequences


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The ``size`` most frequent target ids of the trained sequences (plus ``always``), sorted."""
    counts = Counter()
    for sequence in sequences:
        if not sequence.held_out:
            counts.update(sequence.ids[max(sequence.trained_from, 0):])
    chosen = [t for t in always if 0 <= t < vocab_size]
    # ties broken by id, not by the order the data lists the sequences in (which depends on
    # `train data --batch`): the same data gives the same vocabulary (found in review)
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    filler = (t for t in range(vocab_size) if t not in set(chosen))
    while len(chosen) < size:  # small corpora: pad with the lowest unused ids
        chosen.append(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def sequence_key(ids: list[int]) -> str:
    """What a stored feature record belongs to: the token ids it was computed over."""
    return hashlib.sha1(torch.tensor(ids, dtype=torch.int32).numpy().tobytes()).hexdigest()


def extract_features(runtime, sequences: list[Sequence], capture: tuple[int, ...], out: Path,
                     progress=None) -> dict[str, dict]:
    """Run the target over every sequence: features, final hidden state and argmax per
    token, by ``sequence_key``. Shards under ``out`` are kept and reused by content, so a
    grown training set (more answers) only computes what is new, and an interrupted run
    resumes after its last whole shard."""
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    shards = sorted(out.glob("shard-*.pt"))
    for path in shards:
        for record in torch.load(path):
            if "key" in record:  # shards of an older layout (by index) are not reused
                records[record["key"]] = record
    wanted = {sequence_key(s.ids): s for s in sequences}
    if progress is not None:
        progress(sum(len(s.ids) for key, s in wanted.items() if key in records))
    todo = [(key, s) for key, s in wanted.items() if key not in records]
    number = int(shards[-1].stem.split("-")[1]) + 1 if shards else 0
    batch, size = [], 0
    for position, (key, sequence) in enumerate(todo):
        runtime.reset(len(sequence.ids))
        outputs = runtime(torch.tensor([sequence.ids]), return_hidden=True, capture=capture)
        logits, hidden = outputs[0], outputs[1]
        record = {"key": key, "final": hidden[0].float().to(torch.bfloat16), "argmax": logits[0].argmax(-1).to(torch.int32)}
        if capture:  # no capture layers: the final states and argmax alone (Medusa heads read no more)
            record["features"] = outputs[2][0].to(torch.bfloat16)
        records[key] = record
        batch.append(record)
        size += len(sequence.ids)
        if progress is not None:
            progress(len(sequence.ids))
        if size >= SHARD_TOKENS or position == len(todo) - 1:
            path = out / f"shard-{number:04d}.pt"
            torch.save(batch, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            number, batch, size = number + 1, [], 0
    return records


class Trainer:
    """The head, its optimizer, and the frozen pieces of the target it trains against."""

    def __init__(self, head: EagleHead, embed: torch.Tensor, target_head_rows: torch.Tensor, lr: float,
                 ttt_steps: int, bf16: bool = False):
        self.head = head
        # mixed precision: the head's products and the target's draft-vocabulary distribution in
        # bf16 autocast (weights, optimizer state and the loss stay fp32)
        self.bf16 = bf16
        self.embed = embed  # [V, H] fp32, frozen
        self.target_rows = target_head_rows  # [N, H] fp32: the target's head for the draft vocabulary
        self.ttt_steps = ttt_steps
        self.t2d = torch.full((head.config.target_vocab_size,), -1, dtype=torch.int64)
        self.t2d[head.d2t] = torch.arange(head.d2t.numel())
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.lr = lr

    def batch_loss(self, batch: list[tuple[Sequence, dict]],
                   steps: int | None = None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Weighted loss over ``steps`` unrolled steps (default: the trained ones), and per
        step j the rows' argmax agreement with the target and which rows count
        ([B, rows - 1 - j] bool each)."""
        steps = steps or self.ttt_steps
        length = max(len(s.ids) for s, _ in batch)
        rows = length - 1  # row p reads position p and the token at p+1
        hidden_size = self.embed.shape[1]
        features = torch.zeros(len(batch), rows, batch[0][1]["features"].shape[-1])
        tokens = torch.zeros(len(batch), length + steps, dtype=torch.int64)
        final = torch.zeros(len(batch), length, hidden_size)
        argmax = torch.full((len(batch), length), -1, dtype=torch.int64)
        trained = torch.zeros(len(batch), length, dtype=torch.bool)
        for b, (sequence, record) in enumerate(batch):
            n = len(sequence.ids)
            features[b, : n - 1] = record["features"][: n - 1].float()
            tokens[b, :n] = torch.tensor(sequence.ids)
            final[b, :n] = record["final"].float()
            argmax[b, :n] = record["argmax"].long()
            # the label at position q is the target's next token there (argmax[q]), the last
            # position's too: a finished greedy answer's EOS (it was left out; found in review)
            trained[b, max(sequence.trained_from, 0) : n] = True
        embeds = [F.embedding(tokens[:, 1 + j : 1 + j + rows], self.embed) for j in range(steps)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            states = self.head.unrolled(features, embeds, torch.arange(rows))
        total = torch.zeros(())
        agreement = []
        for j, state in enumerate(states):
            # row p at step j predicts the token after position q = p + 1 + j (q <= the last position)
            valid = max(rows - j, 0)
            q = slice(1 + j, 1 + j + valid)
            target_ids = argmax[:, q]
            mask = trained[:, q] & (target_ids >= 0)
            in_vocab = mask & (self.t2d[target_ids.clamp(min=0)] >= 0)
            # the draft head and the loss only on the rows that train (no prompt, padding or
            # out-of-vocabulary rows): about a third of the rows, and most of the step's time
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.head.logits(state[:, :valid][in_vocab]).float()  # [n, N]
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                target_probs = (final[:, q][in_vocab] @ self.target_rows.T).float().softmax(-1)
            # soft cross-entropy against the target's distribution over the draft vocabulary
            per_row = F.cross_entropy(logits, target_probs, reduction="none")
            total = total + (STEP_DECAY ** j) * per_row.sum() / max(per_row.numel(), 1)
            correct = torch.zeros_like(mask)
            correct[in_vocab] = self.head.d2t[logits.detach().argmax(-1)] == target_ids[in_vocab]
            agreement.append((correct, mask))
        return total, agreement

    def step(self, batch, lr: float) -> tuple[float, float]:
        """One optimizer step; returns the loss and the first step's agreement."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.head.train()
        loss, agreement = self.batch_loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.optimizer.step()
        correct, mask = agreement[0]
        return float(loss.detach()), float((correct & mask).sum()) / max(int(mask.sum()), 1)


def check_train_settings(draft_vocab: int, ttt_steps: int, minutes: float, lr: float, batch_tokens: int,
                         max_length: int = 768) -> None:
    if not 1 <= ttt_steps <= 16:
        raise ConfigError(f"--ttt-steps must be in 1..16, got {ttt_steps}")
    check_common_settings(draft_vocab, minutes, lr, batch_tokens, max_length)


def check_common_settings(draft_vocab: int, minutes: float, lr: float, batch_tokens: int, max_length: int) -> None:
    """What every drafter's training takes: a draft vocabulary, a time budget, a learning
    rate, a batch and a sequence length."""
    if draft_vocab < 16:
        raise ConfigError(f"--draft-vocab must be >= 16, got {draft_vocab}")
    if not 0 < minutes < float("inf"):  # inf and nan failed after the features were extracted
        raise ConfigError(f"--minutes must be a finite number > 0, got {minutes}")
    if not 0 < lr < 1:
        raise ConfigError(f"--lr must be in (0, 1), got {lr}")
    if batch_tokens < 16:
        raise ConfigError(f"--batch-tokens must be >= 16, got {batch_tokens}")
    if max_length < 3:
        raise ConfigError(f"--max-length must be >= 3 (a prompt token and two to predict), got {max_length}")


def batches(items: list, batch_tokens: int, seed: int) -> list[list]:
    """Sequences of similar length grouped up to ``batch_tokens`` padded tokens, shuffled.
    Equal lengths are ordered by content, not by their order in the data (which `train data
    --batch` changes): a resumed run's batch offset then points into the same batches
    (found in review: a reordered copy resumed trained 37 sequences twice and 23 never)."""
    keys = [(len(s.ids), sequence_key(s.ids)) for s, _ in items]
    order = sorted(range(len(items)), key=keys.__getitem__)
    groups, current = [], []
    for index in order:
        length = len(items[index][0].ids)
        if current and length * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current = []
        current.append(items[index])
    if current:
        groups.append(current)
    random.Random(seed).shuffle(groups)
    return groups


def split_items(sequences: list[Sequence], records: dict[str, dict]) -> tuple[list, list, int, str]:
    """(trained items, evaluated items, held-out sequences not evaluated, a line saying so):
    items pair a sequence with its feature record."""
    train_items = [(s, records[sequence_key(s.ids)]) for s in sequences if not s.held_out]
    eval_items = [(s, records[sequence_key(s.ids)]) for s in sequences if s.held_out and s.evaluated]
    seen = sum(s.held_out and not s.evaluated for s in sequences)
    described = (f"sequences: {len(train_items)} training ({sum(len(s.ids) for s, _ in train_items)} tokens), "
                 f"{len(eval_items)} held out" + (f" ({seen} more held out share {SHARED_RUN} prompt tokens with "
                                                  "trained text: not evaluated)" if seen else ""))
    return train_items, eval_items, seen, described


def training_runtime(target, max_length: int, what: str, log=print):
    """(runtime, cfg, max_length) for the target a drafter trains for: the native runtime (a
    drafter reads its hidden states; refused before anything runs, found in review: the
    transformers runtime ended in a traceback), and ``--max-length`` cut to the target's
    context (found in review: a longer one failed in the middle of the feature pass)."""
    runtime = target.runtime
    if not hasattr(runtime, "weights"):
        raise ConfigError(f"{what} train on the native runtime (they read the target's hidden states); this target "
                          "runs through transformers")
    if max_length > runtime.max_positions:
        log(f"--max-length {max_length} is beyond the target's context: sequences are cut at {runtime.max_positions}")
        max_length = runtime.max_positions
    return runtime, runtime.cfg, max_length


def data_fingerprint(items: list) -> str:
    """The training sequences a run trains on, as one short hash."""
    return hashlib.sha1("|".join(sorted(sequence_key(s.ids) for s, _ in items)).encode()).hexdigest()[:16]


def train_eagle(target, data_dir: Path, out: Path, draft_vocab: int = 8192, ttt_steps: int = 3, minutes: float = 60.0,
                lr: float = 3e-4, batch_tokens: int = 2048, corpus_tokens: int = 200_000, max_length: int = 768,
                seed: int = 0, init: Path | None = None, log=print, bf16: bool = False) -> dict:
    """The whole recipe; returns the evaluation report (also written to OUT/report.json)."""
    from tqdm import tqdm

    from .data import check_data_target, target_identity

    check_train_settings(draft_vocab, ttt_steps, minutes, lr, batch_tokens, max_length)
    runtime, cfg, max_length = training_runtime(target, max_length, "EAGLE heads", log)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    sequences = trainable_sequences(Path(data_dir), corpus_tokens, max_length, cfg.vocab_size)
    identity = target_identity(target)
    check_data_target(Path(data_dir), identity)
    if init is not None:  # go on from a trained head: its sizes, vocabulary and weights
        head = EagleHead.load(Path(init), target_layers=runtime.num_layers)
        config = head.config
        if (config.hidden_size, config.target_vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise SpecDecodeError(f"--init {init}: that head was trained for a target with hidden size "
                                  f"{config.hidden_size} and {config.target_vocab_size} tokens; this one has "
                                  f"{cfg.hidden_size} and {cfg.vocab_size}")
        if max(config.capture_layers) >= runtime.num_layers:
            raise SpecDecodeError(f"--init {init}: that head reads layer {max(config.capture_layers)}; the target "
                                  f"has {runtime.num_layers}")
        log(f"starting from the head in {init} (draft vocabulary {config.draft_vocab_size})")
    else:
        config = EagleConfig.for_target(cfg, draft_vocab)
        head = EagleHead(config)
        head.set_draft_vocab(draft_vocabulary(sequences, config.draft_vocab_size, cfg.vocab_size, target.eos_token_ids))

    weights = runtime.weights
    embed = weights.embed.dequantize().float()
    target_rows = (embed if weights.lm_head is weights.embed else weights.lm_head.dequantize().float())[head.d2t]
    if init is None:
        with torch.no_grad():
            head.lm_head.weight.copy_(target_rows)  # start from the target's rows
    trainer = Trainer(head, embed, target_rows.contiguous(), lr, ttt_steps, bf16=bf16)
    # the recipe; a resumed run must share it with the one it continues (--minutes may grow)
    # the training sequences themselves: a resumed run continues the batch order of the
    # same data (data grown or rebuilt since would shift every batch under the saved offset)
    settings = {"ttt_steps": ttt_steps, "lr": lr, "batch_tokens": batch_tokens, "corpus_tokens": corpus_tokens,
                "max_length": max_length, "seed": seed, "bf16": bf16, "init": None if init is None else str(init),
                "target": identity, "data": data_fingerprint([(s, None) for s in sequences if not s.held_out])}
    checkpoint = Checkpoint(out / "checkpoint.pt", head, trainer.optimizer, config.__dict__, head.d2t, settings,
                            kind="EAGLE head")
    # before the feature pass (minutes to an hour, gigabytes): a run that cannot resume here is
    # refused first (found in review: refused only after the whole pass had been written)
    checkpoint.resume(log, "--draft-vocab and --init", "data and --init")

    total_tokens = sum(len(s.ids) for s in sequences)
    with tqdm(total=total_tokens, unit="tok", desc="target features") as bar:
        # features are the target's at the layers the head reads: another target, format or
        # set of layers keeps its own shards
        layers = ",".join(str(layer) for layer in config.capture_layers)
        features_dir = out / "features" / hashlib.sha1(f"{identity}|{layers}".encode()).hexdigest()[:12]
        records = extract_features(runtime, sequences, config.capture_layers, features_dir, bar.update)
    train_items, eval_items, seen, described = split_items(sequences, records)
    log(f"{described}; draft vocabulary {config.draft_vocab_size} of {cfg.vocab_size}")

    def step(batch, progress: float, steps: int) -> tuple[float, float]:
        return trainer.step(batch, learning_rate(lr, steps, progress))

    checkpoint.train(minutes, lambda epoch: batches(train_items, batch_tokens, seed + epoch), step)
    state = checkpoint.state

    report = evaluate(trainer, eval_items, batch_tokens)
    report.update({"held_out_sharing_trained_text": seen,
                   "train_minutes": round(state["seconds"] / 60, 1), "epochs": state["epoch"], "steps": state["steps"],
                   "train_tokens": sum(len(s.ids) for s, _ in train_items),
                   "parameters": sum(p.numel() for p in head.parameters())})
    head.save(out, {"target": getattr(getattr(target, "source", None), "name", None), "report": report,
                    "recipe": {"draft_vocab": config.draft_vocab_size, **settings}})
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@torch.no_grad()
def evaluate(trainer: Trainer, items: list, batch_tokens: int, steps: int | None = None) -> dict:
    """On held-out greedy answers, teacher-forced through ``steps`` unrolled steps (default:
    7, or the trained steps if more; deep chains draft past the trained depth). Only rows
    with all ``steps`` steps inside the answer count as chains, so the τ of small k is over
    a slightly different set of rows than an evaluation with fewer steps. A chain from row p keeps drafting while step j
    agrees with the target's argmax, and because the answer *is* the target's greedy
    output, step j's input then equals the drafted token. So the leading run of agreements
    is exactly the accepted length of a greedy chain of k <= ``steps`` drafts."""
    trainer.head.eval()
    steps = steps or max(EVAL_STEPS, trainer.ttt_steps)
    tally = ChainTally(steps)
    for batch in batches([item for item in items if item[0].greedy], batch_tokens, 0):
        tally.add(trainer.batch_loss(batch, steps)[1])
    return tally.report("agreement_per_step")


class ChainTally:
    """Agreement per draft position and the accepted lengths of greedy chains, summed over
    batches of per-position (correct, counted) masks [B, rows - j]: a chain from row p is
    accepted up to its first disagreeing position; only rows whose every position counts
    are chains."""

    def __init__(self, steps: int):
        self.steps = steps
        self.agree, self.counted = [0] * steps, [0] * steps
        self.accepted_at = [0] * (steps + 1)  # chains accepting exactly a drafts

    def add(self, agreement: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for j, (correct, mask) in enumerate(agreement):
            self.agree[j] += int((correct & mask).sum())
            self.counted[j] += int(mask.sum())
        full = agreement[-1][1].shape[1]
        if full == 0:
            return
        rows_ok = torch.stack([m[:, :full] for _, m in agreement]).all(0)  # [B, full]
        run = torch.ones_like(rows_ok)
        lengths = torch.zeros(rows_ok.shape, dtype=torch.int64)
        for correct, _ in agreement:
            run = run & correct[:, :full]
            lengths += run.long()
        for a in range(self.steps + 1):
            self.accepted_at[a] += int(((lengths == a) & rows_ok).sum())

    def report(self, per_position: str) -> dict:
        chains = sum(self.accepted_at)
        if not chains:  # nothing held out (a small data set, or sampled answers only): nothing measured
            return {"held_out_chains": 0, per_position: None, "first_token_agreement": None, "chain_tau": None}
        taus = [1 + sum(min(a, k) * n for a, n in enumerate(self.accepted_at)) / chains
                for k in range(1, self.steps + 1)]
        rates = [a / c if c else 0.0 for a, c in zip(self.agree, self.counted)]
        return {"held_out_chains": chains, per_position: [round(r, 4) for r in rates],
                "first_token_agreement": round(rates[0], 4), "chain_tau": {k + 1: round(t, 3) for k, t in enumerate(taus)}}
