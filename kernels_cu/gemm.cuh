// The Hopper GEMM engine for 16-bit operands (float16, bfloat16) and for
// float32 ones read as TF32, with float32 accumulation: C = A B^T with A
// [M, K] and B [N, K], both K-major (the forward product of a linear
// layer, x W^T), any M, N and K, with row
// strides of a multiple of 16 bytes (ops.gemm._tma_compatible).  The
// main loop is shared by every kernel on it.  Where the operands' tiles
// come from is the caller's `Loader` (DenseLoader: two matrices through 2D
// tensor maps; a convolution's loader gathers A's tiles from its input
// instead); what is done with the accumulators is the caller's `Store`
// (gemm.cu: bias and activation; linear_gn_chain.cu: the GroupNorm chains).
//
// Persistent and warp-specialised: one block of three warpgroups per SM
// walks the output tiles (128 x 128) in a fixed grouped order, blockIdx.x,
// + gridDim.x, ...
//  * the producer warpgroup (one thread of it) streams the tiles of A and B
//    (128 rows x 128 bytes each: 64 16-bit values, or 32 float32 ones, of
//    k) with the bulk tensor copy engine (TMA) into a kStages
//    ring of shared memory, 128-byte swizzled, each stage guarded by a
//    "full" mbarrier (the copies' bytes) and an "empty" one (the consumer's
//    release), tile after tile;
//  * two consumer warpgroups take the tiles in turn ("ping-pong"): while one
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
constexpr int kHgThreads = 384;                      // producer + 2 consumer warpgroups
constexpr int kHgTileABytes = kHgBM * kHgBK * 2;     // 16 KiB
constexpr int kHgTileBBytes = kHgBN * kHgBK * 2;     // 16 KiB
constexpr int kHgStageBytes = kHgTileABytes + kHgTileBBytes;
constexpr int kHgAccs = 64;                          // accumulators per consumer thread and half

// Dynamic shared memory of the engine: the stages (1024-byte aligned, as the
// 128-byte swizzle pattern repeats every 1024 bytes), the store's staging
// area of kStagingBytes (a multiple of 1024), and the stages' mbarriers.
template <int kStages, int kStagingBytes>
__host__ __device__ constexpr int half_gemm_shared_bytes() {
  // 1024: alignment slack; the barriers: full and empty per stage, 2 turns.
  return 1024 + kStages * kHgStageBytes + kStagingBytes + 2 * kStages * 8 + 16;
}

// A consumer thread: its warpgroup (wg: 0, 1) and where its accumulators
// lie in its tile: rows 64h + row, 64h + row + 8 (row = 16 * warp + g),
// columns 8i + 2t, +1.
struct HalfGemmLane {
  int wg, row, t;
  __device__ __forceinline__ HalfGemmLane() {
    const int ctid = static_cast<int>(threadIdx.x) - 128;
    const int warp = ctid >> 5, lane = ctid & 31;
    wg = warp >> 2;
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
// warpgroup: begin(); put() every pair; end(); and finish() after the last tile.
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
  // Hands the tile to the copy engine: the boxes at (n0 + 64 box, m0) of a
  // 2-D C, or, with outer >= 0, of plane `outer` of a 3-D C (its rows those
  // of one plane, the boxes 64 x 128 x 1).
  __device__ __forceinline__ static void end(const TensorMap& map, const HalfGemmLane& me, unsigned staging,
                                             i64 m0, i64 n0, int outer = -1) {
    fence_proxy_async();
    named_barrier(1 + me.wg, 128);
    if (me.leader()) {
#pragma unroll
      for (int box = 0; box < kHgBN / 64; ++box) {
        const unsigned src = staging + box * (kHgBM * 128);
        const int col = static_cast<int>(n0) + 64 * box, row = static_cast<int>(m0);
        if (outer < 0) {
          tma_store_2d(map, src, col, row);
        } else {
          tma_store_3d(map, src, col, row, outer);
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
// DenseLoader: A [M, K] and B [N, K] through tensor maps with boxes of
// 128 x 64 elements, 128-byte swizzle (ops.gemm._tensor_map).
struct DenseLoader {
  const TensorMap& map_a;
  const TensorMap& map_b;
  i64 M, N, K;
  int m0 = 0, n0 = 0;  // the current output tile's first row and column
  __device__ __forceinline__ i64 tiles_m() const { return (M + kHgBM - 1) / kHgBM; }
  __device__ __forceinline__ i64 tiles_n() const { return (N + kHgBN - 1) / kHgBN; }
  __device__ __forceinline__ int ktiles() const { return static_cast<int>((K + kHgBK - 1) / kHgBK); }
  __device__ __forceinline__ void prefetch() const {
    tma_prefetch_descriptor(map_a);
    tma_prefetch_descriptor(map_b);
  }
  __device__ __forceinline__ void begin_tile(i64 tm, i64 tn) {
    m0 = static_cast<int>(tm * kHgBM);
    n0 = static_cast<int>(tn * kHgBN);
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned tile_b, unsigned bar, int kt) {
    tma_load_2d(tile_a, map_a, kt * kHgBK, m0, bar);
    tma_load_2d(tile_b, map_b, kt * kHgBK, n0, bar);
  }
};

// Shared-memory matrix descriptor of a K-major operand in the 128-byte
// swizzle layout that TMA writes: rows of 128 bytes, 8-row (1024-byte) core
// groups (stride-byte offset 1024; the leading-byte offset is unused there).
__device__ __forceinline__ unsigned long long swizzle128_desc(unsigned addr) {
  return static_cast<unsigned long long>((addr & 0x3ffffu) >> 4) | (1ull << 16) |
         (static_cast<unsigned long long>(1024 >> 4) << 32) | (1ull << 62);
}

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
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
// d (+)= A B^T for one 32-byte step of k: a 64 x 16 slice of A and a 128 x
// 16 slice of B of a 16-bit T, 64 x 8 and 128 x 8 of float32 T (read as
// TF32: the low 13 bits of the mantissa are not used), both in shared
// memory (descriptors).  accumulate = 0 ignores d's old value.
template <typename T>
__device__ __forceinline__ void wgmma_m64n128_step(float (&d)[64], unsigned long long desc_a,
                                                   unsigned long long desc_b, int accumulate) {
  if constexpr (sizeof(T) == 4) {
    CF_WGMMA_M64N128("k8.f32.tf32.tf32", "");  // (TF32 takes no transpose flags)
  } else if constexpr (WgmmaType<T>::kBf16) {
    CF_WGMMA_M64N128("k16.f32.bf16.bf16", ", 0, 0");
  } else {
    CF_WGMMA_M64N128("k16.f32.f16.f16", ", 0, 0");
  }
}
#undef CF_WGMMA_M64N128

// The engine, run by all kHgThreads threads of a block: every tile of C this
// block owns, each handed to store(acc, lane, m0, n0, staging) by every
// thread of the consumer warpgroup that computed it (its 2 x kHgAccs sums,
// layout above) after its last read of the tile's stages; `staging`: the
// shared address of that warpgroup's kStagingBytes / 2 of staging area.
// After its last tile every consumer thread calls store.finish(lane).  The
// store runs inside the consumer branch: code after a join of the producer's
// and the consumers' paths would be held to the producer's register budget.
// `loader` (DenseLoader above) supplies the operands' tiles.
template <typename T, int kStages, int kStagingBytes, typename Loader, typename Store>
__device__ __forceinline__ void half_gemm_persistent(char* smem_raw, const Loader& loader,
                                                     Store& store) {
  // 1024-byte aligned stages, the staging area, then the barriers: full[s] at
  // + 8s, empty[s] at + 8 (kStages + s), turn[w] at + 8 (2 kStages + w).
  static_assert(half_gemm_shared_bytes<kStages, kStagingBytes>() <= 232448, "fits the opt-in shared memory");
  const unsigned base = (shared_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned staging = base + kStages * kHgStageBytes;
  const unsigned bars = staging + kStagingBytes;
  auto tile_a = [&](int s) { return base + s * kHgStageBytes; };
  auto tile_b = [&](int s) { return base + s * kHgStageBytes + kHgTileABytes; };
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (kStages + s); };
  auto turn = [&](int w) { return bars + 8u * (2 * kStages + w); };

  const int tid = threadIdx.x, warp = tid >> 5;
  const i64 tiles_m = loader.tiles_m(), tiles_n = loader.tiles_n();
  const i64 tiles = tiles_m * tiles_n;
  const int ktiles = loader.ktiles();

  if (tid == 0) {
    loader.prefetch();
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);   // the producer's arrive; the copies complete the phase
      mbar_init(empty(s), 4);  // one arrive per warp of the consuming warpgroup
    }
    mbar_init(turn(0), 4);  // one arrive per warp of the other consumer warpgroup
    mbar_init(turn(1), 4);
    fence_mbarrier_init();
  }
  __syncthreads();

  // The block's j-th tile is blockIdx.x + j * gridDim.x, consumed by
  // warpgroup j % 2; its k-tile kt is the pipeline's it = j * ktiles + kt-th
  // use of a stage (stage it % kStages, phase it / kStages).  The consumers'
  // main loops take turns: warpgroup w starts tile j once the other has
  // issued every MMA of tile j - 1 (its arrive on turn[w]).  Besides
  // ordering the tensor-core work, that keeps every wait on a stage's "full"
  // barrier at most one phase ahead of the barrier, as waits by parity need:
  // without it, a warpgroup could wait for a stage's next-but-one phase and
  // take the completion of the phase before it.
  if (warp < 4) {
    // ---------------- producer ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid != 0) return;
    Loader producer = loader;
    int it = 0;
    for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      i64 tm, tn;
      grouped_tile_of(tile, tiles_m, tiles_n, tm, tn);
      producer.begin_tile(tm, tn);
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        const int s = it % kStages;
        // The stage's previous use (it - kStages) must have been released.
        if (it >= kStages) mbar_wait(empty(s), ((it / kStages) - 1) & 1);
        mbar_arrive_expect_tx(full(s), kHgStageBytes);
        producer.load(tile_a(s), tile_b(s), full(s), kt);
      }
    }
    return;
  }
  // ---------------- consumers ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const HalfGemmLane me;
  const bool warp_leader = (tid & 31) == 0;
  const unsigned my_staging = staging + me.wg * (kStagingBytes / 2);
  float acc[2][kHgAccs];
  for (i64 j = me.wg, tile = blockIdx.x + j * gridDim.x; tile < tiles; j += 2, tile += 2 * gridDim.x) {
    i64 tm, tn;
    grouped_tile_of(tile, tiles_m, tiles_n, tm, tn);
    // The first MMA of a tile ignores the accumulators; zeroing them here
    // ends the previous tile's values at its store, so that the store has
    // the registers they held.
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < kHgAccs; ++i) acc[h][i] = 0.0f;
    int it = static_cast<int>(j) * ktiles;
    // Tile j is this warpgroup's (j / 2)-th: wait for the other's tile j - 1,
    // the turn barrier's phase (j - 1) / 2.
    if (j > 0) mbar_wait(turn(me.wg), ((j - 1) >> 1) & 1);
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % kStages;
      mbar_wait(full(s), (it / kStages) & 1);
      const unsigned a = tile_a(s), b = tile_b(s);
      fence_registers(acc[0]);
      fence_registers(acc[1]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHgSteps; ++kk) {  // 32 bytes along the swizzled row
        const unsigned long long db = swizzle128_desc(b + 32 * kk);
        wgmma_m64n128_step<T>(acc[0], swizzle128_desc(a + 32 * kk), db, kt > 0 || kk > 0);
        wgmma_m64n128_step<T>(acc[1], swizzle128_desc(a + 64 * 128 + 32 * kk), db, kt > 0 || kk > 0);
      }
      wgmma_commit();
      if (kt > 0) {
        wgmma_wait<1>();  // the previous k-tile's MMAs are done: release its stage
        if (warp_leader) mbar_arrive(empty((it - 1) % kStages));
      }
    }
    if (warp_leader) mbar_arrive(turn(1 - me.wg));  // every MMA of tile j is issued
    wgmma_wait<0>();
    fence_registers(acc[0]);
    fence_registers(acc[1]);
    if (warp_leader) mbar_arrive(empty((it - 1) % kStages));
    store(acc, me, tm * kHgBM, tn * kHgBN, my_staging);
  }
  store.finish(me);
}
#endif

}  // namespace cf
