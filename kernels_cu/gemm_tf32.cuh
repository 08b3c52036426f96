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
// fold costs 4 adds per fragment per chunk.  Chunk 16: the longest that keeps
// the models within eager's error (docs/gemm.md, "Chunk length: accuracy
// against speed").
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
#include "gemm.cuh"

namespace cf {

constexpr int kGemmThreads = 256;
constexpr int kGemmBK = 32;
constexpr int kChunkK = 16;  // k-values per MMA accumulator chunk
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
  // `tid` in [0, kGemmThreads): the threads sharing the load.
  template <bool kVec>
  __device__ __forceinline__ static void load(float* tile, const float* g, i64 ld, i64 extent,
                                              i64 K, i64 mn0, i64 k0, int tid) {
    // 4-float chunks: K-major rows hold 32/4 chunks, MN-major rows kExtent/4.
    constexpr int kChunksPerRow = (kKMajor ? kGemmBK : kExtent) / 4;
    constexpr int kChunks = (kKMajor ? kExtent : kGemmBK) * kChunksPerRow;
    static_assert(kChunks % kGemmThreads == 0 && kGemmThreads % kChunksPerRow == 0,
                  "tile must split evenly over the loading threads, in whole rows");
    // Pass j covers rows r0 + j * kRowsPerPass: the addresses are computed
    // once and stepped (this runs for every k-tile, and address arithmetic
    // per copy would outnumber the copies' issue slots).
    constexpr int kRowsPerPass = kGemmThreads / kChunksPerRow;
    const int r0 = tid / kChunksPerRow, c4 = (tid % kChunksPerRow) * 4;
    // (row index, contiguous index) in the operand's memory order
    const i64 outer0 = (kKMajor ? mn0 : k0) + r0, inner = (kKMajor ? k0 : mn0) + c4;
    const i64 outer_end = kKMajor ? extent : K, inner_end = kKMajor ? K : extent;
    const float* const src = g + outer0 * ld + inner;
    const i64 pass_stride = kRowsPerPass * ld;
    const unsigned dst0 = shared_addr(tile) + 4u * static_cast<unsigned>(r0 * kStride + c4);
#pragma unroll
    for (int j = 0; j < kChunks / kGemmThreads; ++j) {
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
// first NaN partial sum (NaN is final).  Reads the raw operands (B itself,
// also where its split image feeds the MMAs).  Out of line: it runs
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

// ===========================================================================
// Hopper: the same split products on the GEMM engine (gemm.cuh,
// half_gemm_persistent), with Tf32SplitMma as its Mma policy.  A stays
// float32 as it lies in memory, read by the copy engine through a tensor
// map, and is split in the consumers' registers.  B's parts come into each
// stage as planes: for a 128-column tile of N and a 32-deep k-tile,
// kPasses == 3 ? 2 : 1 planes of its TF32 parts (big, small), 16 KiB each:
// 128 rows of n x 128 bytes, the 16-byte chunk c of row n at (c ^ n % 8) *
// 16 (the 128-byte swizzle the MMAs read), position j of each 8 values
// holding k-value image_k_of(j): 0, 2, 4, 6, 1, 3, 5, 7 (the k order of
// the mma.sync kernel's fragments: MMA k t, t + 4 <-> k 2t, 2t + 1), out-of-range columns and k
// zero.  Either B is split beforehand (PlanesLoader): its split image
// (gemm_tf32_split_image in gemm_tf32.cu) holds every tile's planes, tile
// j and k-tile t at float offset (j * k_tiles + t) * split_tile_floats,
// one contiguous copy a stage; or it is split in the kernel
// (SplittingLoader), by the producer warpgroup's idle warps, from raw tiles
// the copy engine brings.
__host__ __device__ constexpr int image_k_of(int j) { return j < 4 ? 2 * j : 2 * (j - 4) + 1; }
// One plane of a split tile: 128 columns x 32 values of k.
constexpr int kPlaneFloats = kHgBN * kGemmBK;
// The byte offset, in column n's 128-byte row of a plane, of the 16-byte
// chunk holding its k-values 8 st + 4 h .. 8 st + 4 h + 3 (h = 0, 1) in the
// image's order: the 128-byte swizzle the MMAs read.  The in-kernel split
// and the split image write the same layout through it.
__host__ __device__ constexpr int plane_chunk(int n, int st, int h) { return ((2 * st + h) ^ (n & 7)) << 4; }
// The split of a column's k-values 8 st .. 8 st + 7 (value(q): the one at
// 8 st + q), in the image's order.
template <int kPasses, typename Value>
__device__ __forceinline__ Split<kPasses, 8> split_step(const Value& value) {
  Split<kPasses, 8> part;
#pragma unroll
  for (int j = 0; j < 8; ++j) part.set(j, value(image_k_of(j)));
  return part;
}
template <int kPasses>
__host__ __device__ constexpr int split_tile_floats() { return (kPasses == 3 ? 2 : 1) * kPlaneFloats; }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// What the engine's loaders of a split product share: 128 x 128 tiles of C,
// k-tiles of 32, and A [M, K] through map_a (K-major: one box of 128 rows x
// 32 values of k, 128-byte swizzled; kAMn, A as its transpose [K, M]: four
// boxes of 32 rows of k x 32 values of m, side by side in m).
template <bool kAMn>
struct SplitLoaderBase {
  const TensorMap& map_a;
  i64 M, N, K;
  int m0 = 0;
  __device__ __forceinline__ SplitLoaderBase(const TensorMap& a, i64 m, i64 n, i64 k) : map_a(a), M(m), N(n), K(k) {}
  __device__ __forceinline__ i64 tiles_m() const { return (M + kHgBM - 1) / kHgBM; }
  __device__ __forceinline__ i64 tiles_n() const { return (N + kHgBN - 1) / kHgBN; }
  __device__ __forceinline__ int ktiles() const { return static_cast<int>((K + kGemmBK - 1) / kGemmBK); }
  __device__ __forceinline__ void load_a(unsigned tile_a, unsigned bar, int kt) const {
    if constexpr (kAMn) {
#pragma unroll
      for (int box = 0; box < 4; ++box) tma_load_2d(tile_a + box * 4096, map_a, m0 + 32 * box, kt * kGemmBK, bar);
    } else {
      tma_load_2d(tile_a, map_a, kt * kGemmBK, m0, bar);
    }
  }
};

// The loader of a product whose B comes as its split image: the tile's
// planes in one contiguous copy a stage.
template <int kPasses, bool kAMn>
struct PlanesLoader : SplitLoaderBase<kAMn> {
  static constexpr int kPlanesBytes = 4 * split_tile_floats<kPasses>();
  const float* planes;  // B's split image
  const char* tile_planes = nullptr;  // the current tile column's first k-tile of planes
  __device__ __forceinline__ PlanesLoader(const TensorMap& map_a, const float* image, i64 m, i64 n, i64 k)
      : SplitLoaderBase<kAMn>(map_a, m, n, k), planes(image) {}
  __device__ __forceinline__ void prefetch() const { tma_prefetch_descriptor(this->map_a); }
  __device__ __forceinline__ void begin_tile(i64 tm, i64 tn) {
    this->m0 = static_cast<int>(tm * kHgBM);
    tile_planes = reinterpret_cast<const char*>(planes) + tn * this->ktiles() * static_cast<i64>(kPlanesBytes);
  }
  __device__ __forceinline__ void load(unsigned tile_a, unsigned tile_b, unsigned bar, int kt) {
    this->load_a(tile_a, bar, kt);
    bulk_load(tile_b, tile_planes + kt * static_cast<i64>(kPlanesBytes), kPlanesBytes, bar);
  }
};

// The loader of a product that splits B in the kernel: the copy engine
// brings B's raw tiles (128 columns x 32 values of k, float32; K-major
// through map_b [N, K], boxes of 32 x 128, 128-byte swizzled; N-major
// through map_b [K, N], boxes of 128 x 32, unswizzled: rows of 512 bytes)
// into a ring of kRaw slots of the loader's own, and the producer
// warpgroup's three other warps (help()) split each into its stage's
// planes, in the split image's layout.  A stage's copies bring A's tile
// alone.  The producer's thread issues a k-tile's raw B with its A tile.
template <int kPasses, bool kAMn, bool kBKMajor, int kRaw = 2>
struct SplittingLoader : SplitLoaderBase<kAMn>, RawRing<kRaw, 3> {
  static constexpr int kRawBytes = 4 * kPlaneFloats;  // (a raw tile: a plane's 128 x 32, unsplit)
  static constexpr int kHelperWarps = 3, kExtraBytes = kRaw * kRawBytes, kExtraBarriers = 2 * kRaw;
  using Ring = RawRing<kRaw, kHelperWarps>;
  using Ring::raws;
  using Ring::raw_full;
  using Ring::raw_empty;
  const TensorMap& map_b;
  int n0 = 0, issued = 0;  // the current tile's first column; raw tiles issued so far
  __device__ __forceinline__ SplittingLoader(const TensorMap& map_a, const TensorMap& b, i64 m, i64 n, i64 k)
      : SplitLoaderBase<kAMn>(map_a, m, n, k), map_b(b) {}
  __device__ __forceinline__ void prefetch() const {
    tma_prefetch_descriptor(this->map_a);
    tma_prefetch_descriptor(map_b);
  }
  __device__ __forceinline__ void begin_tile(i64 tm, i64 tn) {
    this->m0 = static_cast<int>(tm * kHgBM);
    n0 = static_cast<int>(tn * kHgBN);
  }
  // A's tile, then B's raw tile into its slot once the helpers have read the
  // slot's previous one.
  __device__ __forceinline__ void load(unsigned tile_a, unsigned, unsigned bar, int kt) {
    this->load_a(tile_a, bar, kt);
    const int slot = issued % kRaw;
    if (issued >= kRaw) mbar_wait(raw_empty(slot), ((issued / kRaw) - 1) & 1);
    mbar_arrive_expect_tx(raw_full(slot), kRawBytes);
    if constexpr (kBKMajor) {
      tma_load_2d(raws + slot * kRawBytes, map_b, kt * kGemmBK, n0, raw_full(slot));
    } else {
      tma_load_2d(raws + slot * kRawBytes, map_b, n0, kt * kGemmBK, raw_full(slot));
    }
    ++issued;
  }
  // By the producer warpgroup's last kHelperWarps warps: for each stage the
  // block uses, its raw B tile split into its planes (RawRing::help_stages).
  __device__ __forceinline__ void help(const StageRing& ring, i64 tiles, int ktiles) const {
    const int htid = static_cast<int>(threadIdx.x) - 32 * (4 - kHelperWarps);
    Ring::template help_stages<1, kRawBytes>(
        ring, tiles, ktiles, [&](unsigned raw, int s, int) { split_tile(raw, ring.tile_b(s), htid); });
  }
  // A raw tile into the planes: item (column n, step st of 8 values of k),
  // 512 of them over the helpers' threads, the steps fastest for a K-major
  // B (a warp reads the 16-byte chunks 2 st, 2 st + 1 of 8 raw rows, XOR n %
  // 8: all 32 banks a quarter-warp), the columns fastest for an N-major one
  // (a warp reads 32 consecutive columns of a raw row); the writes land as
  // the K-major reads do.
  __device__ __forceinline__ static void split_tile(unsigned raw, unsigned planes, int htid) {
#pragma unroll 1
    for (int item = htid; item < kHgBN * 4; item += 32 * kHelperWarps) {
      const int n = kBKMajor ? item >> 2 : item & (kHgBN - 1), st = kBKMajor ? item & 3 : item >> 7;
      const unsigned lo = static_cast<unsigned>(plane_chunk(n, st, 0));
      const unsigned hi = static_cast<unsigned>(plane_chunk(n, st, 1));
      float v[8];  // B's k-values 8 st .. 8 st + 7 of column n
      if constexpr (kBKMajor) {
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(raw + n * 128 + lo));
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v[4]), "=f"(v[5]), "=f"(v[6]), "=f"(v[7]) : "r"(raw + n * 128 + hi));
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q)
          asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v[q]) : "r"(raw + (8 * st + q) * (kHgBN * 4) + 4 * n));
      }
      const Split<kPasses, 8> part = split_step<kPasses>([&](int q) { return v[q]; });
      const unsigned row = planes + n * 128;
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + lo), "r"(part.big[0]), "r"(part.big[1]),
                   "r"(part.big[2]), "r"(part.big[3]));
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + hi), "r"(part.big[4]), "r"(part.big[5]),
                   "r"(part.big[6]), "r"(part.big[7]));
      if constexpr (kPasses == 3) {
        constexpr unsigned kSmall = 4 * kPlaneFloats;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + kSmall + lo), "r"(part.small[0]),
                     "r"(part.small[1]), "r"(part.small[2]), "r"(part.small[3]));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + kSmall + hi), "r"(part.small[4]),
                     "r"(part.small[5]), "r"(part.small[6]), "r"(part.small[7]));
      }
    }
  }
};

// The split product's MMAs, cooperative: both consumer warpgroups on every
// 128 x 128 tile, warpgroup w on its rows 64w .. 64w + 63, one
// wgmma.m64n128k8 per TF32 pass and step of 8 values of k, A's fragment from
// registers, split there, B's planes from the stage.  The passes of a
// step in the order a_small b_big, a_big b_small, a_big b_big; the chunked
// accumulation (above) by chunks of two steps, 6 MMAs: acc[0] holds a
// chunk's sums (its first MMA with scale-d = 0), acc[1] the tile's, zeroed
// by the engine; end_tile leaves the tile's in acc[0].  A k-tile's A values are
// loaded at once, then split: the first chunk's while the previous
// k-tile's second chunk runs, the second's while the first runs; the
// fragment registers of the two chunks are separate and stay untouched
// until their MMAs complete.
// K-major A (the m64n128 layout's rows: warp rows g, g + 8 at rows row, row
// + 8): a row's k-values 2t, 2t + 1 of step s lie in its 16-byte chunk 2s +
// t / 2 (XOR row % 8, the swizzle); the odd rows load the steps in the
// order 2, 3, 0, 1, so that each 64-bit load's half-warp (rows g = 0-3 or
// 4-7) finds its values in eight distinct chunks, all 32 banks (in step
// order, four rows share four chunks, a 2-way conflict), and a select puts
// them back.  M-major A: the warp's rows g, g + 8 are rows 2g, 2g + 1 of
// its 16 (row_of), adjacent in A's M-major rows: one 64-bit load a k-value,
// a warp's in 32 distinct banks.
template <int kPasses, bool kAMn>
struct Tf32SplitMma {
  static constexpr int kBM = kHgBM, kBN = kHgBN, kWgRows = 64;
  static constexpr bool kCooperative = true;
  // Both warpgroups walk the same tiles and stages, so those are uniform
  // without it; with it this kernel measured slower (docs/gemm.md).
  static constexpr bool kWarpgroupFromLane0 = false;
  static constexpr int kTileABytes = kHgBM * kGemmBK * 4, kTileBBytes = 4 * split_tile_floats<kPasses>();
  static_assert(kGemmBK == 32 && kChunkK == 16, "two chunks of two MMA steps per k-tile");
  // The tile row of a consumer thread's accumulator row h (0: warp row g,
  // 1: g + 8) in its warpgroup's 64 rows (HalfGemmLane::row = 16 warp + g).
  __device__ __forceinline__ static int row_of(const HalfGemmLane& me, int h) {
    return kAMn ? (me.row & ~15) + 2 * (me.row & 15) + h : me.row + 8 * h;
  }
  unsigned addr;   // this thread's first load's offset in A's tile
  unsigned swz;    // K-major: load q reads at addr + ((32 q) ^ swz) (rows row, + 1024 bytes for row + 8)
  bool odd;        // K-major: an odd row, whose load q reads step q ^ 2
  unsigned big[4][4], small[4][4];  // [step][fragment register]

  __device__ __forceinline__ Tf32SplitMma() {
    const HalfGemmLane me(kWarpgroupFromLane0);
    const int row = kWgRows * me.wg + row_of(me, 0), g = row & 7;
    odd = (g & 1) != 0;
    if constexpr (kAMn) {
      // A(m, k) of box m / 32 at row k, chunk ((m % 32) / 4) ^ (k % 8), word m % 4;
      // the thread's k-values 8 s + 2 t + e: row 2 t + e of the 8-row group s.
      addr = static_cast<unsigned>((row >> 5) * 4096 + 2 * me.t * 128 + 4 * (row & 3));
      swz = static_cast<unsigned>((row & 31) >> 2);  // the chunk, before the XOR with the row's k % 8
    } else {
      // Step s's values lie in chunk (2 s + t / 2) ^ g; load q's step is q ^ (odd ? 2 : 0).
      addr = static_cast<unsigned>(row * 128 + 8 * (me.t & 1));
      swz = (odd ? 64u : 0u) ^ (static_cast<unsigned>((me.t >> 1) ^ g) << 4);
    }
  }
  __device__ __forceinline__ void begin_tile(i64, i64) {
    // (New values: the last tile's stay live only until its end_tile.)
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) big[s][i] = small[s][i] = 0u;
  }
  // The MMAs of steps 2c, 2c + 1 into acc[0], committed as one group.
  __device__ __forceinline__ void chunk(float (&acc)[2][kHgAccs], unsigned b, int c) {
    const Swizzle128Desc sb(b);
    begin_mma_group(acc);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int s = 2 * c + j;
      const unsigned long long big_b = sb.at(32 * s);  // (step s: 32 bytes of each row)
      if constexpr (kPasses == 3) {
        if (j == 0) wgmma_tf32<false>(acc[0], small[s], big_b);
        else wgmma_tf32<true>(acc[0], small[s], big_b);
        wgmma_tf32<true>(acc[0], big[s], sb.at(4 * kPlaneFloats + 32 * s));
        wgmma_tf32<true>(acc[0], big[s], big_b);
      } else {
        if (j == 0) wgmma_tf32<false>(acc[0], big[s], big_b);
        else wgmma_tf32<true>(acc[0], big[s], big_b);
      }
    }
    wgmma_commit();
  }
  // Waits for the chunk in flight (whose fragments are steps 2c, 2c + 1)
  // and adds it into the tile's sums.
  __device__ __forceinline__ void fold(float (&acc)[2][kHgAccs], int c) {
    wgmma_wait<0>();
    fence_registers(acc[0]);
#pragma unroll
    for (int s = 2 * c; s < 2 * c + 2; ++s) {
      fence_registers(big[s]);
      fence_registers(small[s]);
    }
#pragma unroll
    for (int i = 0; i < kHgAccs; ++i) acc[1][i] += acc[0][i];
  }
  __device__ __forceinline__ void split(const float (&v)[4][4], int s) {
    Split<kPasses, 4> part;
#pragma unroll
    for (int i = 0; i < 4; ++i) part.set(i, v[s][i]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      big[s][i] = part.big[i];
      if constexpr (kPasses == 3) small[s][i] = part.small[i];
    }
  }
  __device__ __forceinline__ void issue(float (&acc)[2][kHgAccs], unsigned a, unsigned b, int kt) {
    // [step][fragment register]: rows g, g + 8 at k 2t; the same at 2t + 1
    float v[4][4];
    if constexpr (kAMn) {
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float2 w;  // rows 2g, 2g + 1 at k 8 s + 2 t + e (k % 8 = 2 t + e, as the row within its 8)
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                       : "=f"(w.x), "=f"(w.y)
                       : "r"(a + addr + (8 * s + e) * 128 + ((swz ^ (2 * (threadIdx.x & 3) + e)) << 4)));
          v[s][2 * e] = w.x;
          v[s][2 * e + 1] = w.y;
        }
    } else {
      float2 w[4][2];  // [load q][row, row + 8]
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                       : "=f"(w[q][h].x), "=f"(w[q][h].y)
                       : "r"(a + addr + 1024 * h + ((32u * q) ^ swz)));
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const float2 r0 = odd ? w[s ^ 2][0] : w[s][0], r8 = odd ? w[s ^ 2][1] : w[s][1];
        v[s][0] = r0.x;
        v[s][1] = r8.x;
        v[s][2] = r0.y;
        v[s][3] = r8.y;
      }
    }
    split(v, 0);
    split(v, 1);
    if (kt > 0) fold(acc, 1);  // the previous k-tile's second chunk
    chunk(acc, b, 0);
    split(v, 2);
    split(v, 3);
    fold(acc, 0);
    chunk(acc, b, 1);
  }
  __device__ __forceinline__ void end_tile(float (&acc)[2][kHgAccs]) {
    fold(acc, 1);  // (the engine has waited for it)
#pragma unroll
    for (int i = 0; i < kHgAccs; ++i) acc[0][i] = acc[1][i];
  }
};
#endif

}  // namespace cf
