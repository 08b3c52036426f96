// Kernel family "conv_bias_relu" (cupy_fused/ops/conv_bias_relu.py): problem
// 1's forward, y = relu(conv2d(x, W) + conv_bias) + bias (stride 1, no
// padding, dilation 1, one group), in float16 / bfloat16 as one implicit GEMM
// on the Hopper engine (gemm.cuh): the convolution's operand tiles come from
// ConvLoader, and the chain is applied to the float32 accumulators in the
// store (NchwStore), which writes y once.
//
// The product: C [M, Cout] = A [M, K] B^T.  A row m of A is an output pixel
// (n, oh, ow), its column k = (kh, kw, c) the input value x[n, c, oh + kh,
// ow + kw]: im2col, which is never formed.  B [Cout, K] is the weight with
// its k in the same (kh, kw, c) order, c padded with zeros to a multiple of
// 64 (Cpad), so that a k-tile of 64 is one (kh, kw) and 64 channels.
#include "gemm.cuh"

namespace cf {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// An M tile is 128 consecutive output columns ow0 .. ow0 + 127 of one output
// row (n, oh), so that its A tile for k-tile (kh, kw, c-block cb) is one box
// of the channels-last input, x[n, oh + kh, ow0 + kw .. + 127, 64 cb .. + 63]:
// a single copy, with zeros past the input's width and channels (rows past
// the output's width compute values the store drops).
struct ConvLoader {
  const TensorMap& map_x;  // x [N, H, W, C] channels-last: dims (C, W, H, N), boxes 64 x 128 x 1 x 1
  const TensorMap& map_w;  // B [Cout, KH * KW * Cpad]: boxes of 64 x 128
  i64 n_images, out_rows, col_tiles, cout;
  int kw_size, c_blocks, k_tiles;
  // The current tile (begin_tile) and the next k-tile's tap and channel
  // block, stepped by each load (the k-tiles come in order): no division
  // per copy on the producer's one thread.
  int n = 0, oh = 0, ow0 = 0, n0 = 0, kh = 0, kw = 0, cb = 0;
  __device__ __forceinline__ i64 tiles_m() const { return n_images * out_rows * col_tiles; }
  __device__ __forceinline__ i64 tiles_n() const { return (cout + kHgBN - 1) / kHgBN; }
  __device__ __forceinline__ int ktiles() const { return k_tiles; }
  __device__ __forceinline__ void prefetch() const {
    tma_prefetch_descriptor(map_x);
    tma_prefetch_descriptor(map_w);
  }
  // 32-bit divisions: ops/conv_bias_relu.py keeps the tile count below 2^31.
  __device__ __forceinline__ void begin_tile(i64 tm, i64 tn) {
    const unsigned t = static_cast<unsigned>(tm), ct = static_cast<unsigned>(col_tiles);
    const unsigned row = t / ct, rows = static_cast<unsigned>(out_rows);  // row: n * out_rows + oh
    ow0 = static_cast<int>(t - row * ct) * kHgBM;
    n = static_cast<int>(row / rows);
    oh = static_cast<int>(row - static_cast<unsigned>(n) * rows);
    n0 = static_cast<int>(tn * kHgBN);
    kh = kw = cb = 0;
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned tile_b, unsigned bar, int kt) {
    tma_load_4d(tile_a, map_x, cb * kHgBK, ow0 + kw, oh + kh, n, bar);
    tma_load_2d(tile_b, map_w, kt * kHgBK, n0, bar);
    if (++cb == c_blocks) {
      cb = 0;
      if (++kw == kw_size) {
        kw = 0;
        ++kh;
      }
    }
  }
};

// Staging of a consumer warpgroup's tile, channel-major: [128 channels][128
// columns] of T, rows padded by 8 values, so that the transposed writes of a
// warp fall in distinct banks (lanes with columns 2 apart are 544 bytes, 8
// banks, apart) and each row is read back in 128 contiguous bytes per warp.
constexpr int kConvStageRow = kHgBM + 8;
constexpr int kConvStagingBytes = 2 * kHgBN * kConvStageRow * 2;  // both consumer warpgroups

// y [N, Cout, OH, OW] (NCHW, as the reference returns for an NCHW input):
// relu(acc + conv_bias) + bias, rounded once to T.  The warpgroup writes its
// tile transposed into its staging area, then each warp writes whole rows of
// y (one channel, 128 columns of one output row) with coalesced stores: a
// row of y starts at any even element (pairs of values per lane), or at any
// element for an odd OW (one value per store).
template <typename T>
struct NchwStore {
  T* y;
  const T* conv_bias;  // Cout values
  const T* bias;       // Cout values, or null (none)
  i64 cout, out_rows, out_cols, col_tiles;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) const {
    // The previous tile's rows have been read by every warp of the warpgroup.
    named_barrier(1 + me.wg, 128);
#pragma unroll
    for (int i = 0; i < kHgAccs / 4; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int co = 8 * i + 2 * me.t + e;
        const i64 c = n0 + co;
        const float cb = c < cout ? to_float(conv_bias[c]) : 0.0f;
        const float b = (bias && c < cout) ? to_float(bias[c]) : 0.0f;
#pragma unroll
        for (int hm = 0; hm < 2; ++hm)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float v = acc[hm][4 * i + 2 * h + e] + cb;
            v = (v <= 0.0f ? 0.0f : v) + b;  // relu keeps a NaN
            const int col = 64 * hm + me.row + 8 * h;
            asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(staging + 2 * (co * kConvStageRow + col)),
                         "h"(from_float<T>(v).bits)
                         : "memory");
          }
      }
    }
    named_barrier(1 + me.wg, 128);
    const i64 tm = m0 / kHgBM;
    const i64 row = tm / col_tiles;  // n * out_rows + oh
    const i64 ow0 = (tm - row * col_tiles) * kHgBM;
    const i64 n = row / out_rows, oh = row - n * out_rows;
    const int warp = (static_cast<int>(threadIdx.x) >> 5) & 3, lane = threadIdx.x & 31;
    for (int co = warp; co < kHgBN; co += 4) {
      const i64 c = n0 + co;
      if (c >= cout) break;
      T* const dst = y + ((n * cout + c) * out_rows + oh) * out_cols + ow0;
      const i64 cols = min(static_cast<i64>(kHgBM), out_cols - ow0);
      const bool pairs = (reinterpret_cast<unsigned long long>(dst) & 3) == 0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = 64 * half + 2 * lane;
        unsigned word;
        asm volatile("ld.shared.b32 %0, [%1];\n"
                     : "=r"(word)
                     : "r"(staging + 2 * (co * kConvStageRow + col))
                     : "memory");
        if (pairs && col + 1 < cols) {
          *reinterpret_cast<unsigned*>(dst + col) = word;
        } else {
          if (col < cols) dst[col].bits = static_cast<unsigned short>(word);
          if (col + 1 < cols) dst[col + 1].bits = static_cast<unsigned short>(word >> 16);
        }
      }
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane&) const {}
};
#endif

// x [N, C, H, W] (NCHW) -> xc [N, H, W, C] (channels-last), the layout the
// convolution's loader reads: tiles of 64 channels x 64 columns of one image
// row through shared memory, so that both the reads (along W) and the
// writes (along C) are whole 64-byte runs of a warp.  blockIdx.x: (image
// row n * H + h) * column tiles + column tile; blockIdx.y: channel tile.
template <typename T>
__global__ void __launch_bounds__(256) nchw_to_nhwc(const T* __restrict__ x, T* __restrict__ xc, i64 C,
                                                    i64 H, i64 W) {
  __shared__ unsigned short tile[64][65];  // +1: the transposed reads hit distinct banks
  const i64 col_tiles = (W + 63) / 64;
  const i64 nh = blockIdx.x / col_tiles;  // n * H + h
  const i64 w0 = (blockIdx.x - nh * col_tiles) * 64, c0 = static_cast<i64>(blockIdx.y) * 64;
  const i64 n = nh / H, h = nh - n * H;
  const int tx = threadIdx.x & 63, ty = threadIdx.x >> 6;
#pragma unroll 4
  for (int ci = ty; ci < 64; ci += 4) {
    const i64 c = c0 + ci, w = w0 + tx;
    if (c < C && w < W) tile[ci][tx] = x[((n * C + c) * H + h) * W + w].bits;
  }
  __syncthreads();
#pragma unroll 4
  for (int wi = ty; wi < 64; wi += 4) {
    const i64 w = w0 + wi, c = c0 + tx;
    if (c < C && w < W) xc[(nh * W + w) * C + c].bits = tile[tx][wi];
  }
}

// y = relu(conv2d(x, W) + conv_bias) + bias.  map_x: x channels-last [N, H,
// W, C] as dims (C, W, H, N), boxes 64 x 128 x 1 x 1, 128-byte swizzle;
// map_w: the weight as B [Cout, KH * KW * Cpad] (ops/conv_bias_relu.py),
// boxes 64 x 128.  y: NCHW [N, Cout, OH, OW].  Grid: at most one block per SM
// (persistent), kHgThreads threads, half_gemm_shared_bytes<kStages,
// kConvStagingBytes>() of dynamic shared memory.
template <typename T, int kStages>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_bias_relu_wgmma(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                     T* __restrict__ y, const T* __restrict__ conv_bias, const T* __restrict__ bias,
                     i64 n_images, i64 cout, i64 out_rows, i64 out_cols, i64 kw_size, i64 c_blocks,
                     i64 k_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char conv_shared[];
  const i64 col_tiles = (out_cols + kHgBM - 1) / kHgBM;
  const ConvLoader loader{map_x, map_w, n_images, out_rows, col_tiles, cout, static_cast<int>(kw_size),
                          static_cast<int>(c_blocks), static_cast<int>(k_tiles)};
  NchwStore<T> store{y, conv_bias, bias, cout, out_rows, out_cols, col_tiles};
  half_gemm_persistent<T, kStages, kConvStagingBytes>(reinterpret_cast<char*>(conv_shared), loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

}  // namespace cf
