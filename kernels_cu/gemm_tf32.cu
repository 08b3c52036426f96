// Kernel family "gemm_tf32": float32 GEMM on TF32 tensor cores, C = A * B
// (+ epilogue), with the "3xTF32" split for float32-class accuracy.
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
#include "cf_common.cuh"

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
__device__ __forceinline__ unsigned shared_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
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
// float -> TF32 (low 13 mantissa bits zero), rounding to nearest with ties
// away from zero, as cvt.rna.tf32.f32 does, in two integer instructions
// (the cvt is several instructions on sm_80/sm_90, and this runs once per
// fragment element).  A carry out of the mantissa correctly bumps the
// exponent; values that round past FLT_MAX become inf, as with the cvt.
__device__ __forceinline__ unsigned to_tf32(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
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
    big[i] = to_tf32(x);
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
  template <bool kVec>
  __device__ __forceinline__ static void load(float* tile, const float* g, i64 ld, i64 extent,
                                              i64 K, i64 mn0, i64 k0, int tid) {
    // 4-float chunks: K-major rows hold 32/4 chunks, MN-major rows kExtent/4.
    constexpr int kChunksPerRow = (kKMajor ? kGemmBK : kExtent) / 4;
    constexpr int kChunks = (kKMajor ? kExtent : kGemmBK) * kChunksPerRow;
    static_assert(kChunks % kGemmThreads == 0, "tile must split evenly over the block");
    const unsigned base = shared_addr(tile);
#pragma unroll
    for (int j = 0; j < kChunks / kGemmThreads; ++j) {
      const int i = tid + j * kGemmThreads;
      const int r = i / kChunksPerRow, c4 = (i % kChunksPerRow) * 4;
      // (row index, contiguous index) in the operand's memory order
      const i64 outer = (kKMajor ? mn0 : k0) + r, inner = (kKMajor ? k0 : mn0) + c4;
      const i64 outer_end = kKMajor ? extent : K, inner_end = kKMajor ? K : extent;
      const unsigned dst = base + 4u * static_cast<unsigned>(r * kStride + c4);
      if constexpr (kVec) {  // inner_end % 4 == 0: a chunk is wholly inside or outside
        const bool in = outer < outer_end && inner < inner_end;
        cp_async16(dst, in ? g + outer * ld + inner : g, in ? 16 : 0);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool in = outer < outer_end && inner + e < inner_end;
          cp_async4(dst + 4u * e, in ? g + outer * ld + inner + e : g, in ? 4 : 0);
        }
      }
    }
  }

  // The two 32-bit words at physical (mn, k), (mn, k + 1) for K-major and
  // (k, mn), (k, mn + 1) for MN-major, in one 64-bit shared load.
  __device__ __forceinline__ static float2 pair(const float* tile, int row, int col) {
    return *reinterpret_cast<const float2*>(tile + row * kStride + col);
  }
};

// ---- epilogues ----
// An epilogue is built in the kernel from its (vector, integer) parameters and
// maps one accumulated value of column n to the stored value.
//
// LinearEpilogue: C = act(acc + bias[n]).  bias may be null; act: 0 =
// identity, 1 = relu.  One kernel serves the plain products and problem 76
// (bias + ReLU).
struct LinearEpilogue {
  const float* bias;
  i64 act;
  __device__ __forceinline__ LinearEpilogue(const float* vec, i64 option) : bias(vec), act(option) {}
  __device__ __forceinline__ float operator()(float acc, i64 n) const {
    float v = bias ? acc + bias[n] : acc;
    return act == 1 ? fmaxf(v, 0.0f) : v;
  }
};

template <int BM, int BN, int kStages, int kPasses, bool kAKMajor, bool kBKMajor, bool kVec>
struct GemmConfig {
  static constexpr int WM = BM / 2, WN = BN / 4;  // warp tile
  static constexpr int MI = WM / 16, NI = WN / 8;  // MMA fragments per warp
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile must hold whole fragment pairs");
  typedef OperandTile<kAKMajor, BM> TileA;
  typedef OperandTile<kBKMajor, BN> TileB;
  static constexpr int kStageFloats = TileA::kFloats + TileB::kFloats;
  static constexpr int kSharedBytes = kStages * kStageFloats * 4;
  // Below 128x128 tiles, registers allow two resident blocks per SM.
  static constexpr int kMinBlocks = BM * BN >= 128 * 128 ? 1 : 2;
};

// Grid: one block per BM x BN tile of C, 1-D, grouped by 8 tile-rows so that
// blocks running together share A and B tiles in L2.
template <int BM, int BN, int kStages, int kPasses, bool kAKMajor, bool kBKMajor, bool kVec,
          typename Epilogue>
__global__ void __launch_bounds__(kGemmThreads,
                                  (GemmConfig<BM, BN, kStages, kPasses, kAKMajor, kBKMajor, kVec>::kMinBlocks))
gemm_tf32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
          const float* __restrict__ epilogue_vector, i64 epilogue_option, i64 M, i64 N, i64 K,
          i64 lda, i64 ldb, i64 ldc) {
  typedef GemmConfig<BM, BN, kStages, kPasses, kAKMajor, kBKMajor, kVec> Cfg;
  typedef typename Cfg::TileA TileA;
  typedef typename Cfg::TileB TileB;
  constexpr int MI = Cfg::MI, NI = Cfg::NI;
  // Fold points: after every kChunkK / 8 MMA steps inside a k-tile, or after
  // every kChunkK / 32 k-tiles.
  constexpr int kChunkSteps = kChunkK <= kGemmBK ? kChunkK / 8 : 0;
  constexpr int kChunkTiles = kChunkK <= kGemmBK ? 1 : kChunkK / kGemmBK;
  extern __shared__ float4 shared_f4[];
  float* const shared = reinterpret_cast<float*>(shared_f4);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = (warp >> 2) * Cfg::WM, wn = (warp & 3) * Cfg::WN;

  // Tile of this block (grouped raster).
  constexpr i64 kGroup = 8;
  const i64 tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const i64 pid = blockIdx.x;
  const i64 in_group = kGroup * tiles_n;
  const i64 first_m = (pid / in_group) * kGroup;
  const i64 group_rows = min(tiles_m - first_m, kGroup);
  const i64 m0 = (first_m + (pid % in_group) % group_rows) * BM;
  const i64 n0 = ((pid % in_group) / group_rows) * BN;

  const int ktiles = static_cast<int>((K + kGemmBK - 1) / kGemmBK);
  auto load_stage = [&](int stage, int kt) {
    float* s = shared + stage * Cfg::kStageFloats;
    const i64 k0 = static_cast<i64>(kt) * kGemmBK;
    TileA::template load<kVec>(s, a, lda, M, K, m0, k0, tid);
    TileB::template load<kVec>(s + TileA::kFloats, b, ldb, N, K, n0, k0, tid);
  };

  float acc[MI][NI][4], sum[MI][NI][4];
  // sum += acc; acc = 0 (the compiler then feeds zero accumulators to the next MMAs).
  auto fold = [&]() {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sum[i][j][e] += acc[i][j][e];
          acc[i][j][e] = 0.0f;
        }
  };
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = sum[i][j][e] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt landed for all threads; stage (kt-1) is free
    {
      const int next = kt + kStages - 1;
      if (next < ktiles) load_stage(next % kStages, next);
      cp_async_commit();
    }
    const float* sa = shared + (kt % kStages) * Cfg::kStageFloats;
    const float* sb = sa + TileA::kFloats;
#pragma unroll
    for (int kk = 0; kk < kGemmBK; kk += 8) {
      // B fragments: for each fragment pair, MMA column g of fragment 2p / 2p+1
      // is physical column 16p + 2g / 16p + 2g + 1.
      Split<kPasses, 2 * NI> fb;
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        const int n = wn + 16 * p + 2 * g;
        if constexpr (kBKMajor) {
          const float2 v0 = TileB::pair(sb, n, kk + 2 * t);      // col n:   k t, t+4
          const float2 v1 = TileB::pair(sb, n + 1, kk + 2 * t);  // col n+1
          fb.set(4 * p + 0, v0.x); fb.set(4 * p + 1, v0.y);
          fb.set(4 * p + 2, v1.x); fb.set(4 * p + 3, v1.y);
        } else {
          const float2 lo = TileB::pair(sb, kk + 2 * t, n);      // k t:   cols n, n+1
          const float2 hi = TileB::pair(sb, kk + 2 * t + 1, n);  // k t+4
          fb.set(4 * p + 0, lo.x); fb.set(4 * p + 1, hi.x);
          fb.set(4 * p + 2, lo.y); fb.set(4 * p + 3, hi.y);
        }
      }
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int m = wm + 16 * i + 2 * g;  // MMA rows g, g+8 -> m, m+1
        Split<kPasses, 4> fa;
        if constexpr (kAKMajor) {
          const float2 r0 = TileA::pair(sa, m, kk + 2 * t);
          const float2 r1 = TileA::pair(sa, m + 1, kk + 2 * t);
          fa.set(0, r0.x); fa.set(1, r1.x); fa.set(2, r0.y); fa.set(3, r1.y);
        } else {
          const float2 lo = TileA::pair(sa, kk + 2 * t, m);
          const float2 hi = TileA::pair(sa, kk + 2 * t + 1, m);
          fa.set(0, lo.x); fa.set(1, lo.y); fa.set(2, hi.x); fa.set(3, hi.y);
        }
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          // fragment j = 2p + (j % 2): its (k t, k t+4) words
          const int q = 4 * (j / 2) + 2 * (j % 2);
          const unsigned bb[2] = {fb.big[q], fb.big[q + 1]};
          if constexpr (kPasses == 3) {
            const unsigned bs[2] = {fb.small[q], fb.small[q + 1]};
            mma_tf32(acc[i][j], fa.small, bb);
            mma_tf32(acc[i][j], fa.big, bs);
          }
          mma_tf32(acc[i][j], fa.big, bb);
        }
      }
      if constexpr (kChunkSteps > 0) {
        if ((kk / 8 + 1) % kChunkSteps == 0) fold();
      }
    }
    if constexpr (kChunkSteps == 0) {
      if ((kt + 1) % kChunkTiles == 0 || kt + 1 == ktiles) fold();
    }
  }
  cp_async_wait<0>();

  // Epilogue: thread owns rows m, m+1 of each fragment and columns
  // 16p + 4t .. +3 of each fragment pair p.
  const Epilogue epilogue(epilogue_vector, epilogue_option);
  const bool vec_store = kVec && (ldc % 4 == 0) && ((reinterpret_cast<unsigned long long>(c) & 15) == 0);
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i64 row = m0 + wm + 16 * i + 2 * g + h;
      if (row >= M) continue;
      float* crow = c + row * ldc;
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        const i64 col = n0 + wn + 16 * p + 4 * t;
        const float v[4] = {sum[i][2 * p][2 * h], sum[i][2 * p + 1][2 * h],
                            sum[i][2 * p][2 * h + 1], sum[i][2 * p + 1][2 * h + 1]};
        if (vec_store && col + 3 < N) {
          *reinterpret_cast<float4*>(crow + col) =
              make_float4(epilogue(v[0], col), epilogue(v[1], col + 1), epilogue(v[2], col + 2),
                          epilogue(v[3], col + 3));
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (col + e < N) crow[col + e] = epilogue(v[e], col + e);
        }
      }
    }
}

}  // namespace cf
