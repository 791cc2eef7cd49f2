"""Kernel build: read ``kernels_cu/``, compile one variant per key with NVRTC.

Sources are self-contained (they include no CUDA headers), and the local
``#include "x.cuh"`` lines are inlined here before compilation.  The string
handed to NVRTC is therefore the whole program, so CuPy's on-disk cache, which
hashes the source string, can never serve a cubin built from an older header.

Two paths use the same source text:

* :func:`get_kernel` builds through ``cupy.RawModule`` for the current device
  (first use compiles; later processes load from CuPy's cache).
* :func:`compile_offline` calls NVRTC directly for a named architecture, with
  ``--ptxas-options=-v``; it needs no GPU and reports registers, spills and
  shared memory.  ``python -m cuflash compile`` and the CI test use it.
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CompileError", "kernel_dir", "inline_includes", "load_source", "source_hash", "get_kernel",
           "compile_offline", "compile_source_offline", "OfflineBuild"]

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
NVRTC_OPTIONS = ("-std=c++17",)
# With user modifications (a prelude) a body that can end without a value (940) or a bare `return;` in it
# (117) is an error quoting the user's line, not a warning over a kernel that reads garbage.
PRELUDE_OPTIONS = ("--diag-error=940,117",)


class CompileError(RuntimeError):
    """A kernel variant failed to compile. ``log`` holds the NVRTC log."""

    def __init__(self, name: str, log: str):
        super().__init__(f"cuflash kernel {name} failed to compile:\n{log}")
        self.name = name
        self.log = log


def kernel_dir() -> Path:
    """The directory holding the ``.cu``/``.cuh`` sources.

    Installed wheels carry them as ``cuflash/kernels_cu``; a source checkout has
    them at the repository root, beside the package.
    """
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "kernels_cu", package.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError("cuflash kernel sources (kernels_cu/) not found next to the package")


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """SHA-256 (first 16 hex digits) over every file in ``kernels_cu/``."""
    h = hashlib.sha256()
    for path in sorted(kernel_dir().rglob("*.cu*")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def inline_includes(text: str) -> str:
    """``text`` with every local ``#include "x.cuh"`` replaced by the header (each header once)."""
    root = kernel_dir()
    seen: set[str] = set()

    def expand(body: str) -> str:
        return _INCLUDE.sub(lambda m: header(m.group(1)), body.replace("#pragma once", ""))

    def header(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        return expand((root / name).read_text())

    return f"// cuflash sources {source_hash()}\n" + expand(text)


@functools.lru_cache(maxsize=None)
def load_source(entry: str) -> str:
    """The entry file ``entry`` with its local includes inlined."""
    return inline_includes((kernel_dir() / entry).read_text())


@functools.lru_cache(maxsize=None)
def preload_nvrtc_wheel() -> str | None:
    """Load NVRTC from the NVIDIA pip wheels (nvidia-cuda-nvrtc*), if installed.

    CuPy 14 finds these wheels itself; CuPy 13 only searches the system's CUDA
    toolkit. Loading the wheel's library globally first lets either find it by
    its soname. Returns the path loaded, or None (then CuPy's own search runs).
    """
    import ctypes
    import glob
    import sys

    if not sys.platform.startswith("linux"):
        return None
    for base in sys.path:
        for sub in ("nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            libs = sorted(glob.glob(f"{base}/{sub}/libnvrtc.so.*"))
            if not libs:
                continue
            for builtins in sorted(glob.glob(f"{base}/{sub}/libnvrtc-builtins.so.*")):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
            return libs[0]
    return None


_LINE = re.compile(r'^#line 1 "([^"]+)"$', re.MULTILINE)
_AT = re.compile(r"^(.+?)\((\d+)\): (error|warning)", re.MULTILINE)


def explain_prelude_errors(log: str, prelude: str) -> str:
    """``log`` with the user's source line quoted under each error in a prelude's ``#line 1 "label"``
    section (cuflash.mods): NVRTC names the label and the line within it."""
    if not prelude:
        return log
    sections = {}
    parts = _LINE.split(prelude)
    for label, text in zip(parts[1::2], parts[2::2]):
        sections.setdefault(label, text.split("\n")[1:])   # (the directive's own line ends first)
    out = []
    for line in log.splitlines():
        out.append(line)
        m = _AT.match(line)
        if m and m.group(1) in sections:
            lines = sections[m.group(1)]
            n = int(m.group(2))
            if 1 <= n <= len(lines):
                out.append(f"    in {m.group(1)}, line {n}: {lines[n - 1].strip()}")
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def _module(entry: str, name_expression: str, nvrtc_arch: str | None = None, prelude: str = ""):
    import cupy

    preload_nvrtc_wheel()
    # CuPy appends -arch for the device itself (sm_90 on an H100); an sm_90a target named
    # here as well is what NVRTC builds (wgmma and setmaxnreg exist only there).
    options = NVRTC_OPTIONS + ((f"-arch={nvrtc_arch}",) if nvrtc_arch else ()) + (PRELUDE_OPTIONS if prelude else ())
    # RawModule compiles lazily, on the first get_function (see _function). A prelude (user
    # modifications) comes first: CuPy's cache hashes the whole text, so each is its own build.
    return cupy.RawModule(code=prelude + load_source(entry), options=options, name_expressions=[name_expression])


@functools.lru_cache(maxsize=None)
def _function(entry: str, name_expression: str, device_id: int, smem_bytes: int, nvrtc_arch: str | None = None,
              prelude: str = ""):
    # One RawModule per variant; the function handle is per device.
    import cupy

    try:
        func = _module(entry, name_expression, nvrtc_arch, prelude).get_function(name_expression)
    except cupy.cuda.compiler.CompileException as exc:
        raise CompileError(name_expression, explain_prelude_errors(str(exc), prelude)) from exc
    if smem_bytes > 48 * 1024:
        func.max_dynamic_shared_size_bytes = smem_bytes
    return func


@functools.lru_cache(maxsize=None)
def _compiled(variant, device_id: int):
    return _function(variant.entry, variant.name, device_id, variant.smem_bytes, variant.nvrtc_arch,
                     getattr(variant, "prelude", ""))


def get_kernel(variant):
    """The compiled ``cupy.RawKernel`` of a :class:`cuflash._dispatch.model.Variant` on the current device.

    Cached per (variant, device), so a launch does not rebuild the name expression.
    """
    import cupy

    return _compiled(variant, cupy.cuda.runtime.getDevice())


@dataclass(frozen=True)
class OfflineBuild:
    """What ptxas reported for one variant."""

    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    log: str

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_offline(entry: str, name_expression: str, arch: str = "sm_90", prelude: str = "") -> OfflineBuild:
    """Compile one variant of the entry file ``entry`` to a cubin for ``arch`` with NVRTC, without a GPU;
    ``prelude``: source placed first (a call's user modifications, cuflash.mods).

    Raises :class:`CompileError` with the NVRTC log on failure (the user's line quoted under an
    error in a prelude).
    """
    try:
        return compile_source_offline(prelude + load_source(entry), entry, name_expression, arch,
                                      PRELUDE_OPTIONS if prelude else ())
    except CompileError as exc:
        if not prelude:
            raise
        raise CompileError(name_expression, explain_prelude_errors(exc.log, prelude)) from None


def compile_source_offline(source: str, filename: str, name_expression: str, arch: str = "sm_90",
                           extra_options: tuple = ()) -> OfflineBuild:
    """Compile ``source`` (local includes already inlined) for ``arch`` with NVRTC_OPTIONS and
    ``extra_options``; see :func:`compile_offline`."""
    from cupy_backends.cuda.libs import nvrtc

    preload_nvrtc_wheel()
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        nvrtc.addNameExpression(prog, name_expression)
        options = list(NVRTC_OPTIONS) + list(extra_options) + [f"-arch={arch}", "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise CompileError(name_expression, nvrtc.getProgramLog(prog) or str(exc)) from exc
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    regs = _PTXAS_REGS.search(log)
    frame = _PTXAS_FRAME.search(log)
    if regs is None or frame is None:
        raise CompileError(name_expression, "could not read the ptxas report:\n" + log)
    return OfflineBuild(name_expression, arch, int(regs.group(1)), int(frame.group(2)),
                        int(frame.group(3)), int(frame.group(1)), log)
