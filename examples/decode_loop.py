"""A decoding loop over a paged KV cache: each step appends one key and value per sequence and attends.

Four sequences (8 query heads over 2 K/V heads, head dim 64) start from prompts of different lengths, held
in pages of 16 positions taken from a shared pool in shuffled order. Each step feeds one new query, key
and value per sequence to ``cuflash.attention_with_kvcache``, which writes the key and value at the
sequence's end (in place) and attends the sequence's own keys; the lengths are a NumPy array the host keeps
(checked on the host, nothing read back from the GPU). Every step's output is checked against
``cuflash.attention`` over that sequence's keys so far, and the pages are checked to hold every key.
Runs on the GPU with CuPy arrays, or, where there is no usable GPU, on NumPy arrays (same code).

    PYTHONPATH=. python examples/decode_loop.py
"""
import numpy as np

import cuflash
from cuflash._runtime.device import gpu_available

ok, why = gpu_available()
if ok:
    import cupy as xp
else:
    xp = np
    print(f"No GPU here ({why}): running on NumPy arrays instead.")

rng = np.random.default_rng(0)
batch, heads_q, heads_kv, dim, page, steps = 4, 8, 2, 64, 16, 24
prompts = np.array([5, 17, 0, 30])                            # keys already in each sequence's cache
pages_per_seq = -(-(int(prompts.max()) + steps) // page)
pool = batch * pages_per_seq + 3                              # a few pages to spare
table = rng.permutation(pool)[:batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)

# The pool as (pages, page positions, K/V heads, dim) memory, seen as (pages, heads, positions, dim).
k_pool = xp.asarray(rng.standard_normal((pool, page, heads_kv, dim)).astype(np.float32))
v_pool = xp.asarray(rng.standard_normal((pool, page, heads_kv, dim)).astype(np.float32))
k_pages, v_pages = k_pool.swapaxes(1, 2), v_pool.swapaxes(1, 2)


def host(x):
    return np.asarray(x.get() if xp is not np else x)


def keys_of(pages, b, n):
    """Sequence b's first n positions (heads, n, dim), gathered from its pages on the host."""
    held = host(pages[xp.asarray(table[b])])                  # (pages, heads, page, dim)
    return held.transpose(1, 0, 2, 3).reshape(heads_kv, -1, dim)[:, :n]


lengths = prompts.copy()
seen_k = [keys_of(k_pages, b, n) for b, n in enumerate(prompts)]   # each sequence's keys and values, on the host
seen_v = [keys_of(v_pages, b, n) for b, n in enumerate(prompts)]
worst = 0.0
for step in range(steps):
    q = xp.asarray(rng.standard_normal((batch, heads_q, 1, dim)).astype(np.float32))
    k_new = xp.asarray(rng.standard_normal((batch, heads_kv, 1, dim)).astype(np.float32))
    v_new = xp.asarray(rng.standard_normal((batch, heads_kv, 1, dim)).astype(np.float32))
    out = cuflash.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=lengths,
                                         block_table=table, causal=True)
    lengths = lengths + 1                                     # the host keeps the lengths
    host_q, host_out = host(q), host(out)
    for b in range(batch):
        seen_k[b] = np.concatenate([seen_k[b], host(k_new)[b]], axis=1)
        seen_v[b] = np.concatenate([seen_v[b], host(v_new)[b]], axis=1)
        want = cuflash.attention(host_q[b].astype(np.float64), seen_k[b].astype(np.float64),
                                 seen_v[b].astype(np.float64))
        worst = max(worst, float(np.abs(host_out[b] - want).max()))
    if step % 8 == 0 or step == steps - 1:
        print(f"step {step:2d}: lengths {lengths.tolist()}, largest error so far {worst:.1e}")

assert worst < 1e-4, worst
assert all(np.array_equal(keys_of(k_pages, b, n), seen_k[b]) and np.array_equal(keys_of(v_pages, b, n), seen_v[b])
           for b, n in enumerate(lengths))
print(f"every step matches attention over each sequence's keys so far (largest error {worst:.1e}); "
      f"the pages hold every key and value")
