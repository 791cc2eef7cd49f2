"""The block tables of packed sequences (cuflash/_dispatch/packed.py): every row of every sequence in
exactly one block, longest sequence first, a sequence's last block first under a causal mask; the kernels'
block index -> (entry, head) map a bijection that runs a head's tiles of a sequence in a row (CPU)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash._dispatch.packed import ENTRY_INTS, block_table


@settings(max_examples=80, deadline=None)
@given(lq=st.lists(st.integers(0, 300), min_size=1, max_size=12), data=st.data(), tile=st.sampled_from([16, 64, 128]),
       axis=st.sampled_from(["q", "k"]), reverse=st.booleans())
def test_every_row_once_longest_first(lq, data, tile, axis, reverse):
    lk = data.draw(st.lists(st.integers(0, 300), min_size=len(lq), max_size=len(lq)))
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    table = block_table(cu_q.astype(np.int32), cu_k.astype(np.int32), tile, axis, reverse)
    assert table.dtype == np.int32 and table.shape[1:] == (ENTRY_INTS,)
    own = lq if axis == "q" else lk
    covered = {b: [] for b in range(len(lq))}
    for q_start, k_start, first, n_q, n_k, seq, _, _ in table:
        assert (q_start, k_start, n_q, n_k) == (cu_q[seq], cu_k[seq], lq[seq], lk[seq])
        assert first % tile == 0 and 0 <= first < own[seq]
        covered[seq].append(first)
    for b, firsts in covered.items():
        assert sorted(firsts) == list(range(0, own[b], tile))   # each row in one block, no empty blocks
    seqs = table[:, 5]
    runs = [s for i, s in enumerate(seqs) if i == 0 or seqs[i - 1] != s]
    assert len(runs) == len(set(runs))                      # a sequence's blocks side by side
    assert [own[s] for s in runs] == sorted((own[s] for s in runs), reverse=True)   # longest first
    for s in runs:
        firsts = table[seqs == s, 2]
        assert list(firsts) == sorted(firsts, reverse=reverse)
    heads = data.draw(st.integers(1, 5))
    blocks = [_block_at(table, idx, heads) for idx in range(len(table) * heads)]
    assert sorted(blocks) == [(e, h) for e in range(len(table)) for h in range(heads)]
    for (e0, h0), (e1, h1) in zip(blocks, blocks[1:]):   # within a sequence: a head's tiles in a row
        if table[e0, 5] == table[e1, 5] and h0 == h1:
            assert e1 == e0 + 1
        elif table[e0, 5] == table[e1, 5]:
            assert h1 == h0 + 1


def _block_at(table, idx, heads):
    """(entry, head) of block ``idx``: kernels_cu/scheduler.cuh, PackedBlock::at."""
    seq_entry, seq_tiles = table[idx // heads, 6], table[idx // heads, 7]
    in_seq = idx - heads * seq_entry
    return int(seq_entry + in_seq % seq_tiles), int(in_seq // seq_tiles)
