"""homagg's native data path: C code beside the Python engines, built by the package's own build
(setup.py: setuptools' Extension, optional) and loaded with ctypes.

- ``soft_loop.c``: the software aggregator's datagram loop (``homagg.targets.soft.native``);
- ``agent_loop.c``: the agent's round loop (``homagg.host_agent.engine.native``);
- ``codec.c``: round 1's reading of a float32 tensor (``homagg.host_agent.codec._native``);
- ``union.c``, ``sketch.c``: the codec's union and sketch kernels, so that a float32 tensor's
  codec runs here whatever its mode (``homagg.host_agent.codec._native``);
- ``wire.h``: the protocol's constants for C, generated from ``homagg.wire`` (``genheader``).

``load()`` gives the library, or None where it is not built (no compiler when homagg was
installed) or where ``HOMAGG_PURE_PYTHON=1`` asks for the Python engines; either way it says so
once, in the log. ctypes releases the GIL for every call into it.

Why ctypes and a plain C library, not a CPython extension (pybind11, nanobind): the native code
takes nothing from Python but integers and buffers' addresses, and gives back integers; ctypes
comes with Python, so the build needs a C compiler and libc's headers alone (no Python headers,
no package downloaded at build time), and the library has no ABI tie to one Python version.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
from pathlib import Path

log = logging.getLogger("homagg.native")

HERE = Path(__file__).resolve().parent
#: the built library's module name (setup.py's Extension)
NAME = "_homagg_native"
#: the environment variable that turns the native engines off
PURE_ENV = "HOMAGG_PURE_PYTHON"

_lib: ctypes.CDLL | None = None
_tried = False
_why = ""


def library_path() -> Path | None:
    """Where the built library is (the package's folder), or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = HERE / f"{NAME}{suffix}"
        if p.is_file():
            return p
    return None


def pure_python() -> bool:
    """HOMAGG_PURE_PYTHON asks for the Python engines (any value but '', '0')."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def load() -> ctypes.CDLL | None:
    """The native library, or None (``why()`` says why); says so once, in the log."""
    global _lib, _tried, _why
    if _tried:
        return _lib
    _tried = True
    if pure_python():
        _why = f"{PURE_ENV} is set"
    else:
        path = library_path()
        if path is None:
            _why = (f"it is not built (no {NAME} library in {HERE}: was a C compiler missing "
                    "when homagg was installed? ./run.sh setup installs one, then builds it)")
        else:
            try:
                _lib = _declare(ctypes.CDLL(str(path)))
            except (OSError, AttributeError) as e:
                _why = f"{path.name} does not load: {e}"
    if _lib is None:
        log.info("native data path off: %s; the Python engine runs", _why)
    return _lib


def why() -> str:
    """Why ``load()`` gave None ('' where it gave the library)."""
    load()
    return _why


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The functions' signatures (soft_loop.c, agent_loop.c, codec.c, union.c, sketch.c)."""
    p, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
    sig = {
        "hx_new": (p, []),
        "hx_free": (None, [p]),
        "hx_lock": (None, [p]),
        "hx_unlock": (None, [p]),
        "hx_set_sockets": (ctypes.c_int, [p, p, i32, i32]),
        "hx_set_memory": (None, [p, i64, i32] + [p] * 11),
        "hx_set_jobs": (ctypes.c_int, [p, p, i32, p, i32, p, i32]),
        "hx_serve": (ctypes.c_int, [p, i32]),
        "hx_slow": (i32, [p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint32),
                          ctypes.POINTER(ctypes.c_uint16)]),
        "hx_slow_port": (i32, [p]),
        "hx_io_counts": (None, [p, p]),
        "hx_gso": (i32, [p]),
        "hx_job_cols": (i32, []),
        "hx_set_parents": (ctypes.c_int, [p, p, i32]),
        "ha_round_bytes": (i64, []),
        "ha_new": (p, []),
        "ha_free": (None, [p]),
        "ha_reset": (None, [p, p]),
        "ha_round_run": (ctypes.c_int, [p, p]),
        "ha_pack": (None, [p, p, i64, i64, i64, i64, i64, p]),
        "ha_wake_at": (ctypes.c_double, [p, ctypes.c_double]),
        "ha_rtt_sample": (None, [p, ctypes.c_double]),
        "hc_summary_f32": (i64, [p, i64, i64, i64, i64, i32, p, p, p, p, i32, i64, p, p, i64,
                                  p]),
        "hc_quantize_f32": (i64, [p, i64, p, i64, p, p, i64, p, i32]),
        "hc_scale_i32": (None, [p, i64, p, i64, p, i32, i32]),
        "hc_union_size": (i64, [p, i64]),
        "hc_set_bits": (i64, [p, i64, p]),
        "hc_pack_nonzero_f32": (i64, [p, i64, p]),
        "hc_gather_union": (None, [p, i64, p, p]),
        "hc_subblocks": (None, [p, p, i64, p]),
        "hc_level_counts": (None, [p, i64, p, p]),
        "hc_encode_union_f32": (i32, [p, i64, p, p, i64, p, i64, p, p, i64, p, p]),
        **{f"hc_decode_union_i{v}_f{o}": (i64, [p, i64, p, p, i64, p, i64])
           for v in (32, 64) for o in (32, 64)},
        "hc_assemble": (None, [p, i32, p, p, i32, i64, ctypes.c_double]),
        "hc_scale_wide": (None, [p, i32, i64, p, i64, p, i32]),
        "hc_hashes": (None, [p, i64, i64, u64, u64, p, p]),
        "hc_sketch_encode": (None, [p, p, i32, i64, i64, u64, u64, p]),
        "hc_peel": (i64, [p, i64, u64, u64, p, p, p, i64, p, i32]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib
