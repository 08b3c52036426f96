// Kernel family "conv_bias_relu" (cupy_fused/ops/conv_bias_relu.py): problem
// 1's forward, y = relu(conv2d(x, W) + conv_bias) + bias (stride 1, no
// padding, dilation 1, one group), in float16 / bfloat16, or float32 read as
// TF32, as one implicit GEMM on the Hopper engine (gemm.cuh): the
// convolution's operand tiles come from ConvLoader (from x channels-last: as
// given, or a copy: of an NCHW x, of a float32 x rounded to TF32, or of x
// cast under autocast), and the chain is applied to the float32
// accumulators in the store (NchwStore, NchwStoreF32, NhwcStore,
// NhwcStoreF32: y in x's layout), which writes y once.  The window kernels
// below compute the same convolution transposed, a window of the input
// serving every tap of a kernel row (conv_bias_relu_window,
// conv_bias_relu_nchw_window: the forward from a channels-last or an NCHW
// x; conv_dgrad_wgmma: the input gradient).  conv_wgrad_wgmma computes the
// weight gradient on the same engine (dz^T times x seen from each tap, k the
// output pixels), in runs that conv_wgrad_reduce adds in a fixed order.
//
// The product: C [M, Cout] = A [M, K] B^T.  A row m of A is an output pixel
// (n, oh, ow), its column k = (kh, kw, c) the input value x[n, c, oh + kh,
// ow + kw]: im2col, which is never formed.  B [Cout, K] is the weight with
// its k in the same (kh, kw, c) order, c padded with zeros to a multiple of
// a k-tile's channels (Cpad: 64 16-bit values, 32 float32 ones), so that a
// k-tile is one (kh, kw) and one block of channels.
#include <gemm.cuh>  // (<>: the include path alone, not the working folder)

namespace cf {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// An M tile is 128 consecutive output columns ow0 .. ow0 + 127 of one output
// row (n, oh), so that its A tile for k-tile (kh, kw, c-block cb) is one box
// of the channels-last input, x[n, oh + kh, ow0 + kw .. + 127, kBK cb .. +
// kBK - 1] (kBK: 64 16-bit channels, 32 float32 ones):
// a single copy, with zeros past the input's width and channels (rows past
// the output's width compute values the store drops).  (An NCHW input
// cannot be read so: a box's first element must lie on the 16-byte grid,
// and the taps kw shift it along W one element at a time.)
template <typename T>
struct ConvLoader {
  static constexpr int kBK = hg_bk<T>();  // channels of a k-tile
  const TensorMap& map_x;  // x [N, H, W, C] channels-last: dims (C, W, H, N), boxes kBK x 128 x 1 x 1
  const TensorMap& map_w;  // B [Cout, KH * KW * Cpad]: boxes of kBK x 128
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
    tma_load_4d(tile_a, map_x, cb * kBK, ow0 + kw, oh + kh, n, bar);
    tma_load_2d(tile_b, map_w, kt * kBK, n0, bar);
    if (++cb == c_blocks) {
      cb = 0;
      if (++kw == kw_size) {
        kw = 0;
        ++kh;
      }
    }
  }
};

// The stores' tile at GEMM row m0: its output row n * OH + oh (returned)
// and first output column ow0 (ConvLoader::begin_tile decodes the same in
// 32-bit arithmetic, on the producer's one thread).
__device__ __forceinline__ i64 conv_tile_row(i64 m0, i64 col_tiles, i64& ow0) {
  const i64 tm = m0 / kHgBM;
  const i64 row = tm / col_tiles;
  ow0 = (tm - row * col_tiles) * kHgBM;
  return row;
}

// Where an NCHW store's tile lies in y [N, Cout, OH, OW]: image n, output
// row oh, columns ow0 .. ow0 + cols - 1 of channels n0 .. n0 + rows - 1
// (both clipped at y's edges); plane: OH * OW, the step between channels;
// start: (oh, ow0)'s place in a plane.
struct NchwTile {
  i64 n, n0, cout, plane, start;
  int rows, cols;
  __device__ __forceinline__ NchwTile(i64 m0, i64 tile_n0, i64 y_cout, i64 out_rows, i64 out_cols,
                                      i64 col_tiles)
      : n0(tile_n0), cout(y_cout), plane(out_rows * out_cols) {
    i64 ow0;
    const i64 row = conv_tile_row(m0, col_tiles, ow0);
    n = row / out_rows;
    start = (row - n * out_rows) * out_cols + ow0;
    cols = static_cast<int>(min(static_cast<i64>(kHgBM), out_cols - ow0));
    rows = static_cast<int>(min(static_cast<i64>(kHgBN), cout - n0));
  }
  // Column 0 of the tile's channel co in y.
  template <typename Out>
  __device__ __forceinline__ Out* channel(Out* y, int co) const {
    return y + (n * cout + n0 + co) * plane + start;
  }
};

// The chain's two biases for a tile's 128 channels, float32 in shared memory
// (kConvBiasBytes per consumer warpgroup): pair p holds {conv_bias[c],
// conv_bias[c + 1], bias[c], bias[c + 1]} for c = n0 + 2p, zeros past Cout.
// Refilled only when the warpgroup's tile column n0 changes (once in a
// kernel where Cout <= 128).
constexpr int kConvBiasBytes = kHgBN / 2 * 16;
template <typename T>
struct ConvBiases {
  const T* conv_bias;  // Cout values
  const T* bias;       // Cout values, or null (none)
  i64 cout;
  i64 held = -1;  // the n0 the table holds
  // By all 128 threads of the warpgroup, after a barrier that ends the
  // previous tile's reads of the table.
  __device__ __forceinline__ void refill(unsigned table, i64 n0, const HalfGemmLane& me) {
    if (n0 == held) return;
    held = n0;
    const int p = threadIdx.x & 127;
    if (p < kHgBN / 2) {
      const i64 c = n0 + 2 * p;
      float v[4];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        v[e] = c + e < cout ? to_float(conv_bias[c + e]) : 0.0f;
        v[2 + e] = (bias && c + e < cout) ? to_float(bias[c + e]) : 0.0f;
      }
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(table + 16 * p), "f"(v[0]), "f"(v[1]),
                   "f"(v[2]), "f"(v[3])
                   : "memory");
    }
    named_barrier(1 + me.wg, 128);
  }
  // The start of an NCHW store's tile, by all 128 threads of the
  // warpgroup: once every warp has read the previous tile's staging rows
  // and table, the table for n0.
  __device__ __forceinline__ void begin(unsigned table, i64 n0, const HalfGemmLane& me) {
    named_barrier(1 + me.wg, 128);
    refill(table, n0, me);
  }
  // The entry of the thread's pair of channels 8i + 2t, +1 of the tile.
  __device__ __forceinline__ static float4 pair(unsigned table, int i, int t) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(table + 16 * (4 * i + t))
                 : "memory");
    return v;
  }
  // relu(lo + conv_bias) + bias and the same for hi, rounded once and packed
  // (without the bias: the store adds it later).
  template <typename U, bool kBias = true>
  __device__ __forceinline__ static unsigned chain(float lo, float hi, const float4& p) {
    if constexpr (kBias) {
      return pack2<U>(relu_keep_nan(lo + p.x) + p.z, relu_keep_nan(hi + p.y) + p.w);
    } else {
      return pack2<U>(relu_keep_nan(lo + p.x), relu_keep_nan(hi + p.y));
    }
  }
  // The bias of channel n0 + co of the tile.
  __device__ __forceinline__ static float bias_of(unsigned table, int co) {
    float b;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(b) : "r"(table + 16 * (co >> 1) + 8 + 4 * (co & 1)) : "memory");
    return b;
  }
};

// Staging of a consumer warpgroup's tile, channel-major: [128 channels][128
// columns] of T, each row led by 8 values of padding (rows of 272 bytes: the
// 8 rows that one stmatrix phase writes fall in distinct banks, rows stay
// 16-byte aligned, and the store's reads a few columns before or past a row
// stay in shared memory: the next row's padding, or the bias table after the
// last row), then its bias table.
constexpr int kConvStageLead = 8;
constexpr int kConvStageRow = kConvStageLead + kHgBM;
constexpr int kConvTileBytes = kHgBN * kConvStageRow * 2;
constexpr int kConvNchwStagingBytes = 2 * (kConvTileBytes + kConvBiasBytes);  // both consumer warpgroups

// Relu's mask bits of two 16-bit values of relu's output, rounded, packed
// in a word (bit 0: the low half, bit 1: the high half): set where the
// value has a nonzero magnitude, which is where relu's input was > 0 or
// NaN.  Both stores' masks take their bits so.
__device__ __forceinline__ unsigned nonzero_halves(unsigned pair) {
  return ((pair & 0x7fffu) != 0 ? 1u : 0u) | ((pair & 0x7fff0000u) != 0 ? 2u : 0u);
}
// relu(v + conv_bias) rounded to T, as a float (a float32 T: as it is):
// relu's output as a 16-bit conv2d gives it under autocast, before a float32
// bias is added (NhwcStoreF32, WindowBiases::autocast).
template <typename T>
__device__ __forceinline__ float relu_rounded(float v, float conv_bias) {
  return to_float(from_float<T>(relu_keep_nan(v + conv_bias)));
}
// The same bits for relu's outputs lo, hi rounded to T (float32: as they
// are; NaN != 0 sets its bit).
template <typename T>
__device__ __forceinline__ unsigned nonzero_pair(float lo, float hi) {
  if constexpr (sizeof(T) == 4) {
    return (lo != 0.0f ? 1u : 0u) | (hi != 0.0f ? 2u : 0u);
  } else {
    return nonzero_halves(pack2<T>(lo, hi));
  }
}

// y [N, Cout, OH, OW] (NCHW, as the reference returns for an NCHW input) of
// Out: relu(acc + conv_bias) + bias rounded once to T (Out = T), or, as
// autocast computes it (Out = float), relu(acc + conv_bias) rounded to T,
// then + bias in float32.  With kMask (training), also relu's mask for the
// backward (bias_relu's: bit i of word i / 32 for y's element i in memory
// order, set where relu's input is > 0 or NaN), and y = relu(acc +
// conv_bias) rounded to T, then + bias, rounded again (as eager's
// convolution rounds its output before relu and the bias add): the staged
// value's bits then give the mask bit exactly (a nonzero magnitude).  The
// warpgroup writes its
// tile transposed into its staging area (stmatrix.trans: 16 instructions a
// thread), then each warp writes whole rows of y (one channel, the tile's
// columns of one output row), a lane 8 bytes of the row's 8-byte grid (a
// row of y starts at any element, as OW is any size; 16 bytes for float32
// y).  A lane's two 32-bit
// reads of the staging row, in the order its half-warp alternates, fall in
// distinct banks.  Where every row starts on the grid of pairs of values
// (OW even, y so aligned), a lane's four values go as two pairs, each
// written or not, with no per-value path (a warp issues the stores of
// every branch any of its lanes takes, and a row's partial chunks would
// take the per-value one for every row).  Otherwise rows that start at an odd element
// are read value by value, and the grid's partial chunks at a row's ends
// written so.
template <typename T, typename Out, bool kMask = false>
struct NchwStore {
  // float32 y, or the mask: relu(acc + conv_bias) staged, the bias added at the store
  static constexpr bool kBiasLater = sizeof(Out) == 4 || kMask;
  Out* y;
  // kMask: cdiv(y's elements, 32) words, zeroed by the caller (the words a
  // row shares with its neighbours are OR-ed in; an integer OR, so the
  // result does not depend on the order).  y's first element lies on a
  // 4-element grid (a fresh allocation).
  unsigned* mask;
  ConvBiases<Out> biases;
  i64 cout, out_rows, out_cols, col_tiles;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) {
    const unsigned table = staging + kConvTileBytes;
    biases.begin(table, n0, me);
    // With relu's mask, the warp's index from lane 0: store_rows's row loop
    // holds the mask's shuffles, and bounded by an index ptxas cannot tell is
    // the warp's own it made the consumer's main loop move its descriptors
    // into uniform registers again (without the mask they stay there).
    const int lane = threadIdx.x & 31, own_warp = (threadIdx.x >> 5) & 3;
    const int warp = kMask ? from_lane0(own_warp) : own_warp;
    // stmatrix: lane 8 j + r gives row r of matrix j, which is channel
    // 8 (i + j / 2) + r at columns 64 hm + 16 warp + 8 (j % 2) ...
    constexpr bool kBiasNow = !kBiasLater;
    const unsigned lane_row = staging + 2 * ((8 * (lane >> 4) + (lane & 7)) * kConvStageRow + kConvStageLead +
                                             16 * warp + 8 * ((lane >> 3) & 1));
#pragma unroll
    for (int i = 0; i < kHgAccs / 4; i += 2) {
      const float4 p0 = ConvBiases<Out>::pair(table, i, me.t), p1 = ConvBiases<Out>::pair(table, i + 1, me.t);
#pragma unroll
      for (int hm = 0; hm < 2; ++hm) {
        const float* a = acc[hm];
        stmatrix_x4_trans(lane_row + 2 * (8 * i * kConvStageRow + 64 * hm),
                          ConvBiases<Out>::template chain<T, kBiasNow>(a[4 * i], a[4 * i + 1], p0),
                          ConvBiases<Out>::template chain<T, kBiasNow>(a[4 * i + 2], a[4 * i + 3], p0),
                          ConvBiases<Out>::template chain<T, kBiasNow>(a[4 * i + 4], a[4 * i + 5], p1),
                          ConvBiases<Out>::template chain<T, kBiasNow>(a[4 * i + 6], a[4 * i + 7], p1));
      }
    }
    named_barrier(1 + me.wg, 128);
    const NchwTile tile(m0, n0, cout, out_rows, out_cols, col_tiles);
    Out* dst = tile.channel(y, warp);
    // Every row starts on the grid of pairs of values (kPairs): a lane's
    // four values are two aligned pairs, read and written whole, with no
    // per-value path.
    if (out_cols % 2 == 0 && (reinterpret_cast<unsigned long long>(y) & (2 * sizeof(Out) - 1)) == 0) {
      store_rows<true>(dst, tile.plane, lane, warp, tile.rows, tile.cols, staging, table);
    } else {
      store_rows<false>(dst, tile.plane, lane, warp, tile.rows, tile.cols, staging, table);
    }
    store_last_chunk(tile.channel(y, 0), tile.plane, tile.rows, tile.cols, staging, table);
  }
  // Warp w writes rows w, w + 4, ..., four at a time (dst: row w's column
  // 0): the reads of four rows, then their writes, so that the reads'
  // latencies overlap.
  template <bool kPairs>
  __device__ __forceinline__ void store_rows(Out* dst, i64 plane, int lane, int warp, int rows, int cols,
                                             unsigned staging, unsigned table) const {
    for (int co0 = warp; co0 < rows; co0 += 16) {
      unsigned w[4][2];
      int c0[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int s = row_shift(dst + 4 * j * plane);
        c0[j] = 4 * lane - s;
        if constexpr (kPairs) {
          read_pairs(staging, co0 + 4 * j, c0[j], lane, w[j]);
        } else {
          read4(staging, co0 + 4 * j, c0[j], s, lane, w[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float b = kBiasLater ? ConvBiases<Out>::bias_of(table, co0 + 4 * j) : 0.0f;
        if constexpr (kPairs) {
          if (co0 + 4 * j < rows) write_pairs(dst + 4 * j * plane, c0[j], cols, w[j], b);
        } else {
          if (co0 + 4 * j < rows && c0[j] < cols) write4(dst + 4 * j * plane, c0[j], cols, w[j], b);
        }
      }
      if constexpr (kMask) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (co0 + 4 * j < rows)  // (the whole warp: the mask's shuffles)
            mask_row(dst + 4 * j * plane - y, c0[j], cols, w[j], lane);
      }
      dst += 16 * plane;
    }
  }
  // Chunk 32 (columns 128 - s ..) of the rows that reach it: lane i writes
  // that of the warp's row w + 4i (row0: row 0's column 0 in y; rows and
  // cols: the tile's, clipped).
  __device__ __forceinline__ void store_last_chunk(Out* row0, i64 plane, int rows, int cols, unsigned staging,
                                                   unsigned table) const {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    if (cols > kHgBM - 3) {
      const int co = warp + 4 * lane;
      if (co < rows) {
        Out* const row_dst = row0 + co * plane;
        const int s = row_shift(row_dst), c = kHgBM - s;
        if (c < cols) {
          unsigned w[2];
          read4(staging, co, c, s, lane, w);
          write4(row_dst, c, cols, w, kBiasLater ? ConvBiases<Out>::bias_of(table, co) : 0.0f);
          if constexpr (kMask) {  // never a whole word: OR-ed in
            const i64 f = (row_dst - y) + c;
            const unsigned bits = nibble(w, c, cols) << (f & 31);
            if (bits) atomicOr(mask + (f >> 5), bits);
          }
        }
      }
    }
  }
  // The values of staging row co at columns c .. c + 3, c even: two
  // aligned words, a lane's two reads in the order its half-warp
  // alternates (distinct banks).
  __device__ __forceinline__ static void read_pairs(unsigned staging, int co, int c, int lane, unsigned (&w)[2]) {
    const unsigned at = staging + 2 * (co * kConvStageRow + kConvStageLead + c);
    const int first = (lane >> 4) & 1;
    unsigned a, b;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a) : "r"(at + 4 * first) : "memory");
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(b) : "r"(at + 4 * (1 - first)) : "memory");
    w[0] = first ? b : a;
    w[1] = first ? a : b;
  }
  // Writes them (plus b where the bias comes at the store, kBiasLater) to
  // row[c .. c + 3] as two pairs, each where it lies inside the columns
  // 0 .. cols - 1 (cols even, c >= -2, row + c on the grid of pairs).
  __device__ __forceinline__ static void write_pairs(Out* row, int c, int cols, const unsigned (&w)[2], float b) {
    if (c >= 0 && c < cols) write_pair(row + c, w, 0, b);
    if (c + 2 < cols) write_pair(row + c + 2, w, 1, b);
  }
  // Values 2 p, 2 p + 1 of the four in w (plus b, kBiasLater) to at[0 .. 1].
  __device__ __forceinline__ static void write_pair(Out* at, const unsigned (&w)[2], int p, float b) {
    if constexpr (!kBiasLater) {
      *reinterpret_cast<unsigned*>(at) = w[p];
    } else {
      const float lo = packed_value<T>(w, 2 * p) + b, hi = packed_value<T>(w, 2 * p + 1) + b;
      if constexpr (sizeof(Out) == 4) {
        *reinterpret_cast<float2*>(at) = make_float2(lo, hi);
      } else {  // a 16-bit y (kMask): rounded again after the bias
        *reinterpret_cast<unsigned*>(at) = pack2<T>(lo, hi);
      }
    }
  }
  // The mask bits of a lane's four staged values at columns c .. c + 3 of
  // its row (bit e for column c + e; nonzero_halves), of the columns
  // 0 .. cols - 1 only.
  __device__ __forceinline__ static unsigned nibble(const unsigned (&w)[2], int c, int cols) {
    const unsigned set = nonzero_halves(w[0]) | nonzero_halves(w[1]) << 2;
    unsigned bits = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) bits |= ((set >> e & 1u) != 0 && c + e >= 0 && c + e < cols ? 1u : 0u) << e;
    return bits;
  }
  // The mask words of one row of y (flat index `base` of its column 0),
  // its columns c0 = 4 lane - s .. + 3 from each lane (s = base % 4: each
  // lane's four elements lie in one word).  Lanes whose elements share a
  // word (at most 8 in a row) OR their bits together; the first of them
  // writes the word: a plain store where the word lies inside the columns
  // this warp covers (no other writer touches it), an OR elsewhere.
  // Called by all 32 lanes.
  __device__ __forceinline__ void mask_row(i64 base, int c0, int cols, const unsigned (&w)[2], int lane) const {
    const int s = static_cast<int>(base & 3);
    const i64 first = base - s;  // lane 0's first element
    const int q = static_cast<int>(first & 31);
    const int word = (q + 4 * lane) >> 5;  // the lane's word, counted from first's
    unsigned v = nibble(w, c0, cols) << ((q + 4 * lane) & 31);
#pragma unroll
    for (int d = 1; d < 8; d *= 2) {
      const unsigned other = __shfl_down_sync(0xffffffffu, v, d);
      if (lane + d < 32 && ((q + 4 * (lane + d)) >> 5) == word) v |= other;
    }
    if (lane > 0 && ((q + 4 * (lane - 1)) >> 5) == word) return;  // not the word's first lane
    unsigned* const at = mask + ((first >> 5) + word);
    // The word's elements, as offsets from first: [32 word - q, + 32); this
    // warp's columns 0 .. min(cols, kHgBM - s) - 1 are offsets s ...
    const int lo = 32 * word - q;
    if (lo >= s && lo + 32 <= min(cols + s, kHgBM)) {
      *at = v;
    } else if (v) {
      atomicOr(at, v);
    }
  }
  // Where a row of y starts in its chunk of 4 values (8 or 16 bytes), in
  // values (0 .. 3).
  __device__ __forceinline__ static int row_shift(const Out* row) {
    return static_cast<int>((reinterpret_cast<unsigned long long>(row) / sizeof(Out)) & 3);
  }
  // The four values of staging row co at columns c .. c + 3 (c even where s
  // is, which makes them two aligned words), packed in pairs as they lie in
  // memory; columns below 0 or past the tile are read (padding, or the bias
  // table after the last row) and dropped.  A lane's two 32-bit reads go in
  // the order its half-warp alternates.
  __device__ __forceinline__ static void read4(unsigned staging, int co, int c, int s, int lane,
                                               unsigned (&w)[2]) {
    const unsigned at = staging + 2 * (co * kConvStageRow + kConvStageLead + c);
    if ((s & 1) == 0) {
      read_pairs(staging, co, c, lane, w);
    } else {
      unsigned short v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v[e]) : "r"(at + 2 * e) : "memory");
      w[0] = v[0] | (static_cast<unsigned>(v[1]) << 16);
      w[1] = v[2] | (static_cast<unsigned>(v[3]) << 16);
    }
  }
  // Writes those values (plus b, for float32 y) to row[c .. c + 3]: one
  // 8- or 16-byte store for a whole chunk inside the row's columns 0 ..
  // cols - 1, else the values inside.
  __device__ __forceinline__ static void write4(Out* row, int c, int cols, const unsigned (&w)[2], float b) {
    const bool whole = c >= 0 && c + 4 <= cols;
    if constexpr (kBiasLater) {
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = packed_value<T>(w, e) + b;
      if constexpr (sizeof(Out) == 4) {
        if (whole) {
          *reinterpret_cast<float4*>(row + c) = make_float4(v[0], v[1], v[2], v[3]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (c + e >= 0 && c + e < cols) row[c + e] = v[e];
        }
      } else if (whole) {  // a 16-bit y (kMask): rounded again after the bias
        *reinterpret_cast<uint2*>(row + c) = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (c + e >= 0 && c + e < cols) row[c + e] = from_float<T>(v[e]);
      }
    } else if (whole) {
      *reinterpret_cast<uint2*>(row + c) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (c + e >= 0 && c + e < cols) row[c + e].bits = static_cast<unsigned short>(w[e / 2] >> (16 * (e % 2)));
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane&) const {}
};

// y [N, Cout, OH, OW] of float32 from a float32 (TF32) product: relu(acc +
// conv_bias) + bias in float32.  The tile goes out in two passes of 64
// channels (a float32 staging of all 128 beside the engine's stages would
// not fit in shared memory): the warpgroup writes the pass's values into
// its staging area, channel-major [64 channels][kF32StageRow floats], each
// row shifted by 0 .. 3 values so that its columns lie on the 16-byte grid
// as they do in y (rows of 132 words: 3 + 128 fit, and rows stay 16-byte
// aligned); then thread i hands row i's whole 16-byte chunks to the copy
// engine (one bulk copy) and stores the at most three values at either
// end itself (a row of y starts anywhere on the grid, as OW is any size).
// The global writes are then the copy engine's, not store instructions
// issued beside the other warpgroup's MMAs.  The 8 pixels x 4 channel
// pairs that one staging store writes fall in distinct banks where OH * OW
// is even (every channel's shift differs from the next one's by an even
// number), in two-way conflicts otherwise.
//
// With kMask (training), also relu's mask in y's memory order (bias_relu's
// format, as NchwStore writes it; a bit set where relu's input acc +
// conv_bias is > 0 or NaN).  The bias is added before staging, so the bits
// cannot be read back from the staged values: each warp gathers them from
// its registers by ballots into a bitmap beside the staging rows (row co:
// 128 bits, one per column), and thread i, which writes row i of y, writes
// that row's bits as mask words: the words inside the row with plain
// stores, the at most two it shares with its neighbours in y (other tiles)
// OR-ed in (an integer OR into zeroed words, so the result does not depend
// on the order).
constexpr int kF32StageRow = 4 + kHgBM;
constexpr int kF32StageBytes = 64 * kF32StageRow * 4;
constexpr int kF32MaskBytes = 64 * kHgBM / 8;  // the bitmap of a pass's 64 rows
constexpr int kConvF32StagingBytes = 2 * (kF32StageBytes + kConvBiasBytes + kF32MaskBytes);  // both consumer warpgroups
// The bulk copies' sources are 16-byte aligned: every row, in both
// consumer warpgroups' staging areas.
static_assert(kF32StageRow % 4 == 0 && (kF32StageBytes + kConvBiasBytes + kF32MaskBytes) % 16 == 0,
              "16-byte aligned rows");
template <bool kMask = false>
struct NchwStoreF32 {
  float* y;
  unsigned* mask;  // kMask: cdiv(y's elements, 32) words, zeroed by the caller; else unused
  ConvBiases<float> biases;
  i64 cout, out_rows, out_cols, col_tiles;
  // Where `at` lies on the 16-byte grid, in values (0 .. 3).
  static __device__ __forceinline__ int grid_shift(const float* at) {
    return static_cast<int>((reinterpret_cast<unsigned long long>(at) >> 2) & 3);
  }
  // Staging row co's column c, for a row of y whose column 0 lies at
  // `shift` on the grid (taken modulo 4): shift + c values into the row,
  // on the grid where column c of y is.
  static __device__ __forceinline__ unsigned staged(unsigned staging, int co, int shift, int c) {
    return staging + 4 * (co * kF32StageRow + (shift & 3) + c);
  }
  static __device__ __forceinline__ float staged_value(unsigned staging, int co, int shift, int c) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(staged(staging, co, shift, c)) : "memory");
    return v;
  }
  // The 8 bits of a ballot that belong to the lanes of quad position t
  // (lane 4 g + t: bit g), gathered into the low byte.
  static __device__ __forceinline__ unsigned quad_byte(unsigned ballot, int t) {
    unsigned v = (ballot >> t) & 0x11111111u;
    v = (v | v >> 3) & 0x03030303u;
    v = (v | v >> 6) & 0x000f000fu;
    return (v | v >> 12) & 0xffu;
  }
  // The bitmap of channel pair 8 i + 2 t, +1 of the pass (staging rows co =
  // 8 ii + 2 t, +1): bits[hm][h][e] is the thread's bit of channel co + e
  // at column 64 hm + row + 8 h.  By the whole warp: lane L < 16 writes the
  // 16 bits of channel 8 ii + (L % 8) at the warp's columns 64 (L / 8) +
  // 16 warp .. + 15 (ballot bit 4 g + t is column 16 warp + 8 h + g of
  // channel 8 ii + 2 t + e).
  static __device__ __forceinline__ void put_bits(unsigned bitmap, int ii, const bool (&bits)[2][2][2]) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    unsigned b[2][2][2];
#pragma unroll
    for (int hm = 0; hm < 2; ++hm)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) b[hm][h][e] = __ballot_sync(0xffffffffu, bits[hm][h][e]);
    if (lane < 16) {
      const int hm = lane >> 3, t = (lane >> 1) & 3, e = lane & 1;
      const unsigned lo = hm ? (e ? b[1][0][1] : b[1][0][0]) : (e ? b[0][0][1] : b[0][0][0]);
      const unsigned hi = hm ? (e ? b[1][1][1] : b[1][1][0]) : (e ? b[0][1][1] : b[0][1][0]);
      const unsigned short half = static_cast<unsigned short>(quad_byte(lo, t) | quad_byte(hi, t) << 8);
      const unsigned at = bitmap + 16 * (8 * ii + (lane & 7)) + 2 * (4 * hm + warp);
      asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(at), "h"(half) : "memory");
    }
  }
  // Row co's mask words (its bitmap row; its column 0 is y's element f0,
  // `cols` columns): the words inside the row stored, the others OR-ed in.
  __device__ __forceinline__ void put_mask_row(unsigned bitmap, int co, i64 f0, int cols) const {
    unsigned b[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(bitmap + 16 * co)
                 : "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // the columns past the row's last hold no value of y
      const int n = cols - 32 * k;
      b[k] = n >= 32 ? b[k] : n <= 0 ? 0u : b[k] & ((1u << n) - 1u);
    }
    const int q = static_cast<int>(f0 & 31);
    unsigned* const words = mask + (f0 >> 5);
#pragma unroll
    for (int w = 0; w < 5; ++w) {  // word w: the row's columns 32 w - q .. + 31
      const int lo = 32 * w - q;
      if (lo >= cols) break;
      const unsigned v = (w < 4 ? b[w] << q : 0u) | (w > 0 && q ? b[w - 1] >> (32 - q) : 0u);
      if (lo >= 0 && lo + 32 <= cols) {
        words[w] = v;
      } else if (v) {
        atomicOr(words + w, v);
      }
    }
  }
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) {
    const unsigned table = staging + kF32StageBytes, bitmap = table + kConvBiasBytes;
    bulk_wait_read();  // the previous tile's rows have left the staging area
    biases.begin(table, n0, me);
    const NchwTile tile(m0, n0, cout, out_rows, out_cols, col_tiles);
    const int cols = tile.cols;
    const int tid = threadIdx.x & 127;
    // Channel co's shift: that of channel 0, plus co planes.
    const int shift0 = grid_shift(tile.channel(y, 0)), plane_shift = static_cast<int>(tile.plane & 3);
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      if (pass > 0) {  // the first pass's rows have left the staging area
        bulk_wait_read();
        named_barrier(1 + me.wg, 128);
      }
#pragma unroll
      for (int ii = 0; ii < 8; ++ii) {
        const int i = 8 * pass + ii;  // the thread's channels 8 i + 2 t, +1 of the tile
        const float4 p = ConvBiases<float>::pair(table, i, me.t);
        const int co = 8 * ii + 2 * me.t;  // staging row of channel 8 i + 2 t
        const int s_lo = shift0 + (64 * pass + co) * plane_shift;  // (staged() takes it modulo 4)
        const int s_hi = s_lo + plane_shift;
        bool bits[2][2][2];
#pragma unroll
        for (int hm = 0; hm < 2; ++hm)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = 64 * hm + me.row + 8 * h;
            const float z_lo = acc[hm][4 * i + 2 * h] + p.x, z_hi = acc[hm][4 * i + 2 * h + 1] + p.y;
            bits[hm][h][0] = !(z_lo <= 0.0f);  // relu's mask: > 0 or NaN
            bits[hm][h][1] = !(z_hi <= 0.0f);
            const float lo = relu_keep_nan(z_lo) + p.z;
            const float hi = relu_keep_nan(z_hi) + p.w;
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(staged(staging, co, s_lo, col)), "f"(lo) : "memory");
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(staged(staging, co + 1, s_hi, col)), "f"(hi) : "memory");
          }
        if constexpr (kMask) put_bits(bitmap, ii, bits);
      }
      fence_proxy_async();  // the copy engine reads what the threads wrote
      named_barrier(1 + me.wg, 128);
      if (tid < min(tile.rows - 64 * pass, 64)) {
        float* const row = tile.channel(y, 64 * pass + tid);
        const int s = grid_shift(row);
        const int head = min((4 - s) & 3, cols);  // values before the first whole chunk
        const int body = (cols - head) & ~3;      // values in whole chunks
        if (body > 0) {
          bulk_store(row + head, staged(staging, tid, s, head), 4u * body);
          bulk_commit();
        }
        for (int c = 0; c < head; ++c) row[c] = staged_value(staging, tid, s, c);
        for (int c = head + body; c < cols; ++c) row[c] = staged_value(staging, tid, s, c);
        if constexpr (kMask) put_mask_row(bitmap, tid, row - y, cols);
      }
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane&) const { bulk_wait(); }
};

// Word w of relu's mask for a channels-last store's 4 rows (a thread's
// pixels 64 hm + me.row + 8 h at k = 2 hm + h; bits[k]: channels 32 w ..
// 32 w + 31 of the tile, this thread's pairs among them): OR-ed over the
// lane quad, lane t stores row k = t's (if that pixel and those channels
// exist), then cleared.
__device__ __forceinline__ void nhwc_mask_words(unsigned (&bits)[4], int w, const HalfGemmLane& me, i64 row,
                                                i64 ow0, i64 n0, i64 out_cols, i64 cout, unsigned* mask) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    bits[k] |= __shfl_xor_sync(0xffffffffu, bits[k], 1);
    bits[k] |= __shfl_xor_sync(0xffffffffu, bits[k], 2);
  }
  const int t = me.t;
  const unsigned word = t == 0 ? bits[0] : t == 1 ? bits[1] : t == 2 ? bits[2] : bits[3];
  const i64 ow = ow0 + 64 * (t >> 1) + me.row + 8 * (t & 1);  // row k = t: hm = t / 2, h = t % 2
  const i64 c = n0 + 32 * w;
  if (ow < out_cols && c < cout) mask[((row * out_cols + ow) * cout + c) >> 5] = word;
#pragma unroll
  for (int k = 0; k < 4; ++k) bits[k] = 0u;
}

// y [N, OH, OW, Cout] (channels-last, as the reference returns for a
// channels-last input), through the copy engine: the tile is rows ow0 ..
// ow0 + 127 of the (n, oh) plane of y viewed as [N * OH, OW, Cout], clipped
// at OW and Cout (TmaTileWriter).  With kMask (training; Cout a multiple
// of 32), also relu's mask in y's memory order (bias_relu's format: bit i
// of word i / 32), from registers: a tile row's 128 channels are 4 whole
// words, which no other tile shares, each gathered over the lane quad that
// holds the row and stored by one of its lanes.  The bit: relu's output
// rounded to T has a nonzero magnitude (relu's input > 0 or NaN, as eager's
// rounded convolution output decides it).
constexpr int kConvNhwcStagingBytes = kHgStagingBytes + 2 * kConvBiasBytes;
// What the channels-last stores hold (biases of B).
template <typename B>
struct NhwcStoreFields {
  const TensorMap& map_y;  // dims (Cout, OW, N * OH), boxes of hg_bk<B>() channels x 128 pixels, 128-byte swizzle
  ConvBiases<B> biases;
  i64 col_tiles;
  unsigned* mask;  // kMask: Cout * OW * OH * N / 32 words
  i64 out_cols, cout;
};
template <typename T, bool kMask = false>
struct NhwcStore : NhwcStoreFields<T> {
  using NhwcStoreFields<T>::map_y, NhwcStoreFields<T>::biases, NhwcStoreFields<T>::col_tiles,
      NhwcStoreFields<T>::mask, NhwcStoreFields<T>::out_cols, NhwcStoreFields<T>::cout;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) {
    const unsigned table = staging + kHgStagingBytes / 2;
    TmaTileWriter::begin(me);
    biases.refill(table, n0, me);
    i64 ow0;
    const i64 row = conv_tile_row(m0, col_tiles, ow0);
    // kMask: the bits of the current word (channels 32 (i / 4) ..) of the
    // thread's 4 rows 64 hm + me.row + 8 h, at k = 2 hm + h.
    unsigned bits[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < kHgAccs / 4; ++i) {
      const float4 p = ConvBiases<T>::pair(table, i, me.t);
#pragma unroll
      for (int hm = 0; hm < 2; ++hm)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float lo = acc[hm][4 * i + 2 * h], hi = acc[hm][4 * i + 2 * h + 1];
          TmaTileWriter::put(staging, 64 * hm + me.row + 8 * h, i, me.t,
                             ConvBiases<T>::template chain<T>(lo, hi, p));
          if constexpr (kMask) {
            const unsigned r = ConvBiases<T>::template chain<T, false>(lo, hi, p);  // relu, rounded
            bits[2 * hm + h] |= nonzero_halves(r) << (8 * (i & 3) + 2 * me.t);  // columns 8 i + 2 t, +1
          }
        }
      if constexpr (kMask) {
        if ((i & 3) == 3) nhwc_mask_words(bits, i >> 2, me, row, ow0, n0, out_cols, cout, mask);
      }
    }
    TmaTileWriter::end(map_y, me, staging, ow0, n0, static_cast<int>(row));
  }
  __device__ __forceinline__ void finish(const HalfGemmLane& me) const { TmaTileWriter::finish(me); }
};

// y [N, OH, OW, Cout] of float32, channels-last: relu(acc + conv_bias) +
// bias from a float32 product (T = float); from a 16-bit one (autocast), as
// NchwStore computes it, relu(acc + conv_bias) rounded to T, then + bias in
// float32.  Through the copy engine in two passes of the
// tile's channels 64 p .. 64 p + 63, each staged as two boxes of 32
// channels x 128 pixels (a pixel's 32 values one 128-byte swizzled row: the
// 32 KiB of a 16-bit tile).  With kMask, relu's mask as NhwcStore writes it
// (Cout a multiple of 32), the bit set where relu's output (rounded to T)
// has a nonzero magnitude.
template <typename T, bool kMask = false>
struct NhwcStoreF32 : NhwcStoreFields<float> {
  // Channels c, c + 1 (c even, below 64) of pixel row r: 8 bytes of the
  // 16-byte chunk (c % 32) / 4 of box c / 32, swizzled.  A warp's 32 lanes
  // (8 rows, 4 channel pairs) put 2 values into each bank: two wavefronts,
  // the least 256 bytes take.
  __device__ __forceinline__ static void put(unsigned staging, int r, int c, float lo, float hi) {
    const unsigned at =
        staging + (c >> 5) * (kHgBM * 128) + r * 128 + ((((c & 31) >> 2) ^ (r & 7)) << 4) + 4 * (c & 3);
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(lo), "f"(hi) : "memory");
  }
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) {
    const unsigned table = staging + kHgStagingBytes / 2;
    i64 ow0;
    const i64 row = conv_tile_row(m0, col_tiles, ow0);
    unsigned bits[4] = {0u, 0u, 0u, 0u};  // kMask: as in NhwcStore
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      TmaTileWriter::begin(me);  // the previous boxes have left the staging area
      if (pass == 0) biases.refill(table, n0, me);
#pragma unroll
      for (int ii = 0; ii < 8; ++ii) {
        const int i = 8 * pass + ii;
        const float4 p = ConvBiases<float>::pair(table, i, me.t);
#pragma unroll
        for (int hm = 0; hm < 2; ++hm)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float lo = relu_rounded<T>(acc[hm][4 * i + 2 * h], p.x);
            const float hi = relu_rounded<T>(acc[hm][4 * i + 2 * h + 1], p.y);
            put(staging, 64 * hm + me.row + 8 * h, 8 * ii + 2 * me.t, lo + p.z, hi + p.w);
            if constexpr (kMask) bits[2 * hm + h] |= nonzero_pair<float>(lo, hi) << (8 * (i & 3) + 2 * me.t);
          }
        if constexpr (kMask) {
          if ((i & 3) == 3) nhwc_mask_words(bits, i >> 2, me, row, ow0, n0, out_cols, cout, mask);
        }
      }
      if (TmaTileWriter::staged(me)) {
#pragma unroll
        for (int box = 0; box < 2; ++box)
          tma_store_3d(map_y, staging + box * (kHgBM * 128), static_cast<int>(n0) + 64 * pass + 32 * box,
                       static_cast<int>(ow0), static_cast<int>(row));
        bulk_commit();
      }
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane& me) const { TmaTileWriter::finish(me); }
};

// ---- Convolutions as windows (conv_bias_relu_window, conv_dgrad_wgmma) ----
// Both compute a convolution transposed, out^T [Cout, pixels] = A [Cout, K]
// im2col(in)^T, with `in` channels-last and stride 1, so that the 64-row A
// of a consumer's tile is 64 output channels and its 256 columns are 256
// output pixels, two rows of 128 columns, (n, h0 + r, w0 .. w0 + 127) for
// r = 0, 1 (acc[r]):
//  * the forward: in = x, A = the weight as [Cout, KH * KW * Cpad] (k in
//    (kh, kw, c) order, ConvLoader's B), no padding;
//  * the input gradient: in = dz, out = dx, A = Wf [Cin, KH * KW * Cpad]
//    with Wf[ci, kh, kw, co] = W[co, ci, KH - 1 - kh, KW - 1 - kw] (the
//    weight with its taps flipped and its channels swapped), padded by
//    KH - 1 and KW - 1: dx[n, h, w, ci] = sum over (kh, kw, co) of
//    dz[n, h - (KH - 1) + kh, w - (KW - 1) + kw, co] Wf[ci, kh, kw, co].
// A stage holds one (kh, block of 64 channels of `in`) for all kKw taps kw:
// A's kKw tiles of 64 rows x 64 values of k, and for each row r a window
// of in's row h0 + r - pad_h + kh, its columns w0 - pad_w .. + kConvWindow
// - 1 (one box of the channels-last `in`; the copy engine fills what lies
// outside it, the padding, with zeros).  Tap kw reads the window from its
// row kw on (the B descriptor moved by kw rows of 128 bytes, with no base
// offset: the MMA, like the copy engine, takes the swizzle's phase from the
// address itself), so each value of `in` comes from L2 once per (kh, row r,
// block of 64 output channels) instead of once per tap.  The 64-row tile
// keeps every MMA whole where the output has 64 channels (the input
// gradient of problem 1).
constexpr int kConvWindow = 136;  // 128 columns + the 8 more that 9 taps reach; whole 1024-byte groups
constexpr int kConvWindowBytes = kConvWindow * 128;

// The pixel tile tn's image n, first row h0 and first column w0 (32-bit
// divisions: ops/conv_bias_relu.py keeps the tile count below 2^31).
__device__ __forceinline__ void window_tile(i64 tn, i64 row_pairs, i64 col_tiles, int& n, int& h0, int& w0) {
  const unsigned t = static_cast<unsigned>(tn), ct = static_cast<unsigned>(col_tiles);
  const unsigned row = t / ct, pairs = static_cast<unsigned>(row_pairs);  // row: n * row_pairs + h0 / 2
  w0 = static_cast<int>(t - row * ct) * 128;
  n = static_cast<int>(row / pairs);
  h0 = 2 * static_cast<int>(row - static_cast<unsigned>(n) * pairs);
}

// The MMAs of a stage: for each tap and step of 32 bytes of k (16 16-bit
// values, 8 float32 ones read as TF32), one wgmma.m64n128 per row r, A from
// tap kw's tile at shared address a, B from row kw of window r
// (window_b(r, offset): the descriptor of window r's byte offset).
template <typename T, int kKw, typename WindowB>
__device__ __forceinline__ void window_mma_group(float (&acc)[2][kHgAccs], unsigned a, int kt,
                                                 const WindowB& window_b) {
  const Swizzle128Desc sa(a);
  begin_mma_group(acc);
#pragma unroll
  for (int kw = 0; kw < kKw; ++kw)
#pragma unroll
    for (int kk = 0; kk < kHgSteps; ++kk) {
      const unsigned long long da = sa.at(kw * (64 * 128) + 32 * kk);
#pragma unroll
      for (int r = 0; r < 2; ++r)
        wgmma_m64n128_step<T>(acc[r], da, window_b(r, kw * 128 + 32 * kk), kt > 0 || kw > 0 || kk > 0);
    }
  wgmma_commit();
}

// window_mma_group on a stage's A tiles and its two windows.
template <typename T, int kKw>
struct ConvWindowMma : TilelessMma {
  static constexpr int kBM = 64, kBN = 256, kWgRows = 64;
  static constexpr bool kCooperative = false;
  static constexpr int kTileABytes = kKw * 64 * 128, kTileBBytes = 2 * kConvWindowBytes;
  __device__ __forceinline__ void issue(float (&acc)[2][kHgAccs], unsigned a, unsigned b, int kt) const {
    const Swizzle128Desc sb(b);
    window_mma_group<T, kKw>(acc, a, kt, [&](int r, int offset) { return sb.at(r * kConvWindowBytes + offset); });
  }
};

template <typename T, int kKw>
struct ConvWindowLoader {
  static constexpr int kBK = hg_bk<T>();  // channels of a stage: 64 16-bit, 32 float32
  // `in` [N, H, W, C] channels-last: dims (C, W, H, N), boxes kBK x kConvWindow x 1 x 1
  const TensorMap& map_in;
  const TensorMap& map_a;  // A [Cout, KH * kKw * Cpad]: boxes of kBK x 64
  i64 row_pairs, col_tiles, pixel_tiles, a_rows;
  int kh_size, c_blocks, pad_h, pad_w;
  // The current tile and the next stage's kh and channel block, stepped by
  // each load (the stages come in order).
  int n = 0, h0 = 0, w0 = 0, m0 = 0, kh = 0, cb = 0;
  __device__ __forceinline__ i64 tiles_m() const { return (a_rows + 63) / 64; }
  __device__ __forceinline__ i64 tiles_n() const { return pixel_tiles; }
  __device__ __forceinline__ int ktiles() const { return kh_size * c_blocks; }
  __device__ __forceinline__ void prefetch() const {
    tma_prefetch_descriptor(map_in);
    tma_prefetch_descriptor(map_a);
  }
  __device__ __forceinline__ void begin_tile(i64 tm, i64 tn) {
    window_tile(tn, row_pairs, col_tiles, n, h0, w0);
    m0 = static_cast<int>(tm) * 64;
    kh = cb = 0;
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned tile_b, unsigned bar, int) {
    load_a(tile_a, bar);
    const int c = cb * kBK, w = w0 - pad_w, h = h0 - pad_h + kh;
    tma_load_4d(tile_b, map_in, c, w, h, n, bar);
    tma_load_4d(tile_b + kConvWindowBytes, map_in, c, w, h + 1, n, bar);
    next_stage();
  }
  // The stage's A tiles: k-tiles ((kh KW + kw) c_blocks + cb).
  __device__ __forceinline__ void load_a(unsigned tile_a, unsigned bar) const {
#pragma unroll
    for (int kw = 0; kw < kKw; ++kw)
      tma_load_2d(tile_a + kw * (64 * 128), map_a, ((kh * kKw + kw) * c_blocks + cb) * kBK, m0, bar);
  }
  __device__ __forceinline__ void next_stage() {
    if (++cb == c_blocks) {
      cb = 0;
      ++kh;
    }
  }
};

// The loader of a window kernel whose output has rows x cols pixels in each
// of n_images images and a_rows channels (A's rows), KH = kh_size, c_blocks
// blocks of kBK channels of `in`, `in` padded by pad_h and pad_w.
template <typename T, int kKw>
__device__ __forceinline__ ConvWindowLoader<T, kKw> window_loader(const TensorMap& map_in, const TensorMap& map_a,
                                                                  i64 n_images, i64 rows, i64 cols, i64 a_rows,
                                                                  i64 kh_size, i64 c_blocks, int pad_h,
                                                                  int pad_w) {
  const i64 row_pairs = (rows + 1) / 2, col_tiles = (cols + 127) / 128;
  return {map_in, map_a, row_pairs, col_tiles, n_images * row_pairs * col_tiles, a_rows,
          static_cast<int>(kh_size), static_cast<int>(c_blocks), pad_h, pad_w};
}

// The output channels-last through the copy engine: each half of a
// warpgroup's tile (one row of 128 pixels) transposed into its staging
// area (stage_transposed: value(sum, hi) of the channel m0 + me.row (+ 8
// where hi)), then one box of 64 channels x 128 columns, clipped at the
// output's edges (a second row past the image's last is dropped so, as are
// columns past its width).  map_out: dims (C, W, H, N), boxes 64 x 128 x 1
// x 1.
template <typename T, typename Value>
__device__ __forceinline__ void store_window_tile(const float (&acc)[2][kHgAccs], const HalfGemmLane& me,
                                                  unsigned staging, const TensorMap& map_out, i64 m0, int n,
                                                  int h0, int w0, const Value& value) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    TmaTileWriter::begin(me);
    stage_transposed<T>(acc[h], me, staging, value);
    if (TmaTileWriter::staged(me)) {
      tma_store_4d(map_out, staging, static_cast<int>(m0), w0, h0 + h, n);
      bulk_commit();
    }
  }
}

// store_window_tile for a float32 output (map_out: boxes 32 x kPass x 1 x
// 1): each half of the tile in 128 / kPass passes of kPass pixels, each
// staged as two boxes of 32 channels x kPass pixels (pixel rows of 128
// bytes, swizzled: 256 kPass bytes of a warpgroup's staging, 16 KiB for
// kPass 64), one float32 value a store.  A store instruction's 32 lanes
// (channels me.row of a warp's 8 rows, pixels 2t + e of 4 rows) land in 32
// distinct banks: the swizzle XORs the channel's chunk with the pixel's row.
template <int kPass = 64, typename Value>
__device__ __forceinline__ void store_window_tile_f32(const float (&acc)[2][kHgAccs], const HalfGemmLane& me,
                                                      unsigned staging, const TensorMap& map_out, i64 m0, int n,
                                                      int h0, int w0, const Value& value) {
  static_assert(kPass == 32 || kPass == 64, "passes of whole column blocks of the m64n128 layout");
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int pass = 0; pass < 128 / kPass; ++pass) {
      TmaTileWriter::begin(me);
#pragma unroll
      for (int ii = 0; ii < kPass / 8; ++ii) {
        const int i = (kPass / 8) * pass + ii;  // the m64n128 layout's column block of 8
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int c = me.row + 8 * hi;  // the tile's channel (0 .. 63)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int p = 8 * ii + 2 * me.t + e;  // the pass's pixel
            const unsigned at = staging + (c >> 5) * (kPass * 128) + p * 128 +
                                (((((c & 31) >> 2) ^ (p & 7)) << 4) | (4 * (c & 3)));
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(at), "f"(value(acc[h][4 * i + 2 * hi + e], hi != 0))
                         : "memory");
          }
        }
      }
      if (TmaTileWriter::staged(me)) {
#pragma unroll
        for (int box = 0; box < 2; ++box)
          tma_store_4d(map_out, staging + box * (kPass * 128), static_cast<int>(m0) + 32 * box, w0 + kPass * pass,
                       h0 + h, n);
        bulk_commit();
      }
    }
}

// dx, the sums rounded to T (the input gradient of the reference's
// convolution in T), of Out: T, or float32 (a float32 T, or under autocast
// the float32 that autocast's cast of x hands back).
template <typename T, typename Out = T>
struct DgradStore {
  const TensorMap& map_dx;  // dx [N, H, W, Cin] channels-last, of Out
  i64 row_pairs, col_tiles;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) const {
    int n, h0, w0;
    window_tile(n0 / 256, row_pairs, col_tiles, n, h0, w0);
    if constexpr (sizeof(Out) == 4) {
      store_window_tile_f32(acc, me, staging, map_dx, m0, n, h0, w0,
                            [](float v, bool) { return to_float(from_float<T>(v)); });
    } else {
      static_assert(sizeof(Out) == sizeof(T), "dx of the product's dtype or float32");
      store_window_tile<T>(acc, me, staging, map_dx, m0, n, h0, w0, [](float v, bool) { return v; });
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane& me) const { TmaTileWriter::finish(me); }
};

// The chain's biases of a consumer thread's channels m0 + me.row and + 8
// (zeros past Cout), and relu(v + conv_bias) + bias for a sum v of the
// first (hi false) or the second.
struct WindowBiases {
  float cb[2], b[2];
  template <typename T>
  __device__ __forceinline__ WindowBiases(const T* conv_bias, const T* bias, i64 cout, i64 m0,
                                          const HalfGemmLane& me) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const i64 c = m0 + me.row + 8 * r;
      cb[r] = c < cout ? to_float(conv_bias[c]) : 0.0f;
      b[r] = bias && c < cout ? to_float(bias[c]) : 0.0f;
    }
  }
  __device__ __forceinline__ float operator()(float v, bool hi) const { return relu_keep_nan(v + cb[hi]) + b[hi]; }
  // As nn.Conv2d with its bias computes it under autocast to T:
  // relu(v + conv_bias) rounded to T, then + bias in float32.
  template <typename T>
  __device__ __forceinline__ float autocast(float v, bool hi) const {
    return relu_rounded<T>(v, cb[hi]) + b[hi];
  }
};

// What both window stores know of y and its tiles.  begin(): where the
// tile of 256 pixels from n0 lies (image n, output rows h0 and h0 + 1,
// from column w0), and the biases of the consumer thread's channels of the
// tile from channel m0.
template <typename T>
struct WindowTile {
  const T* conv_bias;
  const T* bias;  // or null
  i64 cout, out_rows, out_cols, row_pairs, col_tiles;
  __device__ __forceinline__ WindowBiases begin(const HalfGemmLane& me, i64 m0, i64 n0, int& n, int& h0,
                                                int& w0) const {
    window_tile(n0 / 256, row_pairs, col_tiles, n, h0, w0);
    return WindowBiases(conv_bias, bias, cout, m0, me);
  }
};

// y = relu(acc + conv_bias) + bias, rounded once, channels-last; for a
// float32 Out, from a float32 product (T = float, read as TF32) or under
// autocast (float32 biases and y), relu(acc + conv_bias) rounded to T, then
// + bias in float32 (WindowBiases::autocast).  With
// kMask (training) also relu's mask for the backward, bit i of word i / 32
// for y's element i in memory order (Cout a multiple of 32), set where
// relu(acc + conv_bias) rounded to T has a nonzero magnitude (as
// NhwcStore's).  A warp's 16 channels of a pixel are one 16-bit half of a
// mask word, OR-ed over the 8 lanes that hold them; a lane stores the
// halves of 4 pixels (every half is written: the mask is not zeroed
// first).
template <typename T, bool kMask, typename Out = T, int kF32Pass = 64>
struct WindowNhwcStore {
  const TensorMap& map_y;  // y [N, OH, OW, Cout] channels-last, of Out
  unsigned short* mask;    // kMask: the mask's words as 16-bit halves
  WindowTile<Out> tile;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) const {
    int n, h0, w0;
    const WindowBiases chain = tile.begin(me, m0, n0, n, h0, w0);
    if constexpr (sizeof(Out) == 4) {
      store_window_tile_f32<kF32Pass>(acc, me, staging, map_y, m0, n, h0, w0,
                            [&](float v, bool hi) { return chain.template autocast<T>(v, hi); });
    } else {
      store_window_tile<T>(acc, me, staging, map_y, m0, n, h0, w0, chain);
    }
    if constexpr (kMask) {
#pragma unroll
      for (int h = 0; h < 2; ++h) store_mask(acc[h], me, chain.cb, m0, n, h0 + h, w0);
    }
  }
  __device__ __forceinline__ void store_mask(const float (&a)[kHgAccs], const HalfGemmLane& me, const float (&cb)[2],
                                             i64 m0, int n, int oh, int w0) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = me.row >> 4;
    // This lane's pixel pairs w0 + 8 (g + 8 k) + 2 t (+ 1): the halves of
    // both pixels of a pair, the second's in the high 16 bits.
    unsigned pairs[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < kHgAccs / 4; ++i) {
      // Channels 16 warp + g (lo) and + 8 (hi) at pixels 8 i + 2 t (bit 0), + 1 (bit 1).
      const unsigned lo = nonzero_pair<T>(relu_keep_nan(a[4 * i] + cb[0]), relu_keep_nan(a[4 * i + 1] + cb[0]));
      const unsigned hi =
          nonzero_pair<T>(relu_keep_nan(a[4 * i + 2] + cb[1]), relu_keep_nan(a[4 * i + 3] + cb[1]));
      unsigned v = ((lo & 1u) | ((hi & 1u) << 8) | ((lo & 2u) << 15) | ((hi & 2u) << 23)) << g;
      // OR over the 8 lanes of this t (g = 0 .. 7): the pair's 16 channels.
      v |= __shfl_xor_sync(0xffffffffu, v, 4);
      v |= __shfl_xor_sync(0xffffffffu, v, 8);
      v |= __shfl_xor_sync(0xffffffffu, v, 16);
      if ((i & 7) == g) pairs[i >> 3] = v;
    }
    const i64 c = m0 + 16 * warp, cout = tile.cout, out_rows = tile.out_rows, out_cols = tile.out_cols;
    if (oh >= out_rows || c >= cout) return;
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const i64 ow = w0 + 8 * (g + 8 * k) + 2 * t + e;
        if (ow < out_cols)
          mask[(((static_cast<i64>(n) * out_rows + oh) * out_cols + ow) * cout + c) >> 4] =
              static_cast<unsigned short>(pairs[k] >> (16 * e));
      }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane& me) const { TmaTileWriter::finish(me); }
};

// A raw row [64 channels][kConvWindow columns] into a window [kConvWindow
// pixels][64 channels], 128-byte swizzled, by 8 x 8 blocks (8 channels x 8
// columns), by kHelperWarps warps: warp `helper` takes column chunks q =
// helper, + kHelperWarps, ..., each as two groups of four blocks, channel
// chunks j = 4 h + m (h = 0, 1), both groups' reads in flight before their
// writes.  Lane 8 m + l reads row l of block m (channel 8 j + l) and
// writes its row l transposed (pixel 8 q + l: 16 bytes at chunk j ^ l of
// the swizzle).  The reads' 8 rows of 272 bytes fall in distinct banks, as
// do the writes' 8 swizzled rows.
template <int kHelperWarps>
__device__ __forceinline__ void transpose_raw_row(unsigned raw, unsigned window, int helper, int lane) {
  const int m = lane >> 3, l = lane & 7;
  const unsigned src = raw + (8 * m + l) * (kConvWindow * 2), dst = window + l * 128;
  const unsigned chunk0 = (m ^ l) << 4, chunk1 = ((4 + m) ^ l) << 4;
#pragma unroll 2
  for (int q = helper; q < kConvWindow / 8; q += kHelperWarps) {
    unsigned lo[4], hi[4];
    ldmatrix_x4(src + 16 * q, lo);
    ldmatrix_x4(src + 32 * (kConvWindow * 2) + 16 * q, hi);
    stmatrix_x4_trans(dst + q * 1024 + chunk0, lo[0], lo[1], lo[2], lo[3]);
    stmatrix_x4_trans(dst + q * 1024 + chunk1, hi[0], hi[1], hi[2], hi[3]);
  }
}

// The same from half a raw row of float32 values, channels 32 half .. + 31
// ([32 channels][kConvWindow columns], rows of 544 bytes), each value
// rounded to T to nearest as it is transposed (autocast's cast of x): lane
// i of a warp loads the two values of its fragment of each 8 x 8 block
// (channel 8 m + i / 4 of the half, columns 8 q + 2 (i % 4), + 1; a warp's
// 64 words in two wavefronts), packs them rounded, and the half's four
// blocks of a column chunk go out as one of transpose_raw_row's groups.
template <int kHelperWarps, typename T>
__device__ __forceinline__ void convert_raw_half(unsigned raw, unsigned window, int half, int helper, int lane) {
  const int m = lane >> 3, l = lane & 7;
  const unsigned src = raw + ((lane >> 2) * kConvWindow + 2 * (lane & 3)) * 4, dst = window + l * 128;
  const unsigned chunk = ((4 * half + m) ^ l) << 4;
#pragma unroll 2
  for (int q = helper; q < kConvWindow / 8; q += kHelperWarps) {
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float lo, hi;
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                   : "=f"(lo), "=f"(hi)
                   : "r"(src + (8 * j * kConvWindow + 8 * q) * 4)
                   : "memory");
      w[j] = pack2<T>(lo, hi);
    }
    stmatrix_x4_trans(dst + q * 1024 + chunk, w[0], w[1], w[2], w[3]);
  }
}

// The same for a channels-last x: half a raw row of float32 values as x
// holds them, [kConvWindow columns][32 channels] (channels 32 half .. + 31),
// into the window's pixel rows, no transposition: each helper thread takes
// 8 channels of a column at a time (two 16-byte loads), rounds them to T
// and stores their 16 bytes at the column's chunk 4 half + g of the
// 128-byte swizzle.
template <int kHelperWarps, typename T>
__device__ __forceinline__ void convert_raw_half_nhwc(unsigned raw, unsigned window, int half, int helper,
                                                      int lane) {
  for (int item = 32 * helper + lane; item < kConvWindow * 4; item += 32 * kHelperWarps) {
    const int col = item >> 2, g = item & 3;
    const unsigned src = raw + col * 128 + g * 32;
    float v[8];
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                 : "r"(src)
                 : "memory");
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v[4]), "=f"(v[5]), "=f"(v[6]), "=f"(v[7])
                 : "r"(src + 16)
                 : "memory");
    st_shared_v4(window + col * 128 + (((4 * half + g) ^ (col & 7)) << 4), pack2<T>(v[0], v[1]),
                 pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
  }
}

// The windows from an NCHW `in` [N, C, H, W] (conv_bias_relu_nchw_window):
// the copy engine cannot shift a box of NCHW rows by one value (a box's
// first element must lie on the 16-byte grid), nor lay channels out
// innermost, so it brings each window's input row as it lies, 64 channels
// x kConvWindow columns (a "raw" row, unswizzled: rows of 272 bytes), into
// a ring of kRaw slots of the loader's own; the producer warpgroup's three
// other warps (help()) then transpose it into the stage's window, in the
// layout ConvWindowLoader's copies give (pixel rows of 64 channels,
// 128-byte swizzled), 8 x 8 blocks at a time (ldmatrix, then stmatrix
// .trans).  A stage's copies bring A's tiles alone.  The producer's thread
// issues the raw rows up to kRaw ahead of the stage it loads (kRaw >= 2: both
// rows of a stage are issued with its A tiles, or earlier).
constexpr int kConvRawBytes = 64 * kConvWindow * 2;
template <typename T, int kKw, int kRaw>
struct NchwWindowLoader : ConvWindowLoader<T, kKw>, RawRing<kRaw, 3> {
  static_assert(kRaw >= 2, "both raw rows of a stage issued with its A tiles");
  static constexpr int kHelperWarps = 3, kExtraBytes = kRaw * kConvRawBytes, kExtraBarriers = 2 * kRaw;
  using Ring = RawRing<kRaw, kHelperWarps>;
  // The base's A side as it is; its map_in: `in` [N, C, H, W] as dims (W, H,
  // C, N), boxes kConvWindow x 1 x 64 x 1, no swizzle; no padding.
  // The raw rows (the ring: RawRing), the stages loaded so far, the raw rows
  // issued, and the next one's tile (the block's raw_tile-th), its image,
  // rows and columns, kh, channel block and row r.
  using Ring::raws;
  using Ring::raw_full;
  using Ring::raw_empty;
  int loaded = 0, issued = 0;
  i64 raw_tile = 0;
  int raw_n = 0, raw_h0 = 0, raw_w0 = 0, raw_kh = 0, raw_cb = 0, raw_r = 0;
  __device__ __forceinline__ void attach(unsigned extra, unsigned loader_bars) {
    Ring::attach(extra, loader_bars);
    raw_tile = blockIdx.x;
    if (raw_tile < this->tiles_m() * this->tiles_n()) begin_raw_tile();
  }
  __device__ __forceinline__ void begin_raw_tile() {
    i64 tm, tn;
    grouped_tile_of(raw_tile, this->tiles_m(), this->tiles_n(), tm, tn);
    window_tile(tn, this->row_pairs, this->col_tiles, raw_n, raw_h0, raw_w0);
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned, unsigned bar, int) {
    this->load_a(tile_a, bar);
    this->next_stage();
    const int upto = 2 * loaded + kRaw;  // this stage's rows 2 loaded, + 1, and those after
    ++loaded;
    const i64 tiles = this->tiles_m() * this->tiles_n();
    while (issued < upto && raw_tile < tiles) issue_raw(tiles);
  }
  // The next raw row into its slot, once the helpers have read the slot's
  // previous row.
  __device__ __forceinline__ void issue_raw(i64 tiles) {
    const int slot = issued % kRaw;
    if (issued >= kRaw) mbar_wait(raw_empty(slot), ((issued / kRaw) - 1) & 1);
    mbar_arrive_expect_tx(raw_full(slot), kConvRawBytes);
    tma_load_4d(raws + slot * kConvRawBytes, this->map_in, raw_w0, raw_h0 + raw_kh + raw_r, raw_cb * 64, raw_n,
                raw_full(slot));
    ++issued;
    if (++raw_r == 2) {
      raw_r = 0;
      if (++raw_cb == this->c_blocks) {
        raw_cb = 0;
        if (++raw_kh == this->kh_size) {
          raw_kh = 0;
          raw_tile += gridDim.x;
          if (raw_tile < tiles) begin_raw_tile();
        }
      }
    }
  }
  // By the producer warpgroup's last kHelperWarps warps: for each stage the
  // block uses, its two raw rows transposed into its windows
  // (RawRing::help_stages).
  __device__ __forceinline__ void help(const StageRing& ring, i64 tiles, int ktiles) const {
    const int lane = threadIdx.x & 31, helper = (threadIdx.x >> 5) - (4 - kHelperWarps);
    Ring::template help_stages<2, kConvRawBytes>(ring, tiles, ktiles, [&](unsigned raw, int s, int r) {
      transpose_raw_row<kHelperWarps>(raw, ring.tile_b(s) + r * kConvWindowBytes, helper, lane);
    });
  }
};

// The NCHW forward with each input row transposed about once
// (conv_bias_relu_nchw_band; x of at most 64 channels, KH + 1 <= kWin).
// The NCHW window kernel above transposes each input row 1.5 times per
// tile (both rows of every stage) and again for every tile of 64 output
// channels.  Here a block takes a band of consecutive pixel tiles
// (band_of_block, in band_tile's order), each with all its tiles of output
// channels in turn (the engine's tiles (tm, tn), tm fastest: BandLoader's
// schedule), and the windows live in a ring of kWin slots of the loader's
// own, not in the stages, which carry A alone: a pixel tile's KH + 1 input
// rows are transposed once for all its tiles and stages, and the next
// pixel tile of the band, two output rows further down the same image and
// columns (but at a column strip's end), keeps KH - 1 of them.

// Pixel tiles first .. first + count - 1 of pixel_tiles: this block's band,
// the tiles shared out in order as evenly as the grid allows.
__device__ __forceinline__ void band_of_block(i64 pixel_tiles, i64& first, i64& count) {
  const i64 per = pixel_tiles / gridDim.x, extra = pixel_tiles % gridDim.x, b = blockIdx.x;
  first = b * per + min(b, extra);
  count = per + (b < extra ? 1 : 0);
}

// The band kernels' order of the pixel tiles: pixel tile p is image n,
// column strip w0 / 128 and row pair h0 / 2, the row pair fastest, so that
// the next pixel tile of a band lies two rows below in the same columns
// but at a strip's end, however wide the output (32-bit divisions, as
// window_tile's; the window kernels' order, which the stores decode, takes
// the columns fastest: window_index).
__device__ __forceinline__ void band_tile(i64 p, i64 row_pairs, i64 col_tiles, int& n, int& h0, int& w0) {
  const unsigned t = static_cast<unsigned>(p), pairs = static_cast<unsigned>(row_pairs);
  const unsigned strip = t / pairs, ct = static_cast<unsigned>(col_tiles);  // strip: n * col_tiles + w0 / 128
  h0 = 2 * static_cast<int>(t - strip * pairs);
  n = static_cast<int>(strip / ct);
  w0 = static_cast<int>(strip - static_cast<unsigned>(n) * ct) * 128;
}
// The window kernels' index (window_tile's tn) of the pixel tile at image
// n, rows h0, h0 + 1 and columns from w0.
__device__ __forceinline__ i64 window_index(int n, int h0, int w0, i64 row_pairs, i64 col_tiles) {
  return (static_cast<i64>(n) * row_pairs + h0 / 2) * col_tiles + w0 / 128;
}

// The input rows of a band's pixel tiles (band_tile's order), numbered in
// the order they are first needed: pixel tile p's rows h0 .. h0 + KH (row
// i of the tile: its stage kh reads rows kh and kh + 1) are numbers first
// .. first + KH, row number q in window slot q % kWin.  Where the next
// pixel tile lies two rows below in the same image and columns (KH >= 2:
// `shares`), its rows 0 .. KH - 2 are this tile's 2 .. KH, and its new
// rows KH - 1 and KH come next; otherwise all its KH + 1 rows are new.
struct BandRows {
  i64 row_pairs, col_tiles;
  int kh_size;
  i64 p = 0;
  int n = 0, h0 = 0, w0 = 0;
  unsigned first = 0;
  bool shares = false;
  __device__ __forceinline__ void start(i64 tile) {
    p = tile;
    first = 0;
    locate();
  }
  __device__ __forceinline__ void next() {
    first += shares ? 2u : static_cast<unsigned>(kh_size) + 1u;
    ++p;
    locate();
  }
  // On to the pixel tile whose window index is tn (this one or a later one).
  __device__ __forceinline__ void advance_to(i64 tn) {
    while (window_index(n, h0, w0, row_pairs, col_tiles) != tn) next();
  }
  __device__ __forceinline__ void locate() {
    band_tile(p, row_pairs, col_tiles, n, h0, w0);
    int n1, h1, w1;
    band_tile(p + 1, row_pairs, col_tiles, n1, h1, w1);
    shares = kh_size >= 2 && n1 == n && w1 == w0 && h1 == h0 + 2;
  }
};

// The ring of kWin slots of kRowWindows windows each (an input row's blocks
// of channels: one 16-bit block of 64, or kRowWindows float32 ones of 32)
// after kRaw raw slots of kRawBytes in a band loader's shared memory, and
// their "empty" barriers after the raw slots' barrier pairs, then, for a
// loader whose copies fill the windows themselves (no raw slots), their
// "full" ones: row number q's window of channel block cb and its barriers.
template <int kRaw, int kRawBytes, int kWin, int kRowWindows_ = 1>
struct BandWindows {
  static constexpr int kRowWindows = kRowWindows_, kRowBytes = kRowWindows * kConvWindowBytes;
  unsigned windows = 0, bars = 0;
  __device__ __forceinline__ void attach(unsigned extra, unsigned loader_bars) {
    windows = extra + kRaw * kRawBytes;
    bars = loader_bars + 8u * (2 * kRaw);
  }
  __device__ __forceinline__ unsigned window(unsigned q, int cb = 0) const {
    return windows + (q % kWin) * kRowBytes + cb * kConvWindowBytes;
  }
  __device__ __forceinline__ unsigned empty(unsigned q) const { return bars + 8u * (q % kWin); }
  __device__ __forceinline__ unsigned full(unsigned q) const { return bars + 8u * (kWin + q % kWin); }
};

// What every band loader adds to the window kernels' A side (one block of
// 64 input channels, no padding): the block's band of pixel tiles, each
// with all its tiles of output channels in turn (the engine's tiles (tm,
// tn), tm fastest: kOwnSchedule), and the two walks over the band's input
// rows (BandRows) that feed its windows.  A stage is one (kh, block of
// channels) as the window kernels' (kRowWindows blocks: k-tile kt is kh =
// kt >> shift(), block kt & (kRowWindows - 1), shift() 0 for one block).
// * The producer's (issue_rows, after each stage's A tiles): every row
//   first read by the stage after it, issue(q, rows, i) for row number q,
//   row i of the pixel tile `rows`, and the rows after those while early(q)
//   (the row's slot is free now).
// * The helpers' (help_band): the block's stages in order; at each stage of
//   a pixel tile's first tile of output channels that begins a kh, the rows
//   that stage reads first made ready (ready(q)), then an arrive on the
//   stage's "full" barrier (after its previous phase, so that it counts
//   towards this one).  Rows are kept from one pixel tile to the next
//   where the next lies two rows below (BandRows: within a column strip of
//   an image); a pixel tile that starts a strip brings its KH + 1 rows.
template <typename T, int kKw, int kRowWindows = 1>
struct BandBase : ConvWindowLoader<T, kKw> {
  static_assert(kRowWindows == 1 || kRowWindows == 2, "one or two blocks of channels a row");
  static constexpr bool kOwnSchedule = true;
  // The block's band; the producer's cursor (the stages loaded, the next
  // row: row raw_i of the pixel tile raw_rows, whose first stage is the
  // block's raw_base-th).
  i64 band_first = 0, band_count = 0;
  unsigned loaded = 0, raw_base = 0;
  int raw_i = 0;
  BandRows raw_rows{0, 0, 0};
  __device__ __forceinline__ int shift() const { return kRowWindows == 1 ? 0 : this->c_blocks - 1; }
  __device__ __forceinline__ i64 block_tiles() const { return band_count * this->tiles_m(); }
  // The block's j-th tile: tile tm of output channels of its band's
  // (j / tiles_m)-th pixel tile, whose window index (the engine's tn, which
  // the stores decode with window_tile) tn.
  __device__ __forceinline__ void block_tile(i64 j, i64& tm, i64& tn) const {
    const unsigned tms = static_cast<unsigned>(this->tiles_m()), jj = static_cast<unsigned>(j);
    const unsigned p = jj / tms;
    int n, h0, w0;
    band_tile(band_first + p, this->row_pairs, this->col_tiles, n, h0, w0);
    tn = window_index(n, h0, w0, this->row_pairs, this->col_tiles);
    tm = jj - p * tms;
  }
  __device__ __forceinline__ BandRows band_rows() const {
    BandRows rows{this->row_pairs, this->col_tiles, this->kh_size};
    rows.start(band_first);
    return rows;
  }
  template <typename Issue, typename Early>
  __device__ __forceinline__ void issue_rows(const Issue& issue, const Early& early) {
    const unsigned upto = ++loaded;  // rows first read by stages up to this one's next
    const int sh = shift();
    const unsigned tms = static_cast<unsigned>(this->tiles_m()), kh_size = static_cast<unsigned>(this->kh_size);
    while (raw_rows.p < band_first + band_count) {
      const unsigned q = raw_rows.first + raw_i;
      if (raw_base + (static_cast<unsigned>(raw_i > 1 ? raw_i - 1 : 0) << sh) > upto && !early(q)) break;
      issue(q, raw_rows, raw_i);
      if (++raw_i > this->kh_size) {
        const bool kept = raw_rows.shares;
        raw_rows.next();
        raw_base += (tms * kh_size) << sh;
        raw_i = kept ? this->kh_size - 1 : 0;
      }
    }
  }
  template <typename Ready>
  __device__ __forceinline__ void help_band(const StageRing& ring, const Ready& ready) const {
    const int lane = threadIdx.x & 31, sh = shift(), ktiles = this->kh_size << sh;
    const i64 tms = this->tiles_m();
    BandRows rows = band_rows();
    bool kept = false;  // whether this pixel tile kept rows of the one before
    unsigned it = 0;
    for (i64 pt = 0; pt < band_count; ++pt) {
      for (i64 m = 0; m < tms; ++m)
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
          const int kh = kt >> sh;
          if (m == 0 && (kt & ((1 << sh) - 1)) == 0) {
            // The rows stage kh reads first: 0 and 1 at kh 0, kh + 1 after;
            // new ones from row KH - 1 on where the tile kept rows.
#pragma unroll 1
            for (int i = kh == 0 ? 0 : kh + 1; i <= kh + 1; ++i) {
              if (kept && i < this->kh_size - 1) continue;
              ready(rows.first + i);
            }
          }
          const int s = static_cast<int>(it % ring.stages);
          if (it >= static_cast<unsigned>(ring.stages)) mbar_wait(ring.full(s), ((it / ring.stages) - 1) & 1);
          fence_proxy_async();  // the windows' writes, before the MMAs read them
          __syncwarp();
          if (lane == 0) mbar_arrive(ring.full(s));
        }
      kept = rows.shares;
      rows.next();
    }
  }
};

// The producer's copies, the helpers' transpositions and the windows' ring.
// The producer's thread, after a stage's A tiles, issues the raw rows (as
// NchwWindowLoader's: 64 channels x kConvWindow columns, into a ring of
// kRaw slots; a float32 row as two slots of 32 channels) of every row
// first read by the stage after it (at most two), waiting for a slot only
// on the helpers, who wait on nothing that needs later copies (the stage
// whose reads free their window slot has its A tiles), and the rows after
// those while their slots are free already.  The helpers
// (BandBase::help_band) transpose each row into its window slot once the
// consumers have released the slot's previous row (BandWindows::empty: an
// arrive by every consumer warp of each tile of output channels that read
// that row last).
template <typename T, int kKw, int kRaw, int kWin, typename Tin = T, bool kNhwcIn = false>
struct BandLoader : BandBase<T, kKw>, RawRing<kRaw, 3> {
  static_assert(kRaw >= 2, "a stage's new rows issued with the stage before it");
  static_assert(sizeof(Tin) == sizeof(T) || sizeof(Tin) == 4, "x of the product's dtype, or float32");
  static_assert(!kNhwcIn || sizeof(Tin) == 4, "a channels-last x of float32 (a 16-bit one: the window kernel)");
  // A raw slot holds a row's 64 channels of a 16-bit x, or half of them
  // (kRowUnits slots a row) of a float32 one: kConvRawBytes either way.
  static constexpr int kRowUnits = static_cast<int>(sizeof(Tin) / sizeof(T)), kUnitChannels = 64 / kRowUnits;
  static constexpr int kRawBytes = kUnitChannels * kConvWindow * static_cast<int>(sizeof(Tin));
  static_assert(kRawBytes == kConvRawBytes, "a raw slot's bytes");
  static constexpr int kHelperWarps = 3, kExtraBytes = kRaw * kRawBytes + kWin * kConvWindowBytes,
                       kExtraBarriers = 2 * kRaw + kWin;
  using Ring = RawRing<kRaw, kHelperWarps>;
  using Windows = BandWindows<kRaw, kRawBytes, kWin>;
  using Ring::raws;
  using Ring::raw_full;
  using Ring::raw_empty;
  // The base's A side as it is (one block of 64 input channels); its
  // map_in: `in` [N, C, H, W] of Tin as dims (W, H, C, N), boxes
  // kConvWindow x 1 x kUnitChannels x 1, no swizzle (a float32 `in`
  // rounded to T as its rows are transposed: convert_raw_half); with
  // kNhwcIn `in` channels-last of float32, dims (C, W, H, N), boxes 32 x
  // kConvWindow x 1 x 1, no swizzle (convert_raw_half_nhwc).  The windows'
  // slots and their barriers; the raw slots' uses so far.
  Windows wins;
  unsigned raw_q = 0;
  __device__ __forceinline__ void init_barriers(unsigned at) const {
    Ring::init_barriers(at);
    for (int slot = 0; slot < kWin; ++slot)
      mbar_init(at + 8u * (2 * kRaw + slot), 4 * static_cast<unsigned>(this->tiles_m()));
  }
  __device__ __forceinline__ void attach(unsigned extra, unsigned loader_bars) {
    Ring::attach(extra, loader_bars);
    wins.attach(extra, loader_bars);
    this->raw_rows = this->band_rows();
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned, unsigned bar, int) {
    this->load_a(tile_a, bar);
    this->next_stage();
    this->issue_rows([&](unsigned, const BandRows& rows, int i) {
#pragma unroll
      for (int u = 0; u < kRowUnits; ++u, ++raw_q) {  // (raw_q: the raw slots' uses, kRowUnits a row)
        const int slot = static_cast<int>(raw_q % kRaw);
        if (raw_q >= kRaw) mbar_wait(raw_empty(slot), ((raw_q / kRaw) - 1) & 1);
        mbar_arrive_expect_tx(raw_full(slot), kRawBytes);
        if constexpr (kNhwcIn) {
          tma_load_4d(raws + slot * kRawBytes, this->map_in, u * kUnitChannels, rows.w0, rows.h0 + i, rows.n,
                      raw_full(slot));
        } else {
          tma_load_4d(raws + slot * kRawBytes, this->map_in, rows.w0, rows.h0 + i, u * kUnitChannels, rows.n,
                      raw_full(slot));
        }
      }
    }, [&](unsigned) {
      // (a row's raw slots free now: the helpers have read their previous rows)
#pragma unroll
      for (int u = 0; u < kRowUnits; ++u) {
        const unsigned use = raw_q + u;
        if (use >= kRaw && !mbar_test(raw_empty(static_cast<int>(use % kRaw)), ((use / kRaw) - 1) & 1)) return false;
      }
      return true;
    });
  }
  // By the producer warpgroup's last kHelperWarps warps (above).
  __device__ __forceinline__ void help(const StageRing& ring, i64, int) const {
    const int lane = threadIdx.x & 31, helper = (threadIdx.x >> 5) - (4 - kHelperWarps);
    this->help_band(ring, [&](unsigned q) {
      if (q >= kWin) mbar_wait(wins.empty(q), ((q / kWin) - 1) & 1);
#pragma unroll
      for (int u = 0; u < kRowUnits; ++u) {
        const unsigned use = q * kRowUnits + u;  // the raw slots' use that brought it
        const int slot = static_cast<int>(use % kRaw);
        mbar_wait(raw_full(slot), (use / kRaw) & 1);
        if constexpr (kNhwcIn) {
          convert_raw_half_nhwc<kHelperWarps, T>(raws + slot * kRawBytes, wins.window(q), u, helper, lane);
        } else if constexpr (kRowUnits == 2) {
          convert_raw_half<kHelperWarps, T>(raws + slot * kRawBytes, wins.window(q), u, helper, lane);
        } else {
          transpose_raw_row<kHelperWarps>(raws + slot * kRawBytes, wins.window(q), helper, lane);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(raw_empty(slot));
      }
    });
  }
};

// A window of float32 values rounded to TF32 in place (to_tf32_keep_nan),
// by kHelperWarps warps: 16-byte vectors, four of a thread loaded before
// any is stored.
template <int kHelperWarps>
__device__ __forceinline__ void round_window_tf32(unsigned window, int helper, int lane) {
  constexpr int kVecs = kConvWindowBytes / 16, kThreads = 32 * kHelperWarps;
  for (int v0 = 32 * helper + lane; v0 < kVecs; v0 += 4 * kThreads) {
    unsigned w[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (v0 + j * kThreads < kVecs)
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[j][0]), "=r"(w[j][1]), "=r"(w[j][2]), "=r"(w[j][3])
                     : "r"(window + 16 * (v0 + j * kThreads))
                     : "memory");
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (v0 + j * kThreads < kVecs)
        st_shared_v4(window + 16 * (v0 + j * kThreads), to_tf32_keep_nan(__uint_as_float(w[j][0])),
                     to_tf32_keep_nan(__uint_as_float(w[j][1])), to_tf32_keep_nan(__uint_as_float(w[j][2])),
                     to_tf32_keep_nan(__uint_as_float(w[j][3])));
  }
}

// The band loader of a channels-last float32 x read as TF32
// (conv_bias_relu_tf32_band): a row's c_blocks blocks of 32 channels come
// from the copy engine straight into its window slot (boxes as the window
// kernel's, 128-byte swizzled), the producer waiting for the slot's
// release by the consumers first (BandWindows::empty; the stage that last
// reads the slot's previous row lies before the one the producer has just
// loaded, so that wait needs no later copy); the helpers round each row to
// TF32 in place once its copies have landed (BandWindows::full), as x's
// rounded copy rounds it, before the stages that read it.
template <int kKw, int kWin>
struct Tf32BandLoader : BandBase<float, kKw, 2> {
  static constexpr int kHelperWarps = 3, kExtraBytes = kWin * 2 * kConvWindowBytes, kExtraBarriers = 2 * kWin;
  using Windows = BandWindows<0, 0, kWin, 2>;
  Windows wins;
  __device__ __forceinline__ void init_barriers(unsigned at) const {
    for (int slot = 0; slot < kWin; ++slot) {
      mbar_init(at + 8u * slot, 4 * static_cast<unsigned>(this->tiles_m()));
      mbar_init(at + 8u * (kWin + slot), 1);
    }
  }
  __device__ __forceinline__ void attach(unsigned extra, unsigned loader_bars) {
    wins.attach(extra, loader_bars);
    this->raw_rows = this->band_rows();
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned, unsigned bar, int) {
    this->load_a(tile_a, bar);
    this->next_stage();
    this->issue_rows(
        [&](unsigned q, const BandRows& rows, int i) {
          if (q >= kWin) mbar_wait(wins.empty(q), ((q / kWin) - 1) & 1);
          mbar_arrive_expect_tx(wins.full(q), this->c_blocks * kConvWindowBytes);
          for (int cb = 0; cb < this->c_blocks; ++cb)
            tma_load_4d(wins.window(q, cb), this->map_in, cb * 32, rows.w0, rows.h0 + i, rows.n, wins.full(q));
        },
        [&](unsigned q) { return q < kWin || mbar_test(wins.empty(q), ((q / kWin) - 1) & 1); });
  }
  __device__ __forceinline__ void help(const StageRing& ring, i64, int) const {
    const int lane = threadIdx.x & 31, helper = (threadIdx.x >> 5) - (4 - kHelperWarps);
    this->help_band(ring, [&](unsigned q) {
      mbar_wait(wins.full(q), (q / kWin) & 1);
      for (int cb = 0; cb < this->c_blocks; ++cb) round_window_tf32<kHelperWarps>(wins.window(q, cb), helper, lane);
    });
  }
};

// window_mma_group with B from the window ring: stage kt of a tile (kh =
// kt >> shift, block cb of channels) reads the windows of block cb of its
// pixel tile's rows kh and kh + 1.  Once a warp's MMAs of a kh's last
// stage have completed (stage_done), its leader releases the rows it read
// for the last time in this tile: row kh, and at the last kh row KH too,
// but for rows 2 .. KH where the next pixel tile keeps them (its own
// stages release them).
template <typename T, int kKw, typename Windows>
struct BandWindowMma {
  static constexpr int kBM = 64, kBN = 256, kWgRows = 64;
  static constexpr bool kCooperative = false, kReadsLoaderExtras = true;
  static constexpr int kTileABytes = kKw * 64 * 128, kTileBBytes = 0;
  BandRows rows;
  i64 band_first;
  int shift;  // (0 where a row is one block of channels)
  Windows wins;
  __device__ __forceinline__ void attach(unsigned extra, unsigned loader_bars) {
    wins.attach(extra, loader_bars);
    rows.start(band_first);
  }
  __device__ __forceinline__ void begin_tile(i64, i64 tn) { rows.advance_to(tn); }
  __device__ __forceinline__ void end_tile(float (&)[2][kHgAccs]) {}
  __device__ __forceinline__ int sh() const { return Windows::kRowWindows == 1 ? 0 : shift; }
  __device__ __forceinline__ void issue(float (&acc)[2][kHgAccs], unsigned a, unsigned, int kt) const {
    const int kh = kt >> sh(), cb = kt & ((1 << sh()) - 1);
    const Swizzle128Desc sb0(wins.window(rows.first + kh, cb)), sb1(wins.window(rows.first + kh + 1, cb));
    window_mma_group<T, kKw>(acc, a, kt, [&](int r, int offset) { return (r ? sb1 : sb0).at(offset); });
  }
  __device__ __forceinline__ void stage_done(int kt) const {
    if ((kt & ((1 << sh()) - 1)) != (1 << sh()) - 1) return;  // not the kh's last block
    const int kh = kt >> sh(), kh_size = rows.kh_size;
    if (kh < 2 || !rows.shares) mbar_arrive(wins.empty(rows.first + kh));
    if (kh == kh_size - 1 && (kh_size < 2 || !rows.shares)) mbar_arrive(wins.empty(rows.first + kh_size));
  }
};

// A band kernel's loader (BandLoader or Tf32BandLoader, with its A side
// and this block's band).
template <typename Loader, typename T, int kKw>
__device__ __forceinline__ Loader band_loader(const TensorMap& map_x, const TensorMap& map_w, i64 n_images, i64 rows,
                                              i64 cols, i64 cout, i64 kh_size, i64 c_blocks = 1) {
  Loader loader{{window_loader<T, kKw>(map_x, map_w, n_images, rows, cols, cout, kh_size, c_blocks, 0, 0)}};
  band_of_block(loader.pixel_tiles, loader.band_first, loader.band_count);
  return loader;
}

// A band kernel's body: the engine with BandWindowMma on `loader`'s band,
// kStagingBytes of staging for `store`.
template <typename T, int kKw, int kStages, int kStagingBytes, typename Loader, typename Store>
__device__ __forceinline__ void run_bands(const Loader& loader, Store& store) {
  using Mma = BandWindowMma<T, kKw, typename Loader::Windows>;
  const Mma mma{{loader.row_pairs, loader.col_tiles, loader.kh_size}, loader.band_first, loader.shift()};
  extern __shared__ __align__(128) unsigned char conv_shared[];
  half_gemm_persistent<T, kStages, kStagingBytes, Mma>(reinterpret_cast<char*>(conv_shared), loader, store, mma);
}

// y [N, Cout, OH, OW] (NCHW) of Out: the 16-bit T = relu(acc + conv_bias)
// + bias rounded once, or under autocast float32, relu(acc + conv_bias)
// rounded to T, then + bias in float32: each half of a warpgroup's tile (64
// channels x one output row of 128 columns) staged channel-major as
// NchwStore stages its tile (stmatrix: rows of kConvStageRow values; for a
// float32 y relu's output, the bias from the table after the rows, added as
// NchwStore adds it), then written row by row by NchwStore's writer
// (`rows`: y, no mask).
// (The staging: 64 rows of kConvStageRow values a warpgroup, the last
// chunk's reads past the last row, and the bias table of a float32 y.)
constexpr int kWindowNchwStagingBytes = 2 * 18 * 1024;
static_assert(64 * kConvStageRow * 2 + kConvBiasBytes <= kWindowNchwStagingBytes / 2, "the rows and the table");
template <typename T, typename Out = T>
struct WindowNchwStore {
  NchwStore<T, Out, false> rows;
  WindowTile<Out> tile;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging) {
    int n, h0, w0;
    const WindowBiases chain = tile.begin(me, m0, n0, n, h0, w0);
    constexpr bool kBiasLater = NchwStore<T, Out, false>::kBiasLater;
    const unsigned table = kBiasLater ? staging + 64 * kConvStageRow * 2 : 0u;
    if constexpr (kBiasLater) rows.biases.begin(table, m0, me);
    const i64 cout = tile.cout, out_rows = tile.out_rows, out_cols = tile.out_cols;
    const int lane = threadIdx.x & 31, warp = me.row >> 4;
    const int tile_rows = static_cast<int>(min(static_cast<i64>(64), cout - m0));
    const int cols = static_cast<int>(min(static_cast<i64>(kHgBM), out_cols - w0));
    const i64 plane = out_rows * out_cols;
    const bool pairs =
        out_cols % 2 == 0 && (reinterpret_cast<unsigned long long>(rows.y) & (2 * sizeof(Out) - 1)) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      named_barrier(1 + me.wg, 128);  // every warp has written the previous half's rows
      if constexpr (kBiasLater) {
        stage_rows(acc[h], me, staging, [&](float v, bool hi) { return relu_keep_nan(v + chain.cb[hi]); });
      } else {
        stage_rows(acc[h], me, staging, chain);
      }
      named_barrier(1 + me.wg, 128);
      if (h0 + h >= out_rows) continue;
      Out* const row0 = rows.y + ((n * cout + m0) * out_rows + h0 + h) * out_cols + w0;
      if (pairs) {
        rows.template store_rows<true>(row0 + warp * plane, plane, lane, warp, tile_rows, cols, staging, table);
      } else {
        rows.template store_rows<false>(row0 + warp * plane, plane, lane, warp, tile_rows, cols, staging, table);
      }
      rows.store_last_chunk(row0, plane, tile_rows, cols, staging, table);
    }
  }
  // acc's 64 x 128 values, with the chain (value(v, hi): of the channel
  // me.row, + 8 where hi), into the staging rows (channel me.row's at row
  // me.row): lane 8 m + l addresses row l of matrix m, rows 16 warp + 8 (m
  // % 2) + l, columns 16 p + 8 (m / 2) of pair p.
  template <typename Value>
  __device__ __forceinline__ static void stage_rows(const float (&a)[kHgAccs], const HalfGemmLane& me,
                                                    unsigned staging, const Value& v) {
    const int lane = threadIdx.x & 31, warp = me.row >> 4, m = lane >> 3, l = lane & 7;
    const unsigned lane_addr =
        staging + 2 * ((16 * warp + 8 * (m & 1) + l) * kConvStageRow + kConvStageLead + 8 * (m >> 1));
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const int i = 2 * p;  // the m64n128 layout's column block of 8
      stmatrix_x4(lane_addr + 32 * p, pack2<T>(v(a[4 * i], false), v(a[4 * i + 1], false)),
                  pack2<T>(v(a[4 * i + 2], true), v(a[4 * i + 3], true)),
                  pack2<T>(v(a[4 * i + 4], false), v(a[4 * i + 5], false)),
                  pack2<T>(v(a[4 * i + 6], true), v(a[4 * i + 7], true)));
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane&) const {}
};
#endif

// A value of Tin as the transposes' T: itself, or rounded from float32 for
// a 16-bit T (autocast's cast); with kTf32, a float32 rounded to TF32 (the
// engine's float32 operand, rounded once here rather than truncated by the
// MMA), NaN kept.
template <typename T, bool kTf32, typename Tin>
__device__ __forceinline__ T tile_value(Tin v) {
  if constexpr (kTf32) {
    return __uint_as_float(to_tf32_keep_nan(v));
  } else if constexpr (sizeof(Tin) == sizeof(T)) {
    return v;  // (a copy keeps the dtype: Tin is T)
  } else {
    return from_float<T>(v);
  }
}

// One 64-channel x 64-column tile of image row (n, h) copied between NCHW
// [N, C, H, W] and channels-last [N, H, W, C] (kToNhwc: that way) through
// shared memory, so that both the reads and the writes are whole runs of a
// warp along the contiguous dim of their tensor.  blockIdx.x: (image row
// n * H + h) * column tiles + column tile; blockIdx.y: channel tile.
template <bool kToNhwc, bool kTf32, typename Tin, typename T>
__device__ __forceinline__ void transpose_tile(const Tin* __restrict__ src, T* __restrict__ dst, i64 C, i64 H,
                                               i64 W) {
  // +1: the transposed accesses of 4-byte words hit distinct banks (of
  // 16-bit ones, two lanes to a bank).
  __shared__ T tile[64][65];
  const i64 col_tiles = (W + 63) / 64;
  const i64 nh = blockIdx.x / col_tiles;  // n * H + h
  const i64 w0 = (blockIdx.x - nh * col_tiles) * 64, c0 = static_cast<i64>(blockIdx.y) * 64;
  const i64 n = nh / H, h = nh - n * H;
  const int tx = threadIdx.x & 63, ty = threadIdx.x >> 6;
#pragma unroll 4
  for (int i = ty; i < 64; i += 4) {
    const int ci = kToNhwc ? i : tx, wi = kToNhwc ? tx : i;
    const i64 c = c0 + ci, w = w0 + wi;
    if (c < C && w < W)
      tile[ci][wi] = tile_value<T, kTf32>(src[kToNhwc ? ((n * C + c) * H + h) * W + w : (nh * W + w) * C + c]);
  }
  __syncthreads();
#pragma unroll 4
  for (int i = ty; i < 64; i += 4) {
    const int ci = kToNhwc ? tx : i, wi = kToNhwc ? i : tx;
    const i64 c = c0 + ci, w = w0 + wi;
    if (c < C && w < W)
      dst[kToNhwc ? (nh * W + w) * C + c : ((n * C + c) * H + h) * W + w] = tile[ci][wi];
  }
}

// transpose_tile_vec's two rounds of one side of the copy, the block's 256
// lanes a vector each a round: the NCHW side (kNchwSide) 8 columns of one
// channel (8 lanes a channel's 64), the channels-last side 8 channels of one
// column (8 lanes a column's 64).  f(ci, wi, c, w): the vector at tile
// channel ci, column wi (c, w in the tensors), for those inside them.
template <bool kNchwSide, typename F>
__device__ __forceinline__ void each_vector(i64 c0, i64 w0, i64 C, i64 W, F f) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int id = static_cast<int>(threadIdx.x) + 256 * i, a = id >> 3, b = 8 * (id & 7);
    const int ci = kNchwSide ? a : b, wi = kNchwSide ? b : a;
    if (c0 + ci < C && w0 + wi < W) f(ci, wi, c0 + ci, w0 + wi);
  }
}

// 8 values from `from` to `to` (16-byte aligned), 16 bytes an access.
template <typename V>
__device__ __forceinline__ void copy_row8(V* to, const V* from) {
#pragma unroll
  for (int e = 0; e < static_cast<int>(sizeof(V)) / 2; ++e)
    reinterpret_cast<uint4*>(to)[e] = reinterpret_cast<const uint4*>(from)[e];
}

// transpose_tile for a 16-bit T, in vectors: C and W multiples of 8, both
// tensors 16-byte aligned (ops/conv_bias_relu.py: _vector_transposes).
// transpose_tile moves 2 bytes a lane each way, too few for a copy at the
// memory's bandwidth; here a lane moves 8 values of W of one channel on the
// NCHW side (16 bytes; 32 of a float32 Tin) and 8 channels of one column on
// the channels-last side (16 bytes), through a [64 w][64 c] tile of
// 128-byte rows whose 16-byte chunks are swizzled by (w / 8) % 8: the 8
// lanes that hold one column's 64 channels hit 8 distinct chunks, and so do
// the 8 lanes that hold one channel's 64 columns (their values e at rows
// 8j + e, j = 0 .. 7).  Grid as transpose_tile's.
template <bool kToNhwc, typename Tin, typename T>
__device__ __forceinline__ void transpose_tile_vec(const Tin* __restrict__ src, T* __restrict__ dst, i64 C,
                                                   i64 H, i64 W) {
  static_assert(sizeof(T) == 2 && (kToNhwc || sizeof(Tin) == 2), "16-bit copies (from float32 to NHWC too)");
  __shared__ __align__(16) unsigned short tile[64 * 64];
  const i64 col_tiles = (W + 63) / 64;
  const i64 nh = blockIdx.x / col_tiles;  // n * H + h
  const i64 w0 = (blockIdx.x - nh * col_tiles) * 64, c0 = static_cast<i64>(blockIdx.y) * 64;
  const i64 n = nh / H, h = nh - n * H;
  // Byte offset of (w, c) in the tile.
  auto at = [](int w, int c) { return w * 128 + ((((c >> 3) ^ (w >> 3)) & 7) << 4) + 2 * (c & 7); };
  auto word = [](T a) { return *reinterpret_cast<unsigned short*>(&a); };
  char* const bytes = reinterpret_cast<char*>(tile);
  if constexpr (kToNhwc) {
    each_vector<true>(c0, w0, C, W, [&](int ci, int wi, i64 c, i64 w) {
      __align__(16) Tin v[8];  // (copy_row8 moves it as 16-byte words)
      copy_row8(v, src + ((n * C + c) * H + h) * W + w);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        *reinterpret_cast<unsigned short*>(bytes + at(wi + e, ci)) = word(tile_value<T, false>(v[e]));
    });
    __syncthreads();
    each_vector<false>(c0, w0, C, W, [&](int ci, int wi, i64 c, i64 w) {
      copy_row8(dst + (nh * W + w) * C + c, reinterpret_cast<const T*>(bytes + at(wi, ci)));
    });
  } else {
    each_vector<false>(c0, w0, C, W, [&](int ci, int wi, i64 c, i64 w) {
      copy_row8(reinterpret_cast<T*>(bytes + at(wi, ci)), src + (nh * W + w) * C + c);
    });
    __syncthreads();
    each_vector<true>(c0, w0, C, W, [&](int ci, int wi, i64 c, i64 w) {
      unsigned u[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        u[k] = *reinterpret_cast<const unsigned short*>(bytes + at(wi + 2 * k, ci)) |
               static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(bytes + at(wi + 2 * k + 1, ci))) << 16;
      // (in PTX: as a uint4 assignment the compiler split it into 4-byte stores)
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst + ((n * C + c) * H + h) * W + w),
                   "r"(u[0]), "r"(u[1]), "r"(u[2]), "r"(u[3])
                   : "memory");
    });
  }
}

// x [N, C, H, W] (NCHW) of Tin -> xc [N, H, W, C] (channels-last) of T: the
// layout the convolution's loader reads (kTf32: float32 rounded to TF32),
// and cuDNN's native one for the training route's backward (dz and x).
// kVec: transpose_tile_vec (its conditions hold), else transpose_tile.
// Grid as transpose_tile's.
template <typename Tin, typename T, bool kTf32 = false, bool kVec = false>
__global__ void __launch_bounds__(256) nchw_to_nhwc(const Tin* __restrict__ x, T* __restrict__ xc, i64 C,
                                                    i64 H, i64 W) {
  if constexpr (kVec) {
    static_assert(!kTf32, "a 16-bit copy");
    transpose_tile_vec<true>(x, xc, C, H, W);
  } else {
    transpose_tile<true, kTf32>(x, xc, C, H, W);
  }
}

// xc = x rounded to TF32 (to_tf32_keep_nan), n4 16-byte vectors of 4
// float32 values (both 16-byte aligned): a channels-last float32 x as the
// engine reads it, rounded once here rather than truncated by the MMA (an
// NCHW x is rounded in its transposing copy instead).  Each thread takes
// kRoundVecs vectors 256 apart, all loaded before any is stored, for bytes
// in flight; blockDim.x 256, grid cdiv(n4, 256 kRoundVecs).
constexpr int kRoundVecs = 4;
__global__ void __launch_bounds__(256) round_to_tf32(const float4* __restrict__ x, float4* __restrict__ xc,
                                                     i64 n4) {
  const i64 first = static_cast<i64>(blockIdx.x) * (256 * kRoundVecs) + threadIdx.x;
  float4 v[kRoundVecs];
#pragma unroll
  for (int j = 0; j < kRoundVecs; ++j)
    if (first + 256 * j < n4) v[j] = x[first + 256 * j];
#pragma unroll
  for (int j = 0; j < kRoundVecs; ++j)
    if (first + 256 * j < n4)
      xc[first + 256 * j] = make_float4(__uint_as_float(to_tf32_keep_nan(v[j].x)),
                                        __uint_as_float(to_tf32_keep_nan(v[j].y)),
                                        __uint_as_float(to_tf32_keep_nan(v[j].z)),
                                        __uint_as_float(to_tf32_keep_nan(v[j].w)));
}

// xc [N, H, W, C] (channels-last) of T -> x [N, C, H, W] (NCHW): the
// training route's input gradient back in the input's layout.  kVec as for
// nchw_to_nhwc.
template <typename T, bool kVec = false>
__global__ void __launch_bounds__(256) nhwc_to_nchw(const T* __restrict__ xc, T* __restrict__ x, i64 C, i64 H,
                                                    i64 W) {
  if constexpr (kVec) {
    transpose_tile_vec<false>(xc, x, C, H, W);
  } else {
    transpose_tile<false, false>(xc, x, C, H, W);
  }
}

// y = relu(conv2d(x, W) + conv_bias) + bias: the implicit GEMM on the
// engine, from x channels-last [N, H, W, C] of T (C a multiple of 8: the
// caller's channels-last input, or a copy of it: nchw_to_nhwc's of an NCHW
// one, round_to_tf32's or a cast) to y NCHW (NchwStore: y and the biases
// of Out, T or float32 as under autocast; NchwStoreF32 for a float32 T,
// read as TF32, and y), or channels-last through map_y (kNhwcOut, Cout a
// multiple of 8: NhwcStore, Out = T, 16-bit; NhwcStoreF32, Out = float32:
// a float32 T, or a 16-bit one under autocast).  kMask:
// also relu's mask into `mask` (NchwStore, NchwStoreF32; the channels-last
// stores with Cout a multiple of 32), for a training step's backward; null
// otherwise.  map_x: dims (C, W, H, N), boxes hg_bk<T>() x 128 x 1 x 1,
// 128-byte swizzle; map_w: the weight as B [Cout, KH * KW * Cpad] of T
// (ops/conv_bias_relu.py), boxes hg_bk<T>() x 128; map_y: boxes of
// hg_bk<Out>() channels x 128 pixels.  Grid: at most one block per SM
// (persistent), kHgThreads threads, half_gemm_shared_bytes<kStages, the
// store's staging (kConvNhwcStagingBytes, kConvNchwStagingBytes or
// kConvF32StagingBytes)>() of dynamic shared memory.
template <typename T, int kStages, bool kNhwcOut, typename Out, bool kMask>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_bias_relu_wgmma(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                     const __grid_constant__ TensorMap map_y, Out* __restrict__ y, unsigned* __restrict__ mask,
                     const Out* __restrict__ conv_bias, const Out* __restrict__ bias, i64 n_images, i64 cout,
                     i64 out_rows, i64 out_cols, i64 kw_size, i64 c_blocks, i64 k_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char conv_shared[];
  const i64 col_tiles = (out_cols + kHgBM - 1) / kHgBM;
  const ConvLoader<T> loader{map_x, map_w, n_images, out_rows, col_tiles, cout, static_cast<int>(kw_size),
                             static_cast<int>(c_blocks), static_cast<int>(k_tiles)};
  const ConvBiases<Out> biases{conv_bias, bias, cout};
  if constexpr (kNhwcOut && sizeof(Out) == 4) {  // (a float32 product, or autocast's float32 biases and y)
    NhwcStoreF32<T, kMask> store{{map_y, biases, col_tiles, mask, out_cols, cout}};
    half_gemm_persistent<T, kStages, kConvNhwcStagingBytes>(reinterpret_cast<char*>(conv_shared), loader, store);
  } else if constexpr (sizeof(T) == 4) {
    static_assert(!kNhwcOut && sizeof(Out) == 4, "a float32 product: y of float32");
    NchwStoreF32<kMask> store{y, mask, biases, cout, out_rows, out_cols, col_tiles};
    half_gemm_persistent<T, kStages, kConvF32StagingBytes>(reinterpret_cast<char*>(conv_shared), loader, store);
  } else if constexpr (kNhwcOut) {
    static_assert(sizeof(Out) == sizeof(T), "a channels-last y has x's dtype or float32");
    NhwcStore<T, kMask> store{{map_y, biases, col_tiles, mask, out_cols, cout}};
    half_gemm_persistent<T, kStages, kConvNhwcStagingBytes>(reinterpret_cast<char*>(conv_shared), loader, store);
  } else {
    NchwStore<T, Out, kMask> store{y, mask, biases, cout, out_rows, out_cols, col_tiles};
    half_gemm_persistent<T, kStages, kConvNchwStagingBytes>(reinterpret_cast<char*>(conv_shared), loader, store);
  }
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A window kernel's body: the engine with ConvWindowMma on `loader`'s
// stages, kStagingBytes of staging for `store`.
template <typename T, int kKw, int kStages, int kStagingBytes, typename Loader, typename Store>
__device__ __forceinline__ void run_windows(const Loader& loader, Store& store) {
  static_assert(kKw >= 1 && kKw <= kConvWindow - 127, "a tile's taps inside its window");
  extern __shared__ __align__(128) unsigned char conv_shared[];
  half_gemm_persistent<T, kStages, kStagingBytes, ConvWindowMma<T, kKw>>(reinterpret_cast<char*>(conv_shared),
                                                                         loader, store);
}
#endif

// y [N, OH, OW, Cout] (channels-last) = relu(conv2d(x, W) + conv_bias) +
// bias from x [N, H, W, Cin] channels-last of T, 16-bit, or float32 rounded
// to TF32 (round_to_tf32's copy), read as TF32 (stride 1, no padding, a KH
// x kKw kernel): the window GEMM above (ConvWindowLoader, ConvWindowMma)
// and WindowNhwcStore; y and the biases of Out, T or float32 (a float32 T,
// or autocast's); with kMask, relu's mask into `mask` (Cout a multiple of
// 32; null otherwise).  map_x: dims (Cin, W, H, N), boxes hg_bk<T>() x
// kConvWindow x 1 x 1; map_w: the weight as [Cout, KH * kKw * Cpad]
// (ops/conv_bias_relu.py: _packed_weight), boxes of hg_bk<T>() x 64;
// map_y: dims (Cout, OW, OH, N), boxes 64 x 128 x 1 x 1 (float32: 32 x 64
// x 1 x 1); all 128-byte swizzled.
// Grid: at most one block per SM (persistent), kHgThreads threads,
// half_gemm_shared_bytes<kStages, kCtStagingBytes, the stage's bytes>() of
// dynamic shared memory.
template <typename T, int kKw, int kStages, bool kMask, typename Out = T>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_bias_relu_window(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                      const __grid_constant__ TensorMap map_y, unsigned short* __restrict__ mask,
                      const Out* __restrict__ conv_bias, const Out* __restrict__ bias, i64 n_images, i64 cout,
                      i64 out_rows, i64 out_cols, i64 kh_size, i64 c_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const auto loader =
      window_loader<T, kKw>(map_x, map_w, n_images, out_rows, out_cols, cout, kh_size, c_blocks, 0, 0);
  WindowNhwcStore<T, kMask, Out> store{
      map_y, mask, {conv_bias, bias, cout, out_rows, out_cols, loader.row_pairs, loader.col_tiles}};
  run_windows<T, kKw, kStages, kCtStagingBytes>(loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

// dx [N, H, W, Cin] (channels-last) of Out, the input gradient of the
// convolution (stride 1, no padding, a KH x kKw kernel) whose output
// gradient is dz [N, OH, OW, Cout] (channels-last) of T, 16-bit, or
// float32 rounded to TF32 (bias_relu's backward rounds it so), read as
// TF32: the window GEMM above with A = Wf, padded, and DgradStore; one
// rounding of float32 sums to T, dx of T or float32 (Out: a float32 T, or
// a 16-bit one under autocast).  map_dz: dims (Cout, OW, OH, N), boxes
// hg_bk<T>() x kConvWindow x 1 x 1; map_w: Wf as [Cin, KH * kKw * Cpad]
// (Cout padded with zeros to Cpad, a multiple of hg_bk<T>();
// ops/conv_bias_relu.py), boxes of hg_bk<T>() x 64; map_dx: dims (Cin, W,
// H, N), boxes 64 x 128 x 1 x 1 (float32: 32 x 64 x 1 x 1); all 128-byte
// swizzled.  Grid, threads and shared memory as conv_bias_relu_window's.
template <typename T, int kKw, int kStages, typename Out = T>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_dgrad_wgmma(const __grid_constant__ TensorMap map_dz, const __grid_constant__ TensorMap map_w,
                 const __grid_constant__ TensorMap map_dx, i64 n_images, i64 cin, i64 rows, i64 cols,
                 i64 kh_size, i64 c_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const auto loader = window_loader<T, kKw>(map_dz, map_w, n_images, rows, cols, cin, kh_size, c_blocks,
                                            static_cast<int>(kh_size) - 1, kKw - 1);
  DgradStore<T, Out> store{map_dx, loader.row_pairs, loader.col_tiles};
  run_windows<T, kKw, kStages, kCtStagingBytes>(loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

// y [N, Cout, OH, OW] (NCHW) of the 16-bit T = relu(conv2d(x, W) +
// conv_bias) + bias from x [N, Cin, H, W] NCHW (stride 1, no padding, a KH x
// kKw kernel), with no copy of x: the window GEMM above, its windows
// transposed from x's rows in shared memory (NchwWindowLoader, kRaw raw
// rows in flight), and WindowNchwStore.  map_x: dims (W, H, Cin, N), boxes
// kConvWindow x 1 x 64 x 1, no swizzle (W a multiple of 8, x 16-byte
// aligned); map_w as conv_bias_relu_window's.  Grid: at most one block per
// SM (persistent), kHgThreads threads, half_gemm_shared_bytes<kStages,
// kWindowNchwStagingBytes, the stage's bytes, the raw rows' bytes, 2
// kRaw>() of dynamic shared memory.
template <typename T, int kKw, int kStages, int kRaw>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_bias_relu_nchw_window(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                           T* __restrict__ y, const T* __restrict__ conv_bias, const T* __restrict__ bias,
                           i64 n_images, i64 cout, i64 out_rows, i64 out_cols, i64 kh_size, i64 c_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const NchwWindowLoader<T, kKw, kRaw> loader{
      window_loader<T, kKw>(map_x, map_w, n_images, out_rows, out_cols, cout, kh_size, c_blocks, 0, 0)};
  WindowNchwStore<T> store{{y, nullptr, {conv_bias, bias, cout}, cout, out_rows, out_cols, loader.col_tiles},
                           {conv_bias, bias, cout, out_rows, out_cols, loader.row_pairs, loader.col_tiles}};
  run_windows<T, kKw, kStages, kWindowNchwStagingBytes>(loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}


// conv_bias_relu_nchw_window's y from x [N, Cin, H, W] NCHW with Cin <= 64
// and KH + 1 <= kWin, each input row transposed about once (above:
// BandLoader, BandWindowMma, kRaw raw rows and kWin windows), the same
// sums in the same order; or under autocast (Tin and Out float32) from a
// float32 x, each value rounded to T as it is transposed (as autocast's
// cast of x rounds it), y = relu(conv2d + conv_bias) rounded to T, then +
// bias in float32 (float32 biases and y).  Arguments as
// conv_bias_relu_nchw_window's (one block of input channels; map_x of
// Tin).  Grid: at most one block per SM and per pixel tile (persistent),
// kHgThreads threads, half_gemm_shared_bytes<kStages,
// kWindowNchwStagingBytes, A's tiles, the raw rows' and windows' bytes, 2
// kRaw + kWin>() of dynamic shared memory.
template <typename T, int kKw, int kStages, int kRaw, int kWin, typename Tin = T, typename Out = T>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_bias_relu_nchw_band(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                         Out* __restrict__ y, const Out* __restrict__ conv_bias, const Out* __restrict__ bias,
                         i64 n_images, i64 cout, i64 out_rows, i64 out_cols, i64 kh_size) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(Tin) == sizeof(Out), "x and y of T, or both float32 (autocast)");
  const auto loader = band_loader<BandLoader<T, kKw, kRaw, kWin, Tin>, T, kKw>(map_x, map_w, n_images, out_rows,
                                                                                out_cols, cout, kh_size);
  WindowNchwStore<T, Out> store{{y, nullptr, {conv_bias, bias, cout}, cout, out_rows, out_cols, loader.col_tiles},
                                {conv_bias, bias, cout, out_rows, out_cols, loader.row_pairs, loader.col_tiles}};
  run_bands<T, kKw, kStages, kWindowNchwStagingBytes>(loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

// conv_bias_relu_window's y under autocast (float32 x, biases and y: Out =
// float) from a channels-last x of at most 64 channels with KH + 1 <= kWin,
// read as it is: the band kernel above with the raw rows of x converted to
// T once per row (BandLoader<..., kNhwcIn>), and WindowNhwcStore's
// float32 y, bitwise that of x's cast and the window kernel.  Arguments as
// conv_bias_relu_window's without the mask (map_x: float32 x, boxes of 32
// channels x kConvWindow columns, no swizzle).  Grid and threads as
// conv_bias_relu_nchw_band's; half_gemm_shared_bytes<kStages,
// kCtStagingBytes, A's tiles, the raw rows' and windows' bytes, 2 kRaw +
// kWin>() of dynamic shared memory.
template <typename T, int kKw, int kStages, int kRaw, int kWin>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_bias_relu_nhwc_band(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                         const __grid_constant__ TensorMap map_y, const float* __restrict__ conv_bias,
                         const float* __restrict__ bias, i64 n_images, i64 cout, i64 out_rows, i64 out_cols,
                         i64 kh_size) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const auto loader =
      band_loader<BandLoader<T, kKw, kRaw, kWin, float, true>, T, kKw>(map_x, map_w, n_images, out_rows, out_cols,
                                                                       cout, kh_size);
  WindowNhwcStore<T, false, float> store{
      map_y, nullptr, {conv_bias, bias, cout, out_rows, out_cols, loader.row_pairs, loader.col_tiles}};
  run_bands<T, kKw, kStages, kCtStagingBytes>(loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

// conv_bias_relu_window's float32 y (and, with kMask, relu's mask) from a
// channels-last float32 x of at most 64 channels with KH + 1 <= kWin, read
// as TF32 with no rounded copy of it: the band kernel's bands and windows,
// each row's windows brought by the copy engine and rounded to TF32 in
// place once (Tf32BandLoader), the same sums in the same order as the
// window kernel's on x's rounded copy, y staged in passes of 32 columns
// (half the window kernel's staging, so that three stages fit at KW 3).
// Arguments as conv_bias_relu_window's (map_x: x itself, boxes of 32
// channels x kConvWindow columns, 128-byte swizzled; map_y: boxes of 32
// channels x 32 columns; c_blocks 1 or 2).  Grid and threads as
// conv_bias_relu_nchw_band's; half_gemm_shared_bytes<kStages,
// kCtStagingBytes / 2, A's tiles, the windows' bytes, 2 kWin>() of dynamic
// shared memory.
template <int kKw, int kStages, int kWin, bool kMask>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_bias_relu_tf32_band(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                         const __grid_constant__ TensorMap map_y, unsigned short* __restrict__ mask,
                         const float* __restrict__ conv_bias, const float* __restrict__ bias, i64 n_images,
                         i64 cout, i64 out_rows, i64 out_cols, i64 kh_size, i64 c_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const auto loader = band_loader<Tf32BandLoader<kKw, kWin>, float, kKw>(map_x, map_w, n_images, out_rows,
                                                                          out_cols, cout, kh_size, c_blocks);
  WindowNhwcStore<float, kMask, float, 32> store{
      map_y, mask, {conv_bias, bias, cout, out_rows, out_cols, loader.row_pairs, loader.col_tiles}};
  run_bands<float, kKw, kStages, kCtStagingBytes / 2>(loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

// ---- The weight gradient (conv_wgrad_wgmma, conv_wgrad_reduce) ----
// dW[co, ci, kh, kw] = the sum over output pixels (n, oh, ow) of dz[n, oh,
// ow, co] x[n, oh + kh, ow + kw, ci]: for each tap a product dz^T x_tap, k
// the output pixels, both operands MN-major (channels contiguous), as a
// linear layer's dZ^T x.  x_tap is x seen from its column kw on through a
// tensor map of its own, OW columns wide, so that its boxes clip where dz's
// do: a k-tile's columns past an output row are zeros in both operands.
// (One window of x shared by a row's taps, as the forward's, would meet
// dz's zeros there with values of x, and 0 x inf is a NaN where the
// reference adds nothing.)
// C [Cout, cols]: cols = KH * KW * c_blocks blocks of 64 input channels,
// col = (kh KW + kw) c_blocks + cb.  An output tile is 128 channels of dz by
// kTb such blocks (B's kTb boxes; past the last block, the last again, whose
// columns the reduction drops), both consumer warpgroups on it, each on 64
// of the channels (WgradMma).  A k-tile is 64 columns of one output row, the
// k-tiles in (n, oh, column block) order, cut into `splits` runs of ksplit
// (the last run's tail past the last image: zeros): the engine's tile (tm,
// tn) is run tn / col_tiles of output tile (tm, tn % col_tiles), its float32
// sums stored into partials[run], which conv_wgrad_reduce adds in run order
// (no atomics: the same bits every call).
constexpr int kWgradMaxKw = 7;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
struct WgradTaps {
  const TensorMap* x[kWgradMaxKw];
};

template <typename T, int kTb>
struct WgradLoader {
  const TensorMap& map_dz;  // dz [N, OH, OW, Cout]: dims (Cout, OW, OH, N), boxes 64 x 64 x 1 x 1
  WgradTaps taps;           // x [N, H, W, Cin] from column kw on: dims (Cin, OW, H, N), boxes 64 x 64 x 1 x 1
  i64 cout, col_tiles, splits;
  int cols, kw_size, c_blocks, out_rows, col_blocks, ksplit;
  int co0 = 0, n = 0, oh = 0, cb_ow = 0;  // the tile's first channel of dz; the next k-tile's place
  // The tile's boxes of x: their map (tap kw), first channel and row offset (kh).
  const TensorMap* box_map[kTb];
  int box_c[kTb], box_kh[kTb];
  __device__ __forceinline__ i64 tiles_m() const { return (cout + 127) / 128; }
  __device__ __forceinline__ i64 tiles_n() const { return col_tiles * splits; }
  __device__ __forceinline__ int ktiles() const { return ksplit; }
  __device__ __forceinline__ void prefetch() const {
    tma_prefetch_descriptor(map_dz);
    for (int kw = 0; kw < kw_size; ++kw) tma_prefetch_descriptor(*taps.x[kw]);
  }
  // (The boxes' taps decoded here, once a tile: the producer's one thread
  // issues every copy, and a division per box and k-tile would set its pace.)
  __device__ __forceinline__ void begin_tile(i64 tm, i64 tn) {
    co0 = static_cast<int>(tm) * 128;
    const i64 run = tn / col_tiles;
    const int col0 = kTb * static_cast<int>(tn - run * col_tiles);
#pragma unroll
    for (int box = 0; box < kTb; ++box) {
      const int col = min(col0 + box, cols - 1), tap = col / c_blocks, cb = col - tap * c_blocks;
      const int kh = tap / kw_size;
      box_map[box] = taps.x[tap - kh * kw_size];
      box_c[box] = 64 * cb;
      box_kh[box] = kh;
    }
    const i64 first = run * ksplit, row = first / col_blocks;  // row: n * OH + oh
    cb_ow = static_cast<int>(first - row * col_blocks);
    n = static_cast<int>(row / out_rows);
    oh = static_cast<int>(row - static_cast<i64>(n) * out_rows);
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned tile_b, unsigned bar, int) {
    const int ow0 = 64 * cb_ow;
    tma_load_4d(tile_a, map_dz, co0, ow0, oh, n, bar);
    tma_load_4d(tile_a + kMnBoxBytes, map_dz, co0 + 64, ow0, oh, n, bar);
#pragma unroll
    for (int box = 0; box < kTb; ++box)
      tma_load_4d(tile_b + box * kMnBoxBytes, *box_map[box], box_c[box], ow0, oh + box_kh[box], n, bar);
    if (++cb_ow == col_blocks) {
      cb_ow = 0;
      if (++oh == out_rows) {
        oh = 0;
        ++n;
      }
    }
  }
};

// Both consumer warpgroups on each tile, warpgroup w on dz's channels 64 w
// .. + 63 (its A box): per step of 16 values of k, the tile's kTb blocks of
// 64 columns as wgmma.m64n128 pairs into acc[0] (blocks 0, 1) and acc[1]
// (2, 3), an odd last block as an m64n64 (acc[h]'s first 32 values).
template <typename T, int kTb>
struct WgradMma : TilelessMma {
  static_assert(kTb >= 1 && kTb <= 4, "up to four 64-column blocks a tile");
  static constexpr int kBM = 128, kBN = 64 * kTb, kWgRows = 64;
  static constexpr bool kCooperative = true;
  static constexpr int kTileABytes = 2 * kMnBoxBytes, kTileBBytes = kTb * kMnBoxBytes;
  __device__ __forceinline__ void issue(float (&acc)[2][kHgAccs], unsigned a, unsigned b, int kt) const {
    const int wg = consumer_warpgroup();
    const Swizzle128Desc sa(a + wg * kMnBoxBytes, kMnBoxBytes), sb(b, kMnBoxBytes);
    begin_mma_group(acc);
#pragma unroll
    for (int kk = 0; kk < kHgSteps; ++kk) {
      const unsigned long long da = sa.at(2048 * kk);
#pragma unroll
      for (int h = 0; h < (kTb + 1) / 2; ++h) {
        const unsigned long long db = sb.at(2 * h * kMnBoxBytes + 2048 * kk);
        if (2 * h + 1 < kTb) {
          wgmma_m64n128_step<T, 1, 1>(acc[h], da, db, kt > 0 || kk > 0);
        } else {
          wgmma_m64n64_step<T, 1, 1>(acc[h], da, db, kt > 0 || kk > 0);
        }
      }
    }
    wgmma_commit();
  }
};

// A consumer warpgroup's float32 sums into partials [splits * mpad, npad]
// (mpad = 128 tiles_m, npad = 64 kTb col_tiles): run tn / col_tiles's rows
// m0 .. m0 + 63, output tile tn % col_tiles's columns.
template <int kTb>
struct WgradPartialStore {
  float* partials;
  i64 col_tiles, mpad, npad;
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned) const {
    const i64 tn = n0 / (64 * kTb), run = tn / col_tiles;
    float* const base = partials + (run * mpad + m0) * npad + (tn - run * col_tiles) * (64 * kTb) + 2 * me.t;
#pragma unroll
    for (int h = 0; h < (kTb + 1) / 2; ++h)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float* const row = base + (me.row + 8 * hh) * npad + 128 * h;
#pragma unroll
        for (int i = 0; i < (2 * h + 1 < kTb ? 16 : 8); ++i)
          *reinterpret_cast<float2*>(row + 8 * i) = make_float2(acc[h][4 * i + 2 * hh], acc[h][4 * i + 2 * hh + 1]);
      }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane&) const {}
};
#endif

// The runs' float32 sums of the weight gradient (above) of the convolution
// whose output gradient is dz [N, OH, OW, Cout] and input x [N, H, W, Cin],
// both channels-last of the 16-bit T (stride 1, no padding, a KH x KW
// kernel, KW <= kWgradMaxKw): map_dz as WgradLoader's, map_x0 ..
// map_x{KW-1} x seen from column kw on (the others any valid map), into
// partials [splits * 128 ceil(Cout / 128), 64 kTb ceil(cols / kTb)] of
// float32.  Grid: at most one block per SM (persistent), kHgThreads
// threads, half_gemm_shared_bytes<kStages, 0, (2 + kTb) 8 KiB>() of
// dynamic shared memory.
template <typename T, int kTb, int kStages>
__global__ void __launch_bounds__(kHgThreads, 1)
conv_wgrad_wgmma(const __grid_constant__ TensorMap map_dz, const __grid_constant__ TensorMap map_x0,
                 const __grid_constant__ TensorMap map_x1, const __grid_constant__ TensorMap map_x2,
                 const __grid_constant__ TensorMap map_x3, const __grid_constant__ TensorMap map_x4,
                 const __grid_constant__ TensorMap map_x5, const __grid_constant__ TensorMap map_x6,
                 float* __restrict__ partials, i64 cout, i64 cols, i64 kw_size, i64 c_blocks, i64 out_rows,
                 i64 col_blocks, i64 splits, i64 ksplit) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char conv_shared[];
  const i64 col_tiles = (cols + kTb - 1) / kTb;
  const WgradLoader<T, kTb> loader{map_dz,
                                   {{&map_x0, &map_x1, &map_x2, &map_x3, &map_x4, &map_x5, &map_x6}},
                                   cout,
                                   col_tiles,
                                   splits,
                                   static_cast<int>(cols),
                                   static_cast<int>(kw_size),
                                   static_cast<int>(c_blocks),
                                   static_cast<int>(out_rows),
                                   static_cast<int>(col_blocks),
                                   static_cast<int>(ksplit)};
  WgradPartialStore<kTb> store{partials, col_tiles, 128 * loader.tiles_m(), 64 * kTb * col_tiles};
  half_gemm_persistent<T, kStages, 0, WgradMma<T, kTb>>(reinterpret_cast<char*>(conv_shared), loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

// dw [Cout, Cin, KH, KW] of T: conv_wgrad_wgmma's runs added in run order
// (float32), rounded once.  Thread i takes partials' column c = i % npad
// of row co = i / npad in every run (the runs' reads coalesced); a column
// past the last block or Cin writes nothing.  Grid: ceil(Cout npad / 256)
// blocks of 256 threads.
template <typename T>
__global__ void __launch_bounds__(256) conv_wgrad_reduce(const float* __restrict__ partials, T* __restrict__ dw,
                                                         i64 splits, i64 mpad, i64 npad, i64 cout, i64 cin,
                                                         i64 kh_size, i64 kw_size, i64 c_blocks) {
  const i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const i64 co = i / npad, c = i - co * npad;
  const i64 col = c / 64, tap = col / c_blocks, ci = (col - tap * c_blocks) * 64 + c % 64;
  if (co >= cout || tap >= kh_size * kw_size || ci >= cin) return;
  float sum = 0.0f;
  for (i64 s = 0; s < splits; ++s) sum += partials[(s * mpad + co) * npad + c];
  const i64 kh = tap / kw_size;
  dw[((co * cin + ci) * kh_size + kh) * kw_size + (tap - kh * kw_size)] = from_float<T>(sum);
}

}  // namespace cf
