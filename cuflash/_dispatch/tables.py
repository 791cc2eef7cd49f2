"""The tile tables: for each (architecture row, kernel family, dtype, head-dim bucket), the tiles in
order of preference, each with one line of reason (a measurement with its script, or the constraint
that chose it). A call takes the first tile whose shared memory fits its GPU (SMEM_LIMITS), so an
entry tuned on an H100 / H200 (227 KB) keeps a tile for the A100 (163 KB) and for sm_86 / sm_89 /
sm_120 GPUs (99 KB). Rows: "sm80" (the portable kernels on every GPU), "sm90" (portable kernels'
tiles for compute capability 9.0 and newer), "sm90a" (Hopper's own kernels).
"""
from __future__ import annotations

from .model import DTYPES, HALF_TYPES, Tile, add

# Each entry lists tiles in order of preference; a call takes the first whose
# shared memory fits the device's per-block limit (SMEM_LIMITS), so a table entry
# tuned on an H100 (227 KB) keeps a configuration for the A100 (163 KB) and for
# sm_86 / sm_89 / sm_120 GPUs (99 KB).
_SMALL_BYTES = "99 KB of shared memory (sm_86 / sm_89 / sm_120)"

# Tensor-core forward: each warp owns block_m / warps query rows, in 16-row strips;
# with two strips a warp reuses every K / V fragment it loads for two MMAs (the
# 16-row loop was bound by shared-memory bandwidth: 36 ldmatrix.x4 per 64 MMAs).
# benchmarks/tune_fwd.py on an H100 (fp16 / bf16 alike, B*L=16384, H*D=2048;
# TFLOP/s at L=4096, non-causal / causal), 2026-11-23:
#   d=32:  64x64/4w 151/140   128x64/4w 181/141   128x128/4w 184/168   64x64/2w 168/134
#   d=64:  64x64/4w 194/172   128x64/4w 223/195   64x64/2w 199/176     128x32/4w 206/160
#   d=128: 64x64/4w 207/187   128x32/4w 230/189   64x32/2w 209/176
#   (2026-11-22, one strip: d=256 64x32/4w 188/145 beat 32x32/2w 129/88; at d=256 two strips spill.)
# 128x64 at d=128 spills (acc_o + S exceed 255 registers). Sixteenth session, tune_fwd.py on the portable
# path of an H100 (fp16 / bf16, L=4096): 128x32/4w 327/325 non-causal, 276/284 causal; 128x64/4w 343/353,
# 289/283 (L=1024: +5-8% both): FA2's tile is faster, but it spills 8-56 bytes (NVRTC 12.9 and 13.0, plain and
# band variants); recomputing the block after the loop (blockIdx read through asm volatile) only moved the
# spills into the loop. Not adopted while a variant spills.
add("fwd_mma", HALF_TYPES, [32], Tile(128, 128, 4, 2, "two strips per warp: +19% over 64x64/4w (tune_fwd.py)"))
# d=64, 128x128 (2026-11-23, fourth session, fp16 tune_fwd.py): 241 -> 269 TFLOP/s at L=4096 over 128x64,
# 183 -> 203 at L=1024; causal 197 -> 220 while the band variant still spilled 132 bytes. It fits every
# plain and band variant (both load widths) since P is packed to 16 bits as the softmax forms it, the
# partial tiles' mask is two bounds a fragment row, the fully visible tiles are found once per warp
# and the K/V loader walks one pointer down the rows (branch band128): 251-255 registers, 0 spills
# on sm_80 and sm_90 (the band variant spilled 132 bytes, the sm_80 scalar-load one 108).
add("fwd_mma", HALF_TYPES, [64], Tile(128, 128, 4, 2, "two strips of 128 keys: +11% (causal +12%, spilling) over "
                                                      "128x64 (tune_fwd.py); 251-255 registers, 0 spills"))
# d=128 at FA2's 128x64 (twentieth session). Without PARK it spills 8-56 bytes (the block's coordinates, the K/V
# pointers or the loop bounds, wherever ptxas puts the pressure); with PARK (Tile.park) they wait in the Q rows'
# padding and every plain and band variant fits 255 registers, 0 spills (NVRTC 12.9, sm_80 / sm_90). PARK costs
# 30-60 instructions a step (the parked values come back per thread, not in uniform registers): 2-4% against the
# spilling kernel. tune_fwd.py --peer on the H100 (calls 3 and 4, fp16 / bf16, L=1024-16384), 128x64 PARK against
# 128x32: 1.00-1.10x non-causal, 0.94-1.08x causal (median 1.03); against FA2 0.95-1.12x. 102 KB: two CTAs an SM
# on the H100 only (resident=2); the A100 and the 99 KB GPUs keep 128x32 (68 KB, two CTAs an SM on the A100).
add("fwd_mma", HALF_TYPES, [128],
     Tile(128, 64, 4, 2, "FA2's tile with PARK: 1.00-1.10x 128x32 non-causal, 0.94-1.08x causal (tune_fwd.py)",
          resident=2, park=True),
     Tile(128, 32, 4, 2, "two strips per warp, 32-key tiles: +11-15% non-causal, +1-3% causal over 64x64 "
                         "(tune_fwd.py)"))
# With EXTRA, 128x64 spills at d=128 with PARK (8-148 bytes) and without (0-144; NVRTC 12.9): 32-key tiles.
add("fwd_mma", HALF_TYPES, [128], Tile(128, 32, 4, 2, "128x64 spills with the EXTRA code"), extra=True)
add("fwd_mma", HALF_TYPES, [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles"))
# With EXTRA (bias, mask, block layout, dropout) and the bias staged in shared memory: two strips as in
# the plain kernel; 128x128 spills (d=32: 44-252 bytes, d=64: 68-236). With the band too, the d=64
# kernel spilled at 128x64 (4-8 bytes on sm_90 when chosen, 24-48 on both archs later) and took 128x32
# (plain causal: 160 TFLOP/s against 195 at 128x64, tune_fwd.py); since the K/V loader of branch band128
# it fits 128x64 (240-253 registers, 0 spills on sm_80 / sm_90), as the EXTRA kernel without the band.
add("fwd_mma", HALF_TYPES, [32, 64], Tile(128, 64, 4, 2, "two strips per warp of 64 keys; 128x128 spills with the "
                                                          "EXTRA code"), extra=True)
add("fwd_mma", HALF_TYPES, [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles"),
     Tile(64, 16, 4, 2, "16-key tiles: K/V and the bias stages fit " + _SMALL_BYTES), extra=True)

# Hopper forward (flash_fwd_wgmma.cu, arch "sm90a"): a TMA producer warpgroup and two consumer
# warpgroups of 64 query rows; S = Q K^T and O += P V on wgmma (m64nNk16), Q/K/V in 128-byte
# swizzled shared memory on mbarrier stages. Offline compile (NVRTC 12.9, sm_90a): 168 registers
# at launch, consumers up to 232 after setmaxnreg, 0 spills. On the H100 (compare_trees.py, sixth
# session) against the fifth session's cp.async kernel at d=128: 1.07-2.0x (bf16 L=16384 673
# TFLOP/s); against the portable kernel at d=64: 1.20-1.42x at L >= 4096, 0.92-0.98x at L = 1024
# (per-block start-up; the short-rows tile below and persistent CTAs since). Ping-pong of the consumers measured
# 0.90-1.01x and is off (FwdWgmmaTraits::PINGPONG). Head dim 64 takes three consumer warpgroups
# (192 rows; 160 registers each after setmaxnreg, the consumer code up to R156): 1.12-1.25x the
# two-warpgroup kernel non-causal, 1.02-1.06x causal at L 2048-16384 (compare_trees.py, eighth
# session). EXTRA (bias, mask, dropout, block layout; ninth session)
# keeps these tiles: a swizzled bias tile per K/V stage (Hopper d=128 and 256: 225 KB), copied
# by two producer warps; offline 0 spills, consumers up to R157 / R229 of 160 / 232, the producer
# up to R29 of 32 at head dim 64 (24 without EXTRA) and R37 of 40 (benchmarks/NOTES.md).
# Persistent CTAs (seventeenth session; FwdWgmmaTraits::PERSISTENT, persistent_grid): the 192- and 128-row
# tiles without EXTRA walk query blocks, one CTA an SM, where the call has no causal band; at head dim 128 O
# is staged in a tile of its own (193 KB) so that the next block's Q lands during this one's epilogue.
# benchmarks/tune_persistent.py on the H100 (queued, same buffers, bitwise-equal outputs): d=128 L=1024
# 1.15x / 1.13x (bf16 / fp16), L=2048 1.08x / 1.04x, L=4096 1.03x / 1.00x; causal calls forced onto the
# stride 0.94-1.02x (their blocks differ in work), so they keep a CTA a block; d=64's long-rows tile
# (L = 4096 here) 1.00-1.02x.
add("fwd_wgmma", HALF_TYPES, [64], Tile(192, 128, 16, 2, "a TMA producer and three consumer warpgroups of 64 "
                                                         "rows, 128-key tiles: 89 KB"), arch="sm90a")
add("fwd_wgmma", HALF_TYPES, [128], Tile(128, 128, 12, 2, "a TMA producer and two consumer warpgroups of 64 rows, "
                                                          "128-key tiles, an O tile: 193 KB"), arch="sm90a")
# Head dim 256: acc_o is 128 registers a consumer thread, so 64-key tiles (S 32, P 16 registers):
# Q 64 KB + two stages of K and V 128 KB = 193 KB.
add("fwd_wgmma", HALF_TYPES, [256], Tile(128, 64, 12, 2, "a TMA producer and two consumer warpgroups of 64 rows, "
                                                         "64-key tiles (acc_o is 128 registers): 193 KB"),
     arch="sm90a")
# Short rows at head dim 64 (row_class, HOPPER_FWD_SHORT_KEYS): the 192 x 128 tile runs one CTA an SM,
# whose start (Q and the first tiles in flight, nothing to overlap them) and epilogue no other CTA
# hides: ~16 K cycles a block against ~2.5 K a key tile at L = 1024 (ncu, thirteenth session). Two CTAs
# an SM: 384 x 80 registers at launch, the producer keeps 24, the consumers take 104 (FwdWgmmaTraits,
# MIN_CTAS 2), which 64-key tiles fit when each tile's P V is waited for before the next S (OVERLAP_PV
# off; with it 16 bytes spill and ptxas serialises every wgmma). Offline (NVRTC 12.9 and 13.0, sm_90a):
# 0 spills, consumer code up to R98. benchmarks/tune_short.py, H100: L = 1024 1.19-1.21x the 192-row tile
# non-causal, 1.6x causal (queued; benchmarks/NOTES.md, fifteenth session).
add("fwd_wgmma", HALF_TYPES, [64], Tile(128, 64, 12, 2, "short rows: two consumer warpgroups of 64 rows, 64-key "
                                                        "tiles, two CTAs an SM: 49 KB", ctas=2),
     arch="sm90a", short=True)

# Hopper backward (flash_bwd_wgmma.cu, arch "sm90a"): dK, dV and atomic dQ. A TMA producer warp and
# two consumer warpgroups of 64 keys (a CTA per 128-key block); S^T, dP^T, dV, dK and dQ on wgmma,
# dQ as a 64 x 64 block per warpgroup: d=64 takes 128-query steps (dQ split by rows), d=128 64-query
# steps (split by columns). Non-deterministic calls only (backward_variants); EXTRA at head dims 64 and
# 128 (ninth session): a swizzled bias tile per Q/dO stage, copied by two
# producer warps; at d=64 two 32 KB bias stages beside the 128-query steps' buffers would be 258 KB, so
# EXTRA takes 64-query steps there (dQ split by keys: both warpgroups add into one 64 x 64 block).
# With a bias's gradient wanted the EXTRA variant adds dS^T itself (``dbias``; branch hopper-dbias,
# run on the H100 in the tenth session: bias forward+backward 9.6 -> 7.9 ms): vector reductions into a key-major fp32 accumulator, same tiles and shared memory,
# offline 0 spills, consumer code up to R205 (d=64) / R228 (d=128) of 232; no dbias kernel.
add("bwd_dkdv_wgmma", HALF_TYPES, [64], Tile(128, 128, 12, 2, "a TMA producer warp, two consumer warpgroups of 64 "
                                                              "keys, 128-query steps: 194 KB"), arch="sm90a")
add("bwd_dkdv_wgmma", HALF_TYPES, [128], Tile(64, 128, 12, 2, "a TMA producer warp, two consumer warpgroups of 64 "
                                                               "keys, 64-query steps: 193 KB"), arch="sm90a")
add("bwd_dkdv_wgmma", HALF_TYPES, [64], Tile(64, 128, 12, 2, "EXTRA: 64-query steps, dQ split by keys; two bias "
                                                              "stages: 161 KB (128-query steps: 258 KB)"),
     arch="sm90a", extra=True)
# Head dim 256 (ninth session): dK + dV of 64 keys over all 256 columns
# would be 256 accumulator registers a consumer thread (of 232), so both consumer warpgroups own the
# block's 64 keys and split dK, dV and dQ by columns (128 each: 64 + 64 registers); S^T (warpgroup 0)
# and dP^T (warpgroup 1) are formed once and P^T / dS^T exchanged in shared memory; dQ is staged in
# the step's own Q / dO slabs. K, V 64 KB + two stages of Q, dO 128 KB + P^T, dS^T twice 32 KB = 226 KB.
add("bwd_dkdv_wgmma", HALF_TYPES, [256], Tile(64, 64, 12, 2, "a TMA producer warp, two consumer warpgroups sharing "
                                                              "64 keys, 128 columns each, 64-query steps: 226 KB"),
     arch="sm90a")

# FMA forward: 16 x 16 threads, block_m / 16 rows per thread; Q, K, V and P
# tiles once each in shared memory.
add("fwd_fma", ["float32"], [32, 64], Tile(64, 64, 8, 1, "4x4 scores per thread"))
_SMALL = "fits " + _SMALL_BYTES
add("fwd_fma", ["float32"], [128], Tile(64, 64, 8, 1, "113 KB shared"), Tile(32, 64, 8, 1, _SMALL))
add("fwd_fma", ["float32"], [256], Tile(64, 32, 8, 1, "137 KB shared; 32-key tiles"), Tile(16, 32, 8, 1, _SMALL))
# float32 on the TF32 tensor cores (flash_fwd_tf32.cu; run on the H100 in the tenth session, 34-42
# TFLOP/s "highest", 125-167 "tf32": the tiles are still chosen by the offline compile alone, NVRTC 12.9, 0 spills on sm_80 and sm_90; benchmarks/NOTES.md has
# the register counts). Two families of one kernel: fwd_tf32x3 is precision="highest" (3xTF32,
# three MMAs a product and the operand splits), fwd_tf32 is precision="tf32" (one MMA).
# 3xTF32 is MMA-bound (each B fragment load feeds 3 MMAs a strip): one 16-row strip a warp
# suffices, and its K loop stays rolled (warp_gemm_tf32.cuh); two strips spilled 20-324 bytes.
# At head dim 256 (acc_o alone 128 registers) 64x16/4w spilled 4-188 bytes: "highest" stays on
# the FMA kernel there, as does any call whose GPU has no tile here (forward_variant).
add("fwd_tf32x3", ["float32"], [32], Tile(64, 64, 4, 2, "one strip a warp (3xTF32 is MMA-bound), 64-key tiles: "
                                                         "54 KB"))
# Eleventh session (benchmarks/tune_f32.py on the H100, L=4096, TFLOP/s non-causal / causal): the fast
# operand split (Tile.split 2, TF32X3_FAST: 3 instructions an element instead of 7; the kernels were
# instruction-issue bound) with the same errors as the rounded split (4.6-4.7e-7 against float64):
#   d=64:  64x64/4w rounded (the table before) 42.0 / 39.9; fast 64x64/4w 54.1 / 49.7 (254 registers on
#          sm_90, 12 bytes spilled on sm_80: an "sm90" row), 64x32/4w 50.1 / 46.3, 128x64/8w 51.7 / 47.6.
#   d=128: 128x16/8w rounded (the table before) 36.7 / 33.5; fast 128x16/8w 43.5 / 38.7, 128x32/8w 50.5 /
#          46.6 (255 registers with 16-byte loads); rounded 128x32/8w 42.5 / 39.6.
add("fwd_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "fast split, one strip a warp, 32-key tiles: 1.19x the "
                                                         "rounded 64x64 (tune_f32.py); 68 KB", split=2))
add("fwd_tf32x3", ["float32"], [64], Tile(64, 64, 4, 2, "fast split, 64-key tiles (12 bytes spilled on sm_80): "
                                                         "1.25-1.29x the rounded 64x64 (tune_f32.py); 102 KB",
                                           split=2), arch="sm90")
# 128x32/8w fast spills 16 bytes on sm_90 in its element-load (vec=False) variants: 16-byte loads only.
add("fwd_tf32x3", ["float32"], [128], Tile(128, 32, 8, 2, "fast split, 8 warps of one strip, 32-key tiles, 16-byte "
                                                           "loads: 1.38-1.39x the rounded 128x16 (tune_f32.py); "
                                                           "198 KB", split=2, vec_only=True),
     Tile(128, 16, 8, 2, "element loads (32-key tiles spill 16 bytes on sm_90), fast split, 16-key tiles: "
                         "1.16-1.19x the rounded one (tune_f32.py); 165 KB", split=2),
     Tile(64, 16, 4, 2, "4 warps, 16-key tiles: 99 KB, the A100 and " + _SMALL_BYTES, split=2))
add("fwd_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "the bias stages, 32-key tiles (64 spilled 4 bytes on "
                                                         "sm_80), fast split: 88 KB", split=2), extra=True)
add("fwd_tf32x3", ["float32"], [128], Tile(64, 16, 4, 2, "the bias stages, fast split: 111 KB", split=2), extra=True)
# Plain TF32: one MMA a product, so two strips a warp as the 16-bit kernel (each K / V fragment
# feeds two MMAs; shared-memory bandwidth bounds the one-strip loop).
add("fwd_tf32", ["float32"], [32, 64], Tile(128, 64, 4, 2, "two strips a warp, 64-key tiles: d=64 102 KB"),
     Tile(64, 32, 4, 2, "one strip, 32-key tiles: " + _SMALL_BYTES))
add("fwd_tf32", ["float32"], [128], Tile(128, 32, 4, 2, "two strips a warp, 32-key tiles: 132 KB"),
     Tile(64, 32, 4, 2, "one strip: 99 KB, the A100 and " + _SMALL_BYTES),
     Tile(64, 16, 4, 2, "16-key tiles: with the bias stages 78 KB, " + _SMALL_BYTES))
add("fwd_tf32", ["float32"], [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles: "
                                                        "195 KB"),
     Tile(64, 16, 4, 2, "16-key tiles: 130 KB, the A100"))
# float32 on Hopper's warpgroup MMA with TF32 operands (flash_fwd_wgmma_tf32.cu, arch "sm90a"; branch
# tf32-wgmma, written and compiled offline, NOT RUN ON A GPU yet): a TMA producer warpgroup that also
# writes K's parts and V's transposed parts (TF32 wgmma takes K-major shared operands only), consumer
# warpgroups of 64 rows; 3xTF32 in fresh fragments pipelined two deep (wgmma_tf32.cuh). Shared memory
# is the limit (fp32 parts: Q twice, a stage K twice, V once as loaded, V^T twice): head dim 64 takes
# two consumer warpgroups and 64-key tiles (225 KB), head dim 128 one warpgroup and 32-key tiles
# (225 KB). Offline compile (NVRTC 12.9, sm_90a), 0 spills: d=64 168 registers at launch (consumers
# 232, the producer 40 after setmaxnreg), d=128 240. EXTRA (bias, mask, dropout, block layout; branch
# wgmma-tf32-extra, offline only) keeps these tiles and their shared memory (no EXTRA rows: the
# _EXTRA_TABLE is for tiles that differ): no room for bias stages, so the consumers read the bias from
# global memory into S's fragments (bias_frags.cuh); 0 spills, consumer code up to R227 of 232 (d=64
# 3xTF32; R195 without EXTRA), R233 of 240 (d=128 3xTF32; R227), R164 plain TF32 (sm_90a SASS, NVRTC 13).
add("fwd_wgmma_tf32x3", ["float32"], [64], Tile(128, 64, 12, 2, "a TMA producer (K's parts, V^T's) and two "
                                                                "consumer warpgroups of 64 rows, 64-key tiles: "
                                                                "225 KB; 79 TFLOP/s, 1.45x the portable table "
                                                                "(tune_f32.py, H100)", split=3), arch="sm90a")
add("fwd_wgmma_tf32x3", ["float32"], [128], Tile(64, 32, 8, 2, "a TMA producer and one consumer warpgroup, "
                                                               "32-key tiles: 225 KB; 54 TFLOP/s, 1.04x the "
                                                               "portable table (H100)", split=3),
     arch="sm90a")
# Plain TF32 (SPLIT 0: one wgmma a k8 step, no small parts; the same tiles at 129 KB) has no rows: on
# the H100 it measured slower than the portable fwd_tf32 (bench_precision.py --quick, thirteenth session:
# 127.9 against 146.2 TFLOP/s at D=64, 76.7 against 138.7 at D=128), the producer's V^T copy being the
# limit without a split to hide it. The family stays defined (fwd_wgmma_tf32); rows here route it.
# (float64 forwards run on the fp64 tensor cores below; fwd_fma compiles for double too, and
# forward_variant falls back to it for any head bucket that has no fwd_dmma entry.)

# fp64 tensor-core forward (mma.sync m8n8k4): each warp owns block_m / warps query rows in 8-row
# tiles (two or more: every K / V fragment a warp loads feeds that many MMAs; an 8-byte load by a
# warp costs about what one m8n8k4 does, warp_gemm_f64.cuh). With 4 warps, registers (140-250:
# ptxas hoists fragment loads as far as the budget allows) allow two CTAs an SM, so a tile of
# <= 113 KB runs 8 warps an SM. Registers of the plain / band kernels from the offline compile
# (sm_80 / sm_90, every flag, 0 spills). Timed on an H100 (benchmarks/tune_fwd.py --dtype float64,
# TFLOP/s non-causal / causal, L=4096): d=64 FMA 11.5 / 10.8, 64x32/4w 18.5 / 17.6, 64x16/4w
# 19.5 / 18.3, 64x64 and 128x32 13.8-13.9; d=128 FMA 9.7 / 9.4, 64x32/4w 16.0 / 15.4, 64x24 15.7 /
# 15.0, 64x16 15.0 / 14.3. (64x16 at d=64 is a candidate still to confirm at L=1024.)
#   d=32:  128x32/4w (four 8-row tiles a warp) 214-230 regs, 71 KB; 128x64 spills 64-550 bytes.
#   d=64:  64x32/4w 174-196 regs, 101 KB; 128x32/4w fits plain (252) but spills with EXTRA or band.
#   d=128: 64x32/4w 238-242 regs, 197 KB (one CTA an SM; so is 64x16: 131 KB).
#   d=256: 32x16/4w (one row tile a warp: acc_o alone is 128 registers) 230-250 regs, 195 KB.
add("fwd_dmma", ["float64"], [32], Tile(128, 32, 4, 2, "four 8-row tiles a warp (half the shared loads per MMA "
                                                        "of two); 71 KB, two CTAs an SM by registers"))
add("fwd_dmma", ["float64"], [64], Tile(64, 32, 4, 2, "two 8-row tiles a warp, 101 KB: two CTAs an SM; four tiles "
                                                       "spill with EXTRA or the band"),
     Tile(64, 16, 4, 2, "16-key tiles: 69 KB, " + _SMALL))
add("fwd_dmma", ["float64"], [128], Tile(64, 32, 4, 2, "two 8-row tiles a warp, 197 KB (one CTA an SM)"),
     Tile(64, 16, 4, 2, "16-key tiles: 131 KB, the A100"), Tile(32, 16, 2, 2, "two warps: 99 KB, " + _SMALL))
# sm_90 runs mma.m16n8k{4,8,16}.f64 at full rate, m8n8k4 at half (benchmarks/dmma_rate.py on the H100: 66
# against 33 TFLOP/s). tune_fwd.py --dtype float64 (eleventh session, H100, L=4096, TFLOP/s non-causal /
# causal): d=64 64x32/4w m8n8k4 (the sm80 row) 18.5 / 18.1, 64x32/4w k16 25.5 / 22.5, k4 25.9 / 24.8,
# 128x32/8w k16 26.8 / 24.9; d=128 64x32/4w 16.0 / 15.5, k16 20.0 / 19.1, k4 23.0 / 21.9, 128x16/8w 21.5 /
# 19.8, 128x16/8w k16 31.5 / 28.5. Errors 2.1-2.2e-15 (non-causal) against long double, as m8n8k4's.
add("fwd_dmma", ["float64"], [64], Tile(128, 32, 8, 2, "mma.m16n8k16 (full-rate fp64 on sm_90), four 8-row tiles a "
                                                        "warp: 1.38-1.45x m8n8k4's 64x32 (tune_fwd.py); 135 KB",
                                         wide_k=16), arch="sm90")
add("fwd_dmma", ["float64"], [128], Tile(128, 16, 8, 2, "mma.m16n8k16 (full-rate fp64 on sm_90), 8 warps, 16-key "
                                                         "tiles: 1.84-1.97x m8n8k4's 64x32 (tune_fwd.py); 197 KB",
                                          wide_k=16), arch="sm90")
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

# Tensor-core backward. dK/dV: warp w owns block_n / warps keys, in 16-key strips
# (flash_bwd_mma.cu, KEY_STRIPS); with two strips each Q / dO fragment it loads
# feeds two MMAs in all four GEMMs, and a key block of 128 halves the dQ atomics
# and the Q / dO tile loads per key. benchmarks/tune_bwd.py, H100, fp16 L=4096
# (backward TFLOP/s, non-causal / causal), one strip, 64x64/4w, 2026-11-22:
#   d=64: 1 stage 107 / 103, 2 stages 109 / 105;  d=128: 1 stage 94 / 88, 2 stages 96 / 91
#   (head dim 128 in two passes: dK + dV accumulators and the 64-query score tiles spill in one).
# Branch bwd2 (offline compile, NVRTC 12.9, 0 spills on sm_80 / sm_90; benchmarks/NOTES.md): d=64 two
# strips a warp, 32-query steps (dK + dV: 128 registers, S^T + dP^T: 64; 254-255 registers, no spill at
# a 240 cap); d=128 one pass with 32-query steps (dK + dV 128, S^T + dP^T 32), 8 warps of 16 keys. The
# EXTRA kernels keep the one-strip 64x64 tiles. tune_bwd.py, H100, fp16 L=4096, attention_backward ms
# (non-causal / causal), sixth session: d=64 64x64/4w 8.27 / 4.78, 32x128/4w 6.38 / 3.87, 32x64/4w
# 8.08 / 5.39, 64x128/8w 7.98 / 4.77; d=128 64x64/4w two passes 9.73 / 5.47, 32x128/8w 7.81 / 4.55,
# 32x64/4w 8.04 / 4.53. dK and dV bitwise equal to the 64x64 layout's.
add("bwd_dkdv_mma", HALF_TYPES, [32], Tile(64, 64, 4, 2, "2 stages +2-3% over 1 (tune_bwd.py)"))
add("bwd_dkdv_mma", HALF_TYPES, [64], Tile(32, 128, 4, 2, "two 16-key strips a warp: 1.24-1.29x the 64x64 "
                                                          "layout (tune_bwd.py); 66 KB"))
# The atomic dQ of every bwd_dkdv_mma tile goes into fragment tiles (atomics.cuh, dq_tile; twenty-first session):
# one 16-byte reduction a lane and fragment. tune_bwd.py on the H100 (whole backward, bf16, L=2048-16384), against
# the tiles before it: d=64 1.05-1.18x, d=128 1.03-1.08x (which no longer stages its dQ tile in shared memory:
# 207 -> 173 KB). d=128 late_copies: +1-3% (one CTA of 8 warps an SM; at d=64, two CTAs of 4, it measured 0.97-1.0x).
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
add("bwd_dq_mma", HALF_TYPES, [32], Tile(64, 64, 4, 1, "16 rows per warp, 64-key steps; 21 KB shared: three "
                                                       "CTAs an SM at <= 168 registers", ctas=3))
add("bwd_dq_mma", HALF_TYPES, [64], Tile(64, 64, 4, 1, "16 rows per warp, 64-key steps; a 168-register cap (three "
                                                       "CTAs an SM) spills 16 bytes on sm_90, so two"))
add("bwd_dq_mma", HALF_TYPES, [128], Tile(64, 32, 4, 1, "32-key steps: 64 spilled registers"))
add("bwd_dq_mma", HALF_TYPES, [32], Tile(64, 64, 4, 1, "EXTRA spills under the 168-register cap: two CTAs an SM",
                                         ctas=2), extra=True)
# dbias kernel: warps of 16 query rows, the step's Q/dO/K/V/bias double-buffered. Every step loads
# four fresh tiles for two GEMMs, so a larger accumulator tile amortises each load over more MMAs
# (64x64: 32 FLOP per byte loaded; 128x64: 43; benchmarks/tune_dbias.py). 128x128 (64) spilled 52-180
# bytes in every variant but the plain 16-byte-load one.
add("bwd_dbias_mma", HALF_TYPES, [32], Tile(128, 64, 8, 2, "8 warps of 16 rows, 97 KB: 1.3x the MMAs per byte "
                                                       "loaded of 64x64"))
add("bwd_dbias_mma", HALF_TYPES, [64], Tile(128, 64, 8, 2, "8 warps of 16 rows, 145 KB: 1.3x the MMAs per byte "
                                                       "loaded of 64x64"),
     Tile(64, 64, 4, 2, "as the dQ kernel's rows; 2 stages: 92 KB, two CTAs an SM, " + _SMALL, ctas=2))
add("bwd_dbias_mma", HALF_TYPES, [128], Tile(64, 64, 4, 2, "2 stages: 155 KB"),
     Tile(64, 64, 4, 1, "one stage: 78 KB, " + _SMALL))

# FMA backward: 16 x 16 threads; K, V, Q, dO tiles in the input dtype and P, dS
# tiles in the accumulator dtype in shared memory; dK, dV in registers.
for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    add(_fam, ["float32"], [32, 64], Tile(64, 64, 8, 1, "98 KB shared, 4x4 scores per thread: two CTAs an SM at "
                                                         "<= 128 registers (145 halved occupancy: -25% measured)",
                                           ctas=2))
    add(_fam, ["float32"], [128], Tile(64, 64, 8, 1, "162 KB shared"), Tile(32, 32, 8, 1, _SMALL))
    add(_fam, ["float32"], [256], Tile(32, 32, 8, 1, "137 KB shared; dK+dV are 64 registers"),
         Tile(16, 16, 8, 1, _SMALL))
    add(_fam, HALF_TYPES, [256], Tile(32, 32, 8, 1, "73 KB shared; dK+dV are 64 registers: two CTAs an SM at "
                                                     "<= 128 registers", ctas=2))
    # (float64 at head dims 32-128 runs on the fp64 tensor cores: bwd_dkdv_dmma / bwd_dq_dmma below. The FMA
    # tiles it replaced, for a baseline: 32x32/8w at d=32, 64 (84 KB) and 128 (146 KB).)
    add(_fam, ["float64"], [256], Tile(16, 32, 8, 1, "fp64: 201 KB shared; dK+dV are 128 registers"),
         Tile(16, 16, 8, 1, "133 KB: the A100; no fp64 head-dim-256 backward fits 99 KB"))

for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    add(_fam, ["float32"], [32, 64], Tile(64, 64, 8, 1, "EXTRA spills 8-80 bytes under the 128-register cap of "
                                                        "two CTAs an SM: one"), extra=True)
add("bwd_dkdv_fma", ["float64"], [256], Tile(16, 16, 8, 1, "EXTRA spills 12 bytes with 32-key tiles: 16"), extra=True)
for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    add(_fam, HALF_TYPES, [256], Tile(32, 32, 8, 1, "EXTRA spills 12-180 bytes under two CTAs' 128 registers: one"),
         extra=True)

# fp64 tensor-core backward (flash_bwd_dmma.cu; mma.sync m8n8k4). dK/dV: 4 warps, each owning
# block_n / 32 8-key tiles (its dK, dV accumulators: head * tiles registers; one pass while that is
# <= 128), block_m query rows a step; all tiles unpadded and swizzled (swizzle_f64.cuh). Registers
# and spills from the offline compile (NVRTC 12.9, sm_80 / sm_90, every flag); NOT yet timed on a
# GPU (benchmarks/tune_bwd.py): the tiles are arithmetic, two CTAs an SM on the H100.
#   d=32:  32x64/4w: two key tiles a warp, 82 KB, 188-238 registers.
#   d=64:  16x64/4w: two key tiles a warp (dK + dV: 128 registers), 104 KB, 220-255.
#   d=128: 16x32/4w one Q/dO stage: one key tile a warp (dK + dV: 128 registers), 100 KB, 224-254.
# With EXTRA (bias stages, per-element dropout draws, dbias) 32-query steps at d=32 and two key tiles
# a warp at d=64 spilled 12-84 bytes on sm_90: 16-query steps at d=32, one key tile a warp at d=64
# (156-195 registers; 8x64, two key tiles a warp with 8-query steps, fit at 255: a lead to time).
add("bwd_dkdv_dmma", ["float64"], [32], Tile(32, 64, 4, 2, "two 8-key tiles a warp, 32-query steps: 82 KB, two "
                                                            "CTAs an SM (not yet timed)"))
add("bwd_dkdv_dmma", ["float64"], [64], Tile(16, 64, 4, 2, "two 8-key tiles a warp (dK + dV: 128 registers): "
                                                            "104 KB, two CTAs an SM (not yet timed)"),
     Tile(16, 32, 4, 2, "one 8-key tile a warp: 70 KB, " + _SMALL_BYTES + " (one stage of 16x64 spills)"))
add("bwd_dkdv_dmma", ["float64"], [128], Tile(16, 32, 4, 1, "one 8-key tile a warp (dK + dV: 128 registers), one "
                                                             "Q/dO stage: 100 KB, two CTAs an SM (not yet timed)"),
     Tile(8, 32, 4, 1, "8-query steps: 84 KB, " + _SMALL_BYTES))
add("bwd_dkdv_dmma", ["float64"], [32], Tile(16, 64, 4, 2, "16-query steps (32 spill with EXTRA): 73 KB"),
     extra=True)
add("bwd_dkdv_dmma", ["float64"], [64], Tile(16, 32, 4, 2, "one 8-key tile a warp (two spill with EXTRA): 78 KB"),
     extra=True)
add("bwd_dkdv_dmma", ["float64"], [128], Tile(16, 32, 4, 1, "the bias stage: 104 KB"),
     Tile(8, 32, 4, 1, "8-query steps: 86 KB, " + _SMALL_BYTES), extra=True)
# Deterministic dQ: query-major as the forward; each warp owns block_m / 32 8-row tiles, K/V double-buffered.
add("bwd_dq_dmma", ["float64"], [32], Tile(64, 32, 4, 2, "two 8-row tiles a warp: 64 KB (not yet timed)"))
add("bwd_dq_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "two 8-row tiles a warp, 16-key steps: 96 KB, two CTAs "
                                                          "an SM (not yet timed)"))
add("bwd_dq_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "two 8-row tiles a warp (dQ: 128 registers): 192 KB "
                                                           "(not yet timed)"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 128 KB, the A100"),
     Tile(16, 16, 2, 2, "two warps: 96 KB, " + _SMALL_BYTES))
# With EXTRA each K/V stage also holds a block_m x block_n fp64 bias tile.
add("bwd_dq_dmma", ["float64"], [32], Tile(64, 16, 4, 2, "the bias stages: 72 KB with 16-key steps"), extra=True)
add("bwd_dq_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "the bias stages: 120 KB"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 76 KB, " + _SMALL_BYTES), extra=True)
add("bwd_dq_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "the bias stages: 216 KB"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 140 KB, the A100"),
     Tile(8, 16, 1, 2, "one warp: 83 KB, " + _SMALL_BYTES), extra=True)

# float32 backward on the TF32 tensor cores (flash_bwd_tf32.cu; branch tf32-bwd, run on the H100 in the tenth
# session, benchmarks/NOTES.md: the tiles are still chosen by shared-memory arithmetic and the offline compile alone, NVRTC 12.9, 0 spills on
# sm_80 and sm_90; benchmarks/NOTES.md has the register counts). Two families per kernel, as the
# forward: *_tf32x3 is precision="highest" (3xTF32), *_tf32 is precision="tf32". dK/dV: a warp owns
# 16 keys (block_n = 16 warps); K and V are split once per CTA in shared memory (3xTF32: big and
# small parts, four fp32 tiles of block_n rows), Q / dO / bias per stage, dS^T for the atomic dQ.
# dQ: a warp owns 16 query rows; Q and dO split once (four tiles with 3xTF32), K / V / bias per stage.
# A call whose GPU has no tile here takes the FMA kernel for that part of the plan (_backward_plan).
# 3xTF32 dK/dV (a fresh fragment and the split operands on top of the accumulators) spilled offline
# at 64-query steps at d=32 (20-36 bytes on sm_80), 32-query steps at d=64 (28-68 bytes) and in one
# pass at d=128 (16-64 bytes; 16-query steps, one stage with EXTRA and element loads: 724-796):
# d=32 and 64 take half the query rows a step, d=128 two passes (dV, then dK and dQ: S^T twice).
add("bwd_dkdv_tf32x3", ["float32"], [32], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps (64 spilled 20-36 "
                                                              "bytes on sm_80): 65 KB (EXTRA 82)"))
# The fast operand split (Tile.split 2; tune_f32.py on the H100, eleventh session, backward TFLOP/s
# non-causal / causal): d=64 33.4 / 30.3 -> 38.8 / 35.3, d=128 19.6 / 18.8 -> 21.9 / 20.8, errors equal.
add("bwd_dkdv_tf32x3", ["float32"], [64], Tile(16, 64, 4, 2, "16 keys a warp, 16-query steps (32 spilled 28-68 "
                                                              "bytes), fast split: 1.16x rounded; 92 KB (EXTRA 99)",
                                                split=2))
add("bwd_dkdv_tf32x3", ["float32"], [128], Tile(16, 64, 4, 2, "16 keys a warp, 16-query steps, two passes (one "
                                                               "spilled 16-64 bytes), fast split: 1.11x rounded; "
                                                               "174 KB (EXTRA 183)", passes=2, split=2),
     Tile(16, 64, 4, 1, "one Q/dO stage: 157 KB (EXTRA 162), the A100", passes=2, split=2))
add("bwd_dkdv_tf32", ["float32"], [32], Tile(64, 64, 4, 2, "16 keys a warp, 64-query steps: 73 KB (EXTRA 108)"),
     Tile(32, 64, 4, 2, "32-query steps: 46 KB (EXTRA 64), " + _SMALL_BYTES))
add("bwd_dkdv_tf32", ["float32"], [64], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps: 79 KB (EXTRA 97)"))
add("bwd_dkdv_tf32", ["float32"], [128], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps: 145 KB (EXTRA 162)"),
     Tile(16, 64, 4, 1, "16-query steps, one Q/dO stage: 90 KB (EXTRA 94), " + _SMALL_BYTES))
add("bwd_dq_tf32x3", ["float32"], [32], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 74 KB (EXTRA 111)"),
     Tile(64, 32, 4, 2, "32-key steps: EXTRA 76 KB, " + _SMALL_BYTES))
add("bwd_dq_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "16 rows a warp, 32-key steps: 104 KB (EXTRA 125)"),
     Tile(32, 32, 2, 2, "two warps: 70 KB (EXTRA 80), " + _SMALL_BYTES))
add("bwd_dq_tf32x3", ["float32"], [128], Tile(64, 16, 4, 2, "16 rows a warp, 16-key steps: 169 KB (EXTRA 181)"),
     Tile(32, 16, 2, 2, "two warps: 101 KB (EXTRA 108), the A100"))
add("bwd_dq_tf32", ["float32"], [32], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 55 KB (EXTRA 92)"))
add("bwd_dq_tf32", ["float32"], [64], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 104 KB (EXTRA 141)"),
     Tile(64, 32, 4, 2, "32-key steps: 70 KB (EXTRA 90), " + _SMALL_BYTES))
add("bwd_dq_tf32", ["float32"], [128], Tile(64, 32, 4, 2, "16 rows a warp, 32-key steps: 135 KB (EXTRA 156)"),
     Tile(64, 16, 4, 2, "16-key steps: 101 KB, " + _SMALL_BYTES),
     Tile(32, 16, 2, 2, "two warps: EXTRA 74 KB, " + _SMALL_BYTES))

# Row-wise helpers (flash_bwd_aux.cu): block_m / warps rows a warp, read 16 bytes a lane where rows
# allow; memory-bound, so sized by the bytes in flight (head dim does not matter: key 0). One warp a row,
# 8 rows a CTA, one element a lane reached 1.6 (dsum) and 2.0 (convert) of the H100's ~3.35 TB/s (ncu).
# These tiles: ncu on the H100 (eighteenth session, the same shape) dsum 82 -> 61 us, convert 98 -> 70 us.
add("bwd_dsum", DTYPES, [0], Tile(16, 0, 8, 1, "2 rows a warp: dO and O of both in flight, 64 bytes a lane; "
                                   "<= 48 registers, 5 CTAs an SM (80 KB in flight); 8 CTAs (<= 32) spill",
                                   ctas=5))
add("bwd_convert_dq", DTYPES, [0], Tile(16, 0, 8, 1, "2 rows a warp: 32 bytes of dQ_acc a lane in flight; a full "
                                         "SM, 8 CTAs at <= 32 registers (64 KB in flight); 4 rows need 56", ctas=8))
