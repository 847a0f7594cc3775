"""Launch shapes of the CUDA backend (:mod:`accel.codegen.cuda`): threads a block, values a
thread, tiles and unrolling, by kernel mode; each with the measurements that chose it."""
import torch

#: threads per block of an elementwise or one-thread-per-result kernel, and how many
#: iterations each thread takes per tile (independent loads in flight).
BLOCK = 256
ILP = 4
#: dtypes moved as vectors of VEC elements (16 bytes; 8 for the 16-bit floats), or of
#: VEC16 16-bit floats (16 bytes) where an elementwise kernel moves only those
VEC_TYPES = (torch.float32, torch.int32, torch.float16, torch.bfloat16)
#: elementwise kernels with 16-byte accesses: elements per vector, vectors per thread a tile.
VEC = 4
VEC16 = 8
VEC_ILP = 2
#: the most values a vector tile's stores interleave (``torch.stack`` of that many along the
#: last dim): as many vectors a thread kept in registers (``VectorLoads._interleaved``).
WEAVE_MAX = 8
#: most threads per block of a row kernel, and most values of a row one thread keeps in
#: registers between the row's loops (longer rows are read again: block loops, 16-byte
#: vectors where they apply). Rows of float32 (and narrower) values keep up to 32. H200,
#: [2048, 32768] / [4096, 24576] float32, ms back to back, 16 in registers with block loops
#: of vectors above it -> 32 (24 with a mean and variance, where ptxas spilled): softmax
#: 0.182 / 0.242 -> 0.157 / 0.215, RMSNorm 0.168 / 0.233 -> 0.163 / 0.200, LayerNorm 0.210 /
#: 0.352 -> (block loops) / 0.289, its residual add 0.331 / 0.436 -> (block) / 0.348. Then,
#: with 64-bit lane indices (CudaRenderer._row_vec_first) and the row's sum kept once (not
#: x and r apart), 32 with a mean and variance too: the residual add over 32768 0.331 ->
#: 0.225 (torch.compile 0.241).
ROW_THREADS = 1024
#: threads a block for a long row with a mean and variance (more than ROW_ELEMS_MOMENTS
#: values a thread at ROW_THREADS) whose per-row inputs hold at most
#: MOMENTS_HALF_BLOCK_BYTES: twice the rows in flight a multiprocessor, in block loops
#: (their second pass reads the row again, from L2 while the rows in flight fit there).
#: H200, ms back to back, ROW_THREADS -> 512: LayerNorm bfloat16 [4096, 24576] 0.230 ->
#: 0.155 (eager 0.187), [2048, 32768] 0.130 -> 0.111; its residual add 0.267 -> 0.209,
#: 0.163 -> 0.145; LayerNorm float32 [4096, 24576] 0.287 -> 0.258; GroupNorm(32) + SiLU
#: [64, 256, 64, 64] 0.246 -> 0.222. Rows reading more (residual add + LayerNorm float32 over
#: 24576: 0.353 -> 0.483) stay at ROW_THREADS: two blocks' rows no longer fit in L2.
MOMENTS_HALF_BLOCK_THREADS = 512
MOMENTS_HALF_BLOCK_BYTES = 128 << 10
#: most values a thread of a block loop sums in float32 for a float32 or 16-bit row's mean
#: and variance (longer shares keep float64 sums: a float32 sum's rounding grows with its
#: length; the block merges in float64 either way). H200, ms back to back, float64 ->
#: float32 a thread: GroupNorm(32) + SiLU [32, 512, 64, 64] 0.234 / 0.235 -> 0.222 / 0.219
#: (torch.compile 0.226), LayerNorm [4096, 24576] 0.242 / 0.241 -> 0.239 / 0.238, the other
#: long rows (48-64 values a thread) within 0.005.
NARROW_MOMENTS_MAX = 64
ROW_REGISTERS = 16
ROW_REGISTERS_32 = 32
#: threads a block, and block loops' unrolling, of a row kernel that computes statistics
#: alone (nothing reads the row after its reductions) over rows too long for ROW_THREADS
#: threads' registers, which it reads in scalar block loops (no 16-byte vectors: rows of an
#: odd length, say): more rows in flight a multiprocessor and more loads a thread. H200,
#: kernel µs of ``F.cross_entropy`` (its log-softmax unwritten: a row's online-softmax max
#: and sum) over [4096, 50257] float32: 1024 threads, unrolled 8 times, 271; 512 240; 256
#: 227; 256, unrolled 16 times, 218 (the copy floor 196; a second run 269 -> 220); 1024
#: and 16 252; 128 and 16 234. Vector block loops keep ROW_THREADS: ``x.logsumexp(-1)``
#: over [2048, 65536] float32 took 204 us with 1024 threads, 234 with 256.
STATS_ROW_THREADS = 256
STATS_ROW_UNROLL = 16
#: values of a row each thread of a row kernel aims to take (smaller blocks, more of them
#: resident per multiprocessor, shorter block reductions); rows with a mean and variance
#: take twice as many: their block reduction merges three sums and syncs four times, and
#: half the threads a row put twice the rows in flight (LayerNorm on [16384, 4096]: 0.287
#: -> 0.271 ms on the H100; softmax, whose rows keep two arrays in registers, got slower).
ROW_ELEMS = 8
#: rows a block where a row takes one warp (32 threads: rows up to 32 * ROW_ELEMS values),
#: a warp each, each with its own scratch and the warp's barrier (accel::block_sync): one
#: row a block capped a multiprocessor at 32 rows in flight (its most resident blocks).
#: H200, kernel µs, 1 -> 4 (8) rows a block (torch.compile): softmax(x * 0.125 + mask) over
#: [64, 4, 128, 128] 21.5 -> 11.4 (11.4) (12.6), its backward 21.3 -> 12.1 (12.1) (12.5),
#: RMSNorm [262144, 128] 73.6 -> 65.5 (67.7) (64.2), a row sum [131072, 200] 45.8 -> 32.9
#: (34.9) (25.3); LayerNorm over 256 and its backward unchanged (at torch.compile's);
#: bfloat16 log_softmax [262144, 256] 99.7 -> 103.9 (103.2) (77.4). Rows of 64 threads keep
#: one row a block: 32 blocks of 64 already fill a Hopper multiprocessor (2048 threads).
ROW_WARPS = 4
ROW_ELEMS_MOMENTS = 16
#: rows whose every buffer holds 16-bit floats: each thread takes this many times the
#: elements above (and may keep as many more in registers), the same bytes as a float32
#: row (softmax f16 on [16384, 4096]: 0.119 -> 0.093 ms on the H100, RMSNorm bf16 0.100 ->
#: 0.093, together with their 16-byte vectors)
ROW_HALF_SCALE = 2
#: iterations of a block-mode thread loop (a row longer than a row kernel keeps in
#: registers: group norm's) unrolled, so that as many loads are in flight per thread.
BLOCK_UNROLL = 8
#: the same for block loops moving 16-byte vectors (an iteration: a vector of each such
#: buffer). H200, ms back to back, scalar -> vector loops (torch.compile): RMSNorm over rows
#: of 65536 float32 0.252 -> 0.212 (0.204), bfloat16 0.169 -> 0.118 (0.104); GroupNorm+SiLU
#: [64, 256, 64, 64] 0.284 -> 0.243 (0.204).
BLOCK_VEC_UNROLL = 4
#: full reductions at least this long run over many blocks (grid mode).
GRID_MIN = 1 << 16
#: iterations of a full reduction's grid-strided loop (grid mode) unrolled: loads in flight
#: a thread (see ``CudaRenderer._grid_loop``).
GRID_UNROLL = 4
#: column mode (reductions along a strided dimension): results per block, and most rows of
#: threads splitting each reduction.
COL_TILE = 32
COL_ROWS = 32
#: column mode with few tiles: blocks aimed at (each SM then holds two or more; an H100 has
#: 132), the rows split among as many blocks per tile, each thread still taking at least
#: COL_MIN_ROWS rows; the last block of a tile combines their partials in order. A
#: [8192, 4096] float32 column sum (a bias gradient) took 110 us in 128 blocks on the H100.
COL_BLOCKS = 256
COL_MIN_ROWS = 16
#: the result dtypes whose column reductions may split their rows among blocks (their
#: partials in a ``__device__`` array; other dtypes keep a tile's rows in one block)
COL_SPLIT_TYPES = (torch.float64, torch.float32, torch.int64, torch.int32)
#: block loops' statistics over few long rows (a batch norm's channels: 128 rows of 262144
#: values): each row split among blocks so that about ROW_SPLIT_BLOCKS blocks run (four an
#: H100 multiprocessor), each thread still taking ROW_SPLIT_MIN values or more; the row's
#: last block to finish combines their partials in order (``CudaRenderer._row_split``). One
#: block a row ran 128 blocks of 256 threads on the H100's 132 multiprocessors.
ROW_SPLIT_BLOCKS = 528
ROW_SPLIT_MIN = 32
#: most blocks in a grid (grid-stride loops cover the rest).
MAX_GRID = 65535
#: a transposing elementwise nest's tiles (:meth:`accel.codegen.cuda_tiles.TransposeTiles._transpose_tiles`):
#: TRANSPOSE_TILE x TRANSPOSE_TILE values, a block of 32 x TRANSPOSE_ROWS threads. H200, kernel
#: µs of ``x.t() + y`` / ``x.t().contiguous()`` / ``x.t().softmax(-1)`` ([16384, 4096]
#: float32) with tiles of 32 and 8 rows: 195 / 143 / 356; 64 and 8: 207 / 160 / 339; 64 and
#: 16: 257 / 205 / 336; 32 and 4: 276 / 153 / 317 (torch.compile: 185 / 135 / 261)
TRANSPOSE_TILE = 32
TRANSPOSE_ROWS = 8
#: the shortest contiguous run (``u``'s size) a transposing tile reads: a tile of 8 x 128
#: values reads 32-byte sectors whole
TRANSPOSE_MIN_RUN = 8
#: shared memory a block's transposing tiles may take (bytes; the tiles' shared memory is
#: static, which the CUDA C++ Programming Guide limits to 48 KiB a block, the rest of the
#: kernel's own taking about 1 KiB more): a nest whose loads' tiles need more is not tiled,
#: and a tile with run values is twice as long only where its tiles then take at most
#: TRANSPOSE_LONG_SMEM (two float32 loads' tiles, one float64's)
TRANSPOSE_SMEM = 44 << 10
TRANSPOSE_LONG_SMEM = 24 << 10
#: most values a block loops' reduction has for each thread of the block to reduce it alone
#: (accel.codegen.cuda.CudaRenderer._alone): a group norm's groups of 16 channels (its C / G up to 512 / 32)
ALONE_MAX = 16
