"""Time one EAGLE training step (forward, backward, optimizer) on synthetic data, fp32
against bf16 autocast: ``python scripts/train_step_ab.py [batch_tokens] [length]``.
Prints the median of 5 steps after 2 warm-ups, per variant, in one process."""

import statistics
import sys
import time
from types import SimpleNamespace

import torch

from specdecode.proposers.eagle_head import EagleConfig, EagleHead
from specdecode.train.eagle import Sequence, Trainer

batch_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
length = int(sys.argv[2]) if len(sys.argv) > 2 else 384
cfg = SimpleNamespace(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                      rms_norm_eps=1e-5, rope={"rope_theta": 100000.0}, vocab_size=49152)
config = EagleConfig.for_target(cfg, 8192)
generator = torch.Generator().manual_seed(0)
batch = []
for _ in range(max(batch_tokens // length, 1)):
    ids = torch.randint(0, 49152, (length,), generator=generator).tolist()
    record = {"features": torch.randn(length, 3 * 576).bfloat16(), "final": torch.randn(length, 576).bfloat16(),
              "argmax": torch.randint(0, 9000, (length,), generator=generator).int()}  # ~90% in the draft vocabulary
    batch.append((Sequence(ids, length // 3, False), record))  # a third is prompt
embed = torch.randn(49152, 576) * 0.02
for bf16 in (False, True):
    torch.manual_seed(0)
    head = EagleHead(config)
    trainer = Trainer(head, embed, torch.randn(8192, 576) * 0.02, 3e-4, 3, bf16=bf16)
    times = []
    for i in range(7):
        started = time.perf_counter()
        loss, _ = trainer.step(batch, 3e-4)
        times.append(time.perf_counter() - started)
    median = statistics.median(times[2:])
    print(f"bf16={bf16}: {median * 1000:.0f} ms per step of {len(batch) * length} tokens "
          f"({len(batch) * length / median:.0f} tok/s), loss {loss:.3f}")
