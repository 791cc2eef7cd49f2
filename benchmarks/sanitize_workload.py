"""A small forward + backward workload of every dtype, for compute-sanitizer.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python benchmarks/sanitize_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/sanitize_workload.py --quick
    compute-sanitizer --tool racecheck python benchmarks/sanitize_workload.py --quick --dims 256 --dtypes float16
    compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/sanitize_workload.py --hopper-extra
    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize_workload.py --hopper-extra \
        --dtypes float32
    compute-sanitizer --tool synccheck --error-exitcode 1 python benchmarks/sanitize_workload.py --hopper-persistent
    compute-sanitizer --tool initcheck --error-exitcode 1 python benchmarks/sanitize_workload.py --split

Odd lengths at the tile edges (Lq = 97, Lk = 130), grouped-query heads, both dQ
strategies; the full set also covers both causal alignments, unaligned head dims
and the two-pass head-dim-128 backward. ``--hopper-extra``: only forwards that take the
Hopper kernel with its masking options on compute capability 9.0 (Lk = 1032: past head
dim 64's key threshold, bias rows in 16-byte chunks; a bias, key padding, dropout and a
block layout whose first query rows see nothing; a bias broadcast over rows with an odd
key count, whose last float pair the sequence end cuts). ``--portable``: the portable kernels
(mma.sync / DMMA / TF32) even on an H100, e.g. the 16-bit dK/dV kernel of flash_bwd_mma.cu. ``--dtypes float32`` with it: the
float32 Hopper forward (flash_fwd_wgmma_tf32.cu, head dims 64 and 128, both precisions).
``--split``: the split-KV forward (decoding shapes: one to 16 query rows over odd key counts, packed
grouped-query heads, one split writing out itself, more splits than key tiles, masking options) and a backward
from its result, and
a KV cache of ragged lengths (0 included) with an append, contiguous and as shuffled pages of 16
(``--kvcache``: that cache part alone). ``--varlen``: packed sequences (cuflash.varlen: empty, one-row and
keyless sequences, more keys than queries and fewer; first sequences of equal lengths, which run the dense
kernels), the forward's packed kernel (the Hopper one for 16-bit rows at head dims 40-256) for every
causal mode and a window, and a backward. ``--mods``: user score and mask modifications (cuflash.mods:
softcap, ALiBi, the trainable relative-position table, a modification evaluated everywhere that reads
arrays by position, document and prefix-LM masks, composed with a bias, a window and dropout; ALiBi alone under a causal band, which the
16-bit Hopper kernels add in a tensor-core step), forward and backward, Hopper and portable.
``--documents``: document masks of runs (documents back to back, one of a single position) on the packed
kernels, (B, H, L, D) and (B, L, H, D) memory, causal, none and a window, both dQ strategies.
``--partials``: the forward in float32 (cuflash.api.forward_in_accumulator: the 16-bit Hopper forward's
float32-output twin at head dims 64, 128 and 256) and a two-rank ring over threads on one GPU
(cuflash.distributed.ThreadRing: causal zigzag, a window), forward and backward.
Prints one line per call (with the kernels it launched) so a sanitizer report can be placed.
"""
import argparse
import itertools

import ml_dtypes
import numpy as np

import cupy as cp

import cuflash

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="head dims 64, 128 and 256 (the Hopper forward), "
                                                                 "bottom-right causal only")
    parser.add_argument("--dims", default=None, help="only these head dims, e.g. 256 (one kernel under a sanitizer)")
    parser.add_argument("--dtypes", default=None, help="only these dtypes, e.g. float16,bfloat16")
    parser.add_argument("--hopper-extra", action="store_true", help="the Hopper forward with masking options only")
    parser.add_argument("--hopper-dbias", action="store_true",
                        help="the Hopper backward forming dbias itself, every bias broadcast shape")
    parser.add_argument("--hopper-persistent", action="store_true",
                        help="the Hopper forward's persistent CTAs, three of them walking every query block")
    parser.add_argument("--split", action="store_true", help="the split-KV forward and its combine kernel")
    parser.add_argument("--kvcache", action="store_true",
                        help="only the KV cache part of --split (ragged lengths, contiguous and paged)")
    parser.add_argument("--varlen", action="store_true", help="packed sequences (cuflash.varlen)")
    parser.add_argument("--mods", action="store_true", help="user score and mask modifications (cuflash.mods)")
    parser.add_argument("--mod-kinds", default="score,mask,every,positions,linear",
                        help="with --mods: these calls only (score, mask, every, positions, linear)")
    parser.add_argument("--documents", action="store_true",
                        help="document masks of runs (cuflash.document_mask) on the packed kernels")
    parser.add_argument("--partials", action="store_true",
                        help="forwards in float32 (the ring's partial results) and a ring of two threads")
    parser.add_argument("--portable", action="store_true",
                        help="the kernels a GPU without sm_90a runs (the portable path, also on an H100)")
    args = parser.parse_args(argv)
    if args.portable:   # as bench.py's "cuflash sm80" contender
        from cuflash._runtime import device
        device.compute_capability = lambda: 80
    if args.hopper_extra:
        hopper_extra(args.dtypes.split(",") if args.dtypes else ["float16", "bfloat16"])
        return
    if args.hopper_dbias:
        hopper_dbias()
        return
    if args.hopper_persistent:
        hopper_persistent(args.dtypes.split(",") if args.dtypes else ["float16", "bfloat16"])
        return
    if args.varlen:
        packed_sequences(args.dtypes.split(",") if args.dtypes else ["float16", "bfloat16", "float32"])
        return
    if args.partials:
        partials(args.dtypes.split(",") if args.dtypes else ["float16", "bfloat16"])
        return
    if args.mods:
        modifications(args.dtypes.split(",") if args.dtypes else list(DTYPES),
                      tuple(int(d) for d in args.dims.split(",")) if args.dims else (64, 128), args.mod_kinds.split(","))
        return
    if args.documents:
        documents(args.dtypes.split(",") if args.dtypes else list(DTYPES),
                  tuple(int(d) for d in args.dims.split(",")) if args.dims else (64, 128))
        return
    if args.split or args.kvcache:
        dtypes = args.dtypes.split(",") if args.dtypes else list(DTYPES)
        if args.split:
            split_kv(dtypes)
        kv_cache(dtypes)
        return
    dims = (64, 128, 256) if args.quick else (40, 64, 111, 128, 256)
    if args.dims:
        dims = tuple(int(d) for d in args.dims.split(","))
    dtypes = args.dtypes.split(",") if args.dtypes else list(DTYPES)
    modes = ("bottom_right",) if args.quick else (False, "bottom_right")
    rng = np.random.default_rng(0)
    for dtype, d, causal, det, masked in itertools.product(dtypes, dims, modes, (False, True), (False, True)):
        lq, lk = (77, 133) if d == 40 else (97, 130)   # head dim 40: rows of 80 bytes, odd lengths both
        mask = np.ones((2, 1, 1, lk), dtype=bool)
        mask[0, ..., 90:] = False
        q, do = (cp.asarray(rng.standard_normal((2, 2, lq, d)).astype(DTYPES[dtype])) for _ in range(2))
        k, v = (cp.asarray(rng.standard_normal((2, 1, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
        opts = {}
        if masked:   # every EXTRA piece at once; the bias is shared by the batch (dbias atomics or turns)
            opts = dict(bias=cp.asarray(rng.standard_normal((1, 2, lq, lk)).astype(DTYPES[dtype])),
                        mask=cp.asarray(mask), window=(60, 20), dropout_p=0.2, seed=11, dropout_origin=(5, 12),
                        block_layout=cuflash.BlockLayout.from_rule(lq, lk, 32, local=1, global_blocks=1))
        out, lse = cuflash.attention_forward(q, k, v, causal=causal, **opts)
        grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=det, **opts)
        cp.cuda.Device().synchronize()
        finite = all(bool(cp.isfinite(x.astype(cp.float64)).all()) for x in (out,) + grads)
        print(f"{dtype:8} d={d:3} causal={causal!s:12} deterministic={det!s:5} masked={masked!s:5} finite={finite}",
              flush=True)


def _record(entry, helpers: list = None):
    """Record what each launch ran (``entry(variant, grid)``) through cuflash's one launch function. The
    helper kernels that make block states and layout spans are not variants: their names go to ``helpers``."""
    from cuflash._runtime import launch

    real = launch.launch_kernel

    def record(variant, params, grid, *a):
        if hasattr(variant, "family"):
            entry(variant, grid)
        elif helpers is not None:
            helpers.append(variant.name)
        real(variant, params, grid, *a)

    launch.launch_kernel = record


def hopper_extra(dtypes) -> None:
    launched = []
    _record(lambda variant, grid: launched.append(variant.family))
    rng = np.random.default_rng(0)
    lq, lk = 197, 1032
    mask = np.ones((2, 1, 1, lk), dtype=bool)
    mask[0, ..., lk - 300:] = False
    layout = np.ones((2, -(-lq // 64), -(-lk // 64)), dtype=bool)
    layout[0, :4] = False                     # head 0: no key for query rows 0-196 (Q never loaded)
    layout[1, :, 3] = False
    runs = [(dtype, d, causal, precision) for dtype in dtypes
            for d in ((64, 128) if dtype == "float32" else (64, 128, 256))   # the float32 kernel's head dims
            for causal in (False, "bottom_right")
            for precision in (("highest", "tf32") if dtype == "float32" else ("highest",))]
    for dtype, d, causal, precision in runs:
        q = cp.asarray(rng.standard_normal((2, 2, lq, d)).astype(DTYPES[dtype]))
        k, v = (cp.asarray(rng.standard_normal((2, 1, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
        cases = {"bias": dict(bias=cp.asarray(rng.standard_normal((1, 2, lq, lk)).astype(DTYPES[dtype]))),
                 "key bias, dropout": dict(bias=cp.asarray(rng.standard_normal((2, 1, 1, lk)).astype(DTYPES[dtype])),
                                           dropout_p=0.2, seed=5),
                 "all": dict(bias=cp.asarray(rng.standard_normal((1, 1, lq, lk)).astype(DTYPES[dtype])),
                             mask=cp.asarray(mask), dropout_p=0.2, seed=11,
                             block_layout=cuflash.BlockLayout(cp.asarray(layout), 64))}
        # (1, 1, 1, lk - 1): every stride 0, so 16-byte chunks whatever the key count
        odd = dict(bias=cp.asarray(rng.standard_normal((1, 1, 1, lk - 1)).astype(DTYPES[dtype])))
        prec = dict(precision=precision) if dtype == "float32" else {}
        for name, opts in [*cases.items(), ("row bias, odd keys", odd)]:
            keys = slice(0, lk - 1) if name == "row bias, odd keys" else slice(None)
            launched.clear()
            out, lse = cuflash.attention_forward(q, k[:, :, keys], v[:, :, keys], causal=causal, **opts, **prec)
            cp.cuda.Device().synchronize()
            finite = bool(cp.isfinite(out.astype(cp.float32)).all())
            print(f"{dtype:8} d={d:3} causal={causal!s:12} {precision:7} {name:18} {','.join(launched)} "
                  f"finite={finite}", flush=True)



def _split_launches() -> list:
    """A list that collects each launch's family ("/split" after a split-KV partial kernel's, "/f32-out"
    after the Hopper forward's float32-output twin's)."""
    launched = []
    _record(lambda variant, grid: launched.append(variant.family + ("/split" if variant.kv_split else "")
                                                  + ("/f32-out" if variant.acc_out else "")))
    return launched


def _all_finite(arrays) -> bool:
    return all(bool(cp.isfinite(x.astype(cp.float64)).all()) for x in arrays)


def partials(dtypes) -> None:
    from cuflash import distributed as dist

    launched = _split_launches()
    rng = np.random.default_rng(0)
    for dtype, d, band in itertools.product(dtypes, (64, 128, 256), ({}, {"causal": True}, {"window": (70, 30)})):
        q = cp.asarray(rng.standard_normal((2, 4, 197, d)).astype(DTYPES[dtype]))
        k, v = (cp.asarray(rng.standard_normal((2, 2, 333, d)).astype(DTYPES[dtype])) for _ in range(2))
        launched.clear()
        out, lse = cuflash.api.forward_in_accumulator(q, k, v, **band)
        cp.cuda.Device().synchronize()
        print(f"{dtype:8} d={d:3} {band} {','.join(launched)} finite={_all_finite((out,))}", flush=True)
    for dtype, window in itertools.product(dtypes, (None, (90, None))):
        q, k, v, do = (cp.asarray(rng.standard_normal((1, 4, 397, 64)).astype(DTYPES[dtype])) for _ in range(4))

        def rank_work(comm):
            mine = [dist.shard(x, comm.rank, comm.size, "zigzag") for x in (q, k, v, do)]
            out, vjp_fn = dist.ring_vjp(*mine[:3], comm, causal=True, window=window)
            return (out, *vjp_fn(mine[3]))

        results = dist.ThreadRing.run(rank_work, dist.ThreadRing.create(2))
        cp.cuda.Device().synchronize()
        print(f"{dtype:8} ring of 2 threads window={window} finite={_all_finite([x for r in results for x in r])}",
              flush=True)


def split_kv(dtypes) -> None:
    launched = _split_launches()
    rng = np.random.default_rng(0)
    for dtype, d, (lq, hq, splits, masked) in itertools.product(
            dtypes, (40, 64, 128), ((1, 8, None, False), (1, 8, 1, False), (3, 4, 5, False), (16, 4, 64, False),
                                     (2, 4, 7, True))):
        lk = 1333
        q = cp.asarray(rng.standard_normal((2, hq, lq, d)).astype(DTYPES[dtype]))
        k, v = (cp.asarray(rng.standard_normal((2, 2, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
        opts = {}
        if masked:
            mask = np.ones((2, 1, 1, lk), dtype=bool)
            mask[0, ..., 500:] = False
            opts = dict(bias=cp.asarray(rng.standard_normal((1, hq, lq, lk)).astype(DTYPES[dtype])),
                        mask=cp.asarray(mask), dropout_p=0.2, seed=7)
        launched.clear()
        out, lse = cuflash.attention_forward(q, k, v, causal="bottom_right", num_splits=splits, **opts)
        do = cp.asarray(rng.standard_normal(out.shape).astype(DTYPES[dtype]))
        grads = cuflash.attention_backward(do, q, k, v, out, lse, causal="bottom_right", **opts)
        cp.cuda.Device().synchronize()
        print(f"{dtype:8} d={d:3} lq={lq:2} hq={hq} splits={splits!s:4} masked={masked!s:5} "
              f"{','.join(launched[:2])} finite={_all_finite((out,) + grads)}", flush=True)


def kv_cache(dtypes) -> None:
    """A KV cache of ragged lengths (0 included), one, three or sixteen new keys appended (three: 4 query heads
    of 3 rows under the causal band in one strip; sixteen: 64 such rows): the kernels read the lengths."""
    launched = _split_launches()
    rng = np.random.default_rng(1)
    for dtype, d, lq in itertools.product(dtypes, (64, 128), (1, 3, 16)):
        q = cp.asarray(rng.standard_normal((3, 8, lq, d)).astype(DTYPES[dtype]))
        k, v = (cp.asarray(rng.standard_normal((3, 2, 3000, d)).astype(DTYPES[dtype])) for _ in range(2))
        new_k, new_v = (cp.asarray(rng.standard_normal((3, 2, lq, d)).astype(DTYPES[dtype])) for _ in range(2))
        lengths = [0, 777, 3000 - lq]
        launched.clear()
        out = cuflash.attention_with_kvcache(q, k, v, new_k, new_v, cache_seqlens=cp.asarray(lengths), causal=True)
        # a paged cache: 188 pages of 16 in shuffled order (the decoding kernel reads them in place)
        page_table = cp.asarray(rng.permutation(3 * 188).reshape(3, 188).astype(np.int32))
        k_pages, v_pages = (cp.zeros((3 * 188, 2, 16, d), dtype=DTYPES[dtype]) for _ in range(2))
        out_paged = cuflash.attention_with_kvcache(q, k_pages, v_pages, new_k, new_v, causal=True,
                                                   cache_seqlens=cp.asarray(lengths), block_table=page_table)
        cp.cuda.Device().synchronize()
        print(f"{dtype:8} d={d:3} lq={lq} kv cache {','.join(launched[:2])} finite={_all_finite((out, out_paged))}",
              flush=True)


def packed_sequences(dtypes) -> None:
    """Packed sequences of ragged lengths (cuflash.varlen), forward and backward."""
    from cuflash import varlen

    launched = []
    _record(lambda variant, grid: launched.append(variant.family + ("/packed" if variant.packed else "")))
    rng = np.random.default_rng(2)
    ragged = [300, 1, 0, 33, 65, 7], [250, 1, 5, 0, 64, 131]
    equal = [97] * 3, [130] * 3   # equal lengths: the dense kernels writing the packed outputs and gradients
    for dtype, (lq, lk), d, (causal, window) in itertools.product(
            dtypes, (equal, ragged), (40, 64, 128, 256),
            ((False, None), (True, None), ("bottom_right", None), ("bottom_right", (30, 4)))):
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
        q = cp.asarray(rng.standard_normal((int(cu_q[-1]), 4, d)).astype(DTYPES[dtype]))
        k, v = (cp.asarray(rng.standard_normal((int(cu_k[-1]), 2, d)).astype(DTYPES[dtype])) for _ in range(2))
        launched.clear()
        out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, window=window)
        first = launched[0]
        grads = varlen.attention_varlen_backward(cp.ones_like(out), q, k, v, out, lse, cu_q, cu_k, causal=causal,
                                                 window=window)
        cp.cuda.Device().synchronize()
        print(f"{dtype:8} d={d:3} causal={causal!s:12} window={window!s:8} {first} "
              f"finite={_all_finite((out,) + grads)}", flush=True)


def modifications(dtypes, dims, kinds) -> None:
    """User modifications (cuflash.mods) through every scoring kernel: forward and backward (both dQ
    strategies), the mask modification's block-state kernel, the trainable table's atomics."""
    launched = []
    _record(lambda variant, grid: launched.append(variant.family + ("/linear" if "CUF_LINEAR_BIAS 1" in variant.prelude
                                                                    else "")), helpers=launched)
    rng = np.random.default_rng(3)
    lq, lk, hq = 97, 130, 4
    doc = cp.asarray(np.sort(rng.integers(0, 3, (2, lk)), axis=1).astype(np.int32))
    slopes = cp.asarray(np.geomspace(0.5, 0.05, hq).astype(np.float32))
    # "positions": arrays of exactly lq / lk elements indexed by the position, evaluated everywhere
    positions = cuflash.ScoreMod("score + acc_t(row_bias[q_idx]) - acc_t(key_bias[kv_idx])", grad="acc_t(1)",
                                 everywhere=True, params={"row_bias": cp.ones(lq, cp.float32),
                                                          "key_bias": cp.ones(lk, cp.float32)})
    for dtype, d, det, kind in itertools.product(dtypes, dims, (False, True),
                                                 kinds):
        table = cp.asarray(rng.standard_normal((32, hq)).astype(np.float64 if dtype == "float64" else np.float32))
        q, do = (cp.asarray(rng.standard_normal((2, hq, lq, d)).astype(DTYPES[dtype])) for _ in range(2))
        k, v = (cp.asarray(rng.standard_normal((2, 2, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
        opts = {"score": dict(score_mod=(cuflash.softcap(5.0), cuflash.relative_position_bias(table, max_distance=40))),
                "mask": dict(mask_mod=(cuflash.document_mask(doc), cuflash.prefix_lm_mask(cp.asarray([9, 50], cp.int32)))),
                "every": dict(score_mod=(cuflash.alibi(slopes), cuflash.softcap(5.0)), mask_mod=cuflash.document_mask(doc),
                              bias=cp.asarray(rng.standard_normal((1, hq, lq, lk)).astype(DTYPES[dtype])),
                              window=(60, 20), dropout_p=0.2, seed=11),
                "positions": dict(score_mod=positions),
                "linear": dict(score_mod=cuflash.alibi(slopes), window=(60, 0))}[kind]
        launched.clear()
        out, lse = cuflash.attention_forward(q, k, v, causal=kind != "mask", **opts)
        grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=kind != "mask", deterministic=det, **opts)
        cp.cuda.Device().synchronize()
        arrays = (out,) + tuple(g for g in grads if not isinstance(g, dict)) + tuple(
            x for g in grads if isinstance(g, dict) for x in g.values())
        print(f"{dtype:8} d={d:3} deterministic={det!s:5} {kind:9} {','.join(dict.fromkeys(launched))} "
              f"finite={_all_finite(arrays)}", flush=True)


def documents(dtypes, dims) -> None:
    """Document masks of runs on the packed kernels, forward and backward (both dQ strategies), the arrays
    in (B, H, L, D) and in (B, L, H, D) memory."""
    launched = []
    _record(lambda variant, grid: launched.append(variant.family + ("/packed" if variant.packed else "")))
    rng = np.random.default_rng(4)
    b, hq, hk, n = 2, 4, 2, 203
    ids = np.zeros((b, n), np.int32)
    ids[0, 70:], ids[0, 190:], ids[0, 202:], ids[1, 129:] = 1, 2, 3, 1
    mask = cuflash.document_mask(cp.asarray(ids))

    def array(shape, dtype, token_major):
        x = rng.standard_normal((shape[0], shape[2], shape[1], shape[3]) if token_major else shape)
        x = cp.asarray(x.astype(DTYPES[dtype]))
        return x.transpose(0, 2, 1, 3) if token_major else x

    for dtype, d, tm, det, (causal, window) in itertools.product(
            dtypes, dims, (False, True), (False, True), ((True, None), (False, None), (False, (30, 4)))):
        q, do = (array((b, hq, n, d), dtype, tm) for _ in range(2))
        k, v = (array((b, hk, n, d), dtype, tm) for _ in range(2))
        launched.clear()
        out, lse = cuflash.attention_forward(q, k, v, causal=causal, window=window, mask_mod=mask)
        grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, window=window, mask_mod=mask,
                                           deterministic=det)
        cp.cuda.Device().synchronize()
        print(f"{dtype:8} d={d:3} token_major={tm!s:5} deterministic={det!s:5} causal={causal!s:5} "
              f"window={window!s:7} {','.join(dict.fromkeys(launched))} finite={_all_finite((out,) + grads)}",
              flush=True)


def hopper_persistent(dtypes) -> None:
    """Forwards on the Hopper kernel's persistent variants (head dims 64 and 128) with three CTAs, so
    that each walks many query blocks (its stage ring, Q barriers and O staging tile reused), causal
    ones forced onto that grid too (head dim 128 taking its blocks from the block queue, 64 striding):
    bottom-right with Lq > Lk leaves whole blocks without a key."""
    from cuflash._dispatch import model, select
    from cuflash._runtime import device

    facts = device.device_facts
    device.device_facts = lambda device_id: facts(device_id)[:3] + (3,)
    select.schedule_for = lambda v: ("block" if not model.walkable(v)
                                     else "queue" if v.band and v.tile.warps == 12 else "stride")
    select.clear_selection_caches()
    launched = []
    _record(lambda variant, grid: launched.append((variant.family, variant.schedule, grid)))
    rng = np.random.default_rng(2)
    for dtype, d, causal, (lq, lk) in itertools.product(dtypes, (64, 128), (False, "bottom_right"),
                                                        ((700, 4130), (4400, 4130))):
        q = cp.asarray(rng.standard_normal((1, 2, lq, d)).astype(DTYPES[dtype]))
        k, v = (cp.asarray(rng.standard_normal((1, 1, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
        launched.clear()
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)
        cp.cuda.Device().synchronize()
        finite = bool(cp.isfinite(out.astype(cp.float32)).all())
        print(f"{dtype:8} d={d:3} causal={causal!s:12} lq={lq} lk={lk} {launched} finite={finite}", flush=True)


def hopper_dbias() -> None:
    """Backwards whose Hopper dK/dV kernel adds dbias itself (bias_grad_t.cuh): key-major vector reductions
    at the Lq / Lk edges (197 queries: a padded row pitch; 1032 keys: a cut key block), one-row sums with
    two query heads a K/V head, d = 64 and 128."""
    launched = []
    _record(lambda variant, grid: launched.append(variant))
    rng = np.random.default_rng(1)
    lq, lk = 197, 1032
    for dtype, d, causal in itertools.product(("float16", "bfloat16"), (64, 128), (False, "bottom_right")):
        q, do = (cp.asarray(rng.standard_normal((2, 2, lq, d)).astype(DTYPES[dtype])) for _ in range(2))
        k, v = (cp.asarray(rng.standard_normal((2, 1, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
        for shape in ((1, 1, lq, lk), (2, 2, lq, lk), (2, 1, 1, lk), (lk,)):
            bias = cp.asarray(rng.standard_normal(shape).astype(DTYPES[dtype]))
            out, lse = cuflash.attention_forward(q, k, v, causal=causal, bias=bias)
            launched.clear()
            grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, bias=bias)
            cp.cuda.Device().synchronize()
            finite = all(bool(cp.isfinite(x.astype(cp.float32)).all()) for x in grads)
            hopper = [x.dbias for x in launched if x.family == "bwd_dkdv_wgmma"]
            print(f"{dtype:8} d={d:3} causal={causal!s:12} bias={shape!s:18} hopper dbias={hopper} finite={finite}",
                  flush=True)

if __name__ == "__main__":
    main()
