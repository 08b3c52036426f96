// Shared machinery of the "gemm_tf32" kernel family (gemm_tf32.cu: the plain
// products with bias / ReLU epilogues): float32 GEMM on TF32 tensor cores,
// C = A * B, with the "3xTF32" split for float32-class accuracy.
//
// Each float32 operand x is split on the fly into big = tf32(x) and
// small = tf32(x - big) (x - big is exact in float32), and a*b is computed as
// a_small*b_big + a_big*b_small + a_big*b_big on the tensor cores
// (mma.sync m16n8k8, float32 accumulation); the dropped small*small term is
// ~2^-22 relative.  kPasses = 1 is plain TF32 (big*big only).
//
// Tensor-core accumulation truncates, so its error grows with the length of
// the accumulation.  The MMA accumulators therefore only ever hold one chunk
// of kChunkK k-values (3 * kChunkK / 8 truncating MMA accumulations); after
// each chunk they are added into a separate float32 sum with ordinary
// round-to-nearest adds and restarted from zero (Ootomo & Yokota, 2022).  The
// fold costs 4 adds per fragment per chunk.  Chunk 16 (default): the longer
// chunks are 1-8 % faster but lose the accuracy lead over SGEMM on sums of a
// few hundred products (GEMM_NOTES.md has the measurements).
//
// Operand layouts (template parameters), for the three products of a linear
// layer y = x W^T:
//   forward   y  = x  W^T : A = x  [M, K] K-major,   B = W [N, K] K-major
//   input     dx = dy W   : A = dy [M, K] K-major,   B = W [K, N] N-major
//   weight    dW = dy^T x : A = dy [K, M] M-major,   B = x [K, N] N-major
// A(m, k) = a[m*lda + k] (K-major) or a[k*lda + m] (M-major);
// B(k, n) = b[n*ldb + k] (K-major) or b[k*ldb + n] (N-major);
// C(m, n) = c[m*ldc + n].  Any M, N, K >= 1: edges are predicated (zero-filled
// loads, guarded stores).  kVec = true needs every operand row 16-byte aligned
// (leading dimensions and the contiguous extents multiples of 4, pointers
// 16-byte aligned); kVec = false loads single words and has no requirement.
//
// Block tile BM x BN x 32, 8 warps as 2 (M) x 4 (N), warp tile (BM/2) x (BN/4),
// a kStages-deep cp.async pipeline in dynamic shared memory.
//
// Fragment layout.  The k order inside each 8-wide MMA step, the row order
// inside each 16-row fragment and the column order inside each pair of 8-column
// fragments are permuted (the same permutation for A and B, so the product is
// unchanged) so that every shared-memory fragment load is one 64-bit access and
// every thread ends up owning 4 adjacent output columns (one 16-byte store):
//   MMA k index t, t+4      <-> physical k  kk + 2t, kk + 2t + 1
//   MMA row g, g+8          <-> physical row 2g, 2g + 1 of the fragment
//   MMA col j of fragment ni <-> physical col 16*(ni/2) + 2j + (ni%2)
// (g = lane / 4, t = lane % 4).  Row strides of the shared tiles are padded
// (K-major: 32 + 4 words, MN-major: extent + 4 words) so those loads are free
// of bank conflicts.
#pragma once
#include "sm90.cuh"

namespace cf {

constexpr int kGemmThreads = 256;
constexpr int kGemmBK = 32;
#ifndef CF_GEMM_CHUNK_K
#define CF_GEMM_CHUNK_K 16
#endif
constexpr int kChunkK = CF_GEMM_CHUNK_K;  // k-values per MMA accumulator chunk
static_assert(kChunkK % 8 == 0 && (kChunkK <= kGemmBK ? kGemmBK % kChunkK == 0 : kChunkK % kGemmBK == 0),
              "a chunk is whole MMA steps and divides (or is a multiple of) the k-tile");

// ---- PTX wrappers (no toolkit headers under NVRTC) ----
// 16-byte / 4-byte asynchronous copies; `bytes` = 0 zero-fills the target.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A fragment value split into its TF32 parts (small unused for one pass).
template <int kPasses, int N>
struct Split {
  unsigned big[N], small[N];
  __device__ __forceinline__ void set(int i, float x) {
    big[i] = to_tf32_keep_nan(x);
    if constexpr (kPasses == 3) small[i] = to_tf32(x - __uint_as_float(big[i]));
  }
};

// ---- shared-memory tiles ----
// One operand's tile of a pipeline stage.  K-major: [extent][32 + 4];
// MN-major: [32][extent + 4].
template <bool kKMajor, int kExtent>
struct OperandTile {
  static constexpr int kStride = kKMajor ? kGemmBK + 4 : kExtent + 4;
  static constexpr int kFloats = kKMajor ? kExtent * kStride : kGemmBK * kStride;

  // Global -> shared for the tile at (mn0, k0) of an operand whose element
  // (mn, k) is at g[mn*ld + k] (K-major) or g[k*ld + mn] (MN-major).
  // `tid` in [0, kThreads): the threads sharing the load.
  template <bool kVec, int kThreads = kGemmThreads>
  __device__ __forceinline__ static void load(float* tile, const float* g, i64 ld, i64 extent,
                                              i64 K, i64 mn0, i64 k0, int tid) {
    // 4-float chunks: K-major rows hold 32/4 chunks, MN-major rows kExtent/4.
    constexpr int kChunksPerRow = (kKMajor ? kGemmBK : kExtent) / 4;
    constexpr int kChunks = (kKMajor ? kExtent : kGemmBK) * kChunksPerRow;
    static_assert(kChunks % kThreads == 0 && kThreads % kChunksPerRow == 0,
                  "tile must split evenly over the loading threads, in whole rows");
    // Pass j covers rows r0 + j * kRowsPerPass: the addresses are computed
    // once and stepped (this runs for every k-tile; the address arithmetic
    // used to cost more issue slots than the copies).
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    const int r0 = tid / kChunksPerRow, c4 = (tid % kChunksPerRow) * 4;
    // (row index, contiguous index) in the operand's memory order
    const i64 outer0 = (kKMajor ? mn0 : k0) + r0, inner = (kKMajor ? k0 : mn0) + c4;
    const i64 outer_end = kKMajor ? extent : K, inner_end = kKMajor ? K : extent;
    const float* const src = g + outer0 * ld + inner;
    const i64 pass_stride = kRowsPerPass * ld;
    const unsigned dst0 = shared_addr(tile) + 4u * static_cast<unsigned>(r0 * kStride + c4);
#pragma unroll
    for (int j = 0; j < kChunks / kThreads; ++j) {
      const i64 outer = outer0 + j * kRowsPerPass;
      const unsigned dst = dst0 + 4u * static_cast<unsigned>(j * kRowsPerPass * kStride);
      const float* const p = src + j * pass_stride;
      if constexpr (kVec) {  // inner_end % 4 == 0: a chunk is wholly inside or outside
        const bool in = outer < outer_end && inner < inner_end;
        cp_async16(dst, in ? p : g, in ? 16 : 0);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool in = outer < outer_end && inner + e < inner_end;
          cp_async4(dst + 4u * e, in ? p + e : g, in ? 4 : 0);
        }
      }
    }
  }

  // The two 32-bit words at physical (mn, k), (mn, k + 1) for K-major and
  // (k, mn), (k, mn + 1) for MN-major, in one 64-bit shared load.
  __device__ __forceinline__ static float2 pair(const float* tile, int row, int col) {
    return *reinterpret_cast<const float2*>(tile + row * kStride + col);
  }

  // The A fragment of the MMA step at k (a multiple of 8) for MMA rows g,
  // g + 8 <-> physical rows m, m + 1 and MMA k t, t + 4 <-> k + 2t, k + 2t + 1,
  // split (two 64-bit loads); `Frag` is a Split<kPasses, 4>.
  template <typename Frag>
  __device__ __forceinline__ static void a_fragment(const float* tile, int m, int k, int t, Frag& fa) {
    if constexpr (kKMajor) {
      const float2 r0 = pair(tile, m, k + 2 * t);
      const float2 r1 = pair(tile, m + 1, k + 2 * t);
      fa.set(0, r0.x); fa.set(1, r1.x); fa.set(2, r0.y); fa.set(3, r1.y);
    } else {
      const float2 lo = pair(tile, k + 2 * t, m);
      const float2 hi = pair(tile, k + 2 * t + 1, m);
      fa.set(0, lo.x); fa.set(1, lo.y); fa.set(2, hi.x); fa.set(3, hi.y);
    }
  }
};

// Grid: one block per BM x BN tile of C, 1-D, in grouped order
// (grouped_tile_of).  Returns the block's tile's first row and column.
__device__ __forceinline__ void grouped_tile(i64 M, i64 N, int BM, int BN, i64& m0, i64& n0) {
  i64 tm, tn;
  grouped_tile_of(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, tm, tn);
  m0 = tm * BM;
  n0 = tn * BN;
}

// ===========================================================================
// Hopper variant: the same 3xTF32 product on `wgmma` (sm_90a), which runs
// TF32 at about twice the rate of mma.sync on H100.
//
// Block tile 128 x 128 x 32, three warpgroups with their own roles (a first
// version where every warp loaded, split and multiplied left the tensor
// cores idle half the time: GEMM_NOTES.md):
//  * the producer (warps 0-3) streams raw float32 tiles of A and B into a
//    kStages ring with cp.async, then rewrites each B tile into a "big" and a
//    "small" TF32 plane in wgmma's no-swizzle K-major layout (8 x 16-byte
//    core matrices; LBO = 128 bytes between the two k-halves of an 8-wide
//    step, SBO = 256 bytes between 8-column blocks), transposing N-major
//    operands on the way, and marks the stage full (mbarrier);
//  * two consumers (warps 4-7, 8-11) each own 64 rows of C: they load their
//    A fragments from the raw tile, split them in registers (the same
//    permuted 64-bit loads as the mma.sync kernel) and issue
//    `wgmma.m64n128k8 {a0..a3}, descB` against the planes, then mark the
//    stage empty.  wgmma takes TF32 operands K-major only, hence the B planes;
//    A from registers needs no plane.
//  * k order inside each 8-wide step follows the A permutation: k-half 0 of a
//    plane row holds physical k 0, 2, 4, 6 and half 1 holds 1, 3, 5, 7.
//  * Chunked accumulation as above: one chunk = two MMA steps (16 k-values,
//    6 wgmma), started with scale-d = 0, then added into the float32 sum (64
//    accumulator + 64 sum registers a thread).  setmaxnreg moves registers
//    from the producer to the consumers.
//
// Accumulator layout (per warp, 16 rows): d[4i + 0/1] = row g, columns
// 8i + 2t, +1; d[4i + 2/3] = row g + 8, same columns.  With the row
// permutation (MMA row g <-> physical 2g, g + 8 <-> 2g + 1) a thread stores
// float2s at physical rows 2g and 2g + 1.
// Compiled for every architecture (the compile check covers it); without
// sm_90a features the body traps, and the library never launches it there.
constexpr int kWgBM = 128, kWgBN = 128;
constexpr int kWgThreads = 384;                      // producer + 2 consumer warpgroups
constexpr int kPlaneStepBytes = kWgBN * 8 * 4;       // one 8-wide k step of a plane: 4 KiB
constexpr int kPlaneBytes = kPlaneStepBytes * (kGemmBK / 8);  // one plane of a k-tile: 16 KiB
constexpr int kWgBarrierBytes = 128;                 // the stages' full/empty mbarriers

// kBPlanes: B comes already split, as the image of its planes in global
// memory (gemm_tf32_split_b below); kBKMajor is then unused here (the
// kernel's redo of NaN sums reads B itself in that layout).
template <int kStages, int kPasses, bool kAKMajor, bool kBKMajor, bool kBPlanes = false>
struct WgmmaConfig {
  typedef OperandTile<kAKMajor, kWgBM> TileA;
  typedef OperandTile<kBKMajor, kWgBN> TileB;
  // A stage: the B planes (big, and small for 3 passes), then the raw tiles
  // (raw A only when B comes as planes).
  static constexpr int kPlanesBytes = (kPasses == 3 ? 2 : 1) * kPlaneBytes;
  static constexpr int kStageBytes = kPlanesBytes + (TileA::kFloats + (kBPlanes ? 0 : TileB::kFloats)) * 4;
  static_assert(2 * kStages * 8 <= kWgBarrierBytes, "barriers fit");
  static_assert(kStageBytes % 128 == 0, "every stage's planes start on 128 bytes");
};

// The planes image of B (kBPlanes): for each 128-column tile j of N and each
// 32-deep k-tile t, the stage's planes exactly as the wgmma kernel's
// producer would write them (big plane, then small for 3 passes), at float
// offset (j * k_tiles + t) * kPlanesBytes / 4; out-of-range columns and k
// are zero.  Item (column n, 8-wide step st) of a tile holds B(8 st + 2 e + h, n)
// at float st * 1024 + (n / 8) * 64 + (n % 8) * 4 + 32 h + e.
__device__ __forceinline__ int plane_float_offset(int n, int st, int h) {
  return st * (kPlaneStepBytes / 4) + (n >> 3) * 64 + (n & 7) * 4 + 32 * h;
}

// ---- non-finite outputs ----
// The split differs from a float32 product in what it makes of an infinite
// operand: the correction products pair its infinite big part with the
// other operand's small part, which is 0 for an operand exact in TF32
// (inf * 0 = NaN) and may have the sign opposite to its big part
// (inf - inf = NaN).  So where SGEMM's output is +-inf, 3xTF32's is that or
// NaN; elsewhere their NaN and infinities agree (for operands short of
// FLT_MAX by more than TF32's rounding, past which to_tf32 itself
// overflows and the sum is NaN too).  The stores therefore redo every
// output whose sum is NaN, from the raw operands, as a
// plain float32 dot product of row m of A and column n of B
// (warp_float32_dot), which is NaN or +-inf where SGEMM's is.  A tile
// without a NaN sum pays one comparison per sum and a warp vote
// (redo_nan_outputs).

// The float32 dot product of row m of A and column n of B, by all 32 lanes
// of a warp (the same m and n), returned to every lane: lane l sums k = l,
// l + 32, ... into 4 partial sums (loads in flight), combined in a fixed
// order, so the result is the same on every run.  Stops with NaN at the
// first NaN partial sum (NaN is final).  Reads the raw operands (for the
// split-B kernel, B itself beside its planes image).  Out of line: it runs
// only for NaN sums, and its registers stay out of the kernels'.
template <bool kAKMajor, bool kBKMajor>
__device__ __noinline__ float warp_float32_dot(const float* __restrict__ a, const float* __restrict__ b, i64 K,
                                               i64 lda, i64 ldb, i64 m, i64 n) {
  const int lane = threadIdx.x & 31;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (i64 k0 = 0; k0 < K; k0 += 128) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const i64 k = k0 + 32 * u + lane;
      if (k < K)
        s[u] = fmaf(kAKMajor ? a[m * lda + k] : a[k * lda + m], kBKMajor ? b[n * ldb + k] : b[k * ldb + n], s[u]);
    }
    if (__any_sync(0xffffffffu, s[0] != s[0] || s[1] != s[1] || s[2] != s[2] || s[3] != s[3]))
      return __int_as_float(0x7fffffff);
  }
  return team_sum((s[0] + s[1]) + (s[2] + s[3]), 32);  // (a + b == b + a: every lane agrees)
}

// Redoes the NaN sums among a warp's v[kCount] (see above); called by all 32
// lanes.  where(j, m, n) gives v[j]'s place in C; places outside M x N are
// left alone.
template <bool kAKMajor, bool kBKMajor, int kCount, typename Where>
__device__ __noinline__ void redo_nan_sums(float* v, Where where, const float* a, const float* b, i64 M, i64 N,
                                           i64 K, i64 lda, i64 ldb) {
  const int lane = threadIdx.x & 31;
  for (int j = 0; j < kCount; ++j) {
    i64 m, n;
    where(j, m, n);
    unsigned todo = __ballot_sync(0xffffffffu, v[j] != v[j] && m < M && n < N);
    while (todo) {  // the same on every lane
      const int src = __ffs(todo) - 1;
      todo &= todo - 1;
      const float d = warp_float32_dot<kAKMajor, kBKMajor>(
          a, b, K, lda, ldb, __shfl_sync(0xffffffffu, m, src), __shfl_sync(0xffffffffu, n, src));
      if (lane == src) v[j] = d;
    }
  }
}

// The stores' check: elem(j) is this lane's j-th sum (j < kCount).  A warp
// without a NaN sum pays kCount comparisons and a vote; the rest runs out of
// line on a copy of the sums, so that the kernel's own registers and code
// stay as they are.
template <bool kAKMajor, bool kBKMajor, int kCount, typename Elem, typename Where>
__device__ __forceinline__ void redo_nan_outputs(const Elem& elem, const Where& where, const float* a,
                                                 const float* b, i64 M, i64 N, i64 K, i64 lda, i64 ldb) {
  bool any = false;
#pragma unroll
  for (int j = 0; j < kCount; ++j) any |= elem(j) != elem(j);
  if (!__any_sync(0xffffffffu, any)) return;
  float v[kCount];
#pragma unroll
  for (int j = 0; j < kCount; ++j) v[j] = elem(j);
  redo_nan_sums<kAKMajor, kBKMajor, kCount>(v, where, a, b, M, N, K, lda, ldb);
#pragma unroll
  for (int j = 0; j < kCount; ++j) elem(j) = v[j];
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor, no swizzle: start address, LBO, SBO (each
// in 16-byte units).
__device__ __forceinline__ unsigned long long plane_desc(unsigned addr) {
  return static_cast<unsigned long long>((addr & 0x3ffffu) >> 4) | (static_cast<unsigned long long>(128 >> 4) << 16) |
         (static_cast<unsigned long long>(256 >> 4) << 32);
}
// d (+)= a * B, a: this warp's 16 x 8 TF32 fragment, B: 8 x 128 from shared
// memory.  kAccumulate = false ignores d's old value (scale-d = 0).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_tf32(float (&d)[64], const unsigned (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : CF_D32(0), CF_D32(32)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(kAccumulate ? 1 : 0));
}

#endif

// A consumer thread's place in the tile: its sums lie in physical rows row and
// row + 1 (row = 64 * consumer warpgroup + 16 * warp + 2g) and columns
// 8i + 2t, +1 (i = 0..15).
struct ConsumerLane {
  int warp, lane, t, row;  // warp: 0..7 over both consumer warpgroups
  __device__ __forceinline__ ConsumerLane() {
    const int ctid = static_cast<int>(threadIdx.x) - 128;
    warp = ctid >> 5;
    lane = ctid & 31;
    t = lane & 3;
    row = 64 * (warp >> 2) + 16 * (warp & 3) + 2 * (lane >> 2);
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The product of one 128 x 128 tile of C at (m0, n0), run by all 384 threads
// of a block; each consumer thread then calls store(sum, me) with its 64
// sums (layout above) and its ConsumerLane, after its last read of the pipeline's shared memory
// (the other consumer warpgroup may still be reading it).  The store runs
// inside the consumer branch: code after a join of the producer's and the
// consumers' paths would be held to the producer's register budget and spill.
//
// kBPlanes: b is the planes image of B (see plane_float_offset; ldb unused here)
// and the producer only copies: the raw A tile and the tile's planes, each
// with 16-byte cp.async, tiles kStages - 2 ahead of the one it marks full.
template <int kStages, int kPasses, bool kAKMajor, bool kBKMajor, typename Store, bool kBPlanes = false>
__device__ __forceinline__ void wgmma_tile_product(char* smem, const float* __restrict__ a,
                                                   const float* __restrict__ b, i64 M, i64 N,
                                                   i64 K, i64 lda, i64 ldb, i64 m0, i64 n0,
                                                   const Store& store) {
  typedef WgmmaConfig<kStages, kPasses, kAKMajor, kBKMajor, kBPlanes> Cfg;
  typedef typename Cfg::TileA TileA;
  typedef typename Cfg::TileB TileB;
  static_assert(kGemmBK == 32 && kChunkK == 16, "two chunks of two MMA steps per k-tile");
  const unsigned bars = shared_addr(smem);  // full[s] at + 8s, empty[s] at + 8 (kStages + s)
  char* const stages = smem + kWgBarrierBytes;
  const unsigned stages_addr = bars + kWgBarrierBytes;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (kStages + s); };
  auto raw_a = [&](int s) { return reinterpret_cast<float*>(stages + s * Cfg::kStageBytes + Cfg::kPlanesBytes); };
  auto raw_b = [&](int s) { return raw_a(s) + TileA::kFloats; };
  auto planes = [&](int s) { return stages_addr + s * Cfg::kStageBytes; };

  const int tid = threadIdx.x, warp = tid >> 5;
  const int ktiles = static_cast<int>((K + kGemmBK - 1) / kGemmBK);
  // Registers per producer / consumer thread after setmaxnreg (128 x P +
  // 256 x C <= 384 x 168, the launch's allotment).  120 / 192 spills in no
  // variant but the one-pass copy-only one, where ptxas spilled 16 bytes of
  // a consumer at 192 and nothing at 104 / 200 (its producer needs few).
  constexpr int kProducerRegs = kBPlanes && kPasses == 1 ? 104 : 120;
  constexpr int kConsumerRegs = kBPlanes && kPasses == 1 ? 200 : 192;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kWgThreads * 168, "register budget");

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 128);   // the producer's threads, after converting
      mbar_init(empty(s), 256);  // the consumers' threads, after their last read
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (warp < 4) {
    // ---------------- producer ----------------
    // kProducerRegs / kConsumerRegs (above): the most the consumers can get
    // (64 accumulator + 64 sum + 32 fragment registers and addresses) while
    // neither role spills (ptxas -v, every variant).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    const int ptid = tid;  // 0..127
    // Raw B tile in stage s -> its planes.  Item (step st, column n): the 8
    // k-values of column n in step st, split, 16 bytes per (plane, k-half).
    auto convert = [&](int s) {
      const float* sb = raw_b(s);
#pragma unroll
      for (int j = 0; j < (kWgBN * kGemmBK / 8) / 128; ++j) {
        const int item = ptid + j * 128;
        const int n = item % kWgBN, st = item / kWgBN;
        float v[8];
        if constexpr (kBKMajor) {
          const float4 lo = *reinterpret_cast<const float4*>(sb + n * TileB::kStride + 8 * st);
          const float4 hi = *reinterpret_cast<const float4*>(sb + n * TileB::kStride + 8 * st + 4);
          v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
          v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
        } else {
#pragma unroll
          for (int q = 0; q < 8; ++q) v[q] = sb[(8 * st + q) * TileB::kStride + n];
        }
        const unsigned dst = planes(s) + 4u * plane_float_offset(n, st, 0);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          Split<kPasses, 4> part;
#pragma unroll
          for (int e = 0; e < 4; ++e) part.set(e, v[2 * e + h]);
          asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + 128 * h), "r"(part.big[0]),
                       "r"(part.big[1]), "r"(part.big[2]), "r"(part.big[3]));
          if constexpr (kPasses == 3)
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + kPlaneBytes + 128 * h),
                         "r"(part.small[0]), "r"(part.small[1]), "r"(part.small[2]), "r"(part.small[3]));
        }
      }
      // The planes are read by the tensor cores (async proxy) next.
      fence_proxy_async();
    };
    if constexpr (kBPlanes) {
      static_assert(kStages >= 3, "the copies run kStages - 2 tiles ahead");
      constexpr int kAhead = kStages - 2;
      constexpr int kPlaneChunks = Cfg::kPlanesBytes / 16;  // 16-byte copies per tile
      static_assert(kPlaneChunks % 128 == 0, "the planes split evenly over the producer");
      // This thread's first 16 bytes of the tile column's planes; steps a tile per iteration.
      const float* planes_src = b + (n0 / kWgBN) * ktiles * static_cast<i64>(Cfg::kPlanesBytes / 4) + 4 * ptid;
      // Iteration `it` issues tile it's copies and marks tile it - kAhead full
      // once this thread's copies of it have landed (each of the 128 threads
      // arrives for its own).  Tile it's stage was released by the consumers
      // of tile it - kStages, marked full kStages - kAhead iterations ago.
      for (int it = 0; it < ktiles + kAhead; ++it) {
        if (it < ktiles) {
          const int s = it % kStages;
          if (it >= kStages) mbar_wait(empty(s), ((it / kStages) - 1) & 1);
          TileA::template load<true, 128>(raw_a(s), a, lda, M, K, m0, static_cast<i64>(it) * kGemmBK, ptid);
          const unsigned dst = planes(s) + 16u * ptid;
#pragma unroll
          for (int j = 0; j < kPlaneChunks / 128; ++j) cp_async16(dst + 16u * 128 * j, planes_src + 4 * 128 * j, 16);
          planes_src += Cfg::kPlanesBytes / 4;
        }
        cp_async_commit();
        if (it >= kAhead) {
          cp_async_wait<kAhead>();  // this thread's copies of tile it - kAhead
          // The planes are read by the tensor cores (async proxy) next.
          fence_proxy_async();
          mbar_arrive(full((it - kAhead) % kStages));
        }
      }
      return;
    }
    // Iteration `it` issues the loads of tile it and converts tile it - 1,
    // so one tile's loads are always in flight while the previous converts.
    for (int it = 0; it <= ktiles; ++it) {
      if (it < ktiles) {
        const int s = it % kStages;
        if (it >= kStages) mbar_wait(empty(s), ((it / kStages) - 1) & 1);
        const i64 k0 = static_cast<i64>(it) * kGemmBK;
        TileA::template load<true, 128>(raw_a(s), a, lda, M, K, m0, k0, ptid);
        TileB::template load<true, 128>(raw_b(s), b, ldb, N, K, n0, k0, ptid);
      }
      cp_async_commit();
      if (it >= 1) {
        const int s = (it - 1) % kStages;
        cp_async_wait<1>();                                  // tile it - 1: this thread's copies
        asm volatile("bar.sync 1, 128;\n" ::: "memory");     // ... and every producer thread's
        convert(s);
        mbar_arrive(full(s));
      }
    }
    return;
  }
  // ---------------- consumers ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const ConsumerLane me;

  // A fragment of MMA step st (0..3) of the tile in stage s, split.
  auto load_a = [&](int s, int st, Split<kPasses, 4>& fa) { TileA::a_fragment(raw_a(s), me.row, 8 * st, me.t, fa); };
  float acc[64], sum[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = sum[i] = 0.0f;
  // The 3 (or 1) MMAs of each of the two steps of a chunk.  Its fragments
  // must stay untouched until the MMAs complete, so the two chunks of a
  // tile use separate fragment registers.
  auto issue_chunk = [&](int s, int chunk, const Split<kPasses, 4> (&fa)[2]) {
    fence_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const unsigned big = planes(s) + (2 * chunk + j) * kPlaneStepBytes;
      if constexpr (kPasses == 3) {
        if (j == 0) wgmma_tf32<false>(acc, fa[j].small, plane_desc(big));
        else wgmma_tf32<true>(acc, fa[j].small, plane_desc(big));
        wgmma_tf32<true>(acc, fa[j].big, plane_desc(big + kPlaneBytes));
        wgmma_tf32<true>(acc, fa[j].big, plane_desc(big));
      } else {
        if (j == 0) wgmma_tf32<false>(acc, fa[j].big, plane_desc(big));
        else wgmma_tf32<true>(acc, fa[j].big, plane_desc(big));
      }
    }
    wgmma_commit();
  };
  auto fold = [&]() {
    wgmma_wait<0>();
    fence_registers(acc);
#pragma unroll
    for (int i = 0; i < 64; ++i) sum[i] += acc[i];
  };

  Split<kPasses, 4> fa_lo[2], fa_hi[2];  // steps 0, 1 and 2, 3 of a tile
  mbar_wait(full(0), 0);
  load_a(0, 0, fa_lo[0]);
  load_a(0, 1, fa_lo[1]);
  for (int kt = 0; kt < ktiles; ++kt) {
    const int s = kt % kStages;
    issue_chunk(s, 0, fa_lo);
    load_a(s, 2, fa_hi[0]);
    load_a(s, 3, fa_hi[1]);
    fold();
    issue_chunk(s, 1, fa_hi);
    if (kt + 1 < ktiles) {  // the next tile's first fragments, while chunk 1 runs
      const int s1 = (kt + 1) % kStages;
      mbar_wait(full(s1), ((kt + 1) / kStages) & 1);
      load_a(s1, 0, fa_lo[0]);
      load_a(s1, 1, fa_lo[1]);
    }
    fold();
    mbar_arrive(empty(s));
  }
  store(sum, me);
}
#endif

}  // namespace cf
