"""User score and mask modifications, compiled into the kernels at run time.

A :class:`ScoreMod` rewrites each score before the softmax; a :class:`MaskMod` decides which keys a
query sees. Both are CUDA source over one element's coordinates, compiled by NVRTC into the
attention kernels (once per modification and kernel variant, then cached on disk like every kernel;
a new sequence length never recompiles)::

    softcap = cuflash.ScoreMod("cap * tanh(score / cap)",
                               grad="1 - tanh(score / cap) * tanh(score / cap)", params={"cap": 30.0},
                               python=lambda score, b, h, q_idx, kv_idx, cap: cap * np.tanh(score / cap))
    out = cuflash.attention(q, k, v, causal=True, score_mod=softcap)

Scores are in natural units (unless ``log2_units``): ``score = scale * q . k + bias`` (the number softmax
exponentiates).
The source sees ``score`` (type ``acc_t``: float, double for float64 inputs), the element's batch
entry ``b``, query head ``h``, query row ``q_idx`` and key ``kv_idx`` (int), a score modification also
``rel_pos`` (``kv_idx - q_idx`` as ``acc_t``, exact below 2^24; the forwards form it with one add an element
where ``acc_t(kv_idx - q_idx)`` would convert an integer), and each parameter by its name. It is an
expression, or a body with ``return``. Parameters are Python numbers (floats arrive as ``acc_t``, ints as
``int``) or C-contiguous arrays on the inputs' device, indexed flat
(``const float* slopes``: ``slopes[h]``); ``consts`` are numbers compiled into the source (one build a
value, nothing read in the kernel's loop). ``log2_units=True`` gives a score modification scores in log2
units (``score * log2(e)``, the kernels' own) and saves two multiplies an element. ``everywhere=True`` says
the source may run at masked positions too: the forwards without per-element tests then evaluate it with no
branch an element, and a value of ``b`` and ``h`` alone (``slopes[h]``) is read once a tile, not once an
element. ``cuf_tanh(x)`` is tanh (the special-function unit's approximation for float16 / bfloat16 inputs,
where its 2^-11 relative error is below their rounding).

Several score modifications apply in order (``score_mod=(a, b)``: b(a(score))); several mask
modifications all have to allow a key. A score modification may return ``-inf`` to mask; a mask
modification also makes the kernels skip blocks it hides entirely (its block states are computed on
the GPU once per modification, shape and parameter arrays, and cached).

The backward needs ``grad``, the derivative of the modification with respect to ``score`` (same
variables). A parameter array may be trainable: ``param_grads={"table": (index, derivative)}``, C
expressions giving the flat index of the element the score depends on and the derivative with respect
to it; :func:`cuflash.attention_backward` then returns those gradients in a dict.

NumPy inputs (and the tests' reference) evaluate the ``python`` twins instead: NumPy functions of
``(score, b, h, q_idx, kv_idx, **params)`` over broadcast index arrays.
"""
from __future__ import annotations

import copy
import hashlib
import keyword
import math
import numbers
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

__all__ = ["ScoreMod", "MaskMod", "softcap", "alibi", "relative_position_bias", "document_mask", "prefix_lm_mask",
           "MAX_PARAM_SLOTS"]

MAX_PARAM_SLOTS = 16
"""Parameter words a call's modifications may use together (MaskParams::mod_args): one a number or
an array, two a trainable array (it and its gradient)."""

_LN2, _LOG2E = math.log(2.0), 1.0 / math.log(2.0)
_FLOAT_MIN, _FLOAT_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = {"score", "b", "h", "q_idx", "kv_idx", "rel_pos", "acc_t", "cuf_args"}
# C++ keywords and the CUDA types a generated declaration names: not usable as a parameter's name
_CXX_WORDS = frozenset("""alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t char32_t
class compl const const_cast constexpr continue decltype default delete do double dynamic_cast else enum explicit
export extern false float for friend goto if inline int long mutable namespace new noexcept not not_eq nullptr operator
or or_eq private protected public register reinterpret_cast return short signed sizeof static static_assert
static_cast struct switch template this thread_local throw true try typedef typeid typename union unsigned using
virtual void volatile wchar_t while xor xor_eq half float2 float4 int2 int4 dim3 threadIdx blockIdx blockDim
gridDim warpSize""".split())
_ARRAY_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.int32): "int",
                np.dtype(np.int64): "long long", np.dtype(np.int8): "signed char", np.dtype(np.uint8): "unsigned char",
                np.dtype(np.bool_): "bool"}


def _body(source: str) -> str:
    """A C++ function body from an expression or a body with ``return``."""
    text = source.strip()
    if re.search(r"\breturn\b", text):
        return text
    return f"return ({text});"


def _check_source(source, what: str) -> str:
    if not isinstance(source, str) or not source.strip():
        raise TypeError(f"{what} must be a non-empty string of CUDA source, got {source!r}")
    if "#" in source:
        raise ValueError(f"{what}: preprocessor directives are not allowed in a modification's source")
    return source


def _check_params(params, what: str = "parameter") -> Dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict of name -> number or array, got {type(params).__name__}")
    out = {}
    for name, value in params.items():
        if not isinstance(name, str) or not _IDENT.match(name) or keyword.iskeyword(name) or name in _RESERVED \
                or name in _CXX_WORDS or name.lower().startswith("cuf_"):
            raise ValueError(f"{what} name {name!r} is not usable: a C identifier, not a C++ keyword or CUDA "
                             f"built-in, not one of {sorted(_RESERVED)}, not starting with cuf_")
        if isinstance(value, (bool, np.bool_)):
            value = int(value)
        if isinstance(value, numbers.Integral):
            if not -2**31 <= int(value) < 2**31:
                raise ValueError(f"{what} {name!r}: an int {what} must fit in 32 bits, got {value}")
            out[name] = int(value)
        elif isinstance(value, numbers.Real):
            if not math.isfinite(float(value)):
                raise ValueError(f"{what} {name!r} must be finite, got {value}")
            out[name] = float(value)
        elif hasattr(value, "dtype") and hasattr(value, "shape"):
            if np.dtype(value.dtype) not in _ARRAY_TYPES:
                raise TypeError(f"parameter {name!r}: array dtype {value.dtype} not supported "
                                f"({', '.join(str(d) for d in _ARRAY_TYPES)})")
            if not value.flags.c_contiguous:
                raise ValueError(f"parameter {name!r} must be C-contiguous (the source indexes it flat)")
            out[name] = value
        else:
            raise TypeError(f"{what} {name!r} must be a number or an array, got {type(value).__name__}")
    return out


def _check_consts(consts, params) -> Dict[str, Any]:
    """Compile-time numbers: name -> int (32 bits) or finite float, names usable as parameters' are and not
    taken by a parameter."""
    if consts is None:
        return {}
    if not isinstance(consts, dict):
        raise TypeError(f"consts must be a dict of name -> number, got {type(consts).__name__}")
    out = _check_params(consts, "const")
    for name, value in out.items():
        if _is_array(value):
            raise TypeError(f"const {name!r} must be a Python number (arrays are params)")
        if name in params:
            raise ValueError(f"{name!r} is both a parameter and a const")
        if isinstance(value, float) and value != 0 and not _FLOAT_MIN <= abs(value) <= _FLOAT_MAX:
            raise ValueError(f"const {name!r} = {value!r} does not fit a float (the source's acc_t for 16-bit and "
                             f"float32 inputs): 0 or {_FLOAT_MIN:.3g} <= |value| <= {_FLOAT_MAX:.3g}")
    return out


def _check_scales(scales) -> Optional[Tuple[float, float]]:
    """ScoreMod's ``scales`` as two floats, or None."""
    if scales is None:
        return None
    try:
        a, c = scales
    except (TypeError, ValueError):
        raise TypeError(f"scales must be a pair (a, c) of numbers, got {scales!r}") from None
    for name, v in (("a", a), ("c", c)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"scales: {name} must be a finite number > 0, got {v!r}")
    return float(a), float(c)


def _scaled(factor: float, expr: str) -> str:
    """C source of ``factor * expr`` (``expr`` where the factor is 1)."""
    return expr if factor == 1.0 else f"A({_literal(factor)}) * {expr}"


def _literal(value) -> str:
    """A C++ literal of an int or a finite float, exact (repr round-trips a double)."""
    return str(value) if isinstance(value, int) else repr(float(value))


def _is_array(x) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape")


class _Mod:
    """What score and mask modifications share: source, parameters, the NumPy twin."""

    kind = ""
    # The shapes a call needs of parameter arrays, name -> dims of ints, "B" (the batch) or "Hq" (query
    # heads); checked before any launch (cuflash.options.check_mods): the kernels index them unchecked.
    param_shapes: Dict[str, tuple] = {}

    def __init__(self, source: str, params, python, name: Optional[str], consts=None):
        self.source = _check_source(source, f"{self.kind} source")
        self.params = _check_params(params)
        self.consts = _check_consts(consts, self.params)
        if python is not None and not callable(python):
            raise TypeError(f"python must be a callable NumPy twin, got {type(python).__name__}")
        self.python = python
        self.name = name or self.kind

    def _signature(self) -> tuple:
        """What the generated source depends on: sources, parameter kinds (not values) and the consts' values."""
        kinds = tuple((n, str(np.dtype(v.dtype)) if _is_array(v) else type(v).__name__)
                      for n, v in self.params.items())
        return (type(self).__name__, self.source, kinds, tuple((n, _literal(v)) for n, v in self.consts.items()))

    def _locals(self, slot0: int, grads: dict) -> Tuple[str, int]:
        """The C declarations of this modification's parameters from the words at ``slot0``, and the
        number of words taken."""
        lines, slot = [], slot0
        for name, value in self.params.items():
            if _is_array(value):
                ctype = _ARRAY_TYPES[np.dtype(value.dtype)]
                lines.append(f"const {ctype}* {name} = reinterpret_cast<const {ctype}*>(cuf_args[{slot}]);")
                slot += 1
                if name in grads:
                    lines.append(f"acc_t* {name}_grad = reinterpret_cast<acc_t*>(cuf_args[{slot}]);")
                    slot += 1
            elif isinstance(value, int):
                lines.append(f"const int {name} = int(cuf_args[{slot}]);")
                slot += 1
            else:
                lines.append(f"const acc_t {name} = cuf_scalar<acc_t>(cuf_args[{slot}]);")
                slot += 1
        for name, value in self.consts.items():   # compiled in: no parameter word, no register to hold it
            ctype = "int" if isinstance(value, int) else "acc_t"
            lines.append(f"constexpr {ctype} {name} = {ctype}({_literal(value)});")
        lines += [f"(void){n};" for n in list(self.params) + list(self.consts)]   # names the source does not use
        return "\n    ".join(lines), slot - slot0

    def on(self, xp):
        """A copy of this modification with its parameter arrays in ``xp`` (numpy or cupy, the current
        device): the same source, so the same builds."""
        other = copy.copy(self)
        other.params = {n: xp.asarray(v.get() if xp is np and hasattr(v, "get") else v) if _is_array(v) else v
                        for n, v in self.params.items()}
        return other

    def twin_args(self, xp) -> dict:
        """The parameters for the NumPy twin, as arrays of ``xp``, and the consts."""
        out = dict(self.consts)
        for name, value in self.params.items():
            if _is_array(value):
                value = value.get() if xp is np and hasattr(value, "get") else xp.asarray(value)
            out[name] = value
        return out

    def _twin(self):
        if self.python is None:
            raise ValueError(f"{self.name}: NumPy inputs and the reference need the modification's NumPy twin "
                             "(python=...)")
        return self.python


class ScoreMod(_Mod):
    """A modification of each score before the softmax, in CUDA source (see the module's docstring).

    Parameters
    ----------
    source : str
        An expression (or a body with ``return``) of type ``acc_t`` over ``score`` (natural units, or log2
        units with ``log2_units``),
        ``b``, ``h``, ``q_idx``, ``kv_idx``, ``rel_pos`` (``kv_idx - q_idx`` as ``acc_t``) and the parameters.
        ``-inf`` masks the element.
    grad : str, optional
        Its derivative with respect to ``score``, same variables; needed by the backward.
    params : dict, optional
        name -> Python number or C-contiguous array (float32, float64, int32, int64, int8, uint8,
        bool) on the inputs' device.
    consts : dict, optional
        name -> Python number compiled into the source as a literal (``acc_t`` for a float, ``int``):
        no parameter word and no register to hold it, and the compiler folds it, at the cost of one build
        per value (where a value changes from call to call, make it a parameter).
    log2_units : bool, optional
        The source (and ``grad``, ``param_grads`` and the NumPy twins) sees and returns scores in log2 units,
        ``score * log2(e)``, as the kernels hold them: no conversion a score around this modification.
        ``grad`` is the same in either unit; a trainable parameter's derivative is that of the log2-unit
        value.
    everywhere : bool, optional
        The source (and ``grad``) may run at every position of a tile a kernel forms, masked ones included;
        their results are dropped there, and ``q_idx`` / ``kv_idx`` are clamped into the sequences (a tile's
        rows and keys past the end take the last one). The kernels then evaluate it without a branch an
        element, so that a value that depends on ``b`` and ``h`` only (``slopes[h]``) is read once a tile, not
        once an element. Give it to a source that reads nothing out of bounds for any (q_idx, kv_idx) pair in
        the sequences. It takes effect where every score modification of a call has it, in the forwards without
        per-element mask tests and the Hopper dK/dV kernel (score modifications alone; the portable backwards
        keep a branch an element, where the unconditional derivative chain spilled registers). A source whose
        loads depend on the position (a table looked up by distance) gains nothing from it: its loads stay one
        an element, and unconditional ones hold more registers.
    scales : (float, float), optional
        ``(a, c)``, both finite and > 0: the modification is ``c * f(a * score)`` where ``source`` is ``f``
        (and ``grad`` its derivative ``f'``, the twins ``f`` and ``f'``, at f's own input ``a * score``).
        The forwards fold ``a`` into the scale they already multiply each score by and hand ``c`` to the
        softmax's exponential (for the first and the last modification of a call), two multiplies an element
        fewer: ``softcap`` is ``cuf_tanh`` with ``scales=(1 / c, c)``. Not with ``param_grads``.
    param_grads : dict, optional
        name of a float32 / float64 array parameter -> (index, derivative): C expressions (same
        variables) of the flat index of the element the score depends on and the derivative of the
        modification with respect to it. The backward returns the gradient of such parameters.
    python, python_grad : callable, optional
        NumPy twins of ``source`` and ``grad``: ``f(score, b, h, q_idx, kv_idx, **params, **consts)``.
    python_param_grads : dict, optional
        name -> NumPy twin returning (flat index, derivative) arrays.
    name : str, optional
        Shown in errors.
    """

    kind = "score_mod"

    def __init__(self, source: str, *, grad: Optional[str] = None, params: Optional[dict] = None,
                 param_grads: Optional[dict] = None, python: Optional[Callable] = None,
                 python_grad: Optional[Callable] = None, python_param_grads: Optional[dict] = None,
                 name: Optional[str] = None, consts: Optional[dict] = None, log2_units: bool = False,
                 everywhere: bool = False, scales: Optional[Tuple[float, float]] = None):
        super().__init__(source, params, python, name, consts)
        self.scales = _check_scales(scales)
        if self.scales is not None and param_grads:
            raise ValueError(f"{self.name}: scales do not combine with param_grads")
        for flag, value in (("log2_units", log2_units), ("everywhere", everywhere)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
        self.log2_units = bool(log2_units)
        self.everywhere = bool(everywhere)
        self.grad = None if grad is None else _check_source(grad, "score_mod grad")
        self.param_grads = {}
        for pname, spec in (param_grads or {}).items():
            value = self.params.get(pname)
            if value is None or not _is_array(value) or np.dtype(value.dtype).kind != "f":
                raise ValueError(f"param_grads[{pname!r}]: not a float array parameter of this modification")
            try:
                index, deriv = spec
            except (TypeError, ValueError):
                raise TypeError(f"param_grads[{pname!r}] must be (index source, derivative source)") from None
            self.param_grads[pname] = (_check_source(index, "param_grads index"),
                                       _check_source(deriv, "param_grads derivative"))
        self.python_grad = python_grad
        self.python_param_grads = dict(python_param_grads or {})
        # The library's linear biases (alibi): a C expression of the slope in log2 units a unit of
        # kv_idx - q_idx where every visible key is at or before its query (Mods.linear_prelude).
        self.linear_slope: Optional[str] = None

    @property
    def slots(self) -> int:
        return len(self.params) + len(self.param_grads)

    @property
    def light(self) -> bool:
        """Evaluated everywhere and reading no integer position (``q_idx``, ``kv_idx``) and no trainable
        parameter: a float or two an element (``rel_pos``, ``b``, ``h`` and parameters allowed). One such
        modification alone keeps the Hopper forward's widest tile (with_mods in cuflash._dispatch.select)."""
        text = self.source + (self.grad or "")
        return self.everywhere and not self.param_grads and not re.search(r"\b(q_idx|kv_idx)\b", text)

    def _signature(self) -> tuple:
        return super()._signature() + (self.grad, tuple(sorted(self.param_grads.items())), self.log2_units,
                                       self.everywhere, self.scales, self.linear_slope)

    def cuda(self, i: int, slot0: int) -> str:
        """The device functions of modification ``i`` (its value, derivative, parameter gradients)."""
        decl, _ = self._locals(slot0, self.param_grads)
        head = ("template <typename acc_t>\n__device__ __forceinline__ {ret} cuf_{what}_{i}(acc_t score, int b, int h, "
                "int q_idx, int kv_idx, acc_t rel_pos, const unsigned long long* cuf_args{extra}) {{\n    {decl}\n"
                "    (void)score; (void)b; (void)h; (void)q_idx; (void)kv_idx; (void)rel_pos;\n"
                "#line 1 \"{label}\"\n{body}\n}}\n")
        label = f"{self.name}"
        parts = [head.format(ret="acc_t", what="score", i=i, extra="", decl=decl, label=label,
                             body=_body(self.source))]
        grad = self.grad if self.grad is not None else "cuf_no_grad()"
        parts.append(head.format(ret="acc_t", what="grad", i=i, extra="", decl=decl, label=label + " grad",
                                 body=_body(grad)))
        adds = []
        for pname, (index, deriv) in self.param_grads.items():
            adds.append(f"cuf_atomic_add({pname}_grad + (long long)({index}), acc_t({deriv}) * cuf_upstream);")
        parts.append(head.format(ret="void", what="param_grads", i=i, extra=", acc_t cuf_upstream", decl=decl,
                                 label=label + " param_grads", body="\n".join(adds) if adds else "(void)cuf_upstream;"))
        return "".join(parts)

    def apply_numpy(self, s, b, h, q, kv, xp):
        """The NumPy twin at natural-unit scores ``s`` (with ``log2_units`` the twin's units on either side;
        with ``scales`` (a, c), c times the twin at a times the score)."""
        a, c = self.scales or (1.0, 1.0)
        if self.log2_units:
            return c * self._twin()(a * (s * _LOG2E), b, h, q, kv, **self.twin_args(xp)) * _LN2
        return c * self._twin()(a * s, b, h, q, kv, **self.twin_args(xp))

    def grad_numpy(self, s, b, h, q, kv, xp):
        """The derivative's twin at natural-unit scores ``s`` (a ratio of scores: the same in either unit)."""
        if self.python_grad is None:
            raise ValueError(f"{self.name}: the backward of NumPy inputs needs python_grad")
        a, c = self.scales or (1.0, 1.0)
        return a * c * self.python_grad(a * (s * _LOG2E if self.log2_units else s), b, h, q, kv,
                                        **self.twin_args(xp))

    def param_grad_numpy(self, name: str, s, b, h, q, kv, xp):
        """(flat index, derivative of the natural-unit modified score) of trainable ``name`` at natural-unit
        scores ``s``, from its twin."""
        twin = self.python_param_grads.get(name)
        if twin is None:
            raise ValueError(f"{self.name}: the backward of NumPy inputs needs python_param_grads[{name!r}]")
        if self.log2_units:
            index, deriv = twin(s * _LOG2E, b, h, q, kv, **self.twin_args(xp))
            return index, deriv * _LN2
        return twin(s, b, h, q, kv, **self.twin_args(xp))


class MaskMod(_Mod):
    """Which keys a query sees, in CUDA source; true = attend.

    Parameters
    ----------
    source : str
        A bool expression, or a body in braces that returns one, over ``b`` (the batch index, leading dims
        flattened), ``h`` (the query head), ``q_idx``, ``kv_idx`` (ints), the parameters and the consts.
    params : dict, optional
        name -> int, float or C-contiguous array (float32 / float64 / int8 / uint8 / int32 / int64 / bool, on
        the inputs' device), passed at launch: a new value builds nothing.
    python : callable, optional
        Its NumPy twin ``f(b, h, q_idx, kv_idx, **params, **consts)`` over broadcast index arrays, for NumPy
        inputs and the reference.
    name : str, optional
        Named in build errors and messages.
    consts : dict, optional
        name -> int or float compiled into the source as a literal (one build per value).

    Blocks of keys the mask hides for every query of a block are skipped (their state is built on the GPU
    once per modification and shape, cuflash._dispatch.masking); changing a parameter array in place after a
    call leaves that state stale: pass a new MaskMod."""

    kind = "mask_mod"
    documents: Optional["DocumentRuns"] = None   # document_mask's documents (read by the dispatch)

    def __init__(self, source: str, *, params: Optional[dict] = None, python: Optional[Callable] = None,
                 name: Optional[str] = None, consts: Optional[dict] = None):
        super().__init__(source, params, python, name, consts)

    @property
    def slots(self) -> int:
        return len(self.params)

    def cuda(self, i: int, slot0: int) -> str:
        decl, _ = self._locals(slot0, {})
        return ("__device__ __forceinline__ bool cuf_mask_{i}(int b, int h, int q_idx, int kv_idx, "
                "const unsigned long long* cuf_args) {{\n    typedef float acc_t;\n    {decl}\n    (void)b; (void)h; "
                "(void)q_idx; (void)kv_idx;\n#line 1 \"{label}\"\n{body}\n}}\n").format(
                    i=i, decl=decl, label=self.name, body=_body(self.source))

    @property
    def reads_batch(self) -> bool:
        return bool(re.search(r"\bb\b", self.source))

    @property
    def reads_head(self) -> bool:
        return bool(re.search(r"\bh\b", self.source))

    def apply_numpy(self, b, h, q, kv, xp):
        return self._twin()(b, h, q, kv, **self.twin_args(xp))


_HELPERS = r"""
template <typename A> __device__ __forceinline__ A cuf_scalar(unsigned long long w);
template <> __device__ __forceinline__ float cuf_scalar<float>(unsigned long long w) { return __int_as_float(int(unsigned(w))); }
template <> __device__ __forceinline__ double cuf_scalar<double>(unsigned long long w) { return __longlong_as_double((long long)w); }
__device__ __forceinline__ float cuf_tanh(float x) {
#if CUF_FAST_SPECIAL
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return tanhf(x);
#endif
}
__device__ __forceinline__ double cuf_tanh(double x) { return tanh(x); }
// A score between log2 units (x = s log2 e, as the kernels hold scores) and natural units (s).
#define CUF_LN2 0.6931471805599453094
#define CUF_LOG2E 1.4426950408889634074
template <typename A> __device__ __forceinline__ A cuf_to_natural(A x) { return x * A(CUF_LN2); }
template <typename A> __device__ __forceinline__ A cuf_to_log2(A s) { return s * A(CUF_LOG2E); }
// A trainable parameter's gradient: the lanes of a warp adding into one element sum their parts first and
// one of them adds. T5's buckets: every lane of a far-off tile adds into one element, summed in five steps
// (the sum over the peers one at a time took 32 shuffles an element: T5's fwd+bwd 36.6 ms, this 27.3; bench_mods).
template <typename A>
__device__ __forceinline__ void cuf_atomic_add(A* at, A x) {
    const unsigned active = __activemask();
    if (active == 0xffffffffu) {
        const unsigned long long mine = reinterpret_cast<unsigned long long>(at);
        if (__all_sync(active, mine == __shfl_sync(active, mine, 0))) {
            for (int step = 16; step; step >>= 1) x += __shfl_xor_sync(active, x, step);
            if (threadIdx.x % 32 == 0) atomicAdd(at, x);
            return;
        }
    }
    const unsigned peers = __match_any_sync(active, reinterpret_cast<unsigned long long>(at));
    A sum = A(0);
    for (unsigned rest = peers; rest; rest &= rest - 1) sum += __shfl_sync(peers, x, __ffs(rest) - 1);
    if (int(threadIdx.x % 32) == __ffs(peers) - 1) atomicAdd(at, sum);
}
"""
# The factor each conversion of the chain (Mods._conversions) multiplies a score by.
_UNIT_FACTORS = {"": 1.0, "cuf_to_natural": _LN2, "cuf_to_log2": _LOG2E}


_PRELUDES: dict = {}
MAX_PRELUDES = 64


def _kept_prelude(key: tuple, mods: tuple, generate) -> str:
    """The prelude kept under ``key`` (modification ids) while its entry holds the same objects ``mods`` (a
    call's Mods is new each call; the objects, held with the text, keep their ids), else ``generate()``'s,
    kept."""
    known = _PRELUDES.get(key)
    if known is not None and len(known[0]) == len(mods) and all(a is b for a, b in zip(known[0], mods)):
        return known[1]
    text = generate()
    if len(_PRELUDES) >= MAX_PRELUDES:
        _PRELUDES.clear()
    _PRELUDES[key] = (mods, text)
    return text


@dataclass(frozen=True)
class Mods:
    """A call's modifications: score modifications in order, mask modifications (all must allow)."""

    score: Tuple[ScoreMod, ...] = ()
    mask: Tuple[MaskMod, ...] = ()

    @property
    def slots(self) -> int:
        return sum(m.slots for m in self.score + self.mask)

    @property
    def trainable(self) -> Tuple[Tuple[ScoreMod, str], ...]:
        """(modification, parameter name) of every trainable parameter, in slot order."""
        return tuple((m, n) for m in self.score for n in m.params if n in m.param_grads)

    @property
    def has_grad(self) -> bool:
        return all(m.grad is not None for m in self.score)

    def key(self) -> str:
        """A short digest of the generated source (a cache key for block states and plans)."""
        sig = repr(tuple(m._signature() for m in self.score + self.mask)).encode()
        return hashlib.sha256(sig).hexdigest()[:16]

    def prelude(self, fast_special: bool) -> str:
        """The CUDA source placed before a kernel's: the CUF_USER_* switches (score_mod.cuh) and the
        modifications' device functions. Kept per modification objects (a call's Mods is new each call;
        the objects, held with the text, keep their ids)."""
        key = (tuple(id(m) for m in self.score), tuple(id(m) for m in self.mask), fast_special)
        return _kept_prelude(key, self.score + self.mask, lambda: self._generate(fast_special))

    @property
    def linear(self) -> bool:
        """One score modification that is a bias linear in ``kv_idx - q_idx`` wherever no key after its query
        is visible (:func:`alibi`), and no mask modification: the Hopper kernels can add it with the tensor
        cores (:meth:`linear_prelude`)."""
        return len(self.score) == 1 and not self.mask and self.score[0].linear_slope is not None

    def linear_prelude(self) -> str:
        """The source placed before the 16-bit Hopper forward's and dK/dV kernel's where :attr:`linear` and the
        call's band shows no query a key after it (cuflash._dispatch.plan): ``CUF_LINEAR_BIAS`` and the slope
        ``cuf_linear_slope(h, cuf_args)`` in log2 units, read from the same parameter words as
        :meth:`prelude`'s (kernels_cu/linear_bias.cuh); no per-element code."""
        if not self.linear:
            raise ValueError("linear_prelude: one linear score modification (alibi) and no mask modification")
        mod = self.score[0]

        def generate() -> str:
            decl, _ = mod._locals(0, mod.param_grads)
            return (f"// cuflash user modifications {self.key()}, a linear bias\n#define CUF_FAST_SPECIAL 0\n"
                    f"#define CUF_LINEAR_BIAS 1\n{_HELPERS}\n"
                    "template <typename acc_t>\n__device__ __forceinline__ acc_t cuf_linear_slope(int h, "
                    f"const unsigned long long* cuf_args) {{\n    {decl}\n    return {mod.linear_slope};\n}}\n")
        return _kept_prelude(((id(mod),), (), "linear"), (mod,), generate)

    def _generate(self, fast_special: bool) -> str:
        lines = [f"// cuflash user modifications {self.key()}", f"#define CUF_FAST_SPECIAL {int(fast_special)}"]
        if self.score:
            lines.append("#define CUF_USER_SCORE 1")
            if all(m.everywhere for m in self.score):
                lines.append("#define CUF_USER_SCORE_EVERYWHERE 1")
            if len(self.score) == 1 and self.score[0].light and not self.mask:
                lines.append("#define CUF_USER_SCORE_LIGHT 1")
        if self.mask:
            lines.append("#define CUF_USER_MASK 1")
        special = sum(len(re.findall(r"\bcuf_tanh\s*\(", m.source)) for m in self.score) if fast_special else 0
        if special:   # tanh on the special-function unit, beside the softmax's exp2 (user_mod.cuh)
            lines.append(f"#define CUF_USER_SPECIAL {special}")
        if self.trainable:
            lines.append("#define CUF_USER_PARAM_GRADS 1")
        lines.append(_HELPERS)
        lines.append("template <typename A> __device__ __forceinline__ A cuf_no_grad() { return A(0) / A(0); }")
        lines.append("#define cuf_no_grad() cuf_no_grad<acc_t>()")
        slot = 0
        for i, m in enumerate(self.score):
            lines.append(m.cuda(i, slot))
            slot += m.slots
        for i, m in enumerate(self.mask):
            lines.append(m.cuda(i, slot))
            slot += m.slots
        lines.append('#line 1 "cuflash"')
        args = "int b, int h, int q_idx, int kv_idx, A rel_pos, const unsigned long long* cuf_args"
        call = "b, h, q_idx, kv_idx, rel_pos, cuf_args"
        # The chain takes and returns scores in log2 units (as the kernels hold them) and converts only where
        # the next modification's units differ from the score's (natural units unless log2_units); a step with
        # scales (a, c) is c f(a z).
        into = self._conversions()
        n = len(self.score)
        scales = [m.scales or (1.0, 1.0) for m in self.score]

        def step(i: int, z: str, fold_in: bool = False, fold_out: bool = False) -> str:
            a, c = scales[i]
            value = f"cuf_score_{i}<A>({z if fold_in else _scaled(a, z)}, {call})"
            return value if fold_out else _scaled(c, value)

        chain = "".join(f"    score = {step(i, f'{into[i]}(score)')};\n" for i in range(n))
        lines.append(f"template <typename A>\n__device__ __forceinline__ A cuf_user_score(A score, {args}) {{\n"
                     f"{chain}    return {into[-1]}(score);\n}}\n")
        # The forwards' folded chain (the plain kernels' mask_and_modify): the first step's conversion and
        # input factor a are the kernel's, in the scale it multiplies the score by (CUF_USER_IN_SCALE), the
        # last step's c and conversion back the softmax's (CUF_USER_OUT_SCALE, its x_per_s).
        fin = _UNIT_FACTORS[into[0]] * scales[0][0] if n else 1.0
        fout = scales[-1][1] * _UNIT_FACTORS[into[-1]] if n else 1.0
        lines.append(f"#define CUF_USER_IN_SCALE {_literal(fin)}\n#define CUF_USER_OUT_SCALE {_literal(fout)}")
        folded = "".join(f"    score = {step(i, 'score' if i == 0 else f'{into[i]}(score)', i == 0, i == n - 1)};\n"
                         for i in range(n))
        lines.append(f"template <typename A>\n__device__ __forceinline__ A cuf_user_score_folded(A score, {args}) {{\n"
                     f"{folded}    return score;\n}}\n")
        # value and derivative (chain rule: each step's derivative at its own input, a c f'(a z); a ratio of
        # scores, the same in either unit)
        def derivative(i: int, z: str) -> str:
            a, c = scales[i]
            return _scaled(a * c, f"cuf_grad_{i}<A>({_scaled(a, z)}, {call})")

        steps = "".join(f"    score = {into[i]}(score);\n    grad *= {derivative(i, 'score')};\n"
                        f"    score = {step(i, 'score')};\n" for i in range(n))
        lines.append(f"template <typename A>\n__device__ __forceinline__ A cuf_user_score_grad(A score, {args}, "
                     f"A& grad) {{\n    grad = A(1);\n{steps}    return {into[-1]}(score);\n}}\n")
        # The backwards' folded twin: the folded chain's value (its input CUF_USER_IN_SCALE times the score, its
        # output over CUF_USER_OUT_SCALE) and the same derivative as cuf_user_score_grad's, d modified / d score.
        folded_steps = "".join(
            (f"    grad *= {_scaled(scales[0][0] * scales[0][1], f'cuf_grad_0<A>(score, {call})')};\n" if i == 0 else
             f"    score = {into[i]}(score);\n    grad *= {derivative(i, 'score')};\n")
            + f"    score = {step(i, 'score', i == 0, i == n - 1)};\n" for i in range(n))
        lines.append(f"template <typename A>\n__device__ __forceinline__ A cuf_user_score_grad_folded(A score, {args}, "
                     f"A& grad) {{\n    grad = A(1);\n{folded_steps}    return score;\n}}\n")
        # parameter gradients: the inputs of every step again, then upstream gradients (d loss / d the natural
        # value of each step's output) from the last step back; a log2-unit step's derivatives are log2 e times
        # the natural ones
        body = [f"    A in[{max(n, 1)}], d[{max(n, 1)}];"]
        for i in range(n):
            z = f"in[{i}]"
            body.append(f"    {z} = {into[i]}(score); d[{i}] = {derivative(i, z)}; score = {step(i, z)};")
        for i in reversed(range(n)):
            factor = " * A(CUF_LN2)" if self.score[i].log2_units else ""
            body.append(f"    cuf_param_grads_{i}<A>(in[{i}], {call}, upstream{factor}); upstream *= d[{i}];")
        lines.append(f"template <typename A>\n__device__ __forceinline__ void cuf_user_param_grads(A score, {args}, "
                     f"A upstream) {{\n" + "\n".join(body) + "\n}\n")
        mask_args = "int b, int h, int q_idx, int kv_idx, const unsigned long long* cuf_args"
        masks = " && ".join(f"cuf_mask_{i}(b, h, q_idx, kv_idx, cuf_args)" for i in range(len(self.mask))) or "true"
        lines.append(f"__device__ __forceinline__ bool cuf_user_mask({mask_args}) {{ return {masks}; }}\n")
        return "\n".join(lines) + "\n"

    def _conversions(self) -> list:
        """The conversion (a C function name, or "" for none) taking the chain's score into each score
        modification's units, and (last) the one back to log2 units."""
        out, log2 = [], True
        for m in self.score:
            out.append("" if m.log2_units == log2 else ("cuf_to_log2" if m.log2_units else "cuf_to_natural"))
            log2 = m.log2_units
        out.append("" if log2 else "cuf_to_log2")
        return out

    def words(self, acc, with_grads: bool = True) -> Tuple[list, list]:
        """The parameter words (MaskParams::mod_args, MAX_PARAM_SLOTS of them) for inputs whose
        accumulator is ``acc`` (float32 or float64), and the trainable parameters' gradient
        accumulators (zeroed arrays of ``acc``, in slot order; with ``with_grads`` False none, their
        words 0) -- CuPy arrays only."""
        import cupy

        words, grads = [], []
        for m in self.score + self.mask:
            for name, value in m.params.items():
                if _is_array(value):
                    if not isinstance(value, cupy.ndarray):
                        raise TypeError(f"{m.name}: parameter {name!r} is a {type(value).__name__}; CuPy inputs "
                                        "take CuPy parameter arrays")
                    words.append(value.data.ptr)
                    if name in getattr(m, "param_grads", {}):
                        g = cupy.zeros(value.shape, dtype=acc) if with_grads else None
                        if g is not None:
                            grads.append(g)
                        words.append(0 if g is None else g.data.ptr)
                elif isinstance(value, int):
                    words.append(value & (2**64 - 1))
                elif np.dtype(acc) == np.float64 and isinstance(m, ScoreMod):   # (mask functions read float)
                    words.append(struct.unpack("<Q", struct.pack("<d", value))[0])
                else:
                    words.append(struct.unpack("<I", struct.pack("<f", value))[0])
        return words + [0] * (MAX_PARAM_SLOTS - len(words)), grads

    # ------------------------------------------------------------------ NumPy evaluation

    def scores(self, s, b, h, q, kv, xp):
        """The score modifications applied to natural-unit scores ``s`` (masked entries stay -inf)."""
        if not self.score:
            return s
        masked = xp.isneginf(s)
        with np.errstate(all="ignore"):
            for m in self.score:
                s = m.apply_numpy(s, b, h, q, kv, xp)
        return xp.where(masked, -np.inf, s)

    def scores_and_grad(self, s, b, h, q, kv, xp):
        """(modified scores, d modified / d raw, [(mod, name, flat index, upstream factor...)])."""
        g = xp.ones_like(s)
        inputs = []
        with np.errstate(all="ignore"):
            for m in self.score:
                inputs.append(s)
                g = g * m.grad_numpy(s, b, h, q, kv, xp)
                s = m.apply_numpy(s, b, h, q, kv, xp)
        return s, g, inputs

    def allowed(self, b, h, q, kv, xp):
        """The mask modifications' verdict, broadcast over the index arrays (None without any)."""
        out = None
        for m in self.mask:
            a = xp.asarray(m.apply_numpy(b, h, q, kv, xp)).astype(bool)
            out = a if out is None else (out & a)
        return out

    def param_grads_numpy(self, inputs, ds_mod, b, h, q, kv, xp) -> Dict[str, Any]:
        """Gradients of the trainable parameters from dL/d(modified score) ``ds_mod`` and the steps'
        inputs (:meth:`scores_and_grad`), float64 arrays of the parameters' shapes."""
        out = {}
        upstream = ds_mod
        with np.errstate(all="ignore"):
            for m, s_in in reversed(list(zip(self.score, inputs))):
                for name in m.param_grads:
                    index, deriv = m.param_grad_numpy(name, s_in, b, h, q, kv, xp)
                    shape = m.params[name].shape
                    acc = xp.zeros(int(np.prod(shape)), dtype=np.float64)
                    seen = upstream != 0   # masked elements: no contribution (their derivative may be NaN)
                    contrib = xp.broadcast_to(xp.where(seen, deriv * upstream, 0.0), upstream.shape)
                    idx = xp.broadcast_to(xp.asarray(index), upstream.shape)
                    xp.add.at(acc, idx[seen].astype(np.int64), contrib[seen])
                    out[name] = out.get(name, 0) + acc.reshape(shape)
                upstream = xp.where(upstream != 0, upstream * m.grad_numpy(s_in, b, h, q, kv, xp), 0.0)
        return out


def _as_tuple(x, cls, what: str) -> tuple:
    if x is None:
        return ()
    items = tuple(x) if isinstance(x, (list, tuple)) else (x,)
    for m in items:
        if not isinstance(m, cls):
            raise TypeError(f"{what} must be a cuflash.{cls.__name__} or a sequence of them, got {type(m).__name__}")
    return items


def resolve(score_mod=None, mask_mod=None) -> Optional[Mods]:
    """The call's :class:`Mods`, or None without modifications (TypeError / ValueError on bad ones)."""
    score, mask = _as_tuple(score_mod, ScoreMod, "score_mod"), _as_tuple(mask_mod, MaskMod, "mask_mod")
    if not score and not mask:
        return None
    trained = [n for m in score for n in getattr(m, "param_grads", {})]
    twice = sorted({n for n in trained if trained.count(n) > 1})
    if twice:
        raise ValueError(f"score modifications train parameters of one name twice ({', '.join(twice)}): the "
                         "backward returns a gradient a name; one such modification a call")
    mods = Mods(score, mask)
    if mods.slots > MAX_PARAM_SLOTS:
        raise ValueError(f"the modifications take {mods.slots} parameter words; at most {MAX_PARAM_SLOTS} "
                         "(one a number or array, two a trainable array)")
    return mods


# --------------------------------------------------------------------------- library modifications

def softcap(cap: float) -> ScoreMod:
    """``cap * tanh(score / cap)``: scores squashed into (-cap, cap) (Gemma 2, Grok); ``cap`` a finite number
    > 0. Returns a :class:`ScoreMod` for ``score_mod=`` (its gradient included). Written in log2 units
    with the cap compiled in (``cap tanh(s / cap)`` is ``c tanh(x / c) ln 2`` for ``x = s log2 e`` and ``c =
    cap log2 e``) as ``tanh`` with ``scales=(1 / c, c)``: the forwards fold 1 / c into the scale and c into the
    exponential, a tanh an element beyond plain attention; one build per cap value."""
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
    cap_log2 = float(cap) * _LOG2E
    return ScoreMod("cuf_tanh(score)", grad="{ const acc_t t = cuf_tanh(score); return acc_t(1) - t * t; }",
                    scales=(1.0 / cap_log2, cap_log2), log2_units=True, everywhere=True, name="softcap",
                    python=lambda t, b, h, q, kv: np.tanh(t),
                    python_grad=lambda t, b, h, q, kv: 1.0 - np.tanh(t) ** 2)


def alibi(slopes: Any, *, offset: int = 0) -> ScoreMod:
    """ALiBi: ``score - slopes[h] * |q_idx + offset - kv_idx|`` (Press et al.).

    Parameters
    ----------
    slopes : float32 array (Hq,)
        One slope a query head, on the inputs' device (NumPy for NumPy inputs).
    offset : int
        Where query 0 stands among the keys: 0 counts queries and keys from the start (FlexAttention's
        ``q_idx``, ``kv_idx``); ``Lk - Lq`` is FlashAttention's ``alibi_slopes``, whose distance is counted
        from the bottom right (the queries are the last ``Lq`` positions of the keys, as in decoding). A
        parameter: a new offset builds nothing. A nonzero offset is one more value a kernel holds: the
        forwards take it without spilling, some backward variants spill 8-48 bytes with it (NVRTC 12.9).

    Returns
    -------
    ScoreMod
        For ``score_mod=``. Its backward needs no parameter gradient.

    Wherever no query sees a key past its own position the distance is linear in ``kv_idx`` and the offset
    shifts a row's scores by a constant: the same attention (the lse moves by ``slopes[h] * offset``).
    Written in log2 units and evaluated everywhere (``slopes[h]`` read once a tile). With ``offset=0``, where
    no query sees a key after it (causal aligned at the start, or at the end with Lq >= Lk; a window with no
    keys to the right) the 16-bit Hopper kernels at head dims up to 128 add it as ``slopes[h] * (kv_idx -
    q_idx)`` in one more tensor-core step a tile, with no work an element (kernels_cu/linear_bias.cuh)."""
    if not _is_array(slopes) or slopes.ndim != 1 or np.dtype(slopes.dtype) != np.float32:
        raise TypeError("alibi: slopes must be a float32 array of shape (Hq,)")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"alibi: offset must be an int, got {offset!r}")
    # offset 0 keeps the source (and builds) of plain ALiBi and its tensor-core form; another is a parameter
    params = {"slopes": slopes} if offset == 0 else {"slopes": slopes, "offset": int(offset)}
    shifted = " - acc_t(offset)" if offset else ""
    mod = ScoreMod(f"score - acc_t(slopes[h]) * acc_t(CUF_LOG2E) * fabs(rel_pos{shifted})",
                   grad="acc_t(1)", params=params, name="alibi", log2_units=True, everywhere=True,
                   python=lambda s, b, h, q, kv, slopes, offset=0: (
                       s - slopes[h].astype(np.float64) * _LOG2E * abs(q + offset - kv)),
                   python_grad=lambda s, b, h, q, kv, slopes, offset=0: np.ones_like(s))
    if offset == 0:
        mod.linear_slope = "acc_t(slopes[h]) * acc_t(CUF_LOG2E)"   # kv <= q: slopes[h] log2(e) (kv - q)
    mod.param_shapes = {"slopes": ("Hq",)}
    return mod


def t5_bucket(rel, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's relative-position bucket (``_relative_position_bucket``) of ``rel = kv_idx - q_idx``, NumPy
    int64: exact buckets for small distances, logarithmic ones up to ``max_distance``."""
    rel = np.asarray(rel, dtype=np.int64)
    bucket = np.zeros(rel.shape, dtype=np.int64)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (rel > 0) * num_buckets
        rel = np.abs(rel)
    else:
        rel = np.where(rel < 0, -rel, 0)
    exact = num_buckets // 2
    with np.errstate(divide="ignore"):
        big = exact + (np.log(np.maximum(rel, 1) / exact) / math.log(max_distance / exact)
                       * (num_buckets - exact)).astype(np.int64)
    return bucket + np.where(rel < exact, rel, np.minimum(big, num_buckets - 1))


def relative_position_bias(table: Any, *, num_buckets: int = 32, max_distance: int = 128,
                           bidirectional: bool = True) -> ScoreMod:
    """T5's learned relative-position bias: ``score + table[bucket(kv_idx - q_idx), h]``.

    Parameters
    ----------
    table : float32 or float64 array (num_buckets, Hq)
        The learned bias of each bucket and query head, on the inputs' device. Trainable: the backward
        returns its gradient as ``{"table": ...}`` (summed with float atomics on the GPU: its last bits may
        differ run to run, ``deterministic=True`` or not).
    num_buckets : int
        Buckets, at least 4 (half for keys after the query when ``bidirectional``).
    max_distance : int
        Distances past it share the last bucket; above the exact buckets (``num_buckets // 4`` or ``// 2``).
    bidirectional : bool
        Separate buckets for keys after the query (T5's encoder) or none (its decoder: keys after the query
        share bucket 0).

    Returns
    -------
    ScoreMod
        For ``score_mod=``. Buckets as T5's ``_relative_position_bucket`` (:func:`t5_bucket`), looked up in a
        table of one bucket per distance up to ``max_distance``.
    """
    for name, value in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"relative_position_bias: {name} must be an int, got {value!r}")
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise TypeError(f"relative_position_bias: bidirectional must be a bool, got {bidirectional!r}")
    if not _is_array(table) or table.ndim != 2 or np.dtype(table.dtype).kind != "f":
        raise TypeError("relative_position_bias: table must be a float array (num_buckets, Hq)")
    if table.shape[0] != num_buckets:
        raise ValueError(f"relative_position_bias: table has {table.shape[0]} rows for {num_buckets} buckets")
    half = num_buckets // 2 if bidirectional else num_buckets
    if num_buckets < 4 or max_distance <= half // 2:
        raise ValueError("relative_position_bias: num_buckets >= 4 and max_distance above the exact buckets")
    heads, md, bd = table.shape[1], int(max_distance), bool(bidirectional)
    # bucket of distance d (0..max_distance) on the side of keys before the query; keys after it add `half`
    lookup = t5_bucket(-np.arange(md + 1), num_buckets, md, bd).astype(np.int32)
    xp = _xp(table)
    lookup = xp.asarray(lookup)
    rel = "kv_idx - q_idx"
    if bd:
        bucket = f"(({rel}) > 0 ? {half} : 0) + bucket_of[min(abs({rel}), {md})]"
    else:
        bucket = f"bucket_of[min(max(-({rel}), 0), {md})]"
    index = f"({bucket}) * {heads} + h"

    def twin(s, b, h, q, kv, table, bucket_of):
        x = _xp(s)
        return s + table[x.asarray(t5_bucket(_host(kv - q), num_buckets, md, bd)), h]

    def twin_index(s, b, h, q, kv, table, bucket_of):
        x = _xp(s)
        return x.asarray(t5_bucket(_host(kv - q), num_buckets, md, bd)) * heads + h, x.ones_like(s)

    mod = ScoreMod(f"score + acc_t(table[{index}])", grad="acc_t(1)",
                   params={"table": table, "bucket_of": lookup}, param_grads={"table": (index, "acc_t(1)")},
                   name="relative_position_bias", python=twin,
                   python_grad=lambda s, b, h, q, kv, table, bucket_of: s * 0 + 1.0,
                   python_param_grads={"table": twin_index})
    mod.param_shapes = {"table": (num_buckets, "Hq")}
    return mod


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _xp(x):
    try:
        import cupy
        return cupy.get_array_module(x)
    except ImportError:   # pragma: no cover
        return np


def document_mask(document_ids: Any) -> MaskMod:
    """Packed documents: query i sees key j only within its own document, ``ids[b, i] == ids[b, j]``.
    ``document_ids``: int32 array (B, L), L >= max(Lq, Lk) (queries and keys share positions). Returns a
    :class:`MaskMod` for ``mask_mod=``.

    The mask holds its own copy of the ids, read once on the host here. Where each document is one run of
    positions in every row (documents packed back to back: ids like 0 0 0 1 1 2 ...) and Lq == Lk == L, a
    call with no other masking than ``causal`` and ``window`` (no bias, mask, dropout, block layout or other
    modification) runs
    the packed-sequence kernels of :mod:`cuflash.varlen` over the runs (cuflash/_dispatch/documents.py):
    every tile lies inside one document, so no element is tested and no tile straddles two."""
    if not _is_array(document_ids) or document_ids.ndim != 2 or np.dtype(document_ids.dtype) != np.int32:
        raise TypeError("document_mask: document_ids must be an int32 array (B, L)")
    ids = document_ids.copy()
    # the length a parameter, not a literal: one build for every sequence length
    mod = MaskMod("doc[(long long)b * length + q_idx] == doc[(long long)b * length + kv_idx]",
                  params={"doc": ids, "length": int(ids.shape[1])}, name="document_mask",
                  python=lambda b, h, q, kv, doc, length: _doc_twin(b, q, kv, doc))
    mod.documents = DocumentRuns(_host(ids))
    return mod


class DocumentRuns:
    """A document mask's documents: the ids' shape (B, L) and, where each document of a row is one run of
    positions, ``runs`` = (batch row, first position, length) int64 arrays (B x documents,), else None."""

    def __init__(self, ids: np.ndarray):
        self.shape = tuple(ids.shape)
        self.runs = _document_runs(np.asarray(ids))


def _document_runs(ids: np.ndarray):
    b, n = ids.shape
    if b * n == 0:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(3))
    first_of_run = np.ones((b, n), dtype=bool)
    first_of_run[:, 1:] = ids[:, 1:] != ids[:, :-1]
    row, first = (x.astype(np.int64) for x in np.nonzero(first_of_run))
    flat = row * n + first
    length = np.diff(np.append(flat, b * n))   # a row's last run ends where the next row's first starts
    run_ids = ids[row, first]
    order = np.lexsort((run_ids, row))
    repeated = (row[order][1:] == row[order][:-1]) & (run_ids[order][1:] == run_ids[order][:-1])
    return None if repeated.any() else (row, first, length)


def _doc_twin(b, q, kv, doc):
    bb = b.reshape(-1)
    rows = doc[bb][:, None, :, None]         # (B, 1, L, 1) ids of the queries
    cols = doc[bb][:, None, None, :]         # (B, 1, 1, L) ids of the keys
    return rows[..., q.reshape(-1), :] == cols[..., kv.reshape(-1)]


def prefix_lm_mask(prefix_lengths: Any) -> MaskMod:
    """Prefix-LM: every query sees the prefix (keys ``j < prefix[b]``) and, past it, keys up to itself
    (``j <= i``).

    Parameters
    ----------
    prefix_lengths : int32 array (B,)
        Each batch entry's prefix length (B: the product of the inputs' leading dims), on the inputs' device.

    Returns
    -------
    MaskMod
        For ``mask_mod=``. Use without ``causal`` (with it the call's causal mask also applies inside the
        prefix: plain causal attention)."""
    if not _is_array(prefix_lengths) or prefix_lengths.ndim != 1 or np.dtype(prefix_lengths.dtype) != np.int32:
        raise TypeError("prefix_lm_mask: prefix_lengths must be an int32 array (B,)")
    mod = MaskMod("kv_idx < prefix[b] || kv_idx <= q_idx", params={"prefix": prefix_lengths}, name="prefix_lm",
                  python=lambda b, h, q, kv, prefix: (kv < prefix[b]) | (kv <= q))
    mod.param_shapes = {"prefix": ("B",)}
    return mod
