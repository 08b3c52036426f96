// Kernel family "gemm": the plain 16-bit product act(x W^T + bias) on the
// Hopper GEMM engine (gemm.cuh), the bias and the activation applied to the
// float32 accumulators in the store (ops.gemm._half_linear; measured against
// cuBLAS by benchmarks/gemm.py --half).
#include "gemm.cuh"

namespace cf {

// C = act(A B^T + bias), rounded once to T.  bias: N values of T, or null;
// act: 0 = identity, 1 = relu (relu_keep_nan).
template <typename T>
struct LinearEpilogue {
  const T* bias;
  i64 act, N;
  __device__ __forceinline__ float operator()(float v, i64 col) const {
    if (bias && col < N) v += to_float(bias[col]);
    return act == 1 ? relu_keep_nan(v) : v;
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// C through the copy engine (TmaTileWriter).
template <typename T, typename Epilogue>
struct TmaStore {
  const TensorMap& map_c;
  Epilogue epilogue;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) const {
    TmaTileWriter::begin(me);
#pragma unroll
    for (int hm = 0; hm < 2; ++hm)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < kHgAccs / 4; ++i) {
          const i64 col = n0 + 8 * i + 2 * me.t;
          TmaTileWriter::put(staging, 64 * hm + me.row + 8 * h, i, me.t,
                             pack2<T>(epilogue(acc[hm][4 * i + 2 * h], col),
                                      epilogue(acc[hm][4 * i + 2 * h + 1], col + 1)));
        }
    TmaTileWriter::end(map_c, me, staging, m0, n0);
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
// maps (ops.gemm._tensor_map), any K.  kTmaStore: C through map_c (boxes of
// 128 x 64), else through c with row stride ldc.  Grid: at most one block per
// SM (persistent), kHgThreads threads, half_gemm_shared_bytes<kStages, staging>()
// of dynamic shared memory.
template <typename T, int kStages, bool kTmaStore>
__global__ void __launch_bounds__(kHgThreads, 1)
gemm_wgmma(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
           const __grid_constant__ TensorMap map_c, T* __restrict__ c, const T* __restrict__ bias, i64 act,
           i64 M, i64 N, i64 K, i64 ldc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char gemm_shared[];
  const LinearEpilogue<T> epilogue{bias, act, N};
  const DenseLoader loader{map_a, map_b, M, N, K};
  if constexpr (kTmaStore) {
    TmaStore<T, LinearEpilogue<T>> store{map_c, epilogue};
    half_gemm_persistent<T, kStages, kHgStagingBytes>(reinterpret_cast<char*>(gemm_shared), loader, store);
  } else {
    DirectStore<T, LinearEpilogue<T>> store{c, epilogue, M, N, ldc};
    half_gemm_persistent<T, kStages, 0>(reinterpret_cast<char*>(gemm_shared), loader, store);
  }
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

}  // namespace cf
