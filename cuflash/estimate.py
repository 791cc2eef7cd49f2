"""Tile and IO estimator: what the tiled forward kernel avoids, in tiles and HBM bytes.

For one attention forward call it counts

* the (query tile, key tile) pairs the kernel visits, with the tile sizes the variant
  table gives this dtype and head dim on a GPU class (fewer under a causal mask: tiles
  wholly above the diagonal are skipped);
* the score entries a naive implementation materialises (``B * Hq * Lq * Lk``, causal
  or not) and their bytes;
* HBM bytes: naive attention reads Q, K, V and writes O, and writes the n x n scores
  S, reads them for the softmax, writes P and reads P for ``P V`` (the FlashAttention
  paper's accounting, scores in the input dtype); the tiled kernel reads each Q tile
  once, each visited K and V tile once per query tile (an upper bound: L2 may serve the
  repeats) and writes O and lse once;
* FLOPs of the two GEMMs over the allowed (query, key) pairs, and each method's
  arithmetic intensity (FLOP per HBM byte): far above the GPU's FLOP/byte balance
  point means compute-bound, below it memory-bound.

    >>> est = cuflash.estimate(lq=4096, lk=4096, d=64, dtype="float16", causal=True)
    >>> print(est.table())
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._dispatch.model import ITEMSIZE, SUPPORTED_ARCHES, head_bucket, smem_limit_for_arch
from ._dispatch.select import forward_variant, row_class
from .semantics import acc_itemsize

__all__ = ["estimate", "Estimate"]



@dataclass(frozen=True)
class Estimate:
    """The counts of :func:`estimate` (all for the whole call: every batch entry and head)."""

    batch: int
    heads_q: int
    heads_k: int
    lq: int
    lk: int
    d: int
    dv: int
    dtype: str
    causal: Optional[str]
    block_m: int                 # the kernel's query rows per tile
    block_n: int                 # the kernel's keys per tile
    tiles_total: int             # (query tile, key tile) pairs, all of them
    tiles_processed: int         # pairs the kernel visits
    allowed_pairs: int           # (query, key) pairs the mask allows
    naive_score_entries: int     # entries of the n x n scores a naive implementation stores
    naive_score_bytes: int
    naive_hbm_bytes: int
    flash_hbm_bytes: int
    flops: int                   # 2 * allowed_pairs * (d + dv) over all heads

    @property
    def naive_intensity(self) -> float:
        """FLOP per HBM byte of naive attention."""
        return self.flops / self.naive_hbm_bytes

    @property
    def flash_intensity(self) -> float:
        """FLOP per HBM byte of the tiled kernel (an upper bound on its bytes, so a lower bound here)."""
        return self.flops / self.flash_hbm_bytes

    def table(self) -> str:
        """A short human-readable report."""
        mib = 2.0**20
        mode = {None: "no mask", "top_left": "causal (top-left)", "bottom_right": "causal (bottom-right)"}[self.causal]
        rows = [
            f"problem        B={self.batch} Hq={self.heads_q} Hk={self.heads_k} Lq={self.lq} Lk={self.lk} "
            f"D={self.d} Dv={self.dv} {self.dtype}, {mode}",
            f"kernel tiles   {self.block_m} query rows x {self.block_n} keys",
            f"tiles          {self.tiles_processed:,} visited of {self.tiles_total:,} "
            f"({100 * self.tiles_processed / max(self.tiles_total, 1):.0f}%)",
            f"naive scores   {self.naive_score_entries:,} entries, {self.naive_score_bytes / mib:,.0f} MiB "
            "(the tiled kernel stores none)",
            f"HBM bytes      naive {self.naive_hbm_bytes / mib:,.1f} MiB, tiled <= {self.flash_hbm_bytes / mib:,.1f} MiB "
            f"({self.naive_hbm_bytes / self.flash_hbm_bytes:.1f}x fewer)",
            f"FLOPs          {self.flops / 1e9:,.1f} GFLOP (two GEMMs over the allowed pairs)",
            f"intensity      naive {self.naive_intensity:.1f} FLOP/byte, tiled >= {self.flash_intensity:.1f} FLOP/byte",
        ]
        return "\n".join(rows)


def _causal_offset(causal, lq: int, lk: int) -> Optional[int]:
    if causal in (False, None):
        return None
    return 0 if causal in (True, "top_left") else lk - lq


def estimate(*, lq: int, lk: int, d: int, dv: Optional[int] = None, dtype: str = "float16", causal=False,
             batch: int = 1, heads_q: int = 1, heads_k: Optional[int] = None, gpu: str = "sm_90") -> Estimate:
    """Tiles, score entries, HBM bytes and FLOPs of one forward call (see the module docstring).

    Parameters
    ----------
    lq, lk, d : int
        Query and key lengths, q/k head dim.
    dv : int, optional
        v head dim (default ``d``).
    dtype : {"float16", "bfloat16", "float32", "float64"}
    causal : False, True / "top_left", or "bottom_right"
    batch, heads_q, heads_k : int
        ``heads_k`` defaults to ``heads_q`` (no grouped-query attention).
    gpu : {"sm_80", "sm_86", "sm_89", "sm_90", "sm_120"}
        The GPU whose kernel and shared memory pick the tile (default sm_90: H100, H200, whose
        16-bit forward is the Hopper kernel).

    Returns
    -------
    Estimate
    """
    dv = d if dv is None else dv
    heads_k = heads_q if heads_k is None else heads_k
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(ITEMSIZE)}, got {dtype!r}")
    if gpu not in SUPPORTED_ARCHES:
        raise ValueError(f"gpu must be one of {', '.join(SUPPORTED_ARCHES)}, got {gpu!r}")
    for name, value in (("lq", lq), ("lk", lk), ("d", d), ("dv", dv), ("batch", batch), ("heads_q", heads_q),
                        ("heads_k", heads_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if heads_q % heads_k:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_k ({heads_k})")
    offset = _causal_offset(causal, lq, lk)
    mode = None if offset is None else ("top_left" if causal in (True, "top_left") else "bottom_right")
    head, band = head_bucket(max(d, dv)), offset is not None
    tile = forward_variant(dtype, head, band=band, vec=True, smem_limit=smem_limit_for_arch(gpu), cc=int(gpu[3:]),
                           rows=row_class(head, lk, band)).tile
    bm, bn = tile.block_m, tile.block_n
    m_tiles, n_tiles = -(-lq // bm), -(-lk // bn)

    processed = allowed = 0
    for i in range(m_tiles):              # the kernel's key-tile range per query tile (score_mod.cuh)
        row0, rows = i * bm, min(bm, lq - i * bm)
        if offset is None:
            processed += n_tiles
        else:
            last_key = row0 + rows - 1 + offset
            processed += 0 if last_key < 0 else min(n_tiles, last_key // bn + 1)
    if offset is None:
        allowed = lq * lk
    else:                                 # sum over rows of the keys j <= i + offset, j < lk
        allowed = sum(max(0, min(lk, i + offset + 1)) for i in range(lq))

    heads = batch * heads_q
    size = ITEMSIZE[dtype]
    inputs = (heads * lq * d + batch * heads_k * lk * (d + dv)) * size
    output = heads * lq * dv * size
    lse = heads * lq * acc_itemsize(dtype)
    scores = heads * lq * lk
    naive = inputs + output + 4 * scores * size       # S written, read; P written, read
    flash = heads * (lq * d * size + processed * bn * (d + dv) * size) + output + lse
    return Estimate(batch, heads_q, heads_k, lq, lk, d, dv, dtype, mode, bm, bn, m_tiles * n_tiles * heads, processed * heads,
                    allowed * heads, scores, scores * size, naive, flash, 2 * allowed * heads * (d + dv))
