// The Hopper GEMM engine for 16-bit operands (float16, bfloat16) and for
// float32 ones read as TF32, with float32 accumulation: C = A B^T with A
// [M, K] and B [N, K], both K-major (the forward product of a linear
// layer, x W^T), any M, N and K, with row
// strides of a multiple of 16 bytes (ops.gemm._tma_compatible).  The
// main loop is shared by every kernel on it.  Where the operands' tiles
// come from is the caller's `Loader` (DenseLoader: two matrices through 2D
// tensor maps; a convolution's loader gathers A's tiles from its input
// instead; a loader may also put the producer warpgroup's idle warps to
// work on B's tiles: LoaderExtras); what is done with the accumulators is
// the caller's `Store` (gemm.cu: bias and activation; linear_gn_chain.cu:
// the GroupNorm chains);
// how the consumers run their MMAs is the `Mma` policy (SmemMma: both
// operands from shared memory, as below; F32ConvertMma: A float32, rounded
// to 16 bits in registers, both consumers on one 128 x 256 tile;
// conv_bias_relu.cu's ConvWindowMma: 64 x 256 tiles whose B is read at
// shifted rows of a window of a convolution's input; gemm_tf32.cuh's
// Tf32SplitMma: float32 products at float32 accuracy, "3xTF32", A split
// into its TF32 parts in registers, B's parts brought as planes by its
// loaders).
//
// Persistent and warp-specialised: one block of three warpgroups per SM
// (four with a store of its own: StoreExtras) walks the output tiles (128 x
// 128 with SmemMma) in a fixed grouped order, blockIdx.x, + gridDim.x, ...
// (or in the loader's own order: EngineSchedule)
//  * the producer warpgroup (one thread of it) streams the tiles of A and B
//    (128 rows x 128 bytes each: 64 16-bit values, or 32 float32 ones, of
//    k) with the bulk tensor copy engine (TMA) into a kStages
//    ring of shared memory, 128-byte swizzled, each stage guarded by a
//    "full" mbarrier (the copies' bytes) and an "empty" one (the consumer's
//    release), tile after tile;
//  * two consumer warpgroups take the tiles in turn ("ping-pong"; with
//    F32ConvertMma both work on every tile instead): while one
//    stores its tile, the other runs its MMAs, so the tensor cores do not
//    wait for the store.  A consumer runs wgmma.m64n128k16 (k8 for TF32)
//    on both 64-row halves of its tile, operands read from shared memory,
//    with one group of MMAs in flight: a stage is released as soon as the
//    MMAs that read it have completed.
// The tensor maps' out-of-bounds fill (zeros) predicates every edge: the
// loads need no bounds checks, and the stores clip rows and columns.
//
// Accumulator layout (m64n128k16, per warp of a consumer warpgroup: 16 rows
// of each half h = 0, 1): acc[h][4i + 0/1] = row 64h + 16 warp + g, columns
// 8i + 2t, +1; acc[h][4i + 2/3] = that row + 8, the same columns (g = lane / 4,
// t = lane % 4).
#pragma once
#include "sm90.cuh"

namespace cf {

constexpr int kHgBM = 128, kHgBN = 128, kHgBK = 64;  // a consumer's tile (k: one 128-byte swizzle row)
// k-values of T in a k-tile's 128-byte rows: kHgBK for 16-bit T, 32 for
// float32 (TF32).  The MMAs take the rows in four steps of 32 bytes.
template <typename T>
__host__ __device__ constexpr int hg_bk() {
  return 128 / static_cast<int>(sizeof(T));
}
constexpr int kHgSteps = 4;
// An MN-major operand's box: 64 rows of k x 128 bytes (64 16-bit values of
// m or n; TiledLoader), two per 128-row tile.
constexpr int kMnBoxBytes = 64 * 128;
constexpr int kHgThreads = 384;                      // producer + 2 consumer warpgroups
constexpr int kHgThreadsWithStore = 512;             // and the store's own (StoreExtras)
constexpr int kHgTileABytes = kHgBM * kHgBK * 2;     // 16 KiB
constexpr int kHgTileBBytes = kHgBN * kHgBK * 2;     // 16 KiB
constexpr int kHgStageBytes = kHgTileABytes + kHgTileBBytes;
constexpr int kHgAccs = 64;                          // accumulators per consumer thread and half
// F32ConvertMma's tile of C^T (rows of its float32 A x rows of B) and stage.
constexpr int kCvBM = 128, kCvBN = 256;
constexpr int kCvStageBytes = kCvBM * 64 * 4 + kCvBN * 64 * 2;  // 64 KiB
// Its store's staging (gemm.cu, TransposedTmaStore): 128 x 64 16-bit values
// of C per consumer warpgroup.
constexpr int kCtStagingBytes = 2 * (kCvBN / 2) * 64 * 2;

// Dynamic shared memory of the engine: the stages (1024-byte aligned, as the
// 128-byte swizzle pattern repeats every 1024 bytes), the store's staging
// area of kStagingBytes (a multiple of 1024), a loader's own kExtraBytes
// (LoaderExtras), and the stages' mbarriers, then the loader's
// kExtraBarriers.
template <int kStages, int kStagingBytes, int kStageBytes = kHgStageBytes, int kExtraBytes = 0,
          int kExtraBarriers = 0>
__host__ __device__ constexpr int half_gemm_shared_bytes() {
  // 1024: alignment slack; the barriers: full and empty per stage, 2 turns.
  return 1024 + kStages * kStageBytes + kStagingBytes + kExtraBytes + 2 * kStages * 8 + 16 + 8 * kExtraBarriers;
}

// v as lane 0 holds it, for a v that is the same across the warp: ptxas
// cannot tell that a value derived from threadIdx is, but it can tell so
// of a full-warp shuffle from one lane.  What is computed from it (a
// consumer's tiles, stages and shared-memory descriptors) then lives in
// uniform registers, which wgmma reads its descriptors from, instead of
// being moved there before every MMA, and loops bounded by it are not
// divergent.
__device__ __forceinline__ int from_lane0(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// The thread's consumer warpgroup (0, 1; the store's own, 2), from lane 0.
__device__ __forceinline__ int consumer_warpgroup() {
  return from_lane0((static_cast<int>(threadIdx.x) >> 7) - 1);
}

// A consumer thread: its warpgroup (wg: 0, 1) and where its accumulators
// lie in its tile: rows 64h + row, 64h + row + 8 (row = 16 * warp + g),
// columns 8i + 2t, +1.  wg from lane 0 (consumer_warpgroup) unless
// from_lane0 is false (warpgroup_from_lane0).
struct HalfGemmLane {
  int wg, row, t;
  __device__ __forceinline__ explicit HalfGemmLane(bool from_lane0 = true) {
    const int ctid = static_cast<int>(threadIdx.x) - 128;
    const int warp = ctid >> 5, lane = ctid & 31;
    wg = from_lane0 ? consumer_warpgroup() : warp >> 2;
    t = lane & 3;
    row = 16 * (warp & 3) + (lane >> 2);
  }
  // The warpgroup's first thread (its bulk copies, its barrier's leader).
  __device__ __forceinline__ bool leader() const { return (threadIdx.x & 127) == 0; }
};

// The TMA store of a consumer warpgroup's 128 x 128 tile of 16-bit C: the
// warpgroup writes its values, rounded and packed in pairs, into its staging
// area as two 128 x 64 boxes in the 128-byte swizzle layout (a warp's 8 rows
// x 16 bytes then hit 32 distinct banks), and one thread hands the boxes to
// TMA, which writes whole lines and clips at the tensor's edges.  The
// warpgroup's next tile starts while those writes drain; its staging area is
// reused once they have read it.  C needs a row stride of a multiple of 16
// bytes (ops.gemm._tma_compatible).  Usage, by all 128 threads of the
// warpgroup: begin(); put() every pair (or put4() four blocks of them at a
// time); end(); and finish() after the last tile.
constexpr int kHgStagingBytes = 2 * kHgBM * kHgBN * 2;  // a tile of 16-bit C per consumer warpgroup
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
struct TmaTileWriter {
  // Waits until the previous tile's boxes have left the staging area.
  __device__ __forceinline__ static void begin(const HalfGemmLane& me) {
    if (me.leader()) bulk_wait_read();
    named_barrier(1 + me.wg, 128);
  }
  // Shared address of 16-byte chunk k (columns 8k .. 8k + 7) of tile row r.
  __device__ __forceinline__ static unsigned chunk_addr(unsigned staging, int r, int k) {
    return staging + (k >> 3) * (kHgBM * 128) + r * 128 + (((k & 7) ^ (r & 7)) << 4);
  }
  // The packed pair at tile row r, columns 8i + 2t, +1.
  __device__ __forceinline__ static void put(unsigned staging, int r, int i, int t, unsigned word) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(chunk_addr(staging, r, i) + 4 * t), "r"(word) : "memory");
  }
  // A thread's packed pairs of columns 8i .. 8i + 15 (i even) of its two
  // rows me.row and + 8 of row half hm, in one stmatrix (four 8 x 8 blocks,
  // each row of a block one 16-byte chunk): w[h][c] holds the pair at row
  // 64 hm + me.row + 8 h, columns 8 (i + c) + 2 me.t, +1, as put() would
  // store it.  (One instruction for put()'s four.)
  __device__ __forceinline__ static void put4(unsigned staging, const HalfGemmLane& me, int hm, int i,
                                              const unsigned (&w)[2][2]) {
    // Lane 8 j + l gives row l of block j: blocks (h, c) = (j & 1, j >> 1),
    // at chunk_addr(staging, r, i + c).  With i even, ((i + c) & 7) ^ l is
    // (i & 7) ^ (c ^ l): the lane's part is the same for every i.
    const int lane = threadIdx.x & 31, j = lane >> 3, l = lane & 7;
    const unsigned row = staging + (64 * hm + (me.row & ~7) + 8 * (j & 1) + l) * 128;
    const unsigned swizzle = (((j >> 1) ^ l) << 4) ^ ((i & 7) << 4);
    stmatrix_x4(row + (i >> 3) * (kHgBM * 128) + swizzle, w[0][0], w[1][0], w[0][1], w[1][1]);
  }
  // put4() of the pairs pair(h, c) (w[h][c] above).
  template <typename Pair>
  __device__ __forceinline__ static void put4_pairs(unsigned staging, const HalfGemmLane& me, int hm, int i,
                                                    const Pair& pair) {
    unsigned w[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < 2; ++c) w[h][c] = pair(h, c);
    put4(staging, me, hm, i, w);
  }
  // Makes the warpgroup's writes of its staging area visible to the copy
  // engine; true for the thread that then hands it over.
  __device__ __forceinline__ static bool staged(const HalfGemmLane& me) {
    fence_proxy_async();
    named_barrier(1 + me.wg, 128);
    return me.leader();
  }
  // Hands the tile to the copy engine: the boxes at (n0 + 64 box, m0) of a
  // 2-D C, or, with outer >= 0, of plane `outer` of a 3-D C (its rows those
  // of one plane, the boxes 64 x 128 x 1); boxes first_box .. end_box - 1;
  // kEvictFirst: as tma_store_2d's.
  template <bool kEvictFirst = false>
  __device__ __forceinline__ static void end(const TensorMap& map, const HalfGemmLane& me, unsigned staging,
                                             i64 m0, i64 n0, int outer = -1, int first_box = 0,
                                             int end_box = kHgBN / 64) {
    if (staged(me)) {
#pragma unroll
      for (int box = first_box; box < end_box; ++box) {
        const unsigned src = staging + box * (kHgBM * 128);
        const int col = static_cast<int>(n0) + 64 * box, row = static_cast<int>(m0);
        if (outer < 0) {
          tma_store_2d<kEvictFirst>(map, src, col, row);
        } else {
          tma_store_3d<kEvictFirst>(map, src, col, row, outer);
        }
      }
      bulk_commit();
    }
  }
  // Shared memory must outlive the copies.
  __device__ __forceinline__ static void finish(const HalfGemmLane& me) {
    if (me.leader()) bulk_wait();
  }
};
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The operands' tiles, as the engine's producer asks for them: C's tiles
// form a tiles_m() x tiles_n() grid, each the sum of ktiles() products of a
// tile of A of 128 rows x 128 bytes (hg_bk<T>() values) and one of B
// (K-major, 128-byte swizzled, zeros past the edges).  The producer (one thread, on its own copy of the loader)
// calls begin_tile() for each output tile, then load() for its k-tiles in
// order, which has the copy engine write them to shared memory, completing
// `bar`'s transaction count by kHgStageBytes.  The producer's issue rate
// can set a short product's pace: per-tile work belongs in begin_tile().
//
// TiledLoader: A [M, K] and B [N, K] through tensor maps, tiles of kBM x
// 64 and kBN x 64 elements of a 16-bit B; A's tile is kABoxes boxes of
// 128-byte rows, side by side in k (one of 64 16-bit values; two of 32
// float32 ones), B's one box (128-byte swizzle: ops.gemm._tensor_map).
// DenseLoader: 128 x 128 tiles of C, A of B's dtype.
// kAMn / kBMn (16-bit operands, 128 x 128 tiles): A (B) is M-major (N-major),
// read through a tensor map of its transpose, [K, M] ([K, N]): a tile is two
// boxes of 64 rows of k x 128 bytes (64 values of m or n), side by side in
// m (n), each in the 128-byte swizzle layout of an MN-major wgmma operand.
// These are the layouts of a linear layer's backward products: dZ W (B
// N-major) and dZ^T x (both MN-major).
template <int kBM, int kBN, int kABoxes = 1, bool kAMn = false, bool kBMn = false>
struct TiledLoader {
  static_assert(!(kAMn || kBMn) || (kBM == 128 && kBN == 128 && kABoxes == 1),
                "MN-major operands: 128 x 128 tiles of 16-bit values");
  const TensorMap& map_a;
  const TensorMap& map_b;
  i64 M, N, K;
  int m0 = 0, n0 = 0;  // the current output tile's first row and column
  __device__ __forceinline__ i64 tiles_m() const { return (M + kBM - 1) / kBM; }
  __device__ __forceinline__ i64 tiles_n() const { return (N + kBN - 1) / kBN; }
  __device__ __forceinline__ int ktiles() const { return static_cast<int>((K + kHgBK - 1) / kHgBK); }
  __device__ __forceinline__ void prefetch() const {
    tma_prefetch_descriptor(map_a);
    tma_prefetch_descriptor(map_b);
  }
  __device__ __forceinline__ void begin_tile(i64 tm, i64 tn) {
    m0 = static_cast<int>(tm * kBM);
    n0 = static_cast<int>(tn * kBN);
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned tile_b, unsigned bar, int kt) {
    if constexpr (kAMn) {
      tma_load_2d(tile_a, map_a, m0, kt * kHgBK, bar);
      tma_load_2d(tile_a + kMnBoxBytes, map_a, m0 + 64, kt * kHgBK, bar);
    } else {
#pragma unroll
      for (int box = 0; box < kABoxes; ++box)
        tma_load_2d(tile_a + box * (kBM * 128), map_a, kt * kHgBK + box * (kHgBK / kABoxes), m0, bar);
    }
    if constexpr (kBMn) {
      tma_load_2d(tile_b, map_b, n0, kt * kHgBK, bar);
      tma_load_2d(tile_b + kMnBoxBytes, map_b, n0 + 64, kt * kHgBK, bar);
    } else {
      tma_load_2d(tile_b, map_b, kt * kHgBK, n0, bar);
    }
  }
};
using DenseLoader = TiledLoader<kHgBM, kHgBN>;

// Shared-memory matrix descriptors of an operand in the 128-byte swizzle
// layout that TMA writes: rows of 128 bytes, 8-row (1024-byte) core groups
// (stride-byte offset 1024).  K-major (the rows along m or n): the
// leading-byte offset is unused there (16).  MN-major (PTX: M-major A,
// N-major B; the rows along k, 64 values of m or n each, as TiledLoader's
// MN-major boxes lay them out): the leading-byte offset is the step to the
// next 64 values of m or n, kMnBoxBytes.
// Made once from a stage's address; at(offset) is the descriptor of the
// slice `offset` bytes on, one add per MMA step.  A shared address stays
// below 2^18, so the 14-bit address field (address / 16) takes the offset
// without carrying into the leading-byte field, and the high word (the
// stride-byte offset and the swizzle mode) is a constant.  (Building each
// descriptor whole would take a mask, shifts and ors per MMA step:
// docs/gemm.md, "Fewer instructions in the main loop".)
struct Swizzle128Desc {
  unsigned lo;
  __device__ __forceinline__ explicit Swizzle128Desc(unsigned addr, unsigned leading_bytes = 16)
      : lo(((addr & 0x3ffffu) >> 4) | ((leading_bytes >> 4) << 16)) {}
  __device__ __forceinline__ unsigned long long at(unsigned offset) const {
    return (static_cast<unsigned long long>((1024 >> 4) | (1u << 30)) << 32) | (lo + (offset >> 4));
  }
};

// Two floats rounded to T and packed into one word (lo in the low half), in
// one instruction.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<bfloat16>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ unsigned pack2<half>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Whether a 16-bit T is bfloat16 (wgmma's operand type name).
template <typename T> struct WgmmaType;
template <> struct WgmmaType<half> { static constexpr bool kBf16 = false; };
template <> struct WgmmaType<bfloat16> { static constexpr bool kBf16 = true; };

#define CF_WGMMA_M64N128(SHAPE_TYPES, TRANSPOSES)                                                    \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                    \
      "wgmma.mma_async.sync.aligned.m64n128" SHAPE_TYPES " "                                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "    \
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "     \
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1" TRANSPOSES ";\n}\n"             \
      : CF_D32(0), CF_D32(32)                                                                          \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
// d (+)= A B^T for one 32-byte step of k: a 64 x 16 slice of A and a 128 x
// 16 slice of B of a 16-bit T, 64 x 8 and 128 x 8 of float32 T (read as
// TF32: the low 13 bits of the mantissa are not used), both in shared
// memory (descriptors).  accumulate = 0 ignores d's old value.  kTransA /
// kTransB (16-bit T): A M-major / B N-major (Swizzle128Desc), else
// K-major.
template <typename T, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n128_step(float (&d)[64], unsigned long long desc_a,
                                                   unsigned long long desc_b, int accumulate) {
  if constexpr (sizeof(T) == 4) {
    static_assert(kTransA == 0 && kTransB == 0, "TF32 operands are K-major");
    CF_WGMMA_M64N128("k8.f32.tf32.tf32", "");  // (TF32 takes no transpose flags)
  } else if constexpr (WgmmaType<T>::kBf16) {
    CF_WGMMA_M64N128("k16.f32.bf16.bf16", ", %67, %68");
  } else {
    CF_WGMMA_M64N128("k16.f32.f16.f16", ", %67, %68");
  }
}
#define CF_WGMMA_M64N64(SHAPE_TYPES, TRANSPOSES)                                                     \
  asm volatile(                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                    \
      "wgmma.mma_async.sync.aligned.m64n64" SHAPE_TYPES " "                                           \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "   \
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1" TRANSPOSES ";\n}\n" \
      : CF_D32(0)                                                                                      \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
// wgmma_m64n128_step's half: a 64 x 16 slice of B (16-bit T), into the 32
// accumulators of d's m64n64 layout (d[4 i + 2 h + e]: row me.row + 8 h,
// column 8 i + 2 t + e).
template <typename T, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n64_step(float* d, unsigned long long desc_a, unsigned long long desc_b,
                                                  int accumulate) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  if constexpr (WgmmaType<T>::kBf16) {
    CF_WGMMA_M64N64("k16.f32.bf16.bf16", ", %35, %36");
  } else {
    CF_WGMMA_M64N64("k16.f32.f16.f16", ", %35, %36");
  }
}
#undef CF_WGMMA_M64N64
#undef CF_WGMMA_M64N128

// The start of a consumer's group of MMAs into acc: the accumulators' reads
// and writes kept out of the asynchronous MMAs' way, then wgmma's fence.
__device__ __forceinline__ void begin_mma_group(float (&acc)[2][kHgAccs]) {
  fence_registers(acc[0]);
  fence_registers(acc[1]);
  wgmma_fence();
}
// An Mma policy with no per-tile state.
struct TilelessMma {
  __device__ __forceinline__ void begin_tile(i64, i64) {}
  __device__ __forceinline__ void end_tile(float (&)[2][kHgAccs]) {}
};

// What a loader adds to the engine: none, unless it declares
// kHelperWarps (then also kExtraBytes and kExtraBarriers).  Such a loader
// writes B's tile of each stage itself, with the last kHelperWarps warps of
// the producer warpgroup (help()): the stage's copies then bring A's tile
// alone, and its "full" barrier also waits for one arrive per helper warp.
// It gets kExtraBytes of shared memory (1024-byte aligned) and
// kExtraBarriers mbarriers of its own (attach(), on the producer's and the
// helpers' copies of it; init_barriers(), once, before the block's first
// barrier).
template <typename L, typename = int>
struct LoaderExtras {
  static constexpr int kHelperWarps = 0, kBytes = 0, kBarriers = 0;
};
template <typename L>
struct LoaderExtras<L, decltype(L::kHelperWarps, 0)> {
  static constexpr int kHelperWarps = L::kHelperWarps, kBytes = L::kExtraBytes, kBarriers = L::kExtraBarriers;
};

// Which tiles a block takes, and in which order, as a cursor c: the
// block's j-th tile is first(j), the one k tiles further c + step(k),
// valid(c) while it exists, at (tm, tn) = at(c).  By default tiles
// blockIdx.x, + gridDim.x, ... of the grouped order (grouped_tile_of); a
// loader that declares kOwnSchedule gives its own (block_tiles() of them,
// the j-th at block_tile(j, tm, tn)), read by every warpgroup alike.
template <typename L, typename = int>
struct EngineSchedule {
  const L& loader;
  i64 tiles, tiles_m, tiles_n;
  __device__ __forceinline__ i64 first(i64 j) const { return blockIdx.x + j * gridDim.x; }
  __device__ __forceinline__ unsigned step(int k) const { return k * gridDim.x; }
  __device__ __forceinline__ bool valid(i64 c) const { return c < tiles; }
  __device__ __forceinline__ void at(i64 c, i64& tm, i64& tn) const { grouped_tile_of(c, tiles_m, tiles_n, tm, tn); }
};
template <typename L>
struct EngineSchedule<L, decltype(L::kOwnSchedule, 0)> {
  const L& loader;
  i64 tiles, tiles_m, tiles_n;
  __device__ __forceinline__ i64 first(i64 j) const { return j; }
  __device__ __forceinline__ unsigned step(int k) const { return k; }
  __device__ __forceinline__ bool valid(i64 c) const { return c < loader.block_tiles(); }
  __device__ __forceinline__ void at(i64 c, i64& tm, i64& tn) const { loader.block_tile(c, tm, tn); }
};

// What an Mma policy reads of the loader's own shared memory: nothing,
// unless it declares kReadsLoaderExtras; then each consumer's copy is
// attach()-ed to the loader's bytes and barriers (LoaderExtras) before its
// first tile, and each warp's leader calls stage_done(kt) right after its
// release of the tile's k-tile kt (its MMAs have completed).
template <typename M, typename = int>
struct MmaExtras {
  static constexpr bool kReadsLoader = false;
};
template <typename M>
struct MmaExtras<M, decltype(M::kReadsLoaderExtras, 0)> {
  static constexpr bool kReadsLoader = M::kReadsLoaderExtras;
};
// Whether the consumers' HalfGemmLane takes its warpgroup from lane 0
// (consumer_warpgroup: uniform registers for what is computed from it):
// yes, unless the policy declares kWarpgroupFromLane0 = false.  Called
// with 0 (the first overload where M declares it).
template <typename M>
constexpr auto warpgroup_from_lane0(int) -> decltype(M::kWarpgroupFromLane0, true) {
  return M::kWarpgroupFromLane0;
}
template <typename M>
constexpr bool warpgroup_from_lane0(long) {
  return true;
}

// What a store adds to the engine: none, unless it declares
// kOwnWarpgroup (true): then the block has a fourth warpgroup
// (kHgThreadsWithStore threads), the store's own, which shares the work of
// finishing each tile with the consumer that computed it, after that
// consumer has put it into its staging area.  Each staging area is handed
// back and forth with two named barriers of the consumer's and the store's
// warpgroups (256 threads; arrive on one side, sync on the other):
// "staged" (the consumer's part for the store's warpgroup is in, and its
// copy engine has read what it was to read from the area) and "freed" (the
// store's warpgroup is done with the area).
template <typename S, typename = int>
struct StoreExtras {
  static constexpr bool kWarpgroup = false;
};
template <typename S>
struct StoreExtras<S, decltype(S::kOwnWarpgroup, 0)> {
  static constexpr bool kWarpgroup = S::kOwnWarpgroup;
};
// Named barriers (1-3: each warpgroup's own, TmaTileWriter): staged[w] at
// kHgStagedBarrier + w, freed[w] at kHgFreedBarrier + w.
constexpr int kHgStagedBarrier = 4, kHgFreedBarrier = 6;
// Registers per thread after setmaxnreg: producer and consumers, and with a
// store warpgroup producer, consumers and the store's (each set within the
// launch's registers: 64 Ki per block, per thread a multiple of 8; ptxas
// -v: no spills in the kernels on them).
constexpr int kHgProducerRegs = 40, kHgConsumerRegs = 232;
constexpr int kHgStoreProducerRegs = 24, kHgStoreConsumerRegs = 168, kHgStoreRowRegs = 152;
static_assert(128 * (kHgProducerRegs + 2 * kHgConsumerRegs) <= kHgThreads * (65536 / kHgThreads / 8 * 8),
              "register budget");
static_assert(128 * (kHgStoreProducerRegs + 2 * kHgStoreConsumerRegs + kHgStoreRowRegs) <=
                  kHgThreadsWithStore * (65536 / kHgThreadsWithStore / 8 * 8),
              "register budget");

// The engine's ring of stages, as a loader's helpers see it.
struct StageRing {
  unsigned base, bars;
  int stages, stage_bytes, tile_a_bytes;
  __device__ __forceinline__ unsigned tile_b(int s) const { return base + s * stage_bytes + tile_a_bytes; }
  __device__ __forceinline__ unsigned full(int s) const { return bars + 8u * s; }
  __device__ __forceinline__ unsigned empty(int s) const { return bars + 8u * (stages + s); }
};

// A loader's own ring of kRaw slots of raw tiles at `raws` (its
// kExtraBytes) and their barriers (two of its kExtraBarriers a slot),
// whose tiles the producer's copies bring and its kHelperWarps helper warps
// read: raw_full(slot) takes the producer's arrive and the copy's bytes,
// raw_empty(slot) one arrive per helper warp once it has read the slot.
template <int kRaw, int kHelperWarps>
struct RawRing {
  unsigned raws = 0, bars = 0;  // (attach)
  __device__ __forceinline__ unsigned raw_full(int slot) const { return bars + 8u * slot; }
  __device__ __forceinline__ unsigned raw_empty(int slot) const { return bars + 8u * (kRaw + slot); }
  __device__ __forceinline__ void init_barriers(unsigned at) const {
    for (int slot = 0; slot < kRaw; ++slot) {
      mbar_init(at + 8u * slot, 1);
      mbar_init(at + 8u * (kRaw + slot), kHelperWarps);
    }
  }
  __device__ __forceinline__ void attach(unsigned extra, unsigned loader_bars) {
    raws = extra;
    bars = loader_bars;
  }
  // The helpers' loop, for a loader's help() (run by its kHelperWarps
  // warps): for each stage the block uses (ktiles k-tiles of each of its
  // tiles in turn), once the consumers have released it, kRowsPerStage raw
  // slots of kSlotBytes in turn, each handed to work(its address, the
  // stage, the row of the stage) once the copy has filled it and released
  // after; then the stage's writes fenced for the MMAs and one arrive per
  // warp on its "full" barrier.  (A slot's reads are done when work
  // returns, their values in the stage's writes: the copy engine's next
  // write of the slot comes after the arrive, as a TMA pipeline's consumers
  // release a stage read by ldmatrix.)
  template <int kRowsPerStage, int kSlotBytes, typename Work>
  __device__ __forceinline__ void help_stages(const StageRing& ring, i64 tiles, int ktiles, const Work& work) const {
    const int lane = threadIdx.x & 31;
    int it = 0, row = 0;
    for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        // (with one row a stage, the row count is the stage count it)
        const int s = it % ring.stages, first_slot = it % kRaw;
        if (it >= ring.stages) mbar_wait(ring.empty(s), ((it / ring.stages) - 1) & 1);
#pragma unroll 1
        for (int r = 0; r < kRowsPerStage; ++r, ++row) {
          const int at = kRowsPerStage == 1 ? it : row, slot = kRowsPerStage == 1 ? first_slot : row % kRaw;
          mbar_wait(raw_full(slot), (at / kRaw) & 1);
          work(raws + slot * kSlotBytes, s, r);
          __syncwarp();
          if (lane == 0) mbar_arrive(raw_empty(slot));
        }
        fence_proxy_async();  // the stage's writes, before the MMAs read them
        __syncwarp();
        if (lane == 0) mbar_arrive(ring.full(s));
      }
    }
  }
};

// The consumers' MMAs, a policy of the engine (half_gemm_persistent): the
// shape of a block's tile of C (kBM x kBN) and how the two consumer
// warpgroups share it (kCooperative: both work on every tile, warpgroup w
// on its rows kWgRows w .. kWgRows (w + 1) - 1; else they take whole tiles in
// turns, "ping-pong"), the bytes of A's and B's tiles in a stage, and
// issue(acc, a, b, kt), which issues and commits the MMAs of k-tile kt
// whose operands lie in the stage at shared addresses a (A) and b (B),
// leaving at most one group of this k-tile's MMAs in flight.
// begin_tile(tm, tn) comes before a tile's first k-tile, end_tile(acc)
// after the wait for its last MMAs (and may leave the tile's sums in acc).
//
// SmemMma: both operands from shared memory (descriptors), A and B 128 rows
// of 128 bytes (K-major) or two boxes of 64 rows of k (kAMn / kBMn:
// MN-major, TiledLoader), two wgmma.m64n128 per step of 16 values of k
// (acc[h]: rows 64h .. 64h + 63), one group per k-tile.
template <typename T, bool kAMn = false, bool kBMn = false>
struct SmemMma : TilelessMma {
  // The operands' slices for step kk of k (rows 64h.. of A): K-major, 32
  // bytes along the swizzled rows; MN-major, 16 rows of k (2048 bytes) on.
  __device__ __forceinline__ static unsigned long long desc_a(const Swizzle128Desc& a, int h, int kk) {
    return kAMn ? a.at(h * kMnBoxBytes + 2048 * kk) : a.at(h * (64 * 128) + 32 * kk);
  }
  __device__ __forceinline__ static unsigned long long desc_b(const Swizzle128Desc& b, int kk) {
    return kBMn ? b.at(2048 * kk) : b.at(32 * kk);
  }
  static constexpr int kBM = kHgBM, kBN = kHgBN, kWgRows = kHgBM;
  static constexpr bool kCooperative = false;
  static constexpr int kTileABytes = kHgTileABytes, kTileBBytes = kHgTileBBytes;
  __device__ __forceinline__ void issue(float (&acc)[2][kHgAccs], unsigned a, unsigned b, int kt) const {
    const Swizzle128Desc sa(a, kAMn ? kMnBoxBytes : 16), sb(b, kBMn ? kMnBoxBytes : 16);
    begin_mma_group(acc);
#pragma unroll
    for (int kk = 0; kk < kHgSteps; ++kk) {
      const unsigned long long db = desc_b(sb, kk);
      wgmma_m64n128_step<T, kAMn, kBMn>(acc[0], desc_a(sa, 0, kk), db, kt > 0 || kk > 0);
      wgmma_m64n128_step<T, kAMn, kBMn>(acc[1], desc_a(sa, 1, kk), db, kt > 0 || kk > 0);
    }
    wgmma_commit();
  }
};

#define CF_E8(i) "+f"(e[i]), "+f"(e[i + 1]), "+f"(e[i + 2]), "+f"(e[i + 3]), "+f"(e[i + 4]), \
                 "+f"(e[i + 5]), "+f"(e[i + 6]), "+f"(e[i + 7])
#define CF_E32(i) CF_E8(i), CF_E8(i + 8), CF_E8(i + 16), CF_E8(i + 24)
#define CF_WGMMA_M64N256_RS(TYPES)                                                                       \
  asm volatile(                                                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                     \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32" TYPES " "                                           \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "     \
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "      \
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "       \
      "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "       \
      "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "       \
      "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "         \
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "       \
      "%123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"                  \
      : CF_D32(0), CF_D32(32), CF_E32(0), CF_E32(32)                                                     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
// d, e (+)= A B^T for one 16-value step of k, A from registers: a 64 x 16
// slice of A of a 16-bit T in the fragment layout of mma.m16n8k16 per warp
// (warp w: rows 16w + g, + 8; a[0]: row g, k 2t, 2t + 1; a[1]: row g + 8;
// a[2], a[3]: the same at k + 8), and a 256 x 16 slice of B in shared
// memory (descriptor).  d: columns 0-127 of C's 64 x 256 slice, e: 128-255,
// each in the m64n128 layout.  accumulate = 0 ignores d's and e's old
// values.  wgmma reads a[] asynchronously: the registers must keep their
// values until the MMA has completed (wgmma_wait).
template <typename T>
__device__ __forceinline__ void wgmma_m64n256_rs(float (&d)[64], float (&e)[64], const unsigned (&a)[4],
                                                 unsigned long long desc_b, int accumulate) {
  if constexpr (WgmmaType<T>::kBf16) {
    CF_WGMMA_M64N256_RS(".bf16.bf16");
  } else {
    CF_WGMMA_M64N256_RS(".f16.f16");
  }
}
#undef CF_WGMMA_M64N256_RS
#undef CF_E32
#undef CF_E8

// Half h of a consumer warpgroup's 64 x 256 tile of C^T (acc[h], its
// columns 128 h .. + 127, in the m64n128 layout) written transposed into
// `staging`: C's 128 x 64 tile, 128-byte swizzled rows, a TMA box of 64 x
// 128 (stmatrix .trans: a warp's 8 x 8 blocks land as 16-byte rows; 8
// instructions a thread).  value(v, hi) is the 16-bit T to stage for the
// sum v at C^T's row me.row (+ 8 where hi).  The caller brackets it with
// TmaTileWriter::begin and ::staged.
template <typename T, typename Value>
__device__ __forceinline__ void stage_transposed(const float (&a)[kHgAccs], const HalfGemmLane& me,
                                                 unsigned staging, const Value& value) {
  const int lane = threadIdx.x & 31, warp = me.row >> 4;
  const int j = lane >> 3, r = lane & 7;  // this lane's row r of matrix j
  // Matrices 0-3 of block pair p: the 8 x 8 blocks at C^T rows 16 warp (+
  // 8), columns 16 p (+ 8) of the half; lane 8j + r addresses C's row 16 p
  // + 8 (j / 2) + r, 16-byte chunk 2 warp + j % 2.
  const unsigned lane_addr = staging + (8 * (j >> 1) + r) * 128 + (((2 * warp + (j & 1)) ^ r) << 4);
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    const int i = 2 * p;  // the m64n128 layout's column block of 8
    stmatrix_x4_trans(lane_addr + p * (16 * 128), pack2<T>(value(a[4 * i], false), value(a[4 * i + 1], false)),
                      pack2<T>(value(a[4 * i + 2], true), value(a[4 * i + 3], true)),
                      pack2<T>(value(a[4 * i + 4], false), value(a[4 * i + 5], false)),
                      pack2<T>(value(a[4 * i + 6], true), value(a[4 * i + 7], true)));
  }
}

// Keeps the compiler from giving the registers of an MMA's A operand to
// anything else before this point (after the wait for that MMA).
__device__ __forceinline__ void fence_registers(unsigned (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// F32ConvertMma: A is float32 in shared memory, rounded to the 16-bit T in
// registers as the MMAs take it (wgmma's A may come from registers, B may
// not), so a float32 operand is read once, with no cast of it in memory.
// A block's tile is 128 rows (A's) x 256 columns (B's), shared by the two
// consumer warpgroups (cooperative: they read the same B tile, which halves
// the operand bytes per MMA of a 64 x 256 tile each).  Warpgroup w takes
// rows 64w .. 64w + 63: one wgmma.m64n256k16 per 16 values of k, acc[0]
// and acc[1] its columns 0-127 and 128-255 (each in the m64n128 layout).
// A's tile in a stage: 128 rows x 64 float32 as two 128-byte swizzled boxes
// of 32 values of k (16 KiB each); B's: 256 rows x 64 values of T (one
// swizzled box).  A k-tile's A fragments are loaded and rounded whole into
// one of two register sets, taken in turn, while the previous k-tile's MMAs
// run; one group of MMAs per k-tile.
// The fragment loads go by pairs of steps (2m, 2m + 1: the two halves of
// box m's rows), the odd rows taking the second step first: a half-warp's
// rows g = 0-3 (or 4-7) at k 2t of one step find their values in four of
// the row's eight 16-byte chunks (the swizzle XORs the chunk with g), two
// rows to a chunk, a 2-way bank conflict; with the odd rows on the other
// step's four chunks, each load's 16 lanes cover all 32 banks.  Two selects
// per fragment register put the values back in step order.
template <typename T>
struct F32ConvertMma {
  static constexpr int kBM = kCvBM, kBN = kCvBN, kWgRows = 64;
  static constexpr bool kCooperative = true;
  static constexpr int kTileABytes = kBM * 64 * 4, kTileBBytes = kBN * 64 * 2;
  static_assert(kTileABytes + kTileBBytes == kCvStageBytes, "the stage as the host sizes it");
  // This thread's rows of A's tile (row, row + 8: in its warpgroup's half),
  // whether it takes the odd step of a pair first (an odd row), and the byte
  // offsets in a box row of its values at k 2t, 2t + 1 (lo) and k + 8 (hi),
  // for its first and second load of a pair of steps.
  int row;
  bool odd_first;
  unsigned off[2][2];
  unsigned regs[2][4][4];  // [k-tile parity][step kk][fragment register]

  __device__ __forceinline__ F32ConvertMma() {
    const HalfGemmLane me;
    row = kWgRows * me.wg + me.row;
    odd_first = (row & 1) != 0;
#pragma unroll
    for (int second = 0; second < 2; ++second)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int odd = second ^ static_cast<int>(odd_first);  // the step's parity
        const int chunk = 4 * odd + 2 * hi + (me.t >> 1);  // 16-byte chunk of k in the 128-byte row
        off[second][hi] = (static_cast<unsigned>(chunk ^ (row & 7)) << 4) + 8u * (me.t & 1);
      }
  }
  __device__ __forceinline__ void begin_tile(i64, i64) {
    // (New values: the last tile's stay live only until its end_tile.)
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) regs[p][kk][i] = 0u;
  }
  __device__ __forceinline__ void end_tile(float (&)[2][kHgAccs]) {
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) fence_registers(regs[p][kk]);
  }
  __device__ __forceinline__ void issue(float (&acc)[2][kHgAccs], unsigned a, unsigned b, int kt) {
    // (Register sets named at compile time: an index by kt would put them
    // in local memory.)
    if (kt & 1) {
      issue_into<1>(acc, a, b, kt);
    } else {
      issue_into<0>(acc, a, b, kt);
    }
  }
  template <int kSet>
  __device__ __forceinline__ void issue_into(float (&acc)[2][kHgAccs], unsigned a, unsigned b, int kt) {
    unsigned (&frag)[4][4] = regs[kSet];
#pragma unroll
    for (int m = 0; m < 2; ++m) {  // steps 2m and 2m + 1
      const unsigned r0 = a + m * (kBM * 128) + row * 128;  // row `row` of box m
      float2 v[2][4];  // [first or second load][j]
#pragma unroll
      for (int second = 0; second < 2; ++second)
#pragma unroll
        for (int j = 0; j < 4; ++j)  // (row, lo), (row + 8, lo), (row, hi), (row + 8, hi)
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                       : "=f"(v[second][j].x), "=f"(v[second][j].y)
                       : "r"(r0 + (j & 1) * 1024 + off[second][j >> 1]));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned first = pack2<T>(v[0][j].x, v[0][j].y);
        const unsigned later = pack2<T>(v[1][j].x, v[1][j].y);
        frag[2 * m][j] = odd_first ? later : first;
        frag[2 * m + 1][j] = odd_first ? first : later;
      }
    }
    const Swizzle128Desc sb(b);
    begin_mma_group(acc);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n256_rs<T>(acc[0], acc[1], frag[kk], sb.at(32 * kk), kt > 0 || kk > 0);
    wgmma_commit();
    wgmma_wait<1>();  // the previous k-tile's MMAs are done: its A registers are free
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) fence_registers(regs[1 - kSet][kk]);
  }
};

// The engine, run by all kHgThreads (or kHgThreadsWithStore) threads of a block: every tile of C this
// block owns, each handed to store(acc, lane, m0, n0, staging) by every
// thread of each consumer warpgroup that computed part of it (its 2 x
// kHgAccs sums, in the layout of its Mma; m0: the first row of its part)
// after its last read of the tile's stages; `staging`: the shared address
// of that warpgroup's kStagingBytes / 2 of staging area.  After its last
// tile every consumer thread calls store.finish(lane).  With a store
// warpgroup (StoreExtras), the consumers call store(acc, lane, m0, n0,
// staging, staged) instead, and every thread of the store arrives on named
// barrier `staged` (named_barrier_arrive, 256 threads) once the store's
// warpgroup may go on; that warpgroup calls, for the block's j-th tile,
// store.rows(lane, m0, n0, staging, wait) (staging: the area tile j was
// staged in; wait(): returns once it has been), after which none of its
// threads may have anything left that reads the area, and
// store.finish(lane) at the end.  The store runs
// inside the consumer branch: code after a join of the producer's and the
// consumers' paths would be held to the producer's register budget.
// `loader` (DenseLoader above) supplies the operands' tiles, `mma` (SmemMma
// by default) runs the MMAs.
template <typename T, int kStages, int kStagingBytes, typename Mma = SmemMma<T>, typename Loader,
          typename Store>
__device__ __forceinline__ void half_gemm_persistent(char* smem_raw, const Loader& loader, Store& store,
                                                     Mma mma = Mma()) {
  // 1024-byte aligned stages, the staging area, the loader's bytes, then the
  // barriers: full[s] at + 8s, empty[s] at + 8 (kStages + s), turn[w] at + 8
  // (2 kStages + w), and the loader's.
  using Extras = LoaderExtras<Loader>;
  constexpr bool kStoreWg = StoreExtras<Store>::kWarpgroup;
  static_assert(!kStoreWg || (!Mma::kCooperative && Extras::kHelperWarps == 0),
                "a store warpgroup beside ping-pong consumers and a plain producer");
  constexpr int kStageBytes = Mma::kTileABytes + Mma::kTileBBytes;
  // The bytes a stage's copies bring (B's tile is the helpers' where there are some).
  constexpr int kStageCopyBytes = Extras::kHelperWarps > 0 ? Mma::kTileABytes : kStageBytes;
  static_assert(half_gemm_shared_bytes<kStages, kStagingBytes, kStageBytes, Extras::kBytes, Extras::kBarriers>() <=
                    232448,
                "fits the opt-in shared memory");
  static_assert(Mma::kTileABytes % 1024 == 0 && Mma::kTileBBytes % 1024 == 0, "tiles keep the swizzle's alignment");
  static_assert(Extras::kBytes == 0 || (kStagingBytes % 1024 == 0 && Extras::kBytes % 1024 == 0),
                "the loader's bytes 1024-byte aligned");
  static_assert(Extras::kHelperWarps >= 0 && Extras::kHelperWarps <= 3, "helpers beside the copies' thread");
  const unsigned base = (shared_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned staging = base + kStages * kStageBytes;
  const unsigned extra = staging + kStagingBytes;
  const unsigned bars = extra + Extras::kBytes;
  const unsigned loader_bars = bars + 8u * (2 * kStages + 2);
  auto tile_a = [&](int s) { return base + s * kStageBytes; };
  auto tile_b = [&](int s) { return base + s * kStageBytes + Mma::kTileABytes; };
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (kStages + s); };
  auto turn = [&](int w) { return bars + 8u * (2 * kStages + w); };

  const int tid = threadIdx.x, warp = tid >> 5;
  const i64 tiles_m = loader.tiles_m(), tiles_n = loader.tiles_n();
  const i64 tiles = tiles_m * tiles_n;
  const int ktiles = loader.ktiles();
  const EngineSchedule<Loader> schedule{loader, tiles, tiles_m, tiles_n};

  if (tid == 0) {
    loader.prefetch();
    for (int s = 0; s < kStages; ++s) {
      // the producer's arrive (and the helpers'); the copies complete the phase
      mbar_init(full(s), 1 + Extras::kHelperWarps);
      mbar_init(empty(s), Mma::kCooperative ? 8 : 4);  // one arrive per warp of the consumer(s)
    }
    mbar_init(turn(0), 4);  // one arrive per warp of the other consumer warpgroup
    mbar_init(turn(1), 4);
    if constexpr (Extras::kHelperWarps > 0) loader.init_barriers(loader_bars);
    fence_mbarrier_init();
  }
  __syncthreads();

  // The block's j-th tile (schedule.first(j)) is consumed by
  // warpgroup j % 2 (ping-pong) or by both (cooperative); its k-tile kt is
  // the pipeline's it = j * ktiles + kt-th use of a stage (stage it %
  // kStages, phase it / kStages).  Ping-pong, the consumers' main loops take
  // turns: warpgroup w starts tile j once the other has issued every MMA of
  // tile j - 1 (its arrive on turn[w]).  Besides ordering the tensor-core
  // work, that keeps every wait on a stage's "full" barrier at most one
  // phase ahead of the barrier, as waits by parity need: without it, a
  // warpgroup could wait for a stage's next-but-one phase and take the
  // completion of the phase before it.  Cooperative, both consumers release
  // every stage, so neither can get a whole ring ahead of the other.
  if (warp < 4) {
    // ---------------- producer ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kStoreWg ? kHgStoreProducerRegs : kHgProducerRegs)
                 : "memory");
    if constexpr (Extras::kHelperWarps > 0) {
      if (warp >= 4 - Extras::kHelperWarps) {
        Loader helper = loader;
        helper.attach(extra, loader_bars);
        helper.help(StageRing{base, bars, kStages, kStageBytes, Mma::kTileABytes}, tiles, ktiles);
        return;
      }
    }
    if (tid != 0) return;
    Loader producer = loader;
    if constexpr (Extras::kHelperWarps > 0) producer.attach(extra, loader_bars);
    unsigned it = 0;  // (unsigned: no signed remainder and quotient for the stage and phase)
    for (i64 tile = schedule.first(0); schedule.valid(tile); tile += schedule.step(1)) {
      i64 tm, tn;
      schedule.at(tile, tm, tn);
      producer.begin_tile(tm, tn);
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        const int s = static_cast<int>(it % kStages);
        // The stage's previous use (it - kStages) must have been released.
        if (it >= kStages) mbar_wait(empty(s), ((it / kStages) - 1) & 1);
        mbar_arrive_expect_tx(full(s), kStageCopyBytes);
        producer.load(tile_a(s), tile_b(s), full(s), kt);
      }
    }
    return;
  }
  if constexpr (kStoreWg) {
    if (warp >= 12) {
      // ---------------- the store's warpgroup ----------------
      static_assert(kHgStoreRowRegs >= 65536 / kHgThreadsWithStore, "more than the launch's: inc");
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kHgStoreRowRegs) : "memory");
      const HalfGemmLane me(warpgroup_from_lane0<Mma>(0));  // (wg 2: its barrier is named 3)
      for (i64 j = 0, tile = schedule.first(0); schedule.valid(tile); ++j, tile += schedule.step(1)) {
        i64 tm, tn;
        schedule.at(tile, tm, tn);
        const int w = static_cast<int>(j & 1);
        store.rows(me, tm * Mma::kBM, tn * Mma::kBN, staging + w * (kStagingBytes / 2),
                   [&] { named_barrier(kHgStagedBarrier + w, 256); });
        // The consumer's next tile, if any, waits for the area (a barrier
        // left with arrivals nobody waits for would outlive the block).
        if (schedule.valid(tile + schedule.step(2))) named_barrier_arrive(kHgFreedBarrier + w, 256);
      }
      store.finish(me);
      return;
    }
  }
  // ---------------- consumers ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kStoreWg ? kHgStoreConsumerRegs : kHgConsumerRegs)
               : "memory");
  const HalfGemmLane me(warpgroup_from_lane0<Mma>(0));
  const bool warp_leader = (tid & 31) == 0;
  const unsigned my_staging = staging + me.wg * (kStagingBytes / 2);
  // Cooperative: every tile, this warpgroup's rows of it; ping-pong: every
  // other tile, whole.
  constexpr int kStride = Mma::kCooperative ? 1 : 2;
  const i64 my_rows = Mma::kCooperative ? me.wg * Mma::kWgRows : 0;
  float acc[2][kHgAccs];
  if constexpr (MmaExtras<Mma>::kReadsLoader) mma.attach(extra, loader_bars);
  for (i64 j = Mma::kCooperative ? 0 : me.wg, tile = schedule.first(j); schedule.valid(tile);
       j += kStride, tile += schedule.step(kStride)) {
    i64 tm, tn;
    schedule.at(tile, tm, tn);
    // The first MMA of a tile ignores the accumulators; zeroing them here
    // ends the previous tile's values at its store, so that the store has
    // the registers they held.
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < kHgAccs; ++i) acc[h][i] = 0.0f;
    unsigned it = static_cast<unsigned>(j) * static_cast<unsigned>(ktiles);  // (as the producer's)
    // Tile j is this warpgroup's (j / 2)-th: wait for the other's tile j - 1,
    // the turn barrier's phase (j - 1) / 2.
    if (!Mma::kCooperative && j > 0) mbar_wait(turn(me.wg), ((j - 1) >> 1) & 1);
    mma.begin_tile(tm, tn);
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = static_cast<int>(it % kStages);
      mbar_wait(full(s), (it / kStages) & 1);
      mma.issue(acc, tile_a(s), tile_b(s), kt);
      if (kt > 0) {
        wgmma_wait<1>();  // the previous k-tile's MMAs are done: release its stage
        if (warp_leader) {
          mbar_arrive(empty((it - 1) % kStages));
          if constexpr (MmaExtras<Mma>::kReadsLoader) mma.stage_done(kt - 1);
        }
      }
    }
    if (!Mma::kCooperative && warp_leader) mbar_arrive(turn(1 - me.wg));  // every MMA of tile j is issued
    wgmma_wait<0>();
    fence_registers(acc[0]);
    fence_registers(acc[1]);
    mma.end_tile(acc);
    if (warp_leader) {
      mbar_arrive(empty((it - 1) % kStages));
      if constexpr (MmaExtras<Mma>::kReadsLoader) mma.stage_done(ktiles - 1);
    }
    if constexpr (kStoreWg) {
      // The store's warpgroup is done with this warpgroup's previous tile.
      if (j >= 2) named_barrier(kHgFreedBarrier + me.wg, 256);
      store(acc, me, tm * Mma::kBM + my_rows, tn * Mma::kBN, my_staging, kHgStagedBarrier + me.wg);
    } else {
      store(acc, me, tm * Mma::kBM + my_rows, tn * Mma::kBN, my_staging);
    }
  }
  store.finish(me);
}
#endif

}  // namespace cf
