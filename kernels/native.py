"""Optional C++ CPU kernels (kernels/csrc), compiled on first use with torch's JIT loader.

Nothing is built when `kernels` is imported: the first call to `paged_decode_attention_op()`
builds the library (seconds, once per machine) or loads the cached build (well under a
second), and later calls return the same op. If anything goes wrong (no compiler, no ninja,
a torch without the stable C++ API, a read-only cache) it logs one warning and returns None,
and callers use the torch path. The library registers `torch.ops.shoal.*` ops through
torch's stable C++ API, so it needs no pybind11 and no Python headers.

- `SHOAL_NATIVE_KERNELS=0` turns the native kernels off (read on every call).
- `SHOAL_CPU_ATTENTION=avx2|portable` holds the attention kernel to a narrower path.
- `SHOAL_KERNEL_CACHE=DIR` puts the builds in DIR (default `~/.cache/shoal/kernels`).

Builds live in a folder named by a hash of the source, the flags, torch and Python, so a
changed source or another torch gets its own build and processes with the same inputs share
one: a finished build (marked by a `built` file) is loaded directly. Concurrent builds are
serialised with an flock (released by the kernel even if the holder dies), around torch's
own lock file (which a killed build would leave behind).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from kernels.env import flag

log = logging.getLogger("shoal.kernels")

_CSRC = Path(__file__).resolve().parent / "csrc"
# No -march: the source multiversions its hot loop (AVX-512 / AVX2 / baseline) itself. No
# -ffast-math: results must match torch's attention to ~1e-6. Threads come from torch's own
# pool (torch::stable::parallel_for), so no -fopenmp either.
_CFLAGS = ["-O3", "-DNDEBUG"]
_LDFLAGS: list[str] = []

_lock = threading.Lock()
_libraries: dict[str, bool] = {}  # stem -> loaded (False once a build has failed)
last_build_seconds: float | None = None  # how long the last load took (build or cache hit)


def enabled() -> bool:
    return flag("SHOAL_NATIVE_KERNELS", True)


# The paths of csrc/paged_attention.cpp, widest first; SHOAL_CPU_ATTENTION=avx2 or portable
# holds a CPU to a narrower one (to run and test the AMD EPYCs' path on an AVX-512 machine).
ATTENTION_PATHS = ("best", "avx2", "portable")


def attention_path() -> str:
    path = os.environ.get("SHOAL_CPU_ATTENTION", "best").strip().lower() or "best"
    if path not in ATTENTION_PATHS:
        raise ValueError(f"SHOAL_CPU_ATTENTION must be one of {', '.join(ATTENTION_PATHS)}, got {path!r}")
    return path


def paged_decode_attention_op(path: str | None = None):
    """`op(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window=0,
    softcap=0., sinks=None)`, or None (sinks: float32 [heads], gpt-oss's attention sinks).

    Writes decode attention over the paged pool into `out` (see csrc/paged_attention.cpp),
    through the widest vector path the CPU has, or no wider than `path` (default:
    SHOAL_CPU_ATTENTION's)."""
    if not enabled() or not _load("paged_attention", ["paged_attention.cpp"]):
        return None
    path = path or attention_path()
    ops = torch.ops.shoal
    return {"best": ops.paged_decode_attention, "avx2": ops.paged_decode_attention_avx2,
            "portable": ops.paged_decode_attention_portable}[path].default


def panel_linear_op():
    """`op(out, x, packed, bias)`, or None: float32 linear layers on AVX-512 CPUs over weights
    packed in panels of 64 columns (see csrc/panel_linear.cpp, kernels/linear.py). None also
    where the CPU lacks AVX-512."""
    if not enabled() or not has_avx512() or not _load("panel_linear", ["panel_linear.cpp"]):
        return None
    return torch.ops.shoal_linear.panel_linear.default


def bf16_linear_op():
    """`op(out, x, packed, bias)`, or None: bfloat16 linear layers over weights packed in k-pair
    panels of 16 columns (csrc/bf16_linear.cpp, kernels/packed_weights.py `pairs`); only where
    the CPU has AVX512-BF16 and no AMX (oneDNN's AMX tiles are faster there)."""
    if not enabled() or not torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return None
    if not _load("bf16_linear", ["bf16_linear.cpp"]):
        return None
    return torch.ops.shoal_bf16.bf16_linear.default


def int8_linear_op(fp8: bool = False):
    """`op(out, x, packed, scale, bias, portable)`, or None: weight-only int8 (or, with `fp8`,
    float8 e4m3 as uint8) linear layers over weights packed in panels of 16 columns
    (csrc/int8_linear.cpp, kernels/quantization.py); AVX2 where the CPU has it, else (or with
    `portable`) a plain loop."""
    if not enabled() or not _load("int8_linear", ["int8_linear.cpp"]):
        return None
    ops = torch.ops.shoal_int8
    return (ops.fp8_linear if fp8 else ops.int8_linear).default


def w8a8_sums_op():
    """`op(out, xq, packed, path)`, or None: the exact int32 sums, as float32, of int8 rows
    times int8 weights packed in panels of 16 columns by groups of 4 k's (w8a8_int8 on CPUs
    without AMX; csrc/int8_linear.cpp, kernels/quantization.py): path 0 through the widest of
    AVX512-VNNI, AVX2 and a plain loop the CPU has, 1 AVX2 at most, 2 the plain loop."""
    if not enabled() or not _load("int8_linear", ["int8_linear.cpp"]):
        return None
    return torch.ops.shoal_int8.w8a8_sums.default


def has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"  # (AMX CPUs report AVX512 too)


def cache_root() -> Path:
    env = os.environ.get("SHOAL_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "shoal" / "kernels"


def _load(stem: str, sources: list[str]) -> bool:
    loaded = _libraries.get(stem)
    if loaded is None:
        with _lock:
            if stem not in _libraries:
                _libraries[stem] = _build(stem, sources)
            loaded = _libraries[stem]
    return loaded


def build_dir(stem: str, sources: list[str]) -> Path:
    """The cache folder of this build: named by a hash of everything that changes the binary
    (its sources and every header beside them)."""
    digest = hashlib.sha256()
    for src in [*sources, *sorted(h.name for h in _CSRC.glob("*.h"))]:
        digest.update((_CSRC / src).read_bytes())
    digest.update(repr((_CFLAGS, _LDFLAGS, torch.__version__, sys.version, sys.platform)).encode())
    return cache_root() / f"shoal_{stem}_{digest.hexdigest()[:12]}"


def _build(stem: str, sources: list[str]) -> bool:
    global last_build_seconds
    start = time.perf_counter()
    try:
        folder = build_dir(stem, sources)
        folder.mkdir(parents=True, exist_ok=True)
        import fcntl

        with open(folder / "shoal.lock", "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # waits while another process builds
            try:
                library, done = folder / f"{folder.name}.so", folder / "built"
                if done.exists() and library.exists():
                    # The folder name is a hash of the inputs, so a finished build is the right
                    # one: load it without ninja (which would rebuild when only mtimes changed,
                    # e.g. in a fresh checkout).
                    torch.ops.load_library(str(library))
                else:
                    _compile_and_load(folder, sources)
                    done.touch()
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
    except Exception as e:  # noqa: BLE001 - any failure means "use the torch path"
        detail = str(e).strip().splitlines()
        log.warning("native %s kernel unavailable, using the torch path (%s: %s)", stem,
                    type(e).__name__, " | ".join(detail[-3:])[:500])
        return False
    last_build_seconds = time.perf_counter() - start
    log.info("native %s kernel ready in %.1f s (%s)", stem, last_build_seconds, folder)
    return True


def _compile_and_load(folder: Path, sources: list[str]) -> None:
    _ninja_on_path()
    from torch.utils import cpp_extension

    # Holding the flock, nobody else is building: a torch lock file here was left by a build
    # that was killed, and would make torch wait for ever.
    (folder / "lock").unlink(missing_ok=True)
    # is_python_module=False: compile and link with ninja, then torch.ops.load_library, which
    # registers the ops.
    cpp_extension.load(name=folder.name, sources=[str(_CSRC / s) for s in sources],
                       extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, build_directory=str(folder),
                       is_python_module=False, verbose=False)


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is not there unless the venv is
    activated (e.g. `.venv/bin/python ...`), so add its folder."""
    try:
        import ninja
    except ImportError:
        return  # maybe a system ninja; torch reports it if there is none
    bin_dir = getattr(ninja, "BIN_DIR", None)
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path if path else bin_dir
