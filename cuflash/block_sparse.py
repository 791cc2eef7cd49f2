"""Block-sparse attention layouts (the FlashAttention paper's block-sparse attention).

A :class:`BlockLayout` says, per (query block, key block), whether the block is
computed at all. Blocks that are off are never loaded, so time scales with the
density. Pass one as ``cuflash.attention(..., block_layout=layout)``; it combines
with ``causal``, ``window`` and ``mask`` (a pair is attended only if every one of
them allows it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

__all__ = ["BlockLayout"]

BLOCK_MULTIPLE = 16
"""Block sizes are multiples of this (the kernels' smallest tile edge)."""


def _check_block_size(block_size) -> Tuple[int, int]:
    if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool):
        block_size = (int(block_size), int(block_size))
    try:
        bq, bk = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be an int or a pair of ints, got {block_size!r}") from None
    for b in (bq, bk):
        if b < BLOCK_MULTIPLE or b % BLOCK_MULTIPLE:
            raise ValueError(f"block sizes must be positive multiples of {BLOCK_MULTIPLE}, got {block_size!r}")
    return bq, bk


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockLayout:
    """Which (query block, key block) pairs attention computes.

    Parameters
    ----------
    layout : bool array, shape (..., n_query_blocks, n_key_blocks)
        True where the block is computed. Its leading dims broadcast against the
        scores' ``(..., Hq)`` (e.g. ``(nQ, nK)`` for all batches and heads, or
        ``(Hq, nQ, nK)`` per head). NumPy or CuPy (converted to the inputs'
        library when used).
    block_size : int or (int, int)
        Query rows and keys per block, multiples of 16 (e.g. 64 or 128); the
        last block of each axis may be partial: ``n_query_blocks =
        ceil(Lq / block_q)``, ``n_key_blocks = ceil(Lk / block_k)``.
    """

    layout: Any
    block_size: Tuple[int, int]

    def __post_init__(self):
        object.__setattr__(self, "block_size", _check_block_size(self.block_size))
        if getattr(self.layout, "ndim", 0) < 2 or np.dtype(self.layout.dtype) != np.bool_:
            raise TypeError("layout must be a bool array of shape (..., n_query_blocks, n_key_blocks), got "
                            f"{getattr(self.layout, 'dtype', type(self.layout).__name__)} "
                            f"{getattr(self.layout, 'shape', '')}")

    def blocks(self, lq: int, lk: int) -> Tuple[int, int]:
        """(n_query_blocks, n_key_blocks) for sequence lengths ``lq``, ``lk``."""
        return _ceil_div(lq, self.block_size[0]), _ceil_div(lk, self.block_size[1])

    @property
    def density(self) -> float:
        """The fraction of blocks that are on (over the layout as given)."""
        return float(self.layout.sum()) / max(1, self.layout.size)

    @classmethod
    def from_mask(cls, mask, block_size) -> "BlockLayout":
        """The blocks of a dense boolean mask ``(..., Lq, Lk)`` that hold any True.

        Use it to skip whole blocks of a sparse mask: pass both
        ``mask=mask, block_layout=BlockLayout.from_mask(mask, 64)`` (the kernels
        also derive this summary from ``mask`` by themselves, so this is mostly
        for inspection and for reusing one layout across calls).
        """
        bq, bk = _check_block_size(block_size)
        xp = _xp(mask)
        lq, lk = mask.shape[-2:]
        nq, nk = _ceil_div(lq, bq), _ceil_div(lk, bk)
        padded = xp.zeros(mask.shape[:-2] + (nq * bq, nk * bk), dtype=bool)
        padded[..., :lq, :lk] = mask
        blocks = padded.reshape(mask.shape[:-2] + (nq, bq, nk, bk)).any(axis=(-3, -1))
        return cls(blocks, (bq, bk))

    @classmethod
    def from_rule(cls, lq: int, lk: int, block_size, *, local: Optional[int] = None, global_blocks: int = 0,
                  stride: Optional[int] = None, causal: bool = False, xp=np) -> "BlockLayout":
        """A sparse-transformer style layout: local + global + strided blocks.

        Parameters
        ----------
        lq, lk : int
            Sequence lengths.
        block_size : int or (int, int)
        local : int, optional
            Query block i attends key blocks j with ``|i - j| <= local``.
        global_blocks : int
            The first ``global_blocks`` key blocks are attended by every query
            block, and the first ``global_blocks`` query blocks attend every key block.
        stride : int, optional
            Key blocks j with ``(j + 1) % stride == 0`` are attended by every query block.
        causal : bool
            Also drop blocks entirely above the diagonal (key block start > query block end).
        xp : module
            numpy (default) or cupy: where the layout lives.
        """
        bq, bk = _check_block_size(block_size)
        nq, nk = _ceil_div(lq, bq), _ceil_div(lk, bk)
        i = np.arange(nq)[:, None]
        j = np.arange(nk)[None, :]
        on = np.zeros((nq, nk), dtype=bool)
        if local is not None:
            # blocks whose centres are within `local` blocks, in units of the key blocks
            on |= np.abs((i * bq) // bk - j) <= local
        if global_blocks:
            on |= (j < global_blocks) | (i < global_blocks)
        if stride:
            on |= (j + 1) % stride == 0
        if causal:
            on &= j * bk <= (i + 1) * bq - 1
        return cls(xp.asarray(on), (bq, bk))


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)
