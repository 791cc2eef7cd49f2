"""PyTorch adapter: cuflash attention as autograd-aware PyTorch operators.

    import cuflash.torch as ct
    out = ct.scaled_dot_product_attention(q, k, v, is_causal=True)            # SDPA's signature
    out = ct.flash_attn_func(q, k, v, causal=True, window_size=(256, 0))      # FlashAttention-2's

Tensors stay where they are: CUDA tensors run cuflash's kernels on PyTorch's current stream (the
arrays pass through DLPack, nothing is copied), CPU tensors run cuflash's NumPy path (float64
arithmetic). Both operators are ``torch.library`` custom ops (``cuflash::forward``,
``cuflash::backward``) with fake implementations and a registered autograd formula, so
``torch.compile`` keeps them in one graph as opaque calls.

Imported only on request (``import cuflash.torch``); it needs PyTorch >= 2.4.
"""
from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Tuple

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised where PyTorch is absent
    raise ImportError("cuflash.torch needs PyTorch (pip install torch); the rest of cuflash does not") from exc

import ml_dtypes
import numpy as np

from . import api, varlen
from . import kvcache as api_kvcache

__all__ = ["scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

_CAUSAL = {"none": False, "top_left": "top_left", "bottom_right": "bottom_right"}


# ----------------------------------------------------------------------------- arrays and streams

def _array(t: Optional[torch.Tensor]):
    """The tensor's memory as a CuPy array (CUDA) or a NumPy array (CPU), without a copy."""
    if t is None:
        return None
    t = t.detach()
    if t.is_cuda:
        import cupy

        return cupy.from_dlpack(t)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _tensor(x) -> torch.Tensor:
    """A CuPy or NumPy result as a tensor on its device, without a copy."""
    if isinstance(x, np.ndarray):
        if x.dtype == np.dtype(ml_dtypes.bfloat16):
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


@contextlib.contextmanager
def _on_stream_of(t: torch.Tensor):
    """CuPy's current device and stream made PyTorch's current ones for ``t``'s device."""
    if not t.is_cuda:
        yield
        return
    import cupy

    stream = torch.cuda.current_stream(t.device)
    with cupy.cuda.Device(t.device.index), cupy.cuda.ExternalStream(stream.cuda_stream, t.device.index):
        yield


def _options(bias, mask, causal: str, scale: float, window_left: int, window_right: int, dropout_p: float,
             seed: int, end_offset: int = 0) -> dict:
    """cuflash's options. A window comes as FlashAttention's, aligned to the bottom right (query i sees keys
    i + end_offset - left .. i + end_offset + right, end_offset = Lk - Lq); cuflash aligns a window without
    causal to the top left, so there its sides move by end_offset (NotImplementedError where one would
    turn negative: a window that does not hold its diagonal)."""
    window = None
    if window_left >= 0 or window_right >= 0:
        left, right = (None if window_left < 0 else window_left, None if window_right < 0 else window_right)
        if causal == "none" and end_offset:
            left = None if left is None else left - end_offset
            right = None if right is None else right + end_offset
            if min(x for x in (left, right, 0) if x is not None) < 0:
                raise NotImplementedError(f"window_size=({window_left}, {window_right}) without causal where "
                                          f"Lk - Lq = {end_offset}: a window past the diagonal is not in cuflash yet")
        window = (left, right)
    opts = dict(causal=_CAUSAL[causal], scale=scale, bias=_array(bias), mask=_array(mask), window=window)
    if dropout_p > 0:
        opts.update(dropout_p=float(dropout_p), seed=int(seed))
    return opts


def _end_offset(q: torch.Tensor, k: torch.Tensor) -> int:
    """Lk - Lq of (..., H, L, D) tensors (2-D: (L, D))."""
    return k.shape[-2] - q.shape[-2]


# ----------------------------------------------------------------------------- the custom ops

@torch.library.custom_op("cuflash::forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
             mask: Optional[torch.Tensor], causal: str, scale: float, window_left: int, window_right: int,
             dropout_p: float, seed: int, deterministic: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of cuflash.attention_forward; ``deterministic`` is the backward's."""
    with _on_stream_of(q):
        out, lse = api.attention_forward(_array(q), _array(k), _array(v),
                                         **_options(bias, mask, causal, scale, window_left, window_right,
                                                    dropout_p, seed, _end_offset(q, k)))
        return _tensor(out), _tensor(lse)


@_forward.register_fake
def _(q, k, v, bias, mask, causal, scale, window_left, window_right, dropout_p, seed, deterministic):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@torch.library.custom_op("cuflash::backward", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor], causal: str,
              scale: float, window_left: int, window_right: int, dropout_p: float, seed: int,
              deterministic: bool, want_dbias: bool) -> List[torch.Tensor]:
    """[dq, dk, dv] (and dbias where ``want_dbias``) of cuflash.attention_backward."""
    with _on_stream_of(q):
        grads = api.attention_backward(_array(dout), _array(q), _array(k), _array(v), _array(out), _array(lse),
                                       deterministic=deterministic, bias_grad=want_dbias,
                                       **_options(bias, mask, causal, scale, window_left, window_right, dropout_p,
                                                  seed, _end_offset(q, k)))
        return [_tensor(g) for g in grads]


@_backward.register_fake
def _(dout, q, k, v, out, lse, bias, mask, causal, scale, window_left, window_right, dropout_p, seed,
      deterministic, want_dbias):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    return grads + ([torch.empty_like(bias)] if want_dbias else [])


def _setup_context(ctx, inputs, output):
    """Both forward ops' inputs are (q, k, v, two tensors: bias and mask, or the offsets, then the options)."""
    q, k, v, extra_a, extra_b, causal, scale, window_left, window_right, dropout_p, seed, deterministic = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, extra_a, extra_b)
    ctx.options = (causal, scale, window_left, window_right, dropout_p, seed, deterministic)


def _grad(ctx, dout, dlse):
    q, k, v, out, lse, bias, mask = ctx.saved_tensors
    want_dbias = bias is not None and ctx.needs_input_grad[3]
    grads = torch.ops.cuflash.backward(dout, q, k, v, out, lse, bias, mask, *ctx.options, want_dbias)
    dbias = grads[3] if want_dbias else None
    return grads[0], grads[1], grads[2], dbias, None, None, None, None, None, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


def _seed(dropout_p: float) -> int:
    """A dropout seed from PyTorch's default generator (reproducible under torch.manual_seed), or 0."""
    return int(torch.randint(0, 2**62, (1,)).item()) if dropout_p else 0


# ----------------------------------------------------------------------------- public operators

def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on cuflash, with its autograd.

    Parameters
    ----------
    query : Tensor (..., Hq, Lq, D); key : (..., Hk, Lk, D); value : (..., Hk, Lk, Dv)
        float16, bfloat16, float32 or float64, on one CUDA device (the fused kernels) or on the
        CPU (cuflash's NumPy path).
    attn_mask : Tensor, optional
        Broadcastable to (..., Hq, Lq, Lk): bool (True = attend) or float, added to the scaled
        scores; a float mask that requires grad gets its gradient.
    dropout_p : float
        Dropout on the attention weights; the mask is drawn from PyTorch's generator's seed and
        regenerated in the backward.
    is_causal : bool
        ``torch.tril`` alignment (query i sees keys j <= i), as SDPA's.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    enable_gqa : bool
        Allow Hk < Hq (Hq a multiple of Hk); without it the head counts must match, as in SDPA.

    Returns
    -------
    Tensor (..., Hq, Lq, Dv) in the inputs' dtype.
    """
    hq, hk = query.shape[-3] if query.dim() >= 3 else 1, key.shape[-3] if key.dim() >= 3 else 1
    if hq != hk and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key {hk}: pass enable_gqa=True for grouped-query attention")
    bias = mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        else:
            bias = attn_mask
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return _forward(query, key, value, bias, mask, "top_left" if is_causal else "none", scale, -1, -1,
                    float(dropout_p), _seed(dropout_p), False)[0]


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False) -> torch.Tensor:
    """FlashAttention-2's ``flash_attn_func`` on cuflash, with its autograd.

    ``q (B, Lq, Hq, D)``, ``k (B, Lk, Hk, D)``, ``v (B, Lk, Hk, Dv)``; returns ``(B, Lq, Hq, Dv)``
    (contiguous, as FlashAttention's). ``causal`` aligns the diagonal to the bottom right (query
    i sees keys j <= i + Lk - Lq); ``window_size=(left, right)``, -1 for an unbounded side;
    ``deterministic`` for the backward. ``softcap``, ``alibi_slopes`` and ``return_attn_probs``
    raise NotImplementedError: this adapter passes no score modifications (``cuflash.attention`` takes
    ``score_mod=cuflash.softcap(cap)`` or ``cuflash.alibi(slopes)`` on CuPy arrays), and cuflash stores no
    probabilities.
    """
    if softcap:
        raise NotImplementedError("softcap: this adapter passes no score modifications; on CuPy arrays "
                                  "cuflash.attention(..., score_mod=cuflash.softcap(cap)) has it")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: this adapter passes no score modifications; on CuPy arrays "
                                  "cuflash.attention(..., score_mod=cuflash.alibi(slopes, offset=Lk - Lq)) has "
                                  "it")
    if return_attn_probs:
        raise NotImplementedError("return_attn_probs: cuflash never stores the attention probabilities")
    left, right = (int(w) for w in window_size)
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out = _forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None,
                   "bottom_right" if causal else "none", scale, left, right, float(dropout_p), _seed(dropout_p),
                   bool(deterministic))[0]
    return out.transpose(1, 2).contiguous()


def _varlen_options(causal: str, scale: float, window_left: int, window_right: int, dropout_p: float,
                    seed: int) -> dict:
    opts = _options(None, None, causal, scale, window_left, window_right, dropout_p, seed)
    del opts["bias"], opts["mask"]
    return opts


@torch.library.custom_op("cuflash::varlen_forward", mutates_args=())
def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, causal: str, scale: float, window_left: int, window_right: int,
                    dropout_p: float, seed: int, deterministic: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of cuflash.varlen.attention_varlen_forward on packed (total, H, D) tensors."""
    with _on_stream_of(q):
        out, lse = varlen.attention_varlen_forward(
            _array(q), _array(k), _array(v), _array(cu_seqlens_q), _array(cu_seqlens_k),
            **_varlen_options(causal, scale, window_left, window_right, dropout_p, seed))
        return _tensor(out), _tensor(lse)


@_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, dropout_p, seed, deterministic):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


@torch.library.custom_op("cuflash::varlen_backward", mutates_args=())
def _varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: str,
                     scale: float, window_left: int, window_right: int, dropout_p: float, seed: int,
                     deterministic: bool) -> List[torch.Tensor]:
    """[dq, dk, dv] of cuflash.varlen.attention_varlen_backward."""
    with _on_stream_of(q):
        grads = varlen.attention_varlen_backward(
            _array(dout), _array(q), _array(k), _array(v), _array(out), _array(lse), _array(cu_seqlens_q),
            _array(cu_seqlens_k), deterministic=deterministic,
            **_varlen_options(causal, scale, window_left, window_right, dropout_p, seed))
        return [_tensor(g) for g in grads]


@_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, dropout_p, seed,
      deterministic):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _varlen_grad(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.cuflash.varlen_backward(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_varlen_forward.register_autograd(_varlen_grad, setup_context=_setup_context)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table=None) -> torch.Tensor:
    """FlashAttention-2's ``flash_attn_varlen_func`` on cuflash (cuflash.varlen), with its autograd.

    ``q (total_q, Hq, D)``, ``k`` / ``v (total_k, Hk, D)`` packed back to back, ``cu_seqlens_q`` /
    ``cu_seqlens_k`` int32 offsets (B + 1,) (read on the host: on a CUDA device, one small copy a call);
    ``max_seqlen_q`` / ``max_seqlen_k`` are checked against the offsets. ``causal`` aligns each sequence's
    diagonal to its bottom right; ``window_size=(left, right)``, -1 for an unbounded side. Returns
    ``(total_q, Hq, Dv)``. ``softcap``, ``alibi_slopes``, ``return_attn_probs`` and ``block_table`` raise
    NotImplementedError naming what is missing.
    """
    if softcap:
        raise NotImplementedError("softcap: this adapter passes no score modifications; on CuPy arrays "
                                  "cuflash.varlen.attention_varlen(..., score_mod=cuflash.softcap(cap)) has it")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: this adapter passes no score modifications; on CuPy arrays "
                                  "cuflash.varlen.attention_varlen(..., score_mod=cuflash.alibi(slopes)) has it, "
                                  "positions counted from each sequence's first")
    if return_attn_probs:
        raise NotImplementedError("return_attn_probs: cuflash never stores the attention probabilities")
    if block_table is not None:
        raise NotImplementedError("block_table: packed sequences from a paged cache are not in cuflash yet")
    for name, cu, limit in (("max_seqlen_q", cu_seqlens_q, max_seqlen_q), ("max_seqlen_k", cu_seqlens_k, max_seqlen_k)):
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        if longest > int(limit):
            raise ValueError(f"{name}={limit} but a sequence has {longest} rows")
    left, right = (int(w) for w in window_size)
    if not causal and (left >= 0 or right >= 0) and not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("window_size without causal over sequences whose query and key counts differ: "
                                  "a window aligned to each sequence's end is not in cuflash.varlen yet")
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, "bottom_right" if causal else "none", scale, left,
                           right, float(dropout_p), _seed(dropout_p), bool(deterministic))[0]


@torch.library.custom_op("cuflash::with_kvcache", mutates_args=("k_cache", "v_cache"))
def _with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                  v: Optional[torch.Tensor], cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                  scale: float, causal: bool, window_left: int, window_right: int,
                  num_splits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of cuflash.attention_with_kvcache on (B, H, L, D) views; appends into the caches."""
    window = None
    if window_left >= 0 or window_right >= 0:
        window = (None if window_left < 0 else window_left, None if window_right < 0 else window_right)
    with _on_stream_of(q):
        out, lse = api_kvcache.attention_with_kvcache(
            _array(q), _array(k_cache), _array(v_cache), _array(k), _array(v), cache_seqlens=_array(cache_seqlens),
            causal=causal, window=window, scale=scale, num_splits=num_splits or None, return_lse=True,
            block_table=_array(block_table))
        return _tensor(out), _tensor(lse)


@_with_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal, window_left, window_right, num_splits):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[:-1] + v_cache.shape[-1:]), q.new_empty(q.shape[:-1], dtype=lse_dtype)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes=None, num_splits: int = 0,
                            return_softmax_lse: bool = False):
    """FlashAttention-2's ``flash_attn_with_kvcache`` on cuflash (forward only, as FlashAttention's).

    ``q (B, Lq, Hq, D)``, caches ``(B, Lcap, Hk, D)`` written in place at ``cache_seqlens[b] ...``
    with ``k`` / ``v (B, Lnew, Hk, D)``; ``cache_seqlens`` an int or an int tensor (B,); ``causal`` and
    ``window_size`` aligned to each sequence's own end; a paged cache ``(num_pages, page_size, Hk, D)``
    with ``block_table (B, max_pages)`` (read in place in 16 bits, gathered otherwise: cuflash.attention_with_kvcache).
    Returns ``(B, Lq, Hq, Dv)`` (and the lse ``(B, Hq, Lq)`` with ``return_softmax_lse``). Rotary
    embeddings, ``cache_batch_idx``, ``cache_leftpad``, ``softcap`` and ``alibi_slopes`` raise
    NotImplementedError naming what is missing.
    """
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx),
                        ("cache_leftpad", cache_leftpad), ("alibi_slopes", alibi_slopes)):
        if value is not None:
            raise NotImplementedError(f"{name}: not in cuflash yet")
    if softcap:
        raise NotImplementedError("softcap: cuflash.attention_with_kvcache takes no score modifications")
    if cache_seqlens is None:
        cache_seqlens = 0
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    left, right = (int(w) for w in window_size)
    out, lse = _with_kvcache(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                             None if k is None else k.transpose(1, 2), None if v is None else v.transpose(1, 2),
                             cache_seqlens, block_table, scale, bool(causal), left, right, int(num_splits))
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
