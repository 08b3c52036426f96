// Kernel family "bias_relu": out = relu(z + b1[ch]) (+ b2[ch]), the epilogue of
// problems 76 (Linear -> +bias -> ReLU) and 1 (Conv2d -> ReLU -> +bias, with the
// conv's own bias folded in as b1).
//
// The activation is viewed as [outer, C, inner] in memory order: a GEMM output
// is [M, N, 1], an NCHW conv output [N, C, H*W], a channels-last one
// [N*H*W, C, 1].  ch = (i / inner) % C.
//
// Forward writes one bit per element instead of keeping z alive: the
// backward needs only that mask, 1/32 of the activation.  The bit is clear
// where u <= 0 and set elsewhere, NaN included: torch's ReLU backward zeroes
// the gradient exactly where its output is <= 0.
//
// Types: z and dz are T; out, dy and the biases are TO, which is T, or float
// for a float16 / bfloat16 z meeting float32 biases (type promotion, as under
// autocast): dz is then rounded to z's dtype, as the promotion's backward does.
#include "cf_common.cuh"

namespace cf {

template <bool kSecondBias>
struct BiasReluChain {
  static constexpr bool kHasSecondBias = kSecondBias;
};

// Grid-stride over 32-element words; warp-uniform loop so __ballot_sync sees
// the whole warp.  mask may be null (no gradient needed).
template <typename T, typename Chain, typename TO = T>
__global__ void bias_relu_forward(const T* __restrict__ z, TO* __restrict__ out,
                                  unsigned* __restrict__ mask, const TO* __restrict__ b1,
                                  const TO* __restrict__ b2, i64 total, i64 channels, i64 inner) {
  const int lane = threadIdx.x & 31;
  const i64 warp = (blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x) >> 5;
  const i64 warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  const i64 words = (total + 31) >> 5;
  // 64-bit division costs several times a 32-bit one and this kernel does
  // one per element: use 32-bit index math whenever the tensor allows it.
  const bool index32 = total < (i64(1) << 31);
  for (i64 w = warp; w < words; w += warps) {
    const i64 i = (w << 5) + lane;
    bool positive = false;
    if (i < total) {
      const i64 ch = index32 ? i64((unsigned(i) / unsigned(inner)) % unsigned(channels))
                             : (i / inner) % channels;
      const float u = to_float(z[i]) + to_float(b1[ch]);
      positive = !(u <= 0.0f);
      float r = positive ? u : 0.0f;  // NaN stays NaN, as in torch.relu
      if (Chain::kHasSecondBias) r += to_float(b2[ch]);
      out[i] = from_float<TO>(r);
    }
    const unsigned bits = __ballot_sync(0xffffffffu, positive);
    if (mask && lane == 0) mask[w] = bits;
  }
}

__device__ __forceinline__ bool mask_bit(const unsigned* mask, i64 i) {
  return (mask[i >> 5] >> (i & 31)) & 1u;
}

// Backward, channel-last layout (inner == 1): thread per channel, looping over
// the rows [row0, row1) of its chunk.  dz = dy * mask; per-chunk sums go to
// partial[chunk][slot][C] (double): slot 0 = sum dz (grad of b1), slot 1 =
// sum dy (b2).
// dy_dense == 0 means dy is one value broadcast everywhere (e.g. out.sum()).
template <typename T, typename Chain, typename TO = T>
__global__ void bias_relu_backward_rows(const TO* __restrict__ dy, i64 dy_dense,
                                        const unsigned* __restrict__ mask, T* __restrict__ dz,
                                        double* __restrict__ partial, i64 rows, i64 channels,
                                        i64 rows_per_chunk) {
  const i64 c = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (c >= channels) return;
  const i64 row0 = blockIdx.y * rows_per_chunk;
  const i64 row1 = min(rows, row0 + rows_per_chunk);
  CompensatedSum sum_dz, sum_dy;
  for (i64 r = row0; r < row1; ++r) {
    const i64 i = r * channels + c;
    const float g = to_float(dy[dy_dense ? i : 0]);
    const float d = mask_bit(mask, i) ? g : 0.0f;
    dz[i] = from_float<T>(d);
    sum_dz.add(d);
    if (Chain::kHasSecondBias) sum_dy.add(g);
  }
  constexpr int kSlots = Chain::kHasSecondBias ? 2 : 1;
  double* p = partial + blockIdx.y * kSlots * channels;
  p[c] = sum_dz.total();
  if (Chain::kHasSecondBias) p[channels + c] = sum_dy.total();
}

// Backward, channel-major layout (inner > 1, e.g. NCHW): block per (n, ch)
// slab of `inner` contiguous elements; partial[n][slot][C].
template <typename T, typename Chain, typename TO = T>
__global__ void bias_relu_backward_slabs(const TO* __restrict__ dy, i64 dy_dense,
                                         const unsigned* __restrict__ mask, T* __restrict__ dz,
                                         double* __restrict__ partial, i64 channels, i64 inner) {
  __shared__ double scratch[32];
  const i64 slab = blockIdx.x;  // n * C + ch
  const i64 n = slab / channels, ch = slab % channels;
  const i64 base = slab * inner;
  CompensatedSum thread_dz, thread_dy;
  for (i64 k = threadIdx.x; k < inner; k += blockDim.x) {
    const i64 i = base + k;
    const float g = to_float(dy[dy_dense ? i : 0]);
    const float d = mask_bit(mask, i) ? g : 0.0f;
    dz[i] = from_float<T>(d);
    thread_dz.add(d);
    if (Chain::kHasSecondBias) thread_dy.add(g);
  }
  // Tree over the block (fixed order), then the chunk stage over n.
  const double sum_dz = block_sum(thread_dz.total(), scratch);
  constexpr int kSlots = Chain::kHasSecondBias ? 2 : 1;
  double* p = partial + n * kSlots * channels;
  const double sum_dy = Chain::kHasSecondBias ? block_sum(thread_dy.total(), scratch) : 0.0;
  if (threadIdx.x == 0) {
    p[ch] = sum_dz;
    if (Chain::kHasSecondBias) p[channels + ch] = sum_dy;
  }
}

}  // namespace cf
