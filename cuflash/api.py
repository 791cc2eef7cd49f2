"""Public entry points: attention, attention_forward, attention_backward, vjp."""
from __future__ import annotations

from typing import Any, Literal, Optional, Tuple, Union

import numpy as np

from . import options, reference
from ._dispatch import documents as _documents
from ._dispatch import masking as _masking
from ._dispatch import plan as _plan
from ._runtime.device import on_device
from .block_sparse import BlockLayout
from .semantics import acc_dtype

Causal = Union[bool, Literal["top_left", "bottom_right"]]

__all__ = ["attention", "attention_forward", "attention_backward", "vjp"]


def attention(q, k, v, *, causal: Causal = False, scale: Optional[float] = None, bias: Any = None,
              mask: Any = None, dropout_p: float = 0.0, seed: Optional[int] = None, window: Any = None,
              block_layout: Optional[BlockLayout] = None, precision: str = "highest",
              num_splits: Optional[int] = None, score_mod=None, mask_mod=None,
              dropout_origin: Tuple[int, int] = options.NO_ORIGIN):
    """Exact softmax attention, ``softmax(scale * q k^T) v``, computed tile by tile.

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, shape (..., Hq, Lq, D) or (Lq, D)
        Queries. float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64.
    k : array, shape (..., Hk, Lk, D) or (Lk, D)
        Keys, same dtype and leading dims as ``q``; ``Hq % Hk == 0`` (grouped-query
        attention: query head h reads key/value head ``h // (Hq // Hk)``).
    v : array, shape (..., Hk, Lk, Dv) or (Lk, Dv)
        Values. ``Dv`` may differ from ``D``; both are at most 256.
    causal : bool or {"top_left", "bottom_right"}
        ``True``/``"top_left"``: query i sees keys ``j <= i`` (like
        ``numpy.tril(ones((Lq, Lk)))``). ``"bottom_right"``: ``j <= i + Lk - Lq``
        (the diagonal ends at the last key, as in KV-cache decoding).
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    bias : array, optional
        Float array broadcastable to ``(..., Hq, Lq, Lk)`` (e.g. a pair bias
        ``(1, 1, Lq, Lk)`` or a key bias ``(B, 1, 1, Lk)``), added to the scaled
        scores: ``softmax(scale q k^T + bias)``. Read through strides (0 along
        broadcast axes), never expanded; read in q's dtype (another float dtype
        is converted: a copy of the bias's own shape). ``-inf`` entries act as a mask.
    mask : bool array, optional
        Broadcastable like ``bias``; True = attend (PyTorch SDPA's boolean
        ``attn_mask``). Key padding is ``(B, 1, 1, Lk)``.
    window : (left, right), optional
        Sliding window: query i attends keys ``i - left <= j <= i + right``
        (``None`` for an unbounded side); with ``causal`` the window follows its
        alignment and ``right`` is capped at the diagonal. Key tiles outside the
        band are skipped, so time scales with the window.
    dropout_p : float
        Dropout probability on the attention weights, in [0, 1). Kept weights
        are scaled by ``1 / (1 - dropout_p)``.
    seed : int, optional
        Dropout seed in [0, 2**64): the mask is a pure function of (seed,
        batch, head, query, key) (Philox4x32-10), so equal seeds give bitwise
        equal results and the backward regenerates the mask. None draws one.
    dropout_origin : (query, key) ints, optional
        Where this call's scores lie in the dropout mask: element (b, h, i, j) is
        dropped as the mask's (b, h, i + query, j + key) is, so a slice of a longer
        problem (a ring step's block, a chunk of queries) drops exactly what one call
        over the whole problem drops there. Default (0, 0). On the GPU ``key`` is a
        multiple of 4 (one Philox draw covers keys 4c..4c+3).
    block_layout : cuflash.BlockLayout, optional
        Block-sparse attention: (query block, key block) pairs that are off are
        never loaded.
    precision : {"highest", "tf32"}
        float32 only (ignored for other dtypes). "highest" (default): float32
        accuracy, the forward on TF32 tensor cores with split operands
        (3xTF32: a = big + small, three MMAs a product) where the GPU's shared
        memory fits a tile, else on CUDA-core FMA. "tf32": the forward on plain
        TF32 tensor cores (operands with 11 significant bits; relative error
        ~1e-3). The float32 backward takes the same precision: 3xTF32 or TF32
        tensor cores at head dims up to 128 where a tile fits, else the
        float32-accurate FMA kernels. NumPy inputs ignore it: they run the float64 reference (blocked
        online softmax) whatever the precision. Elements of magnitude 4e34 or
        more (and inf) of q, k, v and, in the backward, dout ("highest"; "tf32":
        q, and k and v in the backward) make the rows they
        reach NaN: the tensor-core split's a * (2^13 + 1) overflows there.
    num_splits : int, optional
        Split-KV forward: the keys are cut into this many ranges, each attended by its own thread
        blocks, and the partial results merged by their log-sum-exp (as :func:`merge_attention`),
        so that few long rows (decoding over a KV cache) still fill the GPU. None (default): split
        where the query blocks alone would leave most of the GPU idle; 1: never (blocks of a few
        query rows still take the decoding kernel, over one range, which writes the result itself).
        The result is the same up to rounding. Ignored by NumPy inputs.
    score_mod : cuflash.ScoreMod or a sequence of them, optional
        User modifications of each score (natural units, after the bias and before the softmax),
        CUDA source compiled into the kernels (:mod:`cuflash.mods`; library ones: ``cuflash.softcap``,
        ``cuflash.alibi``, ``cuflash.relative_position_bias``). Several apply in order.
    mask_mod : cuflash.MaskMod or a sequence of them, optional
        User masks over (batch, head, query, key) (``cuflash.document_mask``,
        ``cuflash.prefix_lm_mask``); every one has to allow a key, as do the other masking options.
        Blocks they hide entirely are skipped.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv), the input dtype.
        A query row that can see no key is 0.

    Notes
    -----
    CuPy inputs run the fused kernels on the current device and stream; the
    n x n score matrix is never stored. NumPy inputs run the NumPy blocked
    reference (float64 arithmetic). Strided inputs (e.g. ``x.swapaxes(-2, -3)``
    of ``(B, L, H, D)`` data) are used without copying when their last axis is
    unit-stride. Inputs are never modified.
    """
    if dropout_p and seed is None:
        seed = options.draw_seed()   # no backward will need it
    return attention_forward(q, k, v, causal=causal, scale=scale, bias=bias, mask=mask, dropout_p=dropout_p,
                             seed=seed, window=window, block_layout=block_layout, precision=precision,
                             num_splits=num_splits, score_mod=score_mod, mask_mod=mask_mod,
                             dropout_origin=dropout_origin)[0]


def attention_forward(q, k, v, *, causal: Causal = False, scale: Optional[float] = None,
                      bias: Any = None, mask: Any = None, dropout_p: float = 0.0,
                      seed: Optional[int] = None, window: Any = None,
                      block_layout: Optional[BlockLayout] = None,
                      precision: str = "highest", num_splits: Optional[int] = None, score_mod=None,
                      mask_mod=None, dropout_origin: Tuple[int, int] = options.NO_ORIGIN) -> Tuple[Any, Any]:
    """Attention output and the row logsumexp saved for the backward pass.

    Parameters are those of :func:`attention`, except that dropout needs an
    explicit ``seed`` here (the backward must regenerate the same mask; or use
    :func:`vjp`, which draws and keeps one).

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv), the input dtype.
    lse : array, shape (..., Hq, Lq), float32 (float64 for float64 inputs).
        Natural-log logsumexp over keys of the scaled, biased, modified, masked scores
        (before dropout); ``-inf`` for a row that can see no key.
    """
    call = options.forward_call(q, k, v, causal=causal, scale=scale, bias=bias, mask=mask, window=window,
                                dropout_p=dropout_p, seed=seed, block_layout=block_layout, precision=precision,
                                num_splits=num_splits, score_mod=score_mod, mask_mod=mask_mod,
                                dropout_origin=dropout_origin)
    p = call.problem
    if p.xp is np:
        return _forward_numpy(p, call.options, q.dtype)
    cupy = p.xp
    if p.lk == 0 or p.q.size == 0:
        with on_device(p.q.data.device_id):
            out = cupy.empty((p.batch, p.heads_q, p.lq, p.dv), dtype=q.dtype)
            lse = cupy.empty((p.batch, p.heads_q, p.lq), dtype=acc_dtype(p.dtype))
            out.view(cupy.uint8).fill(0)    # no keys: every row attends to nothing (zero bits are 0.0)
            lse.fill(-np.inf)
    else:
        packed = None if call.options.mods is None or num_splits is not None else _documents.forward(call, precision)
        out, lse = packed if packed is not None else _plan.forward(call, precision, num_splits)
        if call.signature is not None:   # 4-D inputs: out and lse have their shapes already
            return out, lse
    return _shaped(out, p.out_shape()), _shaped(lse, p.lse_shape())


def forward_in_accumulator(q, k, v, *, causal: Causal = False, scale: Optional[float] = None, bias: Any = None,
                           mask: Any = None, window: Any = None, dropout_p: float = 0.0, seed: Optional[int] = None,
                           dropout_origin: Tuple[int, int] = options.NO_ORIGIN,
                           precision: str = "highest") -> Tuple[Any, Any]:
    """:func:`attention_forward` with ``out`` in the accumulator dtype (float32, float64 for float64;
    the NumPy path's float64): a partial result to be merged with others before any rounding to 16
    bits (cuflash.distributed). 16-bit calls run the Hopper forward's float32-output twin where the call
    takes that kernel without an EXTRA option (bias, mask, dropout, block layout), else the portable
    forward's split-KV kernel over one split; float32 and float64 calls are plain forwards."""
    call = options.forward_call(q, k, v, causal=causal, scale=scale, bias=bias, mask=mask, window=window,
                                dropout_p=dropout_p, seed=seed, dropout_origin=dropout_origin, precision=precision)
    p = call.problem
    if p.xp is np:
        out, lse = reference.attention_blocked(p.q, p.k, p.v, causal=p.reference_causal, scale=p.scale,
                                               **_reference_kwargs(p, call.options))
        return out.reshape(p.out_shape()), lse.reshape(p.lse_shape())
    acc = acc_dtype(p.dtype)
    if p.lk == 0 or p.q.size == 0:
        with on_device(p.q.data.device_id):
            out = p.xp.zeros(p.out_shape(), dtype=acc)
            return out, p.xp.full(p.lse_shape(), -np.inf, dtype=acc)
    out, lse = _plan.forward(call, precision, None, accumulator_out=True)
    return _shaped(out, p.out_shape()), _shaped(lse, p.lse_shape())


def forward_with_key_lengths(q, k, v, key_lengths, *, causal: Causal = False, scale: Optional[float] = None,
                             window: Any = None, num_splits: Optional[int] = None,
                             page_table: Any = None, plans: Optional[list] = None) -> Tuple[Any, Any]:
    """:func:`attention_forward` of CuPy arrays where batch entry b attends only its first
    ``key_lengths[b]`` keys (an int32 CuPy array (B,), each at most Lk, checked by the caller), with
    ``causal="bottom_right"`` and ``window`` aligned to each entry's own last key (a KV cache of
    ragged lengths: cuflash.kvcache). Runs the split-KV kernels, which read the lengths.

    ``page_table`` (int32 CuPy array (B, pages_per_seq) of valid page indices, checked by the caller):
    k and v are a paged cache (num_pages, Hk, page_size, D), entry b's key j in row j % page_size of
    page ``page_table[b, j // page_size]``; the kernels read the pages in place (where the chosen
    kernel's loader cannot: ``_dispatch.plan.PagesNotReadInPlace``, a ValueError, and the caller
    gathers them instead). ``plans``: a list the forward plan run is appended to (``_dispatch.plan.forward``)."""
    xp = options.array_module(q)
    page_size = num_pages = 0
    if page_table is not None:
        page_size, num_pages = k.shape[2], k.shape[0]
        cap = page_table.shape[1] * page_size
        # The pages seen as (B, Hk, cap, D): validation and the params read the shape and the strides; the
        # batch stride (one page's) is what the kernels step by through the table.
        k, v = (xp.lib.stride_tricks.as_strided(x, shape=(q.shape[0], x.shape[1], cap, x.shape[3]), strides=x.strides)
                for x in (k, v))
    call = options.forward_call(q, k, v, causal=causal, scale=scale, window=window, num_splits=num_splits)
    p = call.problem
    if p.xp is np or type(key_lengths) is not p.xp.ndarray or np.dtype(key_lengths.dtype) != np.int32 \
            or key_lengths.shape != (p.batch,) or not key_lengths.flags.c_contiguous:
        raise TypeError("key lengths run on CuPy inputs, as a contiguous int32 CuPy array of shape (B,)")
    if page_table is not None and (np.dtype(page_table.dtype) != np.int32 or page_table.shape[0] != p.batch
                                   or not page_table.flags.c_contiguous):
        raise TypeError("a page table runs as a contiguous int32 CuPy array of shape (B, pages_per_seq)")
    if p.lk == 0 or p.q.size == 0:
        out = p.xp.zeros(p.out_shape(), dtype=q.dtype)
        return out, p.xp.full(p.lse_shape(), -np.inf, dtype=acc_dtype(p.dtype))
    out, lse = _plan.forward(call, "highest", num_splits, key_lengths=key_lengths, page_table=page_table,
                             page_size=page_size, num_pages=num_pages, plans=plans)
    return _shaped(out, p.out_shape()), _shaped(lse, p.lse_shape())


def _reference_kwargs(p: options.Problem, opts: options.Options) -> dict:
    """The options in the 4-D (B, H, L, D) frame of ``p.q``: leading dims merged into one."""
    kw = opts.reference_kwargs()
    for name in ("bias", "mask"):
        if kw[name] is not None:
            kw[name] = options.own_4d(kw[name], p)
    if opts.block_layout is not None:
        lay = opts.block_layout.layout
        lay = lay if isinstance(lay, np.ndarray) else lay.get()   # a CuPy layout for NumPy inputs
        kw["block_layout"] = BlockLayout(options.own_4d(lay, p), opts.block_layout.block_size)
    return kw


def _forward_numpy(p: options.Problem, opts: options.Options, dtype) -> Tuple[np.ndarray, np.ndarray]:
    out, lse = reference.attention_blocked(p.q, p.k, p.v, causal=p.reference_causal, scale=p.scale,
                                           **_reference_kwargs(p, opts))
    return (out.astype(dtype).reshape(p.out_shape()),
            lse.astype(acc_dtype(p.dtype)).reshape(p.lse_shape()))


def _shaped(x, shape: tuple):
    """``x`` with ``shape``: itself when it has it already (a reshape costs a microsecond a call)."""
    return x if x.shape == shape else x.reshape(shape)


def attention_backward(dout, q, k, v, out, lse, *, causal: Causal = False, scale: Optional[float] = None,
                       bias: Any = None, mask: Any = None, dropout_p: float = 0.0,
                       seed: Optional[int] = None, window: Any = None,
                       block_layout: Optional[BlockLayout] = None, precision: str = "highest",
                       deterministic: bool = False, bias_grad: bool = True, score_mod=None,
                       mask_mod=None, dropout_origin: Tuple[int, int] = options.NO_ORIGIN) -> Tuple[Any, ...]:
    """Gradients of ``sum(dout * attention(q, k, v))`` with respect to q, k, v (and the bias).

    The n x n probabilities are recomputed tile by tile from q, k and the saved
    ``lse``; extra memory is O(L * D).

    Parameters
    ----------
    dout : array, shape (..., Hq, Lq, Dv), q's dtype
        Gradient of the loss with respect to ``out``.
    q, k, v : arrays
        The forward inputs (see :func:`attention`).
    out, lse : arrays
        What :func:`attention_forward` returned for these inputs and options.
        ``lse`` may be any float dtype; it is read as float32 (float64 for float64).
    causal, scale, bias, mask, dropout_p, seed, window, block_layout, precision, score_mod, mask_mod,
    dropout_origin
        The options the forward pass used (they must match; with dropout, the
        same seed and origin). Each score modification needs its ``grad``.
    deterministic : bool
        False (default): dQ (and a bias gradient shared across batches or K/V
        heads) is summed with fp32/fp64 atomics, fast but the last bits may
        differ run to run. True: dQ is computed by a separate pass with a fixed
        summation order, and dbias contributions take turns in a fixed order;
        results are bitwise identical run to run, but for a trainable score
        modification's parameter gradient (e.g. the T5 table), summed with float
        atomics either way.
    bias_grad : bool
        With a bias: True (default) also returns dbias; False returns (dq, dk, dv) only, and the GPU
        kernels skip the bias gradient's work (a fixed bias, e.g. a float attention mask).

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtype of q, k, v.
        With grouped-query attention, dk and dv sum over the query heads that
        share a key/value head. Rows that attend to nothing contribute 0.
    dbias : array with exactly the bias's shape and dtype, only when ``bias`` is
        given and ``bias_grad``: dS summed over the axes the bias broadcasts along (in an fp32 /
        fp64 accumulator of the bias's own shape, never an n x n buffer per head).
        A bias constant along keys (last dim 1) gets exactly 0: it shifts every
        score of a row equally, which softmax ignores.
    param_grads : dict, only when a score modification has trainable parameters (``param_grads``):
        parameter name -> its gradient, with the parameter's shape and dtype.
    """
    call = options.backward_call(dout, q, k, v, out, lse, causal=causal, scale=scale, bias=bias, mask=mask,
                                 window=window, dropout_p=dropout_p, seed=seed, block_layout=block_layout,
                                 precision=precision, score_mod=score_mod, mask_mod=mask_mod,
                                 dropout_origin=dropout_origin)
    p, opts = call.problem, call.options
    dout4, out4, lse4 = call.backward_inputs
    trainable = opts.mods.trainable if opts.mods is not None else ()
    if p.xp is np:
        grads = reference.attention_backward_blocked(dout4, p.q, p.k, p.v, out4, lse4, causal=p.reference_causal,
                                                     scale=p.scale, **_reference_kwargs(p, opts))
        result = tuple(g.astype(x.dtype).reshape(x.shape) for g, x in zip(grads[:3], (q, k, v)))
        if bias is not None and bias_grad:
            result = result + (_masking.DbiasPlan(grads[3], {}, ()).result(p, opts),)
        if trainable:
            result = result + ({name: grads[-1][name].astype(m.params[name].dtype) for m, name in trainable},)
        return result
    cupy = p.xp
    dbias = None
    param_grads = {}
    if p.q.size == 0 or p.lk == 0:   # no queries, batches or heads (q is empty), or no keys
        with on_device(p.q.data.device_id):
            grads = tuple(cupy.zeros(x.shape, dtype=x.dtype) for x in (p.q, p.k, p.v))
            if bias is not None and bias_grad:
                dbias = cupy.zeros(bias.shape, dtype=bias.dtype)
            param_grads = {name: cupy.zeros(m.params[name].shape, dtype=m.params[name].dtype)
                           for m, name in trainable}
    else:
        packed = None if opts.mods is None else _documents.backward(call, dout4, out4, lse4, precision,
                                                                    bool(deterministic))
        if packed is not None:   # a document mask on the packed kernels: no bias, no trainable parameter
            (dq, dk, dv), dbias_plan, param_accs = packed, None, ()
        else:
            dq, dk, dv, dbias_plan, param_accs = _plan.backward(call, dout4, out4, lse4, precision,
                                                                bool(deterministic), bool(bias_grad))
        if call.signature is not None:   # 4-D inputs, no options: the gradients have their shapes already
            return dq, dk, dv
        grads = (dq, dk, dv)
        with on_device(p.q.data.device_id):
            if dbias_plan is not None:
                dbias = dbias_plan.result(p, opts)
            param_grads = {name: acc.astype(m.params[name].dtype, copy=False)
                           for (m, name), acc in zip(trainable, param_accs)}
    result = (_shaped(grads[0], q.shape), _shaped(grads[1], k.shape), _shaped(grads[2], v.shape))
    if bias is not None and bias_grad:
        result = result + (dbias,)
    return result + (param_grads,) if trainable else result


def vjp(q, k, v, *, deterministic: bool = False, **kwargs):
    """Forward pass plus a function that maps ``dout`` to ``(dq, dk, dv)``.

    Parameters
    ----------
    q, k, v : arrays, as for :func:`attention`.
    deterministic : bool
        Passed to :func:`attention_backward`.
    **kwargs
        causal, scale, bias, mask, dropout_p, seed, dropout_origin, window, block_layout, precision,
        score_mod, mask_mod, and num_splits (the forward's only). With ``dropout_p > 0`` and no ``seed``, one is drawn;
        it is kept for the backward and readable as ``vjp_fn.seed``.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv)
    vjp_fn : callable
        ``vjp_fn(dout) -> (dq, dk, dv)``, or ``(dq, dk, dv, dbias)`` with a bias, and the
        trainable parameters' gradients (a dict) last where a score modification has them;
        may be called any number of times. It holds references to q, k, v, the
        bias, mask, out and lse (not copies): do not modify them in place
        between the forward and the backward.
    """
    if kwargs.get("dropout_p") and kwargs.get("seed") is None:
        kwargs = dict(kwargs, seed=options.draw_seed())
    out, lse = attention_forward(q, k, v, **kwargs)
    kwargs.pop("num_splits", None)

    def vjp_fn(dout):
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kwargs)

    vjp_fn.seed = kwargs.get("seed")
    return out, vjp_fn
