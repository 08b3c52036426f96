// Kernel family "gemm": the plain 16-bit product act(x W^T + bias) on the
// Hopper GEMM engine (gemm.cuh), the bias and the activation applied to the
// float32 accumulators in the store (ops.gemm._half_linear; against cuBLAS
// in benchmarks/gemm.py --half), and the same product with a float32
// W rounded to 16 bits inside the engine (ops.gemm._linear_float32_weight;
// benchmarks/gemm.py --float32-weight).
#include <gemm.cuh>  // (<>: the include path alone, not the working folder)

namespace cf {

// C = act(A B^T + bias), rounded once to T.  bias: N values of T, or null;
// act: 0 = identity, 1 = relu (relu_keep_nan).  The stores read a tile's
// bias values (bias_at) before they stage any value: read inside the
// staging loop, each read would wait for the shared-memory stores before
// it (asm volatile), and the reads' latencies would add up in the store.
template <typename T>
struct LinearEpilogue {
  const T* bias;
  i64 act, N;
  __device__ __forceinline__ float bias_at(i64 col) const {
    return bias && col < N ? to_float(bias[col]) : 0.0f;
  }
  __device__ __forceinline__ float apply(float v, float b) const {
    if (bias) v += b;  // (no add without a bias: -0 stays -0)
    return act == 1 ? relu_keep_nan(v) : v;
  }
  __device__ __forceinline__ float operator()(float v, i64 col) const { return apply(v, bias_at(col)); }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// C through the copy engine (TmaTileWriter).
template <typename T, typename Epilogue>
struct TmaStore {
  const TensorMap& map_c;
  Epilogue epilogue;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) const {
    float b[kHgAccs / 4][2];  // the bias of this thread's columns 8 i + 2 t, +1
#pragma unroll
    for (int i = 0; i < kHgAccs / 4; ++i) {
      const i64 col = n0 + 8 * i + 2 * me.t;
      b[i][0] = epilogue.bias_at(col);
      b[i][1] = epilogue.bias_at(col + 1);
    }
    TmaTileWriter::begin(me);
#pragma unroll
    for (int hm = 0; hm < 2; ++hm)
#pragma unroll
      for (int i = 0; i < kHgAccs / 4; i += 2)
        TmaTileWriter::put4_pairs(staging, me, hm, i, [&](int h, int c) {
          return pack2<T>(epilogue.apply(acc[hm][4 * (i + c) + 2 * h], b[i + c][0]),
                          epilogue.apply(acc[hm][4 * (i + c) + 2 * h + 1], b[i + c][1]));
        });
    TmaTileWriter::end(map_c, me, staging, m0, n0);
  }
  __device__ __forceinline__ void finish(const HalfGemmLane& me) const { TmaTileWriter::finish(me); }
};
#endif

// The store of F32ConvertMma's tiles, which compute C^T (C's columns as
// their rows): a warpgroup's 64 x 256 part of a tile of C^T at (m0, n0) goes
// to C [rows, N] as its 256 x 64 tile at (n0, m0), in two halves of 128 rows
// of C, each transposed on its way through the warpgroup's staging area
// (stmatrix .trans: a warp's 8 x 8 blocks land as 16-byte rows, in the
// 128-byte swizzle layout), then written by the copy engine (a box of 64 x
// 128, clipped at C's edges).  epilogue.apply(v, epilogue.bias_at(m)): the
// value at C^T's row m.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename T, typename Epilogue>
struct TransposedTmaStore {
  const TensorMap& map_c;
  Epilogue epilogue;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) const {
    const i64 m = m0 + me.row;  // C^T's rows m, m + 8 (C's columns)
    const float b0 = epilogue.bias_at(m), b8 = epilogue.bias_at(m + 8);
    const auto value = [&](float v, bool hi) { return epilogue.apply(v, hi ? b8 : b0); };
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // C's rows n0 + 128 h .. + 127: acc[h]
      TmaTileWriter::begin(me);
      stage_transposed<T>(acc[h], me, staging, value);
      if (TmaTileWriter::staged(me)) {
        tma_store_2d(map_c, staging, static_cast<int>(m0), static_cast<int>(n0 + 128 * h));
        bulk_commit();
      }
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane& me) const { TmaTileWriter::finish(me); }
};
#endif

// The store from registers, for a C whose rows TMA cannot address (row
// stride not a multiple of 16 bytes): pairs of columns as one 32-bit store
// where the row stride and the pointer allow it.
template <typename T, typename Epilogue>
struct DirectStore {
  T* c;
  Epilogue epilogue;
  i64 M, N, ldc;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned) const {
    const bool pairs = (ldc % 2 == 0) && ((reinterpret_cast<unsigned long long>(c) & 3) == 0);
#pragma unroll
    for (int hm = 0; hm < 2; ++hm)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const i64 r = m0 + 64 * hm + me.row + 8 * h;
        if (r >= M) continue;
        T* const crow = c + r * ldc;
#pragma unroll
        for (int i = 0; i < kHgAccs / 4; ++i) {
          const i64 col = n0 + 8 * i + 2 * me.t;
          const float v0 = acc[hm][4 * i + 2 * h], v1 = acc[hm][4 * i + 2 * h + 1];
          if (pairs && col + 1 < N) {
            *reinterpret_cast<unsigned*>(crow + col) = pack2<T>(epilogue(v0, col), epilogue(v1, col + 1));
          } else {
            if (col < N) crow[col] = from_float<T>(epilogue(v0, col));
            if (col + 1 < N) crow[col + 1] = from_float<T>(epilogue(v1, col + 1));
          }
        }
      }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane&) const {}
};

// C [M, N] = act(A B^T + bias): A [M, K] and B [N, K] through their tensor
// maps (ops.gemm._tensor_map), any K.  kAMn / kBMn: A given as its
// transpose [K, M] (M-major), B as [K, N] (N-major), through maps of boxes
// of 64 x 64 (TiledLoader; ops.gemm._half_matmul).  kTmaStore: C through
// map_c (boxes of 128 x 64), else through c with row stride ldc.  Grid: at
// most one block per SM (persistent), kHgThreads threads,
// half_gemm_shared_bytes<kStages, staging>() of dynamic shared memory.
template <typename T, int kStages, bool kTmaStore, bool kAMn = false, bool kBMn = false>
__global__ void __launch_bounds__(kHgThreads, 1)
gemm_wgmma(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
           const __grid_constant__ TensorMap map_c, T* __restrict__ c, const T* __restrict__ bias, i64 act,
           i64 M, i64 N, i64 K, i64 ldc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char gemm_shared[];
  using Mma = SmemMma<T, kAMn, kBMn>;
  const LinearEpilogue<T> epilogue{bias, act, N};
  const TiledLoader<kHgBM, kHgBN, 1, kAMn, kBMn> loader{map_a, map_b, M, N, K};
  if constexpr (kTmaStore) {
    TmaStore<T, LinearEpilogue<T>> store{map_c, epilogue};
    half_gemm_persistent<T, kStages, kHgStagingBytes, Mma>(reinterpret_cast<char*>(gemm_shared), loader,
                                                           store);
  } else {
    DirectStore<T, LinearEpilogue<T>> store{c, epilogue, M, N, ldc};
    half_gemm_persistent<T, kStages, 0, Mma>(reinterpret_cast<char*>(gemm_shared), loader, store);
  }
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}


// z [M, N] = x W^T (+ bias) with x [M, K] of the 16-bit T and W [N, K]
// float32, W rounded to T in registers (F32ConvertMma; the same products as
// x times W cast to T): the product of a linear layer under autocast, which
// reads the float32 weight once instead of casting it first.  Computed as
// z^T = W x^T (W as wgmma's A, the operand that may come from registers).
// bias: N values of T, or null.  K % 8 == 0, N % 8 == 0, 16-byte aligned
// rows (tensor maps: map_w boxes 32 x 128, map_x 64 x 256, map_z 64 x 128).
// Grid: at most one block per SM, kHgThreads threads,
// half_gemm_shared_bytes<kStages, kCtStagingBytes, kCvStageBytes>() of
// dynamic shared memory.
template <typename T, int kStages>
__global__ void __launch_bounds__(kHgThreads, 1)
gemm_wgmma_f32_weight(const __grid_constant__ TensorMap map_w, const __grid_constant__ TensorMap map_x,
                      const __grid_constant__ TensorMap map_z, const T* __restrict__ bias, i64 M, i64 N,
                      i64 K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char gemm_shared[];
  // A: W's tiles of 128 rows x 64 float32 as two boxes; B: x's of 256 rows.
  const TiledLoader<kCvBM, kCvBN, 2> loader{map_w, map_x, N, M, K};
  TransposedTmaStore<T, LinearEpilogue<T>> store{map_z, LinearEpilogue<T>{bias, 0, N}};
  half_gemm_persistent<T, kStages, kCtStagingBytes>(reinterpret_cast<char*>(gemm_shared), loader, store,
                                                    F32ConvertMma<T>());
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

}  // namespace cf
