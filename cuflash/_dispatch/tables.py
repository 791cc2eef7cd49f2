"""The tile tables: for each (architecture row, kernel family, dtype, head-dim bucket), the tiles in
order of preference, each with one line of reason (a measurement with its script, or the constraint
that chose it). A call takes the first tile whose shared memory fits its GPU (SMEM_LIMITS), so an
entry tuned on an H100 / H200 (227 KB) keeps a tile for the A100 (163 KB) and for sm_86 / sm_89 /
sm_120 GPUs (99 KB). Rows: "sm80" (the portable kernels on every GPU), "sm90" (portable kernels'
tiles for compute capability 9.0 and newer), "sm90a" (Hopper's own kernels).
"""
from __future__ import annotations

from .model import DTYPES, HALF_TYPES, Tile, add

_SMALL_BYTES = "99 KB of shared memory (sm_86 / sm_89 / sm_120)"

# Tensor-core forward (fwd_mma): each warp owns block_m / warps query rows in 16-row strips; with two strips a
# warp feeds every K / V fragment it loads to two MMAs (one strip is bound by shared-memory bandwidth: 36
# ldmatrix.x4 per 64 MMAs). The limit is registers: acc_o + S must fit 255 with 0 spills in every plain and band
# variant (NVRTC 12.9 and 13.0, sm_80 / sm_90). tune_fwd.py, H100, fp16 / bf16, B*L=16384, H*D=2048, TFLOP/s at
# L=4096 non-causal / causal:
#   d=32:  64x64/4w 151/140   128x64/4w 181/141   128x128/4w 184/168   64x64/2w 168/134
#   d=128: 64x64/4w 207/187   128x32/4w 230/189   64x32/2w 209/176
#   d=256: 64x32/4w 188/145   32x32/2w 129/88 (two strips spill)
add("fwd_mma", HALF_TYPES, [32], Tile(128, 128, 4, 2, "two strips per warp: +19% over 64x64/4w (tune_fwd.py)"))
# d=64, 128x128: 251-255 registers, 0 spills in every plain and band variant (both load widths): P is packed to 16
# bits as the softmax forms it, a partial tile's mask is two bounds a fragment row, the fully visible tiles are
# found once per warp and the K/V loader walks one pointer down the rows.
add("fwd_mma", HALF_TYPES, [64], Tile(128, 128, 4, 2, "two strips of 128 keys: 1.12x 128x64 at L = 4096 (269 / 241 "
                                                      "TFLOP/s), 1.11x at L = 1024 (tune_fwd.py)"))
# d=128, 128x64 (FA2's tile): without PARK it spills 8-56 bytes (the block's coordinates, the K/V pointers or the
# loop bounds); with PARK (Tile.park) these wait in the Q rows' padding (255 registers, 0 spills) at 30-60
# instructions a step. 102 KB: two CTAs an SM on the H100 only (resident=2); the A100 and the 99 KB GPUs take
# 128x32 (68 KB, two CTAs an SM on the A100).
add("fwd_mma", HALF_TYPES, [128],
     Tile(128, 64, 4, 2, "FA2's tile with PARK: 1.00-1.10x 128x32 non-causal, 0.94-1.08x causal (tune_fwd.py --peer)",
          resident=2, park=True),
     Tile(128, 32, 4, 2, "two strips per warp, 32-key tiles: +11-15% non-causal, +1-3% causal over 64x64 "
                         "(tune_fwd.py)"))
# EXTRA (bias, mask, block layout, dropout; the bias staged in shared memory): at d=128, 128x64 spills with PARK
# (8-148 bytes) and without (0-144).
add("fwd_mma", HALF_TYPES, [128], Tile(128, 32, 4, 2, "128x64 spills with the EXTRA code"), extra=True)
add("fwd_mma", HALF_TYPES, [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles"))
# EXTRA at d=32 / 64: two strips as in the plain kernel; 128x128 spills (d=32: 44-252 bytes, d=64: 68-236), 128x64
# fits every variant, band included (240-253 registers, 0 spills on sm_80 / sm_90).
add("fwd_mma", HALF_TYPES, [32, 64], Tile(128, 64, 4, 2, "two strips per warp of 64 keys; 128x128 spills with the "
                                                          "EXTRA code"), extra=True)
add("fwd_mma", HALF_TYPES, [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles"),
     Tile(64, 16, 4, 2, "16-key tiles: K/V and the bias stages fit " + _SMALL_BYTES), extra=True)

# Split-KV partial kernel (fwd_mma with KV_SPLIT, no EXTRA): a decoding call's rows are few (packed GQA: Lq x the
# query heads of a K/V head), so a CTA's padded rows cost tensor-core time per key byte: one 16-row strip a warp
# (64 rows) halves it against the prefill tiles' 128 and leaves K/V streaming the bound on paper (H200: ~2.3 of
# ~4.5 TFLOP/s a SM at full HBM bandwidth, d=128): 47-87% of the H200 HBM peak from 32768 keys, 16 query rows x 4
# heads (benchmarks/bench_decode.py).
add("fwd_mma", HALF_TYPES, [32, 64],
    Tile(64, 128, 4, 2, "one strip a warp: half the padded rows of 128x128; three CTAs an SM (168 registers): "
         "1.08-1.12x two at B = 1-8, 0.95-1.03x at B = 64 (H200, 16 rows x 4 heads, tune_decode.py --family fwd_mma)",
         ctas=3, split_only=True),
    Tile(64, 128, 4, 2, "the packed forward's (cuflash.varlen): one strip a warp"), split=True)
add("fwd_mma", HALF_TYPES, [128], Tile(64, 64, 4, 2, "one strip a warp, 87 KB: two CTAs an SM stream K/V", ctas=2),
    split=True)
# Decoding partial kernel (fwd_decode, flash_fwd_decode.cu): at most 16 packed query rows, the four warps split
# each K/V tile's keys (32 or 16 keys a warp), so each K/V byte crosses shared memory once; the 64-row split tile
# above reads it once a warp and spends 4x the tensor-core work on padding rows. K and V stages of 32 KB in swizzled
# rows (benchmarks/bench_decode.py, benchmarks/stream_layout.py).
# One CTA an SM of 8 warps over 256-key tiles (133 KB) or 4 warps over 128-key / 64-key tiles (135 KB at head dim
# 128): 1.01-1.03x the three CTAs of 66-68 KB on one query row, paged 16 1.04-1.06x (H200, tune_decode.py --tiles);
# the small tiles where the shared memory is 99 KB. Blocks that fill the GPU (select._decoding_tile) run one split
# on two CTAs an SM of three stages: B = 64, 4096 keys 127 us at head dim 64 (133 on two stages, 127-128 on
# 64-key tiles of three or four CTAs), 16384 keys 483 at 64 and 954 at 128 (949 on the one-CTA tile; three CTAs of
# two stages 1031: 1.3 waves of 396 slots; H200, bf16, one query row of 4 heads, tune_decode.py --tiles).
add("fwd_decode", HALF_TYPES, [64], Tile(16, 256, 8, 2, "32 keys a warp, 133 KB: one CTA an SM"),
    Tile(16, 128, 4, 3, "32 keys a warp, three stages, 99 KB: two CTAs an SM (H100, H200)", ctas=2), split=True)
# float32 (3xTF32, rows padded by 4 floats): 16 keys a warp. Second, for blocks of at most 8 query rows
# (select.split_variants): the query-minor tile (S^T = K Q^T, 8 padded query rows, Q^T in registers), V rows padded
# by 8 floats: one query row of 4 heads at d=128 on the H200 80-88% of the HBM peak, where the 16-row strip reached
# 66-70% (bench_decode.py rows).
add("fwd_decode", ["float32"], [64], Tile(16, 64, 4, 2, "16 keys a warp, 77 KB: two CTAs an SM", ctas=2),
    Tile(8, 64, 4, 2, "8 query rows, 16 keys a warp, 78 KB: two CTAs an SM", ctas=2), split=True)
# float32 at head dim 128 on three K/V stages (219 / 217 KB) measured 0.98-1.04x two: two kept (tune_decode.py).
add("fwd_decode", ["float32"], [128], Tile(16, 64, 4, 2, "16 keys a warp, 149 KB: one CTA an SM"),
    Tile(8, 64, 4, 2, "8 query rows, 16 keys a warp, 145 KB: one CTA an SM"), split=True)
# Blocks of 17-32 rows at head dim 128 (8 query rows of 4 heads): two strips every warp holds over its 16 keys
# (flash_fwd_decode.cu STRIPS), 8 warps, one CTA an SM: against the 64-row split twin (H200, bf16, tune_decode.py
# --lq 8) 0.91-1.05x dense and 0.94-1.21x over pages of 16, which it reads within 1-4% of the contiguous cache
# (the twin 5-21%). Four strips at head dim 64 on 16 keys a warp measured 0.55-0.81x the twin: the accumulators'
# rescale and the row statistics come every 16 keys for 64 rows; more keys a warp need more registers.
add("fwd_decode", HALF_TYPES, [128], Tile(16, 128, 4, 2, "32 keys a warp, 135 KB: one CTA an SM"),
    Tile(16, 64, 4, 3, "16 keys a warp, three stages, 101 KB: two CTAs an SM (H100, H200)", ctas=2),
    Tile(16, 64, 4, 2, "16 keys a warp, 68 KB: where the shared memory is 99 KB", ctas=3),
    Tile(32, 128, 8, 2, "two strips, 16 keys a warp, 137 KB, 238 registers: one CTA an SM"), split=True)
# float64 (fp64 tensor cores, Q / K rows padded by 4 doubles, V by 2): 8 keys a warp (an n8 tile; 16 would
# need 64-key stages of 64 KB at d=128), four warps a CTA: a warp on each of an SM's schedulers (a 16-row split
# twin of one warp a CTA, two CTAs an SM, left two of the four idle: 31-35% of the H200's HBM peak).
add("fwd_decode", ["float64"], [64], Tile(16, 32, 4, 2, "8 keys a warp, 78 KB: two CTAs an SM", ctas=2), split=True)
# float64 at head dim 128 (one CTA an SM): six warps on 48-key tiles of two stages, 1.5 warps a scheduler, where
# the GPU's shared memory holds them (219 KB: 1.08-1.11x four warps on 32-key tiles of three stages, the same
# 219 KB, on the H200: tune_decode.py --dtypes float64 --tiles 16x32x4x3@1,16x48x6x2@1); four warps of two
# stages on the A100's 163 KB.
add("fwd_decode", ["float64"], [128], Tile(16, 48, 6, 2, "8 keys a warp, six warps, 219 KB: one CTA an SM"),
    Tile(16, 32, 4, 2, "8 keys a warp, 152 KB: one CTA an SM"), split=True)

# Hopper forward (fwd_wgmma, flash_fwd_wgmma.cu, arch "sm90a"): a TMA producer warpgroup and block_m / 64 consumer
# warpgroups of 64 query rows; S = Q K^T and O += P V on wgmma, Q/K/V in 128-byte swizzled shared memory on
# mbarrier stages. The limits are 227 KB of shared memory and the consumers' registers after setmaxnreg (232 with
# two consumer warpgroups, 160 with three): 0 spills offline (NVRTC 12.9, sm_90a), EXTRA included (a swizzled bias
# tile per K/V stage, copied by two producer warps). Consumer ping-pong measures 0.90-1.01x and is off
# (FwdWgmmaTraits::PINGPONG). Without EXTRA or a causal band the 192- and 128-row tiles are persistent (one CTA an
# SM walks query blocks; tune_persistent.py, H100, d=128: 1.15x / 1.13x bf16 / fp16 at L=1024, 1.03x / 1.00x at
# L=4096; causal calls measure 0.94-1.02x on the stride and keep a CTA a block).
add("fwd_wgmma", HALF_TYPES, [64], Tile(192, 128, 16, 2, "three consumer warpgroups: 1.12-1.25x two non-causal, "
                                                         "1.02-1.06x causal, L 2048-16384 (compare_trees.py)"),
     arch="sm90a")
add("fwd_wgmma", HALF_TYPES, [128], Tile(128, 128, 12, 2, "a TMA producer and two consumer warpgroups of 64 rows, "
                                                          "128-key tiles, an O tile: 193 KB"), arch="sm90a")
# Head dim 256: Q 64 KB + two stages of K and V 128 KB = 193 KB.
add("fwd_wgmma", HALF_TYPES, [256], Tile(128, 64, 12, 2, "a TMA producer and two consumer warpgroups of 64 rows, "
                                                         "64-key tiles (acc_o is 128 registers): 193 KB"),
     arch="sm90a")
# Short rows at d=64 (row_class, HOPPER_FWD_SHORT_KEYS): a 192-row CTA alone on its SM leaves its start and epilogue
# unhidden (~16 K cycles a block against ~2.5 K a key tile at L = 1024, ncu). Two CTAs an SM: 384 x 80 registers at
# launch, the producer keeps 24, the consumers take 104, which 64-key tiles fit with each P V waited for before the
# next S (OVERLAP_PV off; with it 16 bytes spill): 0 spills, consumer code up to R98 (NVRTC 12.9 and 13.0).
add("fwd_wgmma", HALF_TYPES, [64], Tile(128, 64, 12, 2, "short rows, two CTAs an SM (49 KB): 1.19-1.21x the 192-row "
                                                        "tile, causal 1.6x, at L = 1024 (tune_short.py)", ctas=2),
     arch="sm90a", short=True)

# Hopper backward (bwd_dkdv_wgmma, flash_bwd_wgmma.cu, arch "sm90a"; non-deterministic calls): dK, dV and atomic dQ.
# A TMA producer warp and two consumer warpgroups of 64 keys (a CTA per 128-key block), block_m query rows a step;
# S^T, dP^T, dV, dK and dQ on wgmma, dQ a 64 x 64 block per warpgroup (d=64 splits it by rows, d=128 by columns).
# The limits are 227 KB of shared memory and 232 consumer registers. EXTRA adds a swizzled bias tile per Q/dO stage
# (two producer warps copy it) and, with dbias wanted, reduces dS^T into a key-major fp32 accumulator: 0 spills,
# consumer code up to R205 (d=64) / R228 (d=128).
add("bwd_dkdv_wgmma", HALF_TYPES, [64], Tile(128, 128, 12, 2, "a TMA producer warp, two consumer warpgroups of 64 "
                                                              "keys, 128-query steps: 194 KB"), arch="sm90a")
add("bwd_dkdv_wgmma", HALF_TYPES, [128], Tile(64, 128, 12, 2, "a TMA producer warp, two consumer warpgroups of 64 "
                                                               "keys, 64-query steps: 193 KB"), arch="sm90a")
add("bwd_dkdv_wgmma", HALF_TYPES, [64], Tile(64, 128, 12, 2, "EXTRA: 64-query steps, dQ split by keys; two bias "
                                                              "stages: 161 KB (128-query steps: 258 KB)"),
     arch="sm90a", extra=True)
# Head dim 256: dK + dV of 64 keys over 256 columns would be 256 registers a consumer thread, so both warpgroups
# own the block's 64 keys and split dK, dV and dQ by columns; S^T and dP^T are formed once and P^T / dS^T
# exchanged in shared memory; dQ is staged in the step's Q / dO slabs.
add("bwd_dkdv_wgmma", HALF_TYPES, [256], Tile(64, 64, 12, 2, "a TMA producer warp, two consumer warpgroups sharing "
                                                              "64 keys, 128 columns each, 64-query steps: 226 KB"),
     arch="sm90a")

# FMA forward (fwd_fma): 16 x 16 threads, block_m / 16 query rows a thread; Q, K, V and P tiles once each in
# shared memory, which is the limit.
add("fwd_fma", ["float32"], [32, 64], Tile(64, 64, 8, 1, "4x4 scores per thread"))
_SMALL = "fits " + _SMALL_BYTES
add("fwd_fma", ["float32"], [128], Tile(64, 64, 8, 1, "113 KB shared"), Tile(32, 64, 8, 1, _SMALL))
add("fwd_fma", ["float32"], [256], Tile(64, 32, 8, 1, "137 KB shared; 32-key tiles"), Tile(16, 32, 8, 1, _SMALL))
# float32 on the TF32 tensor cores (flash_fwd_tf32.cu): fwd_tf32x3 is precision="highest" (3xTF32: three MMAs a
# product and the operand splits), fwd_tf32 precision="tf32" (one MMA). Each warp owns block_m / warps query rows
# in 16-row strips. 3xTF32 is MMA-bound, so one strip a warp with its K loop rolled (warp_gemm_tf32.cuh; two strips
# spill 20-324 bytes); at d=256 64x16/4w spills 4-188 bytes, so "highest" there takes the FMA kernel, as does any
# call whose GPU has no tile here (forward_variant). Registers: offline, NVRTC 12.9 (benchmarks/NOTES.md).
add("fwd_tf32x3", ["float32"], [32], Tile(64, 64, 4, 2, "one strip a warp (3xTF32 is MMA-bound), 64-key tiles: "
                                                         "54 KB"))
# The fast operand split (Tile.split 2, TF32X3_FAST) takes 3 instructions an element instead of 7 with the rounded
# split's errors (4.6-4.7e-7 against float64). tune_f32.py, H100, TFLOP/s at L=4096 non-causal / causal:
#   d=64:  rounded 64x64/4w 42.0 / 39.9; fast 64x64/4w 54.1 / 49.7, 64x32/4w 50.1 / 46.3, 128x64/8w 51.7 / 47.6
#   d=128: rounded 128x16/8w 36.7 / 33.5, 128x32/8w 42.5 / 39.6; fast 128x16/8w 43.5 / 38.7, 128x32/8w 50.5 / 46.6
# Fast 64x64 at d=64: 254 registers on sm_90, 12 bytes spilled on sm_80 (an "sm90" row).
add("fwd_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "fast split, one strip a warp, 32-key tiles: 1.19x the "
                                                         "rounded 64x64 (tune_f32.py); 68 KB", split=2))
add("fwd_tf32x3", ["float32"], [64], Tile(64, 64, 4, 2, "fast split, 64-key tiles: 1.25-1.29x the rounded 64x64 "
                                                         "(tune_f32.py); spills 12 bytes on sm_80; 102 KB",
                                           split=2), arch="sm90")
# 128x32/8w fast spills 16 bytes on sm_90 in its element-load (vec=False) variants: 16-byte loads only.
add("fwd_tf32x3", ["float32"], [128], Tile(128, 32, 8, 2, "fast split, 8 warps of one strip, 32-key tiles, 16-byte "
                                                           "loads: 1.38-1.39x the rounded 128x16 (tune_f32.py); "
                                                           "198 KB", split=2, vec_only=True),
     Tile(128, 16, 8, 2, "element loads (32-key tiles spill 16 bytes on sm_90), fast split, 16-key tiles: "
                         "1.16-1.19x the rounded one (tune_f32.py); 165 KB", split=2),
     Tile(64, 16, 4, 2, "4 warps, 16-key tiles: 99 KB, the A100 and " + _SMALL_BYTES, split=2))
add("fwd_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "the bias stages, 32-key tiles (64 keys spill 4 bytes on "
                                                         "sm_80), fast split: 88 KB", split=2), extra=True)
add("fwd_tf32x3", ["float32"], [128], Tile(64, 16, 4, 2, "the bias stages, fast split: 111 KB", split=2), extra=True)
# Plain TF32: one MMA a product, so two strips a warp as the 16-bit kernel (each K / V fragment feeds two MMAs;
# shared-memory bandwidth bounds the one-strip loop). Tiles sized by shared memory, 0 spills on sm_80 / sm_90.
add("fwd_tf32", ["float32"], [32, 64], Tile(128, 64, 4, 2, "two strips a warp, 64-key tiles: d=64 102 KB"),
     Tile(64, 32, 4, 2, "one strip, 32-key tiles: " + _SMALL_BYTES))
add("fwd_tf32", ["float32"], [128], Tile(128, 32, 4, 2, "two strips a warp, 32-key tiles: 132 KB"),
     Tile(64, 32, 4, 2, "one strip: 99 KB, the A100 and " + _SMALL_BYTES),
     Tile(64, 16, 4, 2, "16-key tiles: with the bias stages 78 KB, " + _SMALL_BYTES))
add("fwd_tf32", ["float32"], [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles: "
                                                        "195 KB"),
     Tile(64, 16, 4, 2, "16-key tiles: 130 KB, the A100"))
# float32 on Hopper's wgmma with TF32 operands (fwd_wgmma_tf32x3, flash_fwd_wgmma_tf32.cu, arch "sm90a"): a TMA
# producer warpgroup that also writes K's parts and V's transposed parts (TF32 wgmma takes K-major shared operands
# only) and consumer warpgroups of 64 rows; 3xTF32 in fresh fragments pipelined two deep (wgmma_tf32.cuh). Shared
# memory is the limit (fp32: Q twice, a stage's K twice, V once, V^T twice). Offline (NVRTC 12.9, sm_90a), 0
# spills: consumers up to R227 of 232 at d=64 and R233 of 240 at d=128 with EXTRA, which keeps these tiles (no room
# for bias stages: the consumers read the bias from global memory into S's fragments, bias_frags.cuh).
# Plain TF32 on wgmma (fwd_wgmma_tf32, SPLIT 0) has no rows: bench_precision.py --quick on the H100 measures it
# below fwd_tf32 (127.9 against 146.2 TFLOP/s at D=64, 76.7 against 138.7 at D=128; the V^T copy is the limit).
add("fwd_wgmma_tf32x3", ["float32"], [64], Tile(128, 64, 12, 2, "two consumer warpgroups of 64 rows, 64-key tiles "
                                                                "(225 KB): 79 TFLOP/s, 1.45x the portable table "
                                                                "(tune_f32.py, H100)", split=3), arch="sm90a")
add("fwd_wgmma_tf32x3", ["float32"], [128], Tile(64, 32, 8, 2, "one consumer warpgroup, 32-key tiles (225 KB): "
                                                               "54 TFLOP/s, 1.04x the portable table (H100)",
                                                 split=3),
     arch="sm90a")

# fp64 tensor-core forward (fwd_dmma; mma.sync m8n8k4, m16n8k16 on "sm90" rows via wide_k): each warp owns
# block_m / warps query rows in 8-row tiles, and every K / V fragment it loads feeds one MMA per row tile (an
# 8-byte load by a warp costs about one m8n8k4, warp_gemm_f64.cuh). At 4 warps the registers (140-250) allow two
# CTAs an SM, so a tile of <= 113 KB runs 8 warps an SM. A head bucket without a fwd_dmma row takes fwd_fma
# (forward_variant). tune_fwd.py --dtype float64, H100, TFLOP/s at L=4096 non-causal / causal:
#   d=64:  FMA 11.5 / 10.8, 64x32/4w 18.5 / 17.6, 64x16/4w 19.5 / 18.3, 64x64 and 128x32 13.8-13.9
#   d=128: FMA 9.7 / 9.4, 64x32/4w 16.0 / 15.4, 64x24 15.7 / 15.0, 64x16 15.0 / 14.3
# (64x16 at d=64 is unmeasured at L=1024.) Offline registers (sm_80 / sm_90, every flag, 0 spills): d=32 128x32
# 214-230 (128x64 spills 64-550 bytes); d=64 64x32 174-196 (128x32 252 plain, spills with EXTRA or the band);
# d=128 64x32 238-242; d=256 32x16 230-250.
add("fwd_dmma", ["float64"], [32], Tile(128, 32, 4, 2, "four 8-row tiles a warp (half the shared loads per MMA "
                                                        "of two); 71 KB, two CTAs an SM by registers"))
add("fwd_dmma", ["float64"], [64], Tile(64, 32, 4, 2, "two 8-row tiles a warp, 101 KB: two CTAs an SM; four tiles "
                                                       "spill with EXTRA or the band"),
     Tile(64, 16, 4, 2, "16-key tiles: 69 KB, " + _SMALL))
add("fwd_dmma", ["float64"], [128], Tile(64, 32, 4, 2, "two 8-row tiles a warp, 197 KB (one CTA an SM)"),
     Tile(64, 16, 4, 2, "16-key tiles: 131 KB, the A100"), Tile(32, 16, 2, 2, "two warps: 99 KB, " + _SMALL))
# sm_90 runs mma.m16n8k{4,8,16}.f64 at full rate, m8n8k4 at half (dmma_rate.py, H100: 66 against 33 TFLOP/s).
# tune_fwd.py --dtype float64, H100, TFLOP/s at L=4096 non-causal / causal (errors 2.1-2.2e-15, as m8n8k4's):
#   d=64:  64x32/4w m8n8k4 18.5 / 18.1, k16 25.5 / 22.5, k4 25.9 / 24.8; 128x32/8w k16 26.8 / 24.9
#   d=128: 64x32/4w m8n8k4 16.0 / 15.5, k16 20.0 / 19.1, k4 23.0 / 21.9; 128x16/8w 21.5 / 19.8, k16 31.5 / 28.5
#   H200 (tune_fwd.py --wide-only --lengths 4096): d=64 128x32/8w k16 27.1 / 25.9, k8 27.3 / 25.8; 128x64/8w k8
#   29.4 / 27.8; 64x32/4w k8 24.4 / 23.8; d=128 128x16/8w k16 32.6 / 30.1, k8 32.5 / 29.9
add("fwd_dmma", ["float64"], [64], Tile(128, 64, 8, 2, "mma.m16n8k8 (full-rate fp64 on sm_90), two 8-row tiles a "
                                                        "warp over 64-key tiles: 1.07-1.09x 128x32/8w on k16, "
                                                        "1.5x m8n8k4's 64x32 (tune_fwd.py, H200); 202 KB",
                                         wide_k=8), arch="sm90")
add("fwd_dmma", ["float64"], [128], Tile(128, 16, 8, 2, "mma.m16n8k16 (full-rate fp64 on sm_90), 8 warps, 16-key "
                                                         "tiles: 1.84-1.97x m8n8k4's 64x32 (tune_fwd.py); 197 KB",
                                          wide_k=16), arch="sm90")
# Split twins for float64 decoding calls (a few packed query rows over many keys): 16-row tiles of two warps, where
# the prefill tiles' 64 / 128 rows (for 4 useful ones) kept float64 decoding at 15-21% of the H200's HBM peak,
# bound by padded fp64 MMAs; these reach 31-35% at d=128 (benchmarks/bench_decode.py).
add("fwd_dmma", ["float64"], [64], Tile(16, 32, 2, 2, "16 rows, 32-key tiles, 77 KB: two CTAs an SM",
                                        split_only=True), split=True)
add("fwd_dmma", ["float64"], [128], Tile(16, 32, 2, 2, "16 rows, 32-key tiles, 151 KB", split_only=True),
    Tile(16, 16, 2, 2, "16-key tiles: 84 KB, " + _SMALL, split_only=True), split=True)
# sm_90: one warp's pair of 8-row tiles on mma.m16n8k16 (full fp64 rate), two CTAs an SM
add("fwd_dmma", ["float64"], [64], Tile(16, 32, 1, 2, "16 rows on m16n8k16, 77 KB", wide_k=16, split_only=True),
    arch="sm90", split=True)
add("fwd_dmma", ["float64"], [128], Tile(16, 16, 1, 2, "16 rows on m16n8k16, 16-key tiles: 84 KB", wide_k=16,
                                         split_only=True), arch="sm90", split=True)
add("fwd_dmma", ["float64"], [256], Tile(32, 16, 4, 2, "acc_o alone is 128 registers: one 8-row tile a warp; 195 KB"),
     Tile(32, 8, 4, 2, "8-key tiles: 133 KB, the A100"), Tile(8, 8, 1, 2, "one warp: 83 KB, " + _SMALL))
# With EXTRA each stage also holds a BM x BN fp64 bias tile: smaller tiles keep two CTAs an SM.
add("fwd_dmma", ["float64"], [32], Tile(64, 32, 4, 2, "the bias stages: 95 KB at 64 rows (two CTAs an SM; 128 rows: "
                                                       "151 KB, one)"), extra=True)
add("fwd_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "the bias stages: 94 KB with 16-key tiles (two CTAs an SM; "
                                                       "32 keys: 141 KB, one)"), extra=True)
add("fwd_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "the bias stages: 156 KB with 16-key tiles (32 keys: 237 KB "
                                                        "exceed 227)"),
     Tile(32, 8, 2, 2, "two warps, 8-key tiles: 71 KB, " + _SMALL), extra=True)
add("fwd_dmma", ["float64"], [256], Tile(32, 16, 4, 2, "the bias stages: 207 KB"),
     Tile(32, 8, 4, 2, "8-key tiles: 137 KB, the A100"), Tile(8, 8, 1, 2, "one warp: 84 KB, " + _SMALL), extra=True)

# Tensor-core backward (bwd_dkdv_mma, flash_bwd_mma.cu): warp w owns block_n / warps keys in 16-key strips
# (KEY_STRIPS), block_m query rows a step; with two strips each Q / dO fragment it loads feeds two MMAs in all
# four GEMMs, and a 128-key block halves the dQ atomics and the Q / dO loads per key. The limit is registers
# (dK + dV, S^T + dP^T; 0 spills offline, NVRTC 12.9, sm_80 / sm_90): d=64 two strips a warp at 32-query steps
# (254-255 registers), d=128 two passes where one pass spills; the EXTRA kernels keep one-strip 64x64 tiles.
# The atomic dQ goes into fragment tiles (atomics.cuh, dq_tile): one 16-byte reduction a lane and fragment.
# tune_bwd.py, H100, fp16 L=4096, attention_backward ms non-causal / causal (dK, dV bitwise equal across layouts):
#   d=64:  64x64/4w 8.27 / 4.78, 32x128/4w 6.38 / 3.87, 32x64/4w 8.08 / 5.39, 64x128/8w 7.98 / 4.77
#   d=128: 64x64/4w two passes 9.73 / 5.47, 32x128/8w 7.81 / 4.55, 32x64/4w 8.04 / 4.53
add("bwd_dkdv_mma", HALF_TYPES, [32], Tile(64, 64, 4, 2, "2 stages +2-3% over 1 (tune_bwd.py)"))
add("bwd_dkdv_mma", HALF_TYPES, [64], Tile(32, 128, 4, 2, "two 16-key strips a warp: 1.24-1.29x the 64x64 "
                                                          "layout (tune_bwd.py); 66 KB"))
# d=128 keeps its dQ fragments out of shared memory (173 KB). late_copies: +1-3% at d=128 (one CTA of 8 warps an
# SM), 0.97-1.0x at d=64 (two CTAs of 4), tune_bwd.py, H100, bf16, L=2048-16384.
add("bwd_dkdv_mma", HALF_TYPES, [128], Tile(64, 128, 8, 2, "two warps a 32-key group, 64-query steps, P^T and dS^T "
                                                           "through shared memory (FlashAttention-2's layout): "
                                                           "173 KB", query_split=2, late_copies=True),
     Tile(64, 128, 8, 1, "the same with one Q/dO stage: 138.5 KB (A100)", query_split=2),
     Tile(32, 64, 4, 2, "one pass, 32-query steps (within 3% of 32x128/8w on the H100): 75 KB, " + _SMALL))
add("bwd_dkdv_mma", HALF_TYPES, [64], Tile(64, 64, 4, 2, "EXTRA (251-255 registers at one strip): 2 stages +2-3% "
                                                         "over 1 (tune_bwd.py)"), extra=True)
add("bwd_dkdv_mma", HALF_TYPES, [128], Tile(64, 64, 4, 2, "EXTRA: 2 stages +2-3% over 1 (tune_bwd.py); 112 KB "
                                                          "shared", passes=2),
     Tile(64, 64, 4, 1, "one Q/dO stage: 78 KB, " + _SMALL, passes=2), extra=True)
# dQ (bwd_dq_mma): each warp owns 16 query rows, block_n keys a step; the limit is registers against the CTAs an SM.
add("bwd_dq_mma", HALF_TYPES, [32], Tile(64, 64, 4, 1, "16 rows per warp, 64-key steps; 21 KB shared: three "
                                                       "CTAs an SM at <= 168 registers", ctas=3))
add("bwd_dq_mma", HALF_TYPES, [64], Tile(64, 64, 4, 1, "16 rows per warp, 64-key steps; a 168-register cap (three "
                                                       "CTAs an SM) spills 16 bytes on sm_90, so two"))
add("bwd_dq_mma", HALF_TYPES, [128], Tile(64, 32, 4, 1, "32-key steps: 64-key steps spill"))
add("bwd_dq_mma", HALF_TYPES, [32], Tile(64, 64, 4, 1, "EXTRA spills under the 168-register cap: two CTAs an SM",
                                         ctas=2), extra=True)
# dbias (bwd_dbias_mma): warps of 16 query rows, the step's Q/dO/K/V/bias double-buffered. Every step loads four
# fresh tiles for two GEMMs, so a larger accumulator tile amortises each load over more MMAs (64x64: 32 FLOP per
# byte loaded; 128x64: 43; tune_dbias.py). 128x128 at d=64 spills 52-180 bytes in every variant but the plain
# 16-byte-load one.
add("bwd_dbias_mma", HALF_TYPES, [32], Tile(128, 64, 8, 2, "8 warps of 16 rows, 97 KB: 1.3x the MMAs per byte "
                                                       "loaded of 64x64"))
add("bwd_dbias_mma", HALF_TYPES, [64], Tile(128, 64, 8, 2, "8 warps of 16 rows, 145 KB: 1.3x the MMAs per byte "
                                                       "loaded of 64x64"),
     Tile(64, 64, 4, 2, "as the dQ kernel's rows; 2 stages: 92 KB, two CTAs an SM, " + _SMALL, ctas=2))
add("bwd_dbias_mma", HALF_TYPES, [128], Tile(64, 64, 4, 2, "2 stages: 155 KB"),
     Tile(64, 64, 4, 1, "one stage: 78 KB, " + _SMALL))

# FMA backward (bwd_dkdv_fma, bwd_dq_fma): 16 x 16 threads; K, V, Q, dO tiles in the input dtype and P, dS tiles
# in the accumulator dtype in shared memory; dK, dV in registers. The limits are shared memory and the
# 128-register cap of two CTAs an SM.
for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    add(_fam, ["float32"], [32, 64], Tile(64, 64, 8, 1, "two CTAs an SM at <= 128 registers (one CTA at 145 "
                                                         "measures -25%); 98 KB shared, 4x4 scores per thread",
                                           ctas=2))
    add(_fam, ["float32"], [128], Tile(64, 64, 8, 1, "162 KB shared"), Tile(32, 32, 8, 1, _SMALL))
    add(_fam, ["float32"], [256], Tile(32, 32, 8, 1, "137 KB shared; dK+dV are 64 registers"),
         Tile(16, 16, 8, 1, _SMALL))
    add(_fam, HALF_TYPES, [256], Tile(32, 32, 8, 1, "73 KB shared; dK+dV are 64 registers: two CTAs an SM at "
                                                     "<= 128 registers", ctas=2))
    # float64 at head dims 32-128 takes bwd_dkdv_dmma / bwd_dq_dmma below; as a baseline the FMA kernel fits
    # 32x32/8w at d=32, 64 (84 KB) and 128 (146 KB).
    add(_fam, ["float64"], [256], Tile(16, 32, 8, 1, "fp64: 201 KB shared; dK+dV are 128 registers"),
         Tile(16, 16, 8, 1, "133 KB: the A100; no fp64 head-dim-256 backward fits 99 KB"))

for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    add(_fam, ["float32"], [32, 64], Tile(64, 64, 8, 1, "EXTRA spills 8-80 bytes under the 128-register cap of "
                                                        "two CTAs an SM: one"), extra=True)
add("bwd_dkdv_fma", ["float64"], [256], Tile(16, 16, 8, 1, "EXTRA spills 12 bytes with 32-key tiles: 16"), extra=True)
for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    add(_fam, HALF_TYPES, [256], Tile(32, 32, 8, 1, "EXTRA spills 12-180 bytes under two CTAs' 128 registers: one"),
         extra=True)

# fp64 tensor-core backward (bwd_dkdv_dmma, flash_bwd_dmma.cu; mma.sync m8n8k4). dK/dV: 4 warps, each owning
# block_n / 32 8-key tiles (dK, dV accumulators: head * tiles registers; one pass while that is <= 128), block_m
# query rows a step; all tiles unpadded and swizzled (swizzle_f64.cuh). The tiles are untimed (tune_bwd.py times
# them): shared memory for two CTAs an SM on the H100, registers from the offline compile (NVRTC 12.9, sm_80 /
# sm_90, every flag, 0 spills): d=32 32x64/4w 188-238, d=64 16x64/4w 220-255, d=128 16x32/4w 224-254.
# With EXTRA (bias stages, per-element dropout draws, dbias) 32-query steps at d=32 and two key tiles a warp at
# d=64 spill 12-84 bytes on sm_90; the EXTRA tiles take 156-195 registers (8x64 with 8-query steps fits at 255).
add("bwd_dkdv_dmma", ["float64"], [32], Tile(32, 64, 4, 2, "two 8-key tiles a warp, 32-query steps: 82 KB, two "
                                                            "CTAs an SM"))
add("bwd_dkdv_dmma", ["float64"], [64], Tile(16, 64, 4, 2, "two 8-key tiles a warp (dK + dV: 128 registers): "
                                                            "104 KB, two CTAs an SM"),
     Tile(16, 32, 4, 2, "one 8-key tile a warp: 70 KB, " + _SMALL_BYTES + " (one stage of 16x64 spills)"))
add("bwd_dkdv_dmma", ["float64"], [128], Tile(16, 32, 4, 1, "one 8-key tile a warp (dK + dV: 128 registers), one "
                                                             "Q/dO stage: 100 KB, two CTAs an SM"),
     Tile(8, 32, 4, 1, "8-query steps: 84 KB, " + _SMALL_BYTES))
add("bwd_dkdv_dmma", ["float64"], [32], Tile(16, 64, 4, 2, "16-query steps (32 spill with EXTRA): 73 KB"),
     extra=True)
add("bwd_dkdv_dmma", ["float64"], [64], Tile(16, 32, 4, 2, "one 8-key tile a warp (two spill with EXTRA): 78 KB"),
     extra=True)
add("bwd_dkdv_dmma", ["float64"], [128], Tile(16, 32, 4, 1, "the bias stage: 104 KB"),
     Tile(8, 32, 4, 1, "8-query steps: 86 KB, " + _SMALL_BYTES), extra=True)
# sm_90: full-rate mma.m16n8k8 on pairs of 8-key tiles (m8n8k4 runs at half rate there; ncu of the 16x32/4w d=128
# kernel on the H200: the DMMA pipe 62% busy, math-pipe throttle and fixed-latency waits the top stalls).
# tune_bwd.py --dtype float64, H200, L=4096, atomic dQ, ms non-causal / causal:
#   d=64:  16x64/4w m8n8k4 60.2 / 31.1; 16x128/8w k8 43.5 / 22.2; head-split 32x64/8w k8 59.0 / 29.9, k16 60.2 /
#          30.6, 16x64/8w k16 67.5 / 34.5
#   d=128: 16x32/4w m8n8k4 68.5 / 33.8; head-split 16x64/8w k8 56.2 / 27.8, k16 56.2 / 28.3 (spills 32 bytes)
# Registers (NVRTC 12.9, sm_90, 0 spills): d=64 16x128/8w 244-255; d=128 head-split 16x64/8w k8 255.
# Element loads spill on these tiles (8-56 bytes; vec_only: they take the sm80 row, select._fit_portable), and so
# do the head-split tile's deterministic and packed kernels (24-68 bytes: select._dkdv_dmma_arch and
# packed_backward_variants take the sm80 row there).
add("bwd_dkdv_dmma", ["float64"], [64], Tile(16, 128, 8, 2, "two 8-key tiles a warp on m16n8k8: 1.38-1.40x the "
                                                             "m8n8k4 16x64/4w tile (tune_bwd.py); 176 KB",
                                             wide_k=8, vec_only=True), arch="sm90")
add("bwd_dkdv_dmma", ["float64"], [128], Tile(16, 64, 8, 2, "two warps a 16-key group, half the columns each "
                                                             "(head_split), on m16n8k8: 1.22x the m8n8k4 16x32/4w "
                                                             "tile (tune_bwd.py); 200 KB", wide_k=8, head_split=2,
                                              vec_only=True), arch="sm90")
# Deterministic dQ (bwd_dq_dmma): query-major as the forward; each warp owns block_m / warps query rows in 8-row
# tiles, K/V double-buffered; untimed, sized by shared memory.
add("bwd_dq_dmma", ["float64"], [32], Tile(64, 32, 4, 2, "two 8-row tiles a warp: 64 KB"))
add("bwd_dq_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "two 8-row tiles a warp, 16-key steps: 96 KB, two CTAs "
                                                          "an SM"))
add("bwd_dq_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "two 8-row tiles a warp (dQ: 128 registers): 192 KB"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 128 KB, the A100"),
     Tile(16, 16, 2, 2, "two warps: 96 KB, " + _SMALL_BYTES))
# sm_90: the d=64 tile on m16n8k16 (tune_bwd.py, H200, deterministic, with the dK/dV kernel on k16: 59.2 / 30.9 ms
# against 84.0 / 43.5 on m8n8k4; 200 registers, 0 spills). At d=128 k16 spills 28 bytes: m8n8k4 stays.
add("bwd_dq_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "two 8-row tiles a warp on m16n8k16: 96 KB", wide_k=16),
    arch="sm90")
# With EXTRA each K/V stage also holds a block_m x block_n fp64 bias tile.
add("bwd_dq_dmma", ["float64"], [32], Tile(64, 16, 4, 2, "the bias stages: 72 KB with 16-key steps"), extra=True)
add("bwd_dq_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "the bias stages: 120 KB"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 76 KB, " + _SMALL_BYTES), extra=True)
add("bwd_dq_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "the bias stages: 216 KB"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 140 KB, the A100"),
     Tile(8, 16, 1, 2, "one warp: 83 KB, " + _SMALL_BYTES), extra=True)

# float32 backward on the TF32 tensor cores (flash_bwd_tf32.cu): *_tf32x3 is precision="highest" (3xTF32), *_tf32
# precision="tf32". dK/dV: a warp owns 16 keys (block_n = 16 * warps); K and V are split once per CTA in shared
# memory (3xTF32: big and small parts, four fp32 tiles), Q / dO / bias per stage, dS^T for the atomic dQ. dQ: a warp
# owns 16 query rows; Q and dO split once (four tiles with 3xTF32), K / V / bias per stage. Tiles sized by shared
# memory, 0 spills offline (NVRTC 12.9, sm_80 / sm_90; registers in benchmarks/NOTES.md). A call whose GPU has no
# tile here takes the FMA kernel for that part of the plan (_backward_plan). 3xTF32 dK/dV spills at 64-query steps
# at d=32 (20-36 bytes on sm_80), 32-query steps at d=64 (28-68) and in one pass at d=128 (16-64): half the query
# rows a step at d=32 and 64, two passes at d=128 (dV, then dK and dQ: S^T twice).
add("bwd_dkdv_tf32x3", ["float32"], [32], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps (64 spill 20-36 "
                                                              "bytes on sm_80): 65 KB (EXTRA 82)"))
# Fast operand split (Tile.split 2), tune_f32.py, H100, backward TFLOP/s non-causal / causal, errors equal:
# d=64 rounded 33.4 / 30.3, fast 38.8 / 35.3; d=128 rounded 19.6 / 18.8, fast 21.9 / 20.8.
add("bwd_dkdv_tf32x3", ["float32"], [64], Tile(16, 64, 4, 2, "fast split, 16-query steps (32 spill): 1.16x the "
                                                              "rounded split (tune_f32.py); 92 KB (EXTRA 99)",
                                                split=2))
# Head dim 128: K and V's parts fill the shared memory, one CTA an SM, so four warps left one warp a scheduler
# waiting on its MMAs (ncu: 6% occupancy). Eight warps, two a 16-key strip (query groups, DkdvTf32Traits), on
# 32-query steps: backward 1.34x / 1.35x the four-warp tile non-causal / causal (H200, tune_f32.py, B=4 H=16 L=4096;
# at head dim 64, two CTAs an SM already, 0.99-1.01x); EXTRA (bias, mask, dropout) 1.29-1.40x (benchmarks/NOTES.md).
_TF32X3_DKDV_128 = Tile(16, 64, 4, 1, "one Q/dO stage: 157 KB (EXTRA 162), the A100", passes=2, split=2)
add("bwd_dkdv_tf32x3", ["float32"], [128], Tile(32, 64, 8, 2, "two query groups of 16 a step, one pass (16-byte "
                                                "loads; select._dkdv_passes): 212 KB", split=2, vec_only=True),
    Tile(32, 64, 8, 2, "two query groups of 16 a step, two passes: 212 KB", passes=2, split=2), _TF32X3_DKDV_128)
add("bwd_dkdv_tf32x3", ["float32"], [128], Tile(32, 64, 8, 2, "two query groups of 16 a step, two passes, a bias "
                                                "stage beside Q / dO's: 225 KB", passes=2, split=2),
    _TF32X3_DKDV_128, extra=True)
add("bwd_dkdv_tf32", ["float32"], [32], Tile(64, 64, 4, 2, "16 keys a warp, 64-query steps: 73 KB (EXTRA 108)"),
     Tile(32, 64, 4, 2, "32-query steps: 46 KB (EXTRA 64), " + _SMALL_BYTES))
add("bwd_dkdv_tf32", ["float32"], [64], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps: 79 KB (EXTRA 97)"))
# precision="tf32" at head dim 128: query groups of 32 on 64-query steps (216 KB) 1.10x / 1.13x the 4-warp tile
# non-causal / causal (H200, B=4 H=16 L=4096, a .dev A/B; benchmarks/NOTES.md); EXTRA (250 KB) keeps the 4-warp one.
_TF32_DKDV_128 = (Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps: 145 KB (EXTRA 162)"),
                  Tile(16, 64, 4, 1, "16-query steps, one Q/dO stage: 90 KB (EXTRA 94), " + _SMALL_BYTES))
add("bwd_dkdv_tf32", ["float32"], [128], Tile(64, 64, 8, 2, "two query groups of 32 a step: 216 KB"), *_TF32_DKDV_128)
add("bwd_dkdv_tf32", ["float32"], [128], *_TF32_DKDV_128, extra=True)
add("bwd_dq_tf32x3", ["float32"], [32], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 74 KB (EXTRA 111)"),
     Tile(64, 32, 4, 2, "32-key steps: EXTRA 76 KB, " + _SMALL_BYTES))
add("bwd_dq_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "16 rows a warp, 32-key steps: 104 KB (EXTRA 125)"),
     Tile(32, 32, 2, 2, "two warps: 70 KB (EXTRA 80), " + _SMALL_BYTES))
# Head dim 128: Q and dO's parts fill the shared memory, one CTA an SM; eight warps, two a 16-row strip (key groups,
# DqTf32Traits), on 32-key steps: the deterministic backward 1.08x / 1.09x non-causal / causal (H200, B=4 H=16
# L=4096; benchmarks/NOTES.md).
_TF32X3_DQ_128 = (Tile(64, 16, 4, 2, "16 rows a warp, 16-key steps: 169 KB (EXTRA 181)"),
                  Tile(32, 16, 2, 2, "two warps: 101 KB (EXTRA 108), the A100"))
add("bwd_dq_tf32x3", ["float32"], [128], Tile(64, 32, 8, 2, "two key groups of 16 a step: 203 KB"), *_TF32X3_DQ_128)
add("bwd_dq_tf32x3", ["float32"], [128], *_TF32X3_DQ_128, extra=True)   # key groups: plain variants
add("bwd_dq_tf32", ["float32"], [32], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 55 KB (EXTRA 92)"))
add("bwd_dq_tf32", ["float32"], [64], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 104 KB (EXTRA 141)"),
     Tile(64, 32, 4, 2, "32-key steps: 70 KB (EXTRA 90), " + _SMALL_BYTES))
add("bwd_dq_tf32", ["float32"], [128], Tile(64, 32, 4, 2, "16 rows a warp, 32-key steps: 135 KB (EXTRA 156)"),
     Tile(64, 16, 4, 2, "16-key steps: 101 KB, " + _SMALL_BYTES),
     Tile(32, 16, 2, 2, "two warps: EXTRA 74 KB, " + _SMALL_BYTES))

# Row-wise helpers (bwd_dsum, bwd_convert_dq; flash_bwd_aux.cu): block_m / warps rows a warp, 16-byte loads a lane
# where rows allow; memory-bound, so sized by the bytes in flight against registers (head dim does not matter: key
# 0). ncu, H100: one warp a row, 8 rows a CTA and one element a lane reach 1.6 (dsum) and 2.0 (convert) of
# ~3.35 TB/s; on the same shape these tiles take dsum to 61 us (from 82) and convert to 70 us (from 98).
add("bwd_dsum", DTYPES, [0], Tile(16, 0, 8, 1, "2 rows a warp: dO and O of both in flight, 64 bytes a lane; "
                                   "<= 48 registers, 5 CTAs an SM (80 KB in flight); 8 CTAs (<= 32) spill",
                                   ctas=5))
add("bwd_convert_dq", DTYPES, [0], Tile(16, 0, 8, 1, "2 rows a warp: 32 bytes of dQ_acc a lane in flight; a full "
                                         "SM, 8 CTAs at <= 32 registers (64 KB in flight); 4 rows need 56", ctas=8))

# Split-KV combine (fwd_combine, flash_fwd_combine.cu): one warp a query row, the row's partial O read once per
# split, head dim the bucket of Dv; the partial results are a few rows against the split keys' K and V.
add("fwd_combine", DTYPES, [32, 64, 128, 256], Tile(4, 1, 4, 1, "one warp a row, 4 rows a CTA"))
