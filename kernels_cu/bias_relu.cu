// Kernel family "bias_relu": out = relu(z + b1[ch]) (+ b2[ch]), the epilogue of
// problems 76 (Linear -> +bias -> ReLU) and 1 (Conv2d -> ReLU -> +bias, with the
// conv's own bias folded in as b1).
//
// The activation is viewed as [outer, C, inner] in memory order: a GEMM output
// is [M, N, 1], an NCHW conv output [N, C, H*W], a channels-last one
// [N*H*W, C, 1].  ch = (i / inner) % C.
//
// Forward writes one bit per element instead of keeping z alive: the
// backward needs only that mask, 1/32 of the activation.  Bit b of word w is
// element 32 * w + b.  The bit is clear where u <= 0 and set elsewhere, NaN
// included: torch's ReLU backward zeroes the gradient exactly where its
// output is <= 0.
//
// Types: z and dz are T; out, dy and the biases are TO, which is T, or float
// for a float16 / bfloat16 z meeting float32 biases (type promotion, as under
// autocast): dz is then rounded to z's dtype, as the promotion's backward does.
//
// Every kernel moves z / dz in 16-byte vectors of kV = 16 / sizeof(T) values
// (and out / dy in kV values of TO: 16 or 32 bytes): with one 2- or 4-byte
// access per value the load/store units, not the memory, set the pace.  A
// vector starts at an element index that is a multiple of kV, so it is
// 16-byte aligned whenever the tensor's base is.  The base of a view need not
// be (z[1:]): each kernel tests its pointers once and, where one is not
// aligned, reads and writes the same vectors one value at a time (a branch
// uniform over the grid), so every input takes the same kernel.
#include <column_reduce.cuh>  // (<>: the include path alone, not the working folder)

namespace cf {

template <bool kSecondBias>
struct BiasReluChain {
  static constexpr bool kHasSecondBias = kSecondBias;
};

// Helpers of this file only; the kernels call them qualified, so that a
// helper of the same name added to cf_common.cuh cannot make a call ambiguous.
namespace brelu {

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15u) == 0;
}

// Words (32-bit) in N values of T.
template <typename T, int N>
constexpr int kWordsOf = N * static_cast<int>(sizeof(T)) / 4;

__device__ __forceinline__ unsigned raw_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ unsigned raw_bits(half x) { return x.bits; }
__device__ __forceinline__ unsigned raw_bits(bfloat16 x) { return x.bits; }

// N consecutive values at p (N * sizeof(T) = 16 or 32 bytes), packed as in
// memory.  With `vec` (p 16-byte aligned) and all N wanted: one 16-byte load
// per 16 bytes.  Otherwise one load per value, of the first n only (the rest
// read as 0): a misaligned base, or the tensor's last, partial vector.  The
// values stay packed until used (packed_value): a 16-bit vector in flight then
// takes 4 registers, not 8.
template <typename T, int N>
__device__ __forceinline__ void load_raw(const T* p, bool vec, int n,
                                         unsigned (&w)[kWordsOf<T, N>]) {
  constexpr int kWords = kWordsOf<T, N>;
  static_assert(kWords % 4 == 0, "16 or 32 bytes");
  if (vec && n == N) {
#pragma unroll
    for (int c = 0; c < kWords / 4; ++c) {
      const uint4 r = reinterpret_cast<const uint4*>(p)[c];
      w[4 * c] = r.x; w[4 * c + 1] = r.y; w[4 * c + 2] = r.z; w[4 * c + 3] = r.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const unsigned bits = k < n ? raw_bits(p[k]) : 0u;
      if constexpr (sizeof(T) == 4) {
        w[k] = bits;
      } else {
        w[k / 2] = k % 2 ? (w[k / 2] | (bits << 16)) : bits;
      }
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void load_values(const T* p, bool vec, int n, float (&out)[N]) {
  unsigned w[kWordsOf<T, N>];
  load_raw<T, N>(p, vec, n, w);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = packed_value<T>(w, k);
}

// Stores the first n of N values at p, as load_values reads them.
template <typename T, int N>
__device__ __forceinline__ void store_values(T* p, bool vec, int n, const float (&in)[N]) {
  constexpr int kWords = N * static_cast<int>(sizeof(T)) / 4;
  static_assert(kWords % 4 == 0, "16 or 32 bytes");
  if (vec && n == N) {
    store_vec<T, N>(p, in);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (k < n) p[k] = from_float<T>(in[k]);
  }
}

// dz as the backwards store it: d, or with kTf32Dz (a float32 dz that the
// convolution's TF32 input gradient reads: conv_bias_relu.cu,
// conv_dgrad_wgmma) rounded to TF32 as the engine's operands are
// (to_tf32_keep_nan).  The biases' sums take d itself.
template <bool kTf32Dz>
__device__ __forceinline__ float dz_value(float d) {
  if constexpr (kTf32Dz) {
    return __uint_as_float(to_tf32_keep_nan(d));
  } else {
    return d;
  }
}

// n (<= 32) mask bits from element i on, in the low bits.  They cross into
// the next word only when that word holds some of the n elements, so nothing
// past the mask is read.
__device__ __forceinline__ unsigned mask_bits(const unsigned* mask, i64 i, int n) {
  const int shift = static_cast<int>(i & 31);
  unsigned bits = mask[i >> 5] >> shift;
  if (shift + n > 32) bits |= mask[(i >> 5) + 1] << (32 - shift);
  return bits;
}

// The channel of each of the N elements from element e on, as biases: b[k]
// (and c[k] from the second bias).  Layouts, tested once per launch:
//  kBiasVector: inner == 1 and C a multiple of N, biases 16-byte aligned —
//    the N channels are consecutive from e % C: vector loads;
//  kTwoChannels: inner >= N — at most one channel boundary inside the
//    vector: the channel of e and the next one, one division per vector;
//  kPerElement: anything else (inner < N, e.g. [M, 77] or a 2x3 image) —
//    the channel run is followed element by element.
enum BiasLayout { kBiasVector, kTwoChannels, kPerElement };

//  index32 (e < 2^31): the divisions by inner and channels by FastDiv.
template <typename TO, typename Chain, int N>
__device__ __forceinline__ void channel_biases(const TO* b1, const TO* b2, int layout, i64 e,
                                               i64 channels, i64 inner, bool index32,
                                               const FastDiv& by_inner, const FastDiv& by_channels,
                                               float (&b)[N], float (&c)[N]) {
  i64 q, ch;
  if (index32) {
    const unsigned q32 = inner == 1 ? unsigned(e) : by_inner.div(unsigned(e));
    q = q32;
    ch = q32 - by_channels.div(q32) * unsigned(channels);
  } else {
    q = inner == 1 ? e : e / inner;
    ch = q % channels;
  }
  if (layout == kBiasVector) {
    load_values<TO, N>(b1 + ch, true, N, b);
    if (Chain::kHasSecondBias) load_values<TO, N>(b2 + ch, true, N, c);
    return;
  }
  // Elements of the vector left in channel ch.
  i64 left = (q + 1) * inner - e;
  if (layout == kTwoChannels) {
    const float b_this = to_float(b1[ch]);
    const float c_this = Chain::kHasSecondBias ? to_float(b2[ch]) : 0.0f;
    if (left >= N) {  // the whole vector in one channel: nearly every vector
#pragma unroll
      for (int k = 0; k < N; ++k) {
        b[k] = b_this;
        c[k] = c_this;
      }
      return;
    }
    const i64 next = ch + 1 == channels ? 0 : ch + 1;
    const float b_next = to_float(b1[next]);
    const float c_next = Chain::kHasSecondBias ? to_float(b2[next]) : 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      b[k] = k < left ? b_this : b_next;
      c[k] = k < left ? c_this : c_next;
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (left == 0) {
      ch = ch + 1 == channels ? 0 : ch + 1;
      left = inner;
    }
    --left;
    b[k] = to_float(b1[ch]);
    c[k] = Chain::kHasSecondBias ? to_float(b2[ch]) : 0.0f;
  }
}

}  // namespace brelu

// Forward.  Each lane takes one vector of kV values (16 bytes of z) per
// pass, kU passes unrolled (their loads issued before any use), each pass a
// warp's 32 consecutive vectors; kLanes = 32 / kV lanes then hold one mask
// word and OR their bytes of it together (shuffles inside aligned groups).
// Grid: a warp per tile of 32 * kU vectors, grid-stride; the loop is
// warp-uniform so that the shuffles see the whole warp.  mask may be null
// (no gradient needed).
template <typename T, typename Chain, typename TO = T>
__global__ void __launch_bounds__(256)
bias_relu_forward(const T* __restrict__ z, TO* __restrict__ out, unsigned* __restrict__ mask,
                  const TO* __restrict__ b1, const TO* __restrict__ b2, i64 total,
                  i64 channels, i64 inner, i64 inner_divisor, i64 channels_divisor) {
  constexpr int kV = 16 / static_cast<int>(sizeof(T));
  constexpr int kLanes = 32 / kV;
  constexpr int kU = 2;
  const int lane = threadIdx.x & 31;
  const i64 warp = (blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x) >> 5;
  const i64 warps = (static_cast<i64>(gridDim.x) * blockDim.x) >> 5;
  const i64 tiles = (total + 32 * kU * kV - 1) / (32 * kU * kV);
  // 64-bit division costs several times a 32-bit one: 32-bit index math
  // whenever the tensor allows it.
  const bool index32 = total < (i64(1) << 31);
  const FastDiv by_inner(inner_divisor), by_channels(channels_divisor);
  const bool vec = brelu::aligned16(z) && brelu::aligned16(out);
  const bool biases_aligned = brelu::aligned16(b1) && (!b2 || brelu::aligned16(b2));
  const int layout = inner == 1 && channels % kV == 0 && biases_aligned ? brelu::kBiasVector
                     : inner >= kV                                      ? brelu::kTwoChannels
                                                                        : brelu::kPerElement;
  for (i64 t = warp; t < tiles; t += warps) {
    unsigned x[kU][brelu::kWordsOf<T, kV>];
    i64 e[kU];
    int n[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      e[u] = ((t * kU + u) * 32 + lane) * kV;
      n[u] = static_cast<int>(max(i64(0), min(i64(kV), total - e[u])));
      if (n[u] > 0) brelu::load_raw<T, kV>(z + e[u], vec, n[u], x[u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      unsigned bits = 0;
      if (n[u] > 0) {
        float b[kV], c[kV], y[kV];
        brelu::channel_biases<TO, Chain, kV>(b1, b2, layout, e[u], channels, inner, index32,
                                             by_inner, by_channels, b, c);
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          const float v = packed_value<T>(x[u], k) + b[k];
          float r = relu_keep_nan(v);
          if (Chain::kHasSecondBias) r += c[k];
          y[k] = r;
          bits |= (!(v <= 0.0f) && k < n[u] ? 1u : 0u) << k;  // NaN: set
        }
        brelu::store_values<TO, kV>(out + e[u], vec, n[u], y);
      }
      if (mask) {  // uniform over the grid
        // e is a multiple of kV: this lane's bits sit at e % 32 of its word.
        bits <<= static_cast<int>(e[u] & 31);
#pragma unroll
        for (int offset = 1; offset < kLanes; offset <<= 1)
          bits |= __shfl_xor_sync(0xffffffffu, bits, offset);
        if (lane % kLanes == 0 && n[u] > 0) mask[e[u] >> 5] = bits;
      }
    }
  }
}

// Blocks per SM the rows kernel is built for (its registers are capped so
// that they fit: 64 a thread for float; 80 for the 16-bit types, whose 8
// channels' compensated sums take 32, and 64 where they are plain float
// sums, kPlainSums, which leaves room for a fourth block); ops/bias_relu.py
// (ROWS_BLOCKS_PER_SM, PLAIN_ROWS_BLOCKS_PER_SM) sizes its grid from the
// same numbers.
template <typename T, bool kPlainSums>
constexpr int kRowsBlocksPerSm = sizeof(T) == 4 ? 4 : (kPlainSums ? 4 : 3);

// Backward, channel-last layout (inner == 1): dz = dy * mask; per-chunk sums
// go to partial[chunk][slot][C] (double): slot 0 = sum dz (grad of b1), slot
// 1 = sum dy (b2).  dy_dense == 0 means dy is one value broadcast everywhere
// (e.g. out.sum()).  With `counters` (not null), the column block's last
// block also sums the chunks' partials into sums_out[slot][C]
// (reduce_columns_in_last_block).
//
// A thread owns one vector of kV consecutive channels; a block is `cols`
// (a power of two, <= 32) vectors wide and blockDim.x / cols row groups deep.
// Row group g of chunk blockIdx.y takes rows row0 + g, row0 + g + groups,
// ..., kR of them per pass with their loads issued first; each thread sums
// its rows in order, then the row groups combine in a fixed tree in shared
// memory (double), so that one partial per chunk covers many rows: the
// partials are written and read again by _reduce_partials, traffic that
// grows with the chunk count.  A thread's sums are compensated
// (CompensatedSum) for a float32 gradient; for a 16-bit one (kPlainSums)
// they are plain float sums (FloatSum), the launch giving a thread at most
// PLAIN_SUM_ROWS rows (ops/bias_relu.py, rows_launch): these kernels are
// bound by the instructions they issue, and in the compensated variant the
// compensation is most of them.  When C is not a multiple of kV the rows
// are not vector-aligned: values one at a time (the same sums).  kTf32Dz:
// a float32 dz rounded to TF32 (brelu::dz_value).
template <typename T, typename Chain, typename TO = T, bool kPlainSums = false, bool kTf32Dz = false>
__global__ void __launch_bounds__(256, kRowsBlocksPerSm<T, kPlainSums>)
bias_relu_backward_rows(const TO* __restrict__ dy, i64 dy_dense,
                        const unsigned* __restrict__ mask, T* __restrict__ dz,
                        double* __restrict__ partial, i64 rows, i64 channels,
                        i64 rows_per_chunk, i64 cols, TO* __restrict__ sums_out,
                        unsigned* __restrict__ counters) {
  static_assert(!kPlainSums || sizeof(TO) == 2, "plain sums round to a 16-bit gradient");
  static_assert(!kTf32Dz || sizeof(T) == 4, "a float32 dz rounded to TF32");
  constexpr int kV = 16 / static_cast<int>(sizeof(T));
  // Rows per pass: 64 bytes of dy in flight per thread for float; 32 for
  // a 16-bit z, whose 8 channels' compensated sums already hold 32
  // registers (more would spill at kRowsBlocksPerSm; the plain variant
  // holds 16, and spends the room on a fourth block per SM instead).
  constexpr int kR = sizeof(T) == 4 ? 4 : 32 / (kV * static_cast<int>(sizeof(TO)));
  constexpr int kSlots = Chain::kHasSecondBias ? 2 : 1;
  using Sum = typename ColumnSum<kPlainSums>::type;
  __shared__ double scratch[kV][256];
  const int tid = threadIdx.x;
  const int groups = blockDim.x / static_cast<int>(cols);
  const int group = tid / static_cast<int>(cols);
  const i64 c0 = (blockIdx.x * cols + tid % cols) * kV;
  const int nc = static_cast<int>(max(i64(0), min(i64(kV), channels - c0)));
  const bool vec =
      channels % kV == 0 && brelu::aligned16(dz) && (!dy_dense || brelu::aligned16(dy));
  const float g_all = dy_dense ? 0.0f : to_float(dy[0]);
  const i64 row0 = blockIdx.y * rows_per_chunk;
  const i64 row1 = min(rows, row0 + rows_per_chunk);
  Sum sum_dz[kV], sum_dy[kV];
  if (nc > 0) {
#pragma unroll 1
    for (i64 r = row0 + group; r < row1; r += i64(groups) * kR) {
      unsigned g[kR][brelu::kWordsOf<TO, kV>];
      unsigned bits[kR];
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        const i64 row = r + i64(u) * groups;
        if (row < row1) {
          const i64 i = row * channels + c0;
          if (dy_dense) brelu::load_raw<TO, kV>(dy + i, vec, nc, g[u]);
          bits[u] = brelu::mask_bits(mask, i, nc) & ((1u << nc) - 1u);  // not the next row's
        }
      }
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        const i64 row = r + i64(u) * groups;
        if (row < row1) {
          float gv[kV], d[kV];
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            gv[k] = dy_dense ? packed_value<TO>(g[u], k) : g_all;
            d[k] = (bits[u] >> k) & 1u ? gv[k] : 0.0f;
          }
          if constexpr (kTf32Dz) {
            float rounded[kV];
#pragma unroll
            for (int k = 0; k < kV; ++k) rounded[k] = brelu::dz_value<true>(d[k]);
            brelu::store_values<T, kV>(dz + row * channels + c0, vec, nc, rounded);
          } else {
            brelu::store_values<T, kV>(dz + row * channels + c0, vec, nc, d);
          }
          // Channels past C (k >= nc) sum values that are never written out.
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            sum_dz[k].add(d[k]);
            if (Chain::kHasSecondBias) sum_dy[k].add(gv[k]);
          }
        }
      }
    }
  }
  double* p = partial + blockIdx.y * kSlots * channels;
#pragma unroll
  for (int slot = 0; slot < kSlots; ++slot) {
    double v[kV];
#pragma unroll
    for (int k = 0; k < kV; ++k) v[k] = (slot == 0 ? sum_dz[k] : sum_dy[k]).total();
    // Row group g adds group g + s, s = groups / 2, ..., 1: fixed order.
    for (int s = groups / 2; s > 0; s >>= 1) {
      __syncthreads();
      if (group >= s && group < 2 * s) {
#pragma unroll
        for (int k = 0; k < kV; ++k) scratch[k][tid] = v[k];
      }
      __syncthreads();
      if (group < s) {
#pragma unroll
        for (int k = 0; k < kV; ++k) v[k] += scratch[k][tid + s * static_cast<int>(cols)];
      }
    }
    if (group == 0) {
#pragma unroll
      for (int k = 0; k < kV; ++k)
        if (k < nc) p[slot * channels + c0 + k] = v[k];
    }
  }
  const i64 col0 = blockIdx.x * cols * kV;
  reduce_columns_in_last_block(partial, sums_out, counters, kSlots, channels, col0,
                               min(channels, col0 + cols * kV));
}

// Backward, channel-major layout (inner > 1, e.g. NCHW): block per (n, ch)
// slab of `inner` contiguous elements, slab0 + blockIdx.x (a grid holds
// fewer than 2^31 blocks: ops/bias_relu.py launches more grids beyond);
// partial[n][slot][C].  The slab's
// vectors start at its first element index that is a multiple of kV (a slab
// starts at slab * inner, which need not be one): the elements before it
// (head) and after its last whole vector (tail), fewer than kV each, go one
// per thread.  Each thread sums its head element, its vectors in order and
// its tail element; then a fixed tree over the block.  Registers capped at
// 64 (4 blocks per SM): the compiler would otherwise take up to 114 for the
// vectors in flight and leave 2 blocks per SM, which stall together in their
// final block sums.
template <typename T, typename Chain, typename TO = T>
__global__ void __launch_bounds__(256, 4)
bias_relu_backward_slabs(const TO* __restrict__ dy, i64 dy_dense,
                         const unsigned* __restrict__ mask, T* __restrict__ dz,
                         double* __restrict__ partial, i64 channels, i64 inner, i64 slab0) {
  constexpr int kV = 16 / static_cast<int>(sizeof(T));
  constexpr int kU = 64 / (kV * static_cast<int>(sizeof(TO)));  // 64 bytes of dy in flight
  __shared__ double scratch[32];
  const i64 slab = slab0 + blockIdx.x;  // n * C + ch
  const i64 n = slab / channels, ch = slab % channels;
  const i64 base = slab * inner, end = base + inner;
  const i64 first = min(end, (base + kV - 1) / kV * kV);
  const i64 vectors = (end - first) / kV;
  const i64 body_end = first + vectors * kV;
  const bool vec = brelu::aligned16(dz) && (!dy_dense || brelu::aligned16(dy));
  const float g_all = dy_dense ? 0.0f : to_float(dy[0]);
  CompensatedSum thread_dz, thread_dy;
  auto scalar = [&](i64 i) {
    const float g = dy_dense ? to_float(dy[i]) : g_all;
    const float d = (mask[i >> 5] >> (i & 31)) & 1u ? g : 0.0f;
    dz[i] = from_float<T>(d);
    thread_dz.add(d);
    if (Chain::kHasSecondBias) thread_dy.add(g);
  };
  if (base + threadIdx.x < first) scalar(base + threadIdx.x);
  for (i64 j = threadIdx.x; j < vectors; j += i64(blockDim.x) * kU) {
    unsigned g[kU][brelu::kWordsOf<TO, kV>];
    unsigned bits[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const i64 jj = j + i64(u) * blockDim.x;
      if (jj < vectors) {
        const i64 i = first + jj * kV;
        if (dy_dense) brelu::load_raw<TO, kV>(dy + i, vec, kV, g[u]);
        bits[u] = mask[i >> 5] >> (i & 31);  // kV divides 32: one word
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const i64 jj = j + i64(u) * blockDim.x;
      if (jj < vectors) {
        float gv[kV], d[kV];
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          gv[k] = dy_dense ? packed_value<TO>(g[u], k) : g_all;
          d[k] = (bits[u] >> k) & 1u ? gv[k] : 0.0f;
        }
        brelu::store_values<T, kV>(dz + first + jj * kV, vec, kV, d);
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          thread_dz.add(d[k]);
          if (Chain::kHasSecondBias) thread_dy.add(gv[k]);
        }
      }
    }
  }
  if (body_end + threadIdx.x < end) scalar(body_end + threadIdx.x);
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

// Blocks per SM bias_relu_backward_to_nhwc is built for (registers capped
// to fit them; the next tile's loads take up to 32 of a thread's): ops/
// bias_relu.py sizes its grid from it.
constexpr int kToNhwcBlocksPerSm = 3;

// Backward of an NCHW z whose dz goes channels-last (the convolution's
// channels-last backward reads it so): dz [N, H, W, C] = dy * mask from dy
// [N, C, H, W] (NCHW, as z), through shared memory in tiles of 64 channels
// x 64 positions p = h * W + w of one image, so that the reads (along p)
// and the writes (along C) are whole runs of a warp.  blockIdx.x: channel
// tile; blockIdx.y: chunk, which takes the tiles (n, p tile) numbered
// tiles_per_chunk * chunk onwards.
//
// A thread moves kVec (1 or 2) consecutive values per access: kVec
// positions of a channel when it loads dy, kVec channels of a position when
// it stores dz.  kVec = 2 (H * W and C even, dy and dz aligned to two
// values; the caller checks) halves the loads and stores, and with them
// the instructions per element, which set this kernel's pace: the loads of
// a block's next tile are issued into registers before it writes the
// current one, addresses advance by pointer steps, and the per-channel sums
// add in double (more accurate than compensated float sums, at a third of
// their instructions).  A thread's write phase holds its channels, whose
// sums it keeps over its positions; the block's row groups (4 for kVec 1,
// 8 for kVec 2) then combine in a fixed order into partial[chunk][slot][C],
// as the other backwards.  So the biases' gradients may differ in their
// last bits between the two variants; each is bitwise reproducible.
// kTf32Dz: a float32 dz rounded to TF32 (brelu::dz_value).
template <typename T, typename Chain, typename TO = T, int kVec = 1, bool kTf32Dz = false>
__global__ void __launch_bounds__(256, kToNhwcBlocksPerSm)
bias_relu_backward_to_nhwc(const TO* __restrict__ dy, i64 dy_dense, const unsigned* __restrict__ mask,
                           T* __restrict__ dz, double* __restrict__ partial, i64 channels, i64 positions,
                           i64 tiles, i64 tiles_per_chunk) {
  static_assert(kVec == 1 || kVec == 2, "one or two values per access");
  static_assert(!kTf32Dz || sizeof(T) == 4, "a float32 dz rounded to TF32");
  constexpr int kSlots = Chain::kHasSecondBias ? 2 : 1;
  constexpr int kLanes = 64 / kVec;      // threads along a tile row
  constexpr int kGroups = 256 / kLanes;  // row groups: 4 or 8
  constexpr int kRows = 64 / kGroups;    // rows a thread loads, and writes
  // dy's raw words per access (a lone 16-bit value in the low half of one).
  constexpr int kRawWords = kVec * static_cast<int>(sizeof(TO)) > 4 ? 2 : 1;
  // dz, and dy where bias2's sum needs it, as [channel][position]; +1: the
  // transposed accesses hit distinct banks (two lanes to a bank, both ways,
  // for kVec 2).
  __shared__ float d_tile[64][65];
  __shared__ float g_tile[Chain::kHasSecondBias ? 64 : 1][65];
  __shared__ double scratch[kSlots][kGroups][64];
  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
  const i64 c0 = static_cast<i64>(blockIdx.x) * 64;
  // This thread loads channels c0 + ty + kGroups * k, k < load_rows, at
  // positions kVec * tx + j, and writes channels c0 + kVec * tx + j.
  const int load_rows = static_cast<int>(
      max(static_cast<i64>(0), min(static_cast<i64>(kRows), (channels - c0 - ty + kGroups - 1) / kGroups)));
  const bool writes = c0 + kVec * tx < channels;  // (C is even for kVec 2)
  const i64 p_tiles = (positions + 63) / 64;
  const i64 row_step = kGroups * positions, out_step = kGroups * channels;
  const float g_all = dy_dense ? 0.0f : to_float(dy[0]);
  const i64 t0 = static_cast<i64>(blockIdx.y) * tiles_per_chunk;
  const i64 t1 = min(tiles, t0 + tiles_per_chunk);
  // One tile's loads, raw: dy, and the mask word of each access (kVec
  // elements from an even one share a word).  Entries out of range stay
  // unset; nothing reads them.
  unsigned g_raw[kRows][kRawWords];
  unsigned m_raw[kRows];
  const auto load = [&](i64 t) {
    const i64 n = t / p_tiles, p = (t - n * p_tiles) * 64 + kVec * tx;
    if (p >= positions) return;
    i64 e = (n * channels + c0 + ty) * positions + p;
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (k < load_rows) {
        m_raw[k] = mask[e >> 5];
        if (dy_dense) {
          if constexpr (kVec == 1) {
            g_raw[k][0] = brelu::raw_bits(dy[e]);
          } else {
            Packed<TO, kVec> v;
            v.load(dy + e);
#pragma unroll
            for (int w = 0; w < kRawWords; ++w) g_raw[k][w] = v.w[w];
          }
        }
      }
      e += row_step;
    }
  };
  double sum_dz[kVec] = {}, sum_dy[kVec] = {};
  if (t0 < t1) load(t0);
  for (i64 t = t0; t < t1; ++t) {
    const i64 n = t / p_tiles, p0 = (t - n * p_tiles) * 64;
    __syncthreads();  // the previous tile's reads of the staging are done
    if (p0 + kVec * tx < positions) {
      // The bit of element e in its mask word: e's low five bits.
      const unsigned e_low = static_cast<unsigned>((n * channels + c0 + ty) * positions + p0 + kVec * tx);
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        if (k < load_rows) {
          const unsigned bit = (e_low + static_cast<unsigned>(k * row_step)) & 31u;
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const float g = dy_dense ? packed_value<TO>(g_raw[k], j) : g_all;
            d_tile[ty + kGroups * k][kVec * tx + j] = (m_raw[k] >> (bit + j)) & 1u ? g : 0.0f;
            if constexpr (Chain::kHasSecondBias) g_tile[ty + kGroups * k][kVec * tx + j] = g;
          }
        }
      }
    }
    __syncthreads();
    if (t + 1 < t1) load(t + 1);  // in flight while this tile is written
    if (writes) {
      const int valid = static_cast<int>(min(static_cast<i64>(64), positions - p0));
      T* out = dz + (n * positions + p0 + ty) * channels + c0 + kVec * tx;
#pragma unroll 4
      for (int i = ty; i < valid; i += kGroups) {
        float d[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float v = d_tile[kVec * tx + j][i];
          sum_dz[j] += static_cast<double>(v);
          if constexpr (Chain::kHasSecondBias) sum_dy[j] += static_cast<double>(g_tile[kVec * tx + j][i]);
          d[j] = brelu::dz_value<kTf32Dz>(v);
        }
        if constexpr (kVec == 1) {
          *out = from_float<T>(d[0]);
        } else {
          store_vec<T, kVec>(out, d);
        }
        out += out_step;
      }
    }
  }
  // The row groups' sums of each channel, added in order.
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    scratch[0][ty][kVec * tx + j] = sum_dz[j];
    if constexpr (Chain::kHasSecondBias) scratch[kSlots - 1][ty][kVec * tx + j] = sum_dy[j];
  }
  __syncthreads();
  const int slot = threadIdx.x / 64, ch = threadIdx.x % 64;
  if (slot < kSlots && c0 + ch < channels) {
    double v = scratch[slot][0][ch];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) v += scratch[slot][g][ch];
    partial[(static_cast<i64>(blockIdx.y) * kSlots + slot) * channels + c0 + ch] = v;
  }
}

}  // namespace cf
