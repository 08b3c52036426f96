// Kernel family "gemm_tf32": the float32 products of linear() on TF32 tensor
// cores with the 3xTF32 split (gemm_tf32.cuh describes the scheme and the
// operand layouts), their bias / ReLU epilogue fused into the store:
// `gemm_tf32` (mma.sync, sm_80+) and, on Hopper, `gemm_tf32_engine` (the
// GEMM engine of gemm.cuh; B split in the kernel, or beforehand by
// `gemm_tf32_split_image`).
#include <gemm_tf32.cuh>  // (<>: the include path alone, not the working folder)

namespace cf {

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
    return act == 1 ? relu_keep_nan(v) : v;
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

template <int BM, int BN, int kStages, int kPasses, bool kAKMajor, bool kBKMajor, bool kVec,
          typename Epilogue>
__global__ void __launch_bounds__(kGemmThreads,
                                  (GemmConfig<BM, BN, kStages, kPasses, kAKMajor, kBKMajor, kVec>::kMinBlocks))
gemm_tf32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
          const float* __restrict__ epilogue_vector, i64 epilogue_option, i64 M, i64 N, i64 K,
          i64 lda, i64 ldb, i64 ldc) {
#if __CUDA_ARCH__ >= 800  // TF32 mma.sync and cp.async; older GPUs use cuBLAS SGEMM
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

  i64 m0, n0;
  grouped_tile(M, N, BM, BN, m0, n0);

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
        Split<kPasses, 4> fa;
        TileA::a_fragment(sa, wm + 16 * i + 2 * g, kk, t, fa);  // MMA rows g, g+8 -> m, m+1
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
  if constexpr (kPasses == 3) {  // an infinite operand's NaN sums (gemm_tf32.cuh)
    // sum[i][j][e]: row 16i + 2g + e / 2, column 16 (j / 2) + 4t + j % 2 + 2 (e % 2) of the warp tile
    auto elem = [&](int x) -> float& { return sum[x / (4 * NI)][(x / 4) % NI][x % 4]; };
    auto where = [=](int x, i64& m, i64& n) {
      const int i = x / (4 * NI), j = (x / 4) % NI, e = x % 4;
      m = m0 + wm + 16 * i + 2 * g + e / 2;
      n = n0 + wn + 16 * (j / 2) + 4 * t + j % 2 + 2 * (e % 2);
    };
    redo_nan_outputs<kAKMajor, kBKMajor, MI * NI * 4>(elem, where, a, b, M, N, K, lda, ldb);
  }
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
#else
  __trap();  // never launched below compute capability 8.0 (ops.gemm.has_tf32_tensor_cores)
#endif
}

// ---- on the Hopper GEMM engine ----
// SplitTileStore's store of one row of a consumer thread's 64 sums:
// sum[4 i + 2 h], sum[4 i + 2 h + 1] (i = 0..15) to columns n0 + 8 i + 2 t,
// + 1 of the row at crow, through the epilogue, as float2 where vec_store
// allows (an even row stride and an 8-byte aligned C), clipped at N.
template <typename Epilogue>
__device__ __forceinline__ void store_row_sums(float* crow, const float (&sum)[64], int h, i64 n0, int t, i64 N,
                                               bool vec_store, const Epilogue& epilogue) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const i64 col = n0 + 8 * i + 2 * t;
    const float v0 = sum[4 * i + 2 * h], v1 = sum[4 * i + 2 * h + 1];
    if (vec_store && col + 1 < N) {
      *reinterpret_cast<float2*>(crow + col) = make_float2(epilogue(v0, col), epilogue(v1, col + 1));
    } else {
      if (col < N) crow[col] = epilogue(v0, col);
      if (col + 1 < N) crow[col + 1] = epilogue(v1, col + 1);
    }
  }
}

// The store of Tf32SplitMma's tiles: C = epilogue(sum), float32, from
// registers (a warpgroup's 64 rows: its accumulator row h at tile row
// Mma::row_of(me, h), columns n0 + 8 i + 2 t, +1 at acc[0][4 i + 2 h], + 1),
// after the redo of NaN sums for 3 passes (a and b: the raw operands,
// layouts kAKMajor and kBKMajor).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int kPasses, bool kAKMajor, bool kBKMajor, typename Epilogue>
struct SplitTileStore {
  using Mma = Tf32SplitMma<kPasses, !kAKMajor>;
  float* c;
  Epilogue epilogue;
  i64 M, N, K, ldc;
  const float* a;
  const float* b;
  i64 lda, ldb;
  __device__ __forceinline__ void operator()(float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0, i64 n0,
                                             unsigned) const {
    float (&sum)[kHgAccs] = acc[0];
    if constexpr (kPasses == 3) {  // an infinite operand's NaN sums (gemm_tf32.cuh)
      auto elem = [&](int x) -> float& { return sum[x]; };
      auto where = [m0, n0, me](int x, i64& m, i64& n) {
        m = m0 + Mma::row_of(me, x >> 1 & 1);
        n = n0 + 8 * (x >> 2) + 2 * me.t + (x & 1);
      };
      redo_nan_outputs<kAKMajor, kBKMajor, kHgAccs>(elem, where, a, b, M, N, K, lda, ldb);
    }
    const bool vec_store = (ldc % 2 == 0) && ((reinterpret_cast<unsigned long long>(c) & 7) == 0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i64 r = m0 + Mma::row_of(me, h);
      if (r < M) store_row_sums(c + r * ldc, sum, h, n0, me.t, N, vec_store, epilogue);
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane&) const {}
};
#endif

// B [K, N] (B(k, n) = b[n*ldb + k] K-major, b[k*ldb + n] N-major) -> its
// split image for gemm_tf32_engine (gemm_tf32.cuh), split as Split does.
// One thread per (column, step of 8 values of k) of a k-tile, grid-stride
// over tiles_n * k_tiles * 128 * 4 items, the steps fastest: the 4 threads
// of a column write its 128-byte row of each plane, and read 128
// contiguous bytes of a K-major B, or 32 of an N-major one (8 columns in
// each of a warp's rows of B).
template <int kPasses, bool kBKMajor>
__global__ void gemm_tf32_split_image(const float* __restrict__ b, float* __restrict__ image, i64 N, i64 K,
                                      i64 ldb, i64 k_tiles, i64 items) {
  for (i64 item = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; item < items;
       item += static_cast<i64>(gridDim.x) * blockDim.x) {
    const int st = static_cast<int>(item & 3), nl = static_cast<int>((item >> 2) & (kHgBN - 1));
    const i64 tile = item >> 9;  // (tile_n, k-tile) = tile / k_tiles, tile % k_tiles
    const i64 n = (tile / k_tiles) * kHgBN + nl, k0 = (tile % k_tiles) * kGemmBK + 8 * st;
    const Split<kPasses, 8> part = split_step<kPasses>([&](int q) {
      const i64 k = k0 + q;
      return (n < N && k < K) ? (kBKMajor ? b[n * ldb + k] : b[k * ldb + n]) : 0.0f;
    });
    float* const row = image + tile * split_tile_floats<kPasses>() + nl * kGemmBK;
    uint4* const lo = reinterpret_cast<uint4*>(row + plane_chunk(nl, st, 0) / 4);
    uint4* const hi = reinterpret_cast<uint4*>(row + plane_chunk(nl, st, 1) / 4);
    *lo = make_uint4(part.big[0], part.big[1], part.big[2], part.big[3]);
    *hi = make_uint4(part.big[4], part.big[5], part.big[6], part.big[7]);
    if constexpr (kPasses == 3) {
      lo[kPlaneFloats / 4] = make_uint4(part.small[0], part.small[1], part.small[2], part.small[3]);
      hi[kPlaneFloats / 4] = make_uint4(part.small[4], part.small[5], part.small[6], part.small[7]);
    }
  }
}

// C = epilogue(A B) on the engine: A through map_a (K-major: [M, K], boxes
// of 128 rows x 32; else its transpose [K, M], boxes of 32 x 32); B split
// beforehand (kSplitBefore: `planes`, its split image from
// gemm_tf32_split_image above) or in the kernel (map_b: B as it lies, K-major
// [N, K] in boxes of 32 x 128, 128-byte swizzled, or N-major [K, N] in
// boxes of 128 x 32, unswizzled); a and b, the raw operands (B in layout
// kBKMajor, row strides lda, ldb), for the redo of NaN sums.  Grid: at most
// one block per SM (persistent), kHgThreads threads,
// half_gemm_shared_bytes<kStages, 0, A's 16 KiB + the planes' 16 KiB each,
// and in-kernel SplittingLoader's kExtraBytes and kExtraBarriers>() of
// dynamic shared memory.
template <int kStages, int kPasses, bool kAKMajor, bool kBKMajor, bool kSplitBefore>
__global__ void __launch_bounds__(kHgThreads, 1)
gemm_tf32_engine(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
                 const float* __restrict__ planes, float* __restrict__ c, const float* __restrict__ epilogue_vector,
                 i64 epilogue_option, i64 M, i64 N, i64 K, i64 ldc, const float* __restrict__ a, i64 lda,
                 const float* __restrict__ b, i64 ldb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char engine_shared[];
  using Store = SplitTileStore<kPasses, kAKMajor, kBKMajor, LinearEpilogue>;
  Store store{c, LinearEpilogue(epilogue_vector, epilogue_option), M, N, K, ldc, a, b, lda, ldb};
  char* const smem = reinterpret_cast<char*>(engine_shared);
  if constexpr (kSplitBefore) {
    const PlanesLoader<kPasses, !kAKMajor> loader(map_a, planes, M, N, K);
    half_gemm_persistent<float, kStages, 0, typename Store::Mma>(smem, loader, store);
  } else {
    const SplittingLoader<kPasses, !kAKMajor, kBKMajor> loader(map_a, map_b, M, N, K);
    half_gemm_persistent<float, kStages, 0, typename Store::Mma>(smem, loader, store);
  }
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

}  // namespace cf
