"""The SASS of one kernel variant, on a machine without a GPU: read what ptxas made of a loop
before spending device time on it.

    pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm      # the CUDA 13 wheels (nvidia/cu13/)
    python benchmarks/sass.py 'fwd_mma<half_t, TileCfg<64, 128, 64.*MaskFlags<false, false>, true>' [--arch sm_90]
        [--full] [--tile 32,128,4,2[,ctas][,park]]

The regex picks the first matching variant of ``cuflash._dispatch.select.all_variants()``. The
source is compiled with NVRTC 13 (through ctypes: CuPy's own NVRTC may be 12.x, whose cubins
nvdisasm 13 does not read) with cuflash's options, disassembled with nvdisasm, and summarised:
registers and spills, the instruction count by opcode, and the lines worth a look in a
float16 / float32 kernel (fp64 instructions and conversions: F2F.F32.F64 in a loop is a double
parameter converted again on every iteration). ``--full`` prints the whole listing. ``NVRTC_LIB=/path/to/libnvrtc.so.13`` compiles with another NVRTC 13,
e.g. the device's 13.0 (``pip download nvidia-cuda-nvrtc==13.0.88`` and unzip it; add its lib folder to
LD_LIBRARY_PATH for the builtins): the versions schedule some loops differently (104 against 84
instructions in one dK/dV loop). ``--tile
BM,BN,WARPS,STAGES[,CTAS]`` swaps the variant's tile for a candidate that is not in the table yet.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuflash._dispatch.model import Tile  # noqa: E402
from cuflash._dispatch.select import all_variants  # noqa: E402
from cuflash._runtime.build import NVRTC_OPTIONS, load_source  # noqa: E402

WATCH = re.compile(r"\b(D(ADD|MUL|FMA|SETP|MNMX)|F2F\.[A-Z0-9.]*F64|F2F\.F64|I2F\.F64|F2I\.[A-Z0-9.]*F64)\b")


def _cu13(*parts: str) -> str:
    for root in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        hits = glob.glob(os.path.join(root, "nvidia", "cu13", *parts))
        if hits:
            return sorted(hits)[-1]
    raise SystemExit(f"nvidia/cu13/{'/'.join(parts)} not found: pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm")


def cubin(entry: str, name: str, arch: str) -> tuple:
    """(cubin bytes, ptxas log) of one name expression, compiled with NVRTC 13."""
    lib = ctypes.CDLL(os.environ.get("NVRTC_LIB") or _cu13("lib", "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), load_source(entry).encode(), entry.encode(), 0, None, None):
        raise SystemExit("nvrtcCreateProgram failed")
    try:
        lib.nvrtcAddNameExpression(prog, name.encode())
        opts = [o.encode() for o in list(NVRTC_OPTIONS) + [f"-arch={arch}", "--ptxas-options=-v"]]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc:
            raise SystemExit(log.value.decode())
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        data = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, data)
        return data.raw, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("regex", help="picks the variant (its C++ name expression)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--full", action="store_true", help="print the whole listing")
    ap.add_argument("--tile", help="BM,BN,WARPS,STAGES[,CTAS][,park]: a candidate tile in place of the table's")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a Tile field of the (candidate) tile, e.g. --set query_split=2 --set late_copies=true")
    args = ap.parse_args()
    pat = re.compile(args.regex)
    variant = next((v for v in all_variants() if pat.search(v.name)), None)
    if variant is None:
        raise SystemExit(f"no variant matches {args.regex!r}")
    if args.tile:
        fields = args.tile.split(",")
        park = "park" in fields
        bm, bn, warps, stages, *ctas = (int(x) for x in fields if x != "park")
        variant = replace(variant, tile=Tile(bm, bn, warps, stages, "candidate", ctas[0] if ctas else variant.tile.ctas,
                                             park=park))
    for item in args.set:
        key, value = item.split("=", 1)
        value = {"true": True, "false": False}.get(value.lower(), value)
        variant = replace(variant, tile=replace(variant.tile, **{key: value if isinstance(value, bool) else int(value)}))
    data, log = cubin(variant.entry, variant.name, args.arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(data)
        f.flush()
        sass = subprocess.run([_cu13("bin", "nvdisasm"), "-c", "-g", f.name], capture_output=True, text=True,
                              check=True).stdout
    print(f"{variant.name} ({args.arch})")
    print("\n".join(line for line in log.splitlines() if "registers" in line or "spill" in line))
    if args.full:
        print(sass)
        return
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
    print(f"{sum(ops.values())} instructions:", ", ".join(f"{k} {n}" for k, n in ops.most_common(24)))
    watched = [line.strip() for line in sass.splitlines() if WATCH.search(line)]
    print(f"{len(watched)} fp64 instructions / conversions" + (":" if watched else ""))
    for line in watched[:20]:
        print("   ", line)


if __name__ == "__main__":
    main()
