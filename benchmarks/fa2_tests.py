"""Run FlashAttention-2's own test file against cuflash.torch (needs a GPU, PyTorch and einops).

    python benchmarks/fa2_tests.py PATH/TO/flash-attention/tests/test_flash_attn.py [--sample 7] [-- PYTEST ARGS]

The test file is not shipped here: take it from a FlashAttention-2 checkout. This script puts a
``flash_attn`` package of its own first on the path, whose functions are cuflash.torch's
(``flash_attn_func`` and its packed variants, ``flash_attn_with_kvcache``), with small padding helpers
written here (``pad_input``, ``unpad_input``, ``index_first_axis``), and runs pytest on the file. A test
that reaches a feature cuflash lacks (NotImplementedError: softcap, ALiBi, returned probabilities,
rotary, paged caches) is reported as skipped with the feature's name. ``--sample N``
keeps every N-th collected test (deterministic), for a run of a few minutes.
"""
from __future__ import annotations

import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

SHIM = {
    "flash_attn/__init__.py": '''
        from cuflash.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

        def flash_attn_kvpacked_func(q, kv, *args, **kwargs):
            return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], *args, **kwargs)

        def flash_attn_qkvpacked_func(qkv, *args, **kwargs):
            return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *args, **kwargs)

        def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args,
                                            **kwargs):
            return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, *args, **kwargs)

        def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, *args, **kwargs):
            return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                                          max_seqlen, *args, **kwargs)
        ''',
    "flash_attn/flash_attn_interface.py": '''
        from flash_attn import *  # noqa: F401,F403

        USE_TRITON_ROCM = False

        def _get_block_size_n(device, head_dim, is_dropout, is_causal):
            return 128

        def _flash_attn_varlen_forward(*args, **kwargs):
            raise NotImplementedError("FlashAttention's internal varlen forward: not in cuflash")

        class _Extension:
            def __getattr__(self, name):
                raise NotImplementedError(f"FlashAttention's CUDA extension ({name}): not in cuflash")

        flash_attn_gpu = _Extension()
        ''',
    "flash_attn/bert_padding.py": '''
        import torch
        import torch.nn.functional as F

        def index_first_axis(x, indices):
            return x.reshape(x.shape[0], -1)[indices].reshape((-1,) + tuple(x.shape[1:]))

        def unpad_input(hidden_states, attention_mask, unused_mask=None):
            """The kept tokens of (B, L, ...) as (nnz, ...), their flat indices, cu_seqlens, the longest
            length and each sequence's length."""
            mask = attention_mask if unused_mask is None else attention_mask | unused_mask
            lengths = mask.sum(dim=-1, dtype=torch.int32)
            used = attention_mask.sum(dim=-1, dtype=torch.int32)
            indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
            cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
            flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
            return flat[indices], indices, cu_seqlens, int(lengths.max()), used

        def pad_input(hidden_states, indices, batch, seqlen):
            out = hidden_states.new_zeros((batch * seqlen,) + tuple(hidden_states.shape[1:]))
            out[indices] = hidden_states
            return out.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
        ''',
    "flash_attn/layers/__init__.py": "",
    "flash_attn/layers/rotary.py": '''
        def apply_rotary_emb(*args, **kwargs):
            raise NotImplementedError("rotary embeddings: not in cuflash yet")
        ''',
}


class _Plugin:
    """NotImplementedError as a skip naming the feature; every N-th test kept with --sample N."""

    def __init__(self, sample: int):
        self.sample = sample

    def pytest_collection_modifyitems(self, config, items):
        if self.sample > 1:
            items[:] = items[::self.sample]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        outcome = yield
        try:
            outcome.get_result()
        except NotImplementedError as exc:
            outcome.force_exception(pytest.skip.Exception(f"cuflash lacks: {exc}"))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    sample = 1
    if "--sample" in argv:
        i = argv.index("--sample")
        sample = int(argv[i + 1])
        del argv[i:i + 2]
    if len(argv) != 1:
        print(__doc__)
        return 2
    test_file = Path(argv[0]).resolve()
    shim = Path(tempfile.mkdtemp(prefix="cuflash-fa2-"))
    for name, text in SHIM.items():
        path = shim / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    sys.path[:0] = [str(shim), str(Path(__file__).resolve().parent.parent), str(test_file.parent)]
    return pytest.main([str(test_file), "-q", "-p", "no:cacheprovider", "-rs", "--rootdir", str(test_file.parent),
                        *extra], plugins=[_Plugin(sample)])


if __name__ == "__main__":
    sys.exit(main())
