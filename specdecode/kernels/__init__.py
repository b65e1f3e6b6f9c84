"""specdecode's CPU kernels (``cpu.cpp``): built once per machine, loaded through ctypes.

The library is compiled with the machine's C++ compiler (``$CXX``, else ``g++``, else
``c++``) at ``-O3 -march=native -fopenmp -ffp-contract=off`` into
``<cache>/kernels/<key>/``, where the key hashes the source, the compiler's version and
the CPU's flags: a cache copied to another machine is rebuilt, never run on the wrong
instruction set. Building takes a few seconds and says so on stderr.

``load()`` returns the library or raises ``KernelsUnavailable`` with the reason (no
compiler, a failed build); ``available()`` says whether it loads. Without the library the
runtime falls back to PyTorch's kernels (dense formats only).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from ..config import SpecDecodeError

SOURCE = Path(__file__).with_name("cpu.cpp")
LIBRARY = "libspecdecode_cpu.so"
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")
# the instruction set: the machine's own by default; SPECDECODE_KERNELS_MARCH=x86-64 (no
# AVX2) builds the portable scalar code, which the tests also check. Options that take an
# extension away may follow the name: "native -mno-avx512bw" builds, on a Zen 4, what a CPU
# with 256-bit VNNI and no 512-bit VNNI runs (the tests check that build too)
DEFAULT_MARCH = "native"
FORMATS = {"fp32": 0, "bf16": 1, "q8_0": 2, "q4_1": 3, "fp16": 4, "q4_1x8": 5, "q8_0x8": 6, "q4_1x16": 7}


class KernelsUnavailable(SpecDecodeError, RuntimeError):
    """The CPU kernels cannot be built or loaded on this machine."""


class Linear(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim",
        "capacity", "batch", "kv_fmt", "max_rows", "num_threads", "pad")] + [
        ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
        ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p), ("layers", ctypes.POINTER(Layer)),
        ("normed", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("attn", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
        ("xq", ctypes.c_void_p), ("xd", ctypes.c_void_p), ("xs", ctypes.c_void_p),
        ("partial", ctypes.c_void_p), ("partial_items", ctypes.c_int64)]


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine()


def _march() -> str:
    return os.environ.get("SPECDECODE_KERNELS_MARCH", DEFAULT_MARCH)


def source_digest() -> str:
    """A digest of the kernels' source: measured costs (profiles, the weight format chosen
    by ``--weights auto``) are keyed by it, so a changed kernel is measured anew."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


@lru_cache(maxsize=1)
def build_digest() -> str:
    """What measured costs (profiles, the weight format ``--weights auto`` chose) are keyed
    by: the build the kernels load here (source, flags, -march, compiler version, CPU
    flags), so a rebuild for another instruction set or compiler is measured anew; the
    source's digest where no compiler builds them."""
    compiler = _compiler()
    return source_digest() if compiler is None else _build_key(compiler, _march())


def _build_key(compiler: str, march: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), march.encode(), "".join(version).encode(),
                 _cpu_flags().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def _march_options(march: str) -> list[str]:
    """The compiler options of a ``march`` value: "-march=NAME", then any options after
    the name, each of which must take an extension away ("-mno-...")."""
    parts = march.split()
    if not parts:
        raise KernelsUnavailable("kernel build: the instruction set's name is empty (SPECDECODE_KERNELS_MARCH)")
    name, *extra = parts
    wrong = [option for option in extra if not option.startswith("-mno-")]
    if wrong:
        raise KernelsUnavailable(f"kernel build {march!r}: only options that take an extension away (-mno-...) "
                                 f"may follow the instruction set's name, got {' '.join(wrong)}")
    return [f"-march={name}", *extra]


def build(force: bool = False, march: str | None = None) -> Path:
    """Compile the library for this machine if its cached build is missing; its path."""
    march = march or _march()
    options = _march_options(march)
    from ..models.loading import cache_dir, shared_mode

    compiler = _compiler()
    if compiler is None:
        raise KernelsUnavailable("no C++ compiler found (set $CXX or install g++); specdecode's CPU kernels are built on first use")
    try:  # a cache that cannot be written (read-only, a file where a folder should be): no kernels, not a crash
        target = cache_dir() / "kernels" / _build_key(compiler, march) / LIBRARY
        if target.is_file() and not force:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"specdecode: building the CPU kernels for this machine with {Path(compiler).name} (once; a few "
              "seconds)", file=sys.stderr, flush=True)
        handle, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            result = subprocess.run([compiler, *FLAGS, *options, str(SOURCE), "-o", staging],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                # a compiler that fails without a word (found in review: an empty reason)
                said = (result.stderr.strip() or result.stdout.strip())[-2000:] or \
                    f"{Path(compiler).name} exited with status {result.returncode} and printed nothing"
                raise KernelsUnavailable(f"building the CPU kernels failed:\n{said}")
            shared_mode(staging, 0o777)  # a library others may load from a shared cache
            os.replace(staging, target)
        finally:  # a failed or interrupted build leaves no half-written library behind
            if os.path.exists(staging):
                os.unlink(staging)
    except OSError as error:
        raise KernelsUnavailable(f"the CPU kernels cannot be built in specdecode's cache ({error})") from None
    return target


def load() -> ctypes.CDLL:
    """The loaded library (built first if needed). torch is imported before it, so the
    library shares torch's OpenMP runtime instead of starting a second thread pool."""
    if os.environ.get("SPECDECODE_NO_KERNELS"):
        raise KernelsUnavailable("SPECDECODE_NO_KERNELS is set")
    march = _march()
    if march in _FAILED:  # a build that failed is not tried again in this process (seconds each time)
        raise KernelsUnavailable(str(_FAILED[march]))
    try:
        return load_build(march)
    except KernelsUnavailable as error:
        _FAILED[march] = error
        raise


_FAILED: dict[str, KernelsUnavailable] = {}  # march -> why its build failed in this process


@lru_cache(maxsize=4)
def load_build(march: str) -> ctypes.CDLL:
    """The library built for ``march``, loaded, with its functions' signatures set."""
    import torch  # noqa: F401  (see load)

    path = build(march=march)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # damaged from outside (a copy cut short, a full disk): built again, once
        try:
            lib = ctypes.CDLL(str(build(force=True, march=march)))
        except OSError as error:
            raise KernelsUnavailable(f"the CPU kernels built at {path} do not load: {error}") from None
    c_int, c_i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    signatures = {
        "sd_version": ([], c_int),
        "sd_simd": ([], c_int),
        "sd_key_chunk": ([], c_int),
        "sd_pairs16": ([], c_int),
        "sd_team_size": ([c_int], c_int),
        "sd_forward_layers": ([ctypes.POINTER(Model), c_int, c_int, ptr, c_int, c_int, ptr, ptr, ptr, ptr], None),
        "sd_linear_forward": ([ctypes.POINTER(Linear), ptr, c_i64, ptr, ptr, ptr, ptr, c_int], None),
        "sd_rms_norm": ([ptr, ptr, c_i64, c_int, ctypes.c_float, ptr, c_int], None),
        "sd_embed": ([ctypes.POINTER(Linear), ptr, c_i64, ptr], None),
        "sd_attention": ([ctypes.POINTER(Model), c_int, ptr, c_int, c_int, ptr, ptr, ptr, ptr], None),
        "sd_eagle_layer": ([ctypes.POINTER(Model), ptr, ptr, ptr, c_int, c_int, ptr, c_int, ptr], None),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def available() -> bool:
    try:
        load()
        return True
    except KernelsUnavailable:
        return False


def unavailable_reason() -> str | None:
    try:
        load()
        return None
    except KernelsUnavailable as error:
        return str(error)
