"""torch.compile (inductor, static shapes) against eager torch on the 30 layers' bf16 linear
layers of the default model, T = 1 and 4 rows: whether compiling the torch backend could
approach the kernels backend (docs/performance.md).

    .venv/bin/python scripts/compile_linears.py
"""
import time

import torch
import torch.nn.functional as F

from specdecode.models.loading import resolve_model
from specdecode.models.llama import load_native

torch.set_num_threads(2)
rt = load_native(resolve_model("default").path, torch.bfloat16, "bf16", "torch")
layers = rt.weights.layers


def dense(p):  # bf16 dense [out, in]
    return p.dequantize().to(torch.bfloat16) if p.weight is None else p.weight.detach().to(torch.bfloat16)


mats = [[dense(getattr(l, k)) for k in ("qkv", "o", "gate_up", "down")] for l in layers]


def linears(x, qkv, o, gu, down):
    a = F.linear(x, qkv)[..., :576]
    h = x + F.linear(a, o)
    g, u = F.linear(h, gu).chunk(2, dim=-1)
    return h + F.linear(F.silu(g) * u, down)


compiled = torch.compile(linears, dynamic=False)
for T in (1, 4):
    x = torch.randn(1, T, 576, dtype=torch.bfloat16)
    for f in (linears, compiled):
        for m in mats[:2]: f(x, *m)
    res = {}
    for r in range(5):
        for name, f in (("eager", linears), ("compiled", compiled)):
            t = time.perf_counter()
            with torch.no_grad():
                for m in mats: y = f(x, *m)
            res.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
    print("T", T, {k: f"{min(v):.2f} ms (min of 5; 30 layers' linears)" for k, v in res.items()}, flush=True)
