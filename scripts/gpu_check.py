"""The CUDA path end to end, through the CLI a user runs: each method's greedy output
against plain decoding (`generate --compare --json`; the tiny model runs ngram, suffix and
draft, the real one adds eagle and tree), seeded sampling against plain sampling, the GPU
against the CPU in fp32, and optionally `bench` and `profile` on the GPU.

    python scripts/gpu_check.py --model tiny --out OUT            # a tiny random chat model
    python scripts/gpu_check.py --model default --out OUT --bench # the real model

Each step runs as its own process, so one failure does not hide the next; the tracebacks
and a summary (OUT/gpu_check.json) come back either way. Written for the machines that are
lent a GPU now and then (none of CI's has one); with --device cpu it checks itself here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {
    "copy": "Repeat this list exactly, one per line: apples, pears, plums, cherries, figs, dates.",
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "open": "Tell me a short story about a lighthouse keeper.",
}


def cli(args: list[str], log, timeout: float = 900) -> tuple[int, str, float]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    seconds = time.perf_counter() - started
    log.write(f"\n$ specdecode {' '.join(args)}\n[rc {proc.returncode}, {seconds:.1f} s]\n{proc.stdout[-6000:]}"
              f"\n--- stderr ---\n{proc.stderr[-6000:]}\n")
    log.flush()
    return proc.returncode, proc.stdout, seconds


def tiny_model(root: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import save_chat_model

    return str(save_chat_model(root / "tiny-chat", seed=21, num_layers=3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (built here), 'default' or a path")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--bench", action="store_true", help="also run bench (the real model's methods) and profile")
    parser.add_argument("--bench-limit", type=int, default=1)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    model = tiny_model(tmp) if args.model == "tiny" else args.model
    real = args.model != "tiny"
    methods = ["ngram", "suffix", "draft", "eagle", "tree", "medusa"] if real else ["ngram", "suffix", "draft"]
    draft = {"draft": [] if real else ["--draft", "self:1"]}
    prompts = {"code": PROMPTS["code"]} if real else PROMPTS  # the real model's methods meet bench's prompts
    results: list[dict] = []
    with open(out / "gpu_check.log", "w") as log:
        def record(step: str, rc: int, **fields) -> None:
            results.append({"step": step, "ok": rc == 0 and fields.pop("ok", True), "rc": rc, **fields})
            print(json.dumps(results[-1]), flush=True)

        base = ["--model", model, "--device", args.device, "--max-new-tokens", str(args.max_new_tokens)]
        for dtype in ("fp32", "bf16"):
            for name, prompt in prompts.items():
                for method in methods:
                    rc, stdout, seconds = cli(["generate", prompt, "--method", method, "--compare", "--json",
                                               "--dtype", dtype, *base, *draft.get(method, [])], log)
                    fields: dict = {"seconds": round(seconds, 1)}
                    if rc == 0:
                        data = json.loads(stdout)
                        stats = data["stats"]
                        fields.update(identical=data["identical_to_plain"], speedup=None if data["speedup"] is None else round(data["speedup"], 2),
                                      tok_s=round(stats["tokens_per_s"], 1), tau=stats["tau"],
                                      plain_tok_s=round(data["plain"]["tokens_per_s"], 1),
                                      ok=dtype != "fp32" or data["identical_to_plain"] is True)
                    record(f"generate {dtype} {name} {method}", rc, **fields)
            # a deterministic drafter's sampled tokens are plain sampling's for the seed
            # (docs/architecture.md, Randomness), twice over and whatever k auto chose
            sampler = "tree" if real else "ngram"
            texts = []
            for method in (sampler, sampler, "none"):
                rc, stdout, _ = cli(["generate", PROMPTS["open"], "--method", method, "--json", "--dtype", dtype,
                                     "--temperature", "0.8", "--top-p", "0.9", "--seed", "5", *base], log)
                texts.append(json.loads(stdout)["text"] if rc == 0 else None)
            record(f"sampled {dtype} {sampler} seed 5 twice == plain", 0,
                   ok=all(t is not None for t in texts) and (dtype != "fp32" or texts[0] == texts[1] == texts[2]),
                   same=[texts[0] == texts[1], texts[0] == texts[2]])
        # the GPU against the CPU (torch backend), fp32, plain greedy
        texts = []
        for device in (args.device, "cpu"):
            rc, stdout, _ = cli(["generate", PROMPTS["code"], "--method", "none", "--json", "--dtype", "fp32",
                                 "--backend", "torch", "--model", model, "--device", device,
                                 "--max-new-tokens", str(args.max_new_tokens)], log)
            texts.append(json.loads(stdout)["text"] if rc == 0 else None)
        record(f"plain fp32 {args.device} == cpu", 0, ok=texts[0] is not None and texts[0] == texts[1],
               texts=texts if texts[0] != texts[1] else None)
        if args.bench:
            for dtype in ("bf16", "fp32"):
                rc, _, seconds = cli(["bench", "--model", model, "--device", args.device, "--dtype", dtype,
                                      "--methods", "none,ngram,suffix,eagle,tree,hf", "--limit", str(args.bench_limit),
                                      "--out", str(out / f"bench_{dtype}.json")], log, timeout=1200)
                record(f"bench {dtype}", rc, seconds=round(seconds, 1))
            rc, stdout, seconds = cli(["profile", "--model", model, "--device", args.device, "--remeasure"], log)
            (out / "profile.txt").write_text(stdout)
            record("profile", rc, seconds=round(seconds, 1))
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    failed = [r["step"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} of {len(results)} steps ok" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
