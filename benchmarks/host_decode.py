"""Small decoding calls, where the host's path is the call's time (needs a GPU): attention_forward against
attention_with_kvcache (lengths unchecked, checked, an int, NumPy lengths), pages of 16 and 256, a decoding
step that appends one key a sequence (lengths unchecked, NumPy lengths), and the upload of a NumPy lengths
array by cupy.asarray, as the mean of 300 queued calls (best of 5; CUDA events)
beside the host's own time per call.

    PYTHONPATH=. python benchmarks/host_decode.py

Float16, 32 query heads over 8 K/V heads, one query row: B = 1 and 8 at 4096 keys (D = 64), B = 1 at 16384
(D = 128), B = 8 at 32768 (D = 128, where the GPU's time shows instead)."""
import sys
import time
from pathlib import Path

import numpy as np
import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import _paged_cache  # noqa: E402
import cuflash  # noqa: E402

ROWS = ((1, 4096, 64), (8, 4096, 64), (1, 16384, 128), (8, 32768, 128))


def timed(fn, n: int = 300):
    """(queued us, host us) per call: the best of 5 runs of n calls."""
    for _ in range(30):
        fn()
    cp.cuda.Device().synchronize()
    best_queued = best_host = float("inf")
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(5):
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        end.record()
        end.synchronize()
        best_queued = min(best_queued, cp.cuda.get_elapsed_time(start, end) * 1e3 / n)
        best_host = min(best_host, host)
    return best_queued, best_host


def main() -> None:
    print(f"{'B':>3} {'Lk':>6} {'D':>4} {'contender':26s} {'queued us':>9} {'host us':>8}")
    for b, lk, d in ROWS:
        q = cp.random.standard_normal((b, 32, 1, d)).astype(cp.float16)
        k, v = (cp.random.standard_normal((b, 8, lk, d)).astype(cp.float16) for _ in range(2))
        lengths = cp.full((b,), lk, dtype=cp.int32)
        host_lengths = np.full((b,), lk, dtype=np.int32)
        cases = {"attention_forward": lambda: cuflash.attention_forward(q, k, v),
                 "kvcache unchecked": lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                                             causal=True, validate=False),
                 "kvcache checked": lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True),
                 "kvcache int length": lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lk, causal=True),
                 "kvcache NumPy lengths": lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=host_lengths,
                                                                                 causal=True)}
        for page in (16, 256):
            kp, vp, table = _paged_cache(k, v, page)
            cases[f"paged {page}"] = (lambda kp=kp, vp=vp, table=table: cuflash.attention_with_kvcache(
                q, kp, vp, cache_seqlens=lengths, causal=True, block_table=table, validate=False))
        # a decoding step: one new key a sequence appended after lk - 1 cached ones, then attended
        k_new, v_new = (x[:, :, -1:].copy() for x in (k, v))
        before, host_before = lengths - 1, host_lengths - 1
        cases["append unchecked"] = lambda: cuflash.attention_with_kvcache(
            q, k, v, k_new, v_new, cache_seqlens=before, causal=True, validate=False)
        cases["append NumPy lengths"] = lambda: cuflash.attention_with_kvcache(
            q, k, v, k_new, v_new, cache_seqlens=host_before, causal=True)
        cases["lengths upload"] = lambda: cp.asarray(host_lengths)
        for name, fn in cases.items():
            queued, host = timed(fn)
            print(f"{b:>3} {lk:>6} {d:>4} {name:26s} {queued:9.1f} {host:8.1f}", flush=True)


if __name__ == "__main__":
    main()
