// Kernel family "linear_gn_chain" (cupy_fused/ops/linear_gn_chain.py): a
// linear layer whose GEMM applies a GroupNorm op chain (gn_chains.cuh) in
// its store, on the Hopper GEMM engine of gemm.cuh (float16 / bfloat16).
#include <gemm.cuh>  // (<>: the include path alone, not the working folder)
#include <gn_chain.cuh>  // (<>: the include path alone, not the working folder)

namespace cf {

// z = x W^T + lin_bias on the GEMM engine (gemm.cuh), then,
// in the store of each 128 x 128 tile,
//     z rounded to T (as cuBLAS's output with the bias in its epilogue),
//     v = Pre(z), GroupNorm over each group of kCpg columns, y = Post(y^)
// for groups of kCpg channels (a power of two, 8 <= kCpg <= 128: every group
// lies inside one tile).
//
// The store runs on one warp per scheduler while the other warpgroup's MMAs
// run, and the accumulators leave no registers for the chain: so z goes to
// shared memory first, as the tile TMA stores (TmaTileWriter's layout),
// and leaves through TMA as it is when the backward needs it.  Then each
// thread takes one row of the tile and works through its groups from shared
// memory, as gn_chain_forward does: Pre, the statistics (float, two-pass,
// summed in column order by one thread: bitwise reproducible), the
// normalisation and Post, each group's values in registers; y replaces z in
// place and leaves through TMA.  The tile's columns of every vector are
// cached in shared memory first (one coalesced load per vector and thread;
// every lane then reads the same column: a broadcast).  Pre takes the fast
// activations exactly where the gn_chain kernels do (fast_math), so that
// gn_chain_backward recomputes these normalised values from z and the saved
// statistics.
//
// TO: the type of y and of the chain's vectors: T, or float under autocast
// (the GroupNorm then runs, and returns, float32; z stays T, and so does the
// linear bias, cast with the GEMM's operands).  A 16-bit y leaves through
// TMA, in place of z in the staging area.  A float32 y (twice z's bytes, no
// room to stage it) is stored from registers by a second pass in which a
// warp covers whole rows (a lane 4 adjacent columns: 512 contiguous bytes
// per row and store): the row phase then only computes the statistics
// (kept in shared memory), and the second pass recomputes Pre, bit for bit
// the same, from z; or, for a chain that splits Pre (problem 37's: the
// swish, then its bias), adds the bias to the swish, which the row phase
// left in z's place rounded to T, where the reference under autocast
// rounds it too (the statistics are those of the unrounded Pre, as the
// backward recomputes it).  That store would outlast the other warpgroup's
// main loop; so with a float32 y (and fewer than 128 channels per group)
// the block has a fourth warpgroup (the engine's StoreExtras), which takes
// the groups of the tile's second 64 columns, both passes, while the
// consumer does those of the first 64.
//
// y and z are written once, while x's row blocks and W are read again from
// L2 by other tiles: so the stores mark their lines first to leave L2
// (evict-first through TMA; a float32 y's stores streaming, __stcs).
//
// Outputs: y [M, N] (through map_y when TO is 16-bit, else y); with mean_out
// not null (training) also z [M, N] through map_z and mean / rstd [M, groups]
// (what gn_chain_backward reads).  x [M, K] and W [N, K] through their tensor
// maps; lin_bias: N values of T, the other vectors N values of TO, or null.
constexpr int kGnVectors = 5;                               // lin_bias, extra_bias, gn_weight, gn_bias, mul_weight
constexpr int kGnVectorBytes = 8192;  // a warpgroup's cache of them (5 x 128 floats) and, at kGnStatsOffset,
                                      // a float32 y's statistics
constexpr int kGnStatsOffset = 4096;
constexpr int kGnStagingBytes = kHgStagingBytes + 2 * kGnVectorBytes;  // per block
static_assert(kGnVectors * kHgBN * 4 <= kGnStatsOffset && kGnVectorBytes % 1024 == 0, "cache fits, alignment kept");

// A warpgroup's cached columns of the chain's vectors (tile-local column c,
// [vector][128] floats).  The linear bias is in z: lin() is 0.
template <typename TO, bool kFastMath>
using TileVectors = SharedVectors<TO, kFastMath, kHgBN, 1, true>;

template <typename T, typename TO, typename Chain, int kCpg>
struct GroupNormTileStore {
  static_assert(kCpg >= 8 && kCpg <= kHgBN && (kCpg & (kCpg - 1)) == 0, "a group inside a tile");
  // Eager rounding (which may round the statistics, depending on the torch
  // version) takes the two-launch route (ops.linear_gn_chain).
  static_assert(!Chain::kRoundsLikeEager, "the chains that round like eager are not instantiated here");
  static constexpr bool kFast = fast_math<T, Chain>();
  static constexpr int kChunks = kCpg / 8;      // 16-byte chunks (8 values) per group
  static constexpr int kGroups = kHgBN / kCpg;  // groups per tile row
  const TensorMap& map_y;
  const TensorMap& map_z;
  bool save;  // z, mean and rstd for the backward
  TO* y;  // (a float32 y; a 16-bit one leaves through map_y)
  float* mean_out;
  float* rstd_out;
  const T* lin_bias;
  const TO* vectors[kGnVectors - 1];  // extra_bias, gn_weight, gn_bias, mul_weight (null: absent)
  i64 M, N, groups;
  float feps;

  // With a float32 y (autocast), the consumer finishes the groups of the
  // tile's first 64 columns and the store's own warpgroup those of the
  // other 64, each while the other consumer's MMAs run.  A 16-bit y, and a
  // group of 128 channels (one per tile: the store's warpgroup's registers
  // would not hold it), stay with the consumer, and the block has no store
  // warpgroup (docs/gemm.md).
  static constexpr bool kOwnWarpgroup = sizeof(TO) == 4 && kCpg < kHgBN;
  static constexpr int kMine = kOwnWarpgroup ? kGroups / 2 : kGroups;  // the consumer's groups: 0 .. kMine - 1
  // A float32 y's second pass reads Pre's first step, rounded to T, where
  // the chain splits Pre (gn_chains.cuh, kSplitPre), else z.
  static constexpr bool kSplitPre = sizeof(TO) == 4 && Chain::kSplitPre;

  // A consumer's part: the vectors' cache, z = acc + lin_bias, rounded,
  // into the staging area (and out through TMA when the backward needs it),
  // the hand-off to the store's warpgroup (named barrier `staged`), then
  // groups 0 .. kMine - 1 of every row.
  __device__ __forceinline__ void operator()(const float (&acc)[2][kHgAccs], const HalfGemmLane& me, i64 m0,
                                             i64 n0, unsigned staging, int staged = 0) const {
    const TileVectors<TO, kFast> p{staging + kHgStagingBytes / 2};
    const int lt = threadIdx.x & 127;
    TmaTileWriter::begin(me);  // this warpgroup's last boxes have left the staging area
    // The cache: column n0 + lt of every vector (absent vectors and columns
    // past N: the neutral value).
    {
      const i64 col = n0 + lt;
      constexpr float kNeutral[kGnVectors] = {0.0f, 0.0f, 1.0f, 0.0f, 0.0f};
#pragma unroll
      for (int v = 0; v < kGnVectors; ++v) {
        float value = kNeutral[v];
        if (col < N) {
          if (v == 0 && lin_bias) value = to_float(lin_bias[col]);
          if (v > 0 && vectors[v - 1]) value = to_float(vectors[v - 1][col]);
        }
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(p.base + 4u * (v * kHgBN + lt)), "f"(value) : "memory");
      }
      named_barrier(1 + me.wg, 128);
    }
    // The lane's biases are read ahead of the staging's writes (a batch at
    // a time within the registers a consumer has beside a store
    // warpgroup): the reads and the writes are volatile asm, kept in
    // program order, so reads between the writes would each wait out their
    // latency in turn.
    constexpr int kBatch = kOwnWarpgroup ? 8 : kHgAccs / 4;
#pragma unroll
    for (int i0 = 0; i0 < kHgAccs / 4; i0 += kBatch) {
      float lb[kBatch][2];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        lb[i][0] = p.bias(8 * (i0 + i) + 2 * me.t);
        lb[i][1] = p.bias(8 * (i0 + i) + 2 * me.t + 1);
      }
#pragma unroll
      for (int i = 0; i < kBatch; i += 2)
#pragma unroll
        for (int hm = 0; hm < 2; ++hm)
          TmaTileWriter::put4_pairs(staging, me, hm, i0 + i, [&](int h, int c) {
            return pack2<T>(__fadd_rn(acc[hm][4 * (i0 + i + c) + 2 * h], lb[i + c][0]),
                            __fadd_rn(acc[hm][4 * (i0 + i + c) + 2 * h + 1], lb[i + c][1]));
          });
    }
    if (save) {  // z leaves as it is; y may overwrite it once the copy has read it
      TmaTileWriter::end<true>(map_z, me, staging, m0, n0);
      TmaTileWriter::begin(me);
    } else {
      fence_proxy_async();  // (a 16-bit y's boxes leave through TMA from here)
      named_barrier(1 + me.wg, 128);
    }
    if (kOwnWarpgroup) named_barrier_arrive(staged, 256);
    finish_groups<0, kMine>(me, m0, n0, staging);
  }

  // The store's warpgroup: groups kMine .. of the tile staged in `staging`
  // (once wait() has returned).
  template <typename Wait>
  __device__ __forceinline__ void rows(const HalfGemmLane& me, i64 m0, i64 n0, unsigned staging,
                                       const Wait& wait) const {
    wait();
    finish_groups<kMine, kGroups>(me, m0, n0, staging);
    if (me.leader()) bulk_wait_read();
  }

  // Groups kQ0 .. kQ1 - 1 of each row of the tile (columns kQ0 kCpg .. kQ1
  // kCpg: one or both 64-column boxes), row lt by thread lt: Pre, the
  // statistics (float, two-pass, summed in column order by one thread:
  // bitwise reproducible), the normalisation and Post, each group's values
  // in registers.  A 16-bit y replaces z in place and its boxes leave
  // through TMA; a float32 y is stored by a second pass (below).
  template <int kQ0, int kQ1>
  __device__ __forceinline__ void finish_groups(const HalfGemmLane& me, i64 m0, i64 n0, unsigned staging) const {
    static_assert((kQ1 - kQ0) * kCpg % 64 == 0 && kQ0 * kCpg % 64 == 0, "whole boxes");
    const TileVectors<TO, kFast> p{staging + kHgStagingBytes / 2};
    const int lt = threadIdx.x & 127;
    const i64 row = m0 + lt;
    const float inv_cpg = 1.0f / static_cast<float>(kCpg);
    const unsigned stats = p.base + kGnStatsOffset;  // float32 y: [128 rows][kGroups] (mean, rstd)
#pragma unroll 1
    for (int q = kQ0; q < kQ1; ++q) {
      float v[kCpg];
      // (kSplitPre: pre_head of up to 8 chunks, packed, written over z after
      // their loads: the loads and the stores are volatile asm, kept in
      // program order, so a store between two loads would hold the second
      // back.  z has left (TmaTileWriter::end before the groups) or is not
      // saved, and only this thread reads its row in this pass; the second
      // pass reads the heads where it read z.)
      constexpr int kBatch = kChunks < 8 ? kChunks : 8;
      unsigned head[kSplitPre ? kBatch : 1][4];
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        unsigned w[4];
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                     : "r"(TmaTileWriter::chunk_addr(staging, lt, q * kChunks + k)));
        if constexpr (kSplitPre) {
          float h[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int c = q * kCpg + 8 * k + e;
            h[e] = Chain::pre_head(packed_value<T>(w, e), p, c);
            v[8 * k + e] = Chain::pre_tail(h[e], p.extra(c));
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) head[k % kBatch][j] = pack2<T>(h[2 * j], h[2 * j + 1]);
          if (k % kBatch == kBatch - 1) {
#pragma unroll
            for (int b = 0; b < kBatch; ++b)
              st_shared_v4(TmaTileWriter::chunk_addr(staging, lt, q * kChunks + k - kBatch + 1 + b), head[b][0],
                           head[b][1], head[b][2], head[b][3]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            v[8 * k + e] = Chain::pre(packed_value<T>(w, e), p, q * kCpg + 8 * k + e);
          }
        }
      }
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < kCpg; ++e) sum += v[e];
      float mean = sum * inv_cpg, sq = 0.0f;
#pragma unroll
      for (int e = 0; e < kCpg; ++e) {
        const float d = v[e] - mean;
        sq += d * d;
      }
      float rstd;
      finish_statistics<T, Chain>(sq, inv_cpg, feps, false, mean, rstd);
      const i64 g = n0 / kCpg + q;
      if (save && row < M && g < groups) {
        mean_out[row * groups + g] = mean;
        rstd_out[row * groups + g] = rstd;
      }
      if constexpr (sizeof(TO) == 2) {
        // The weight and bias of chunk k + 1 are read before chunk k is
        // computed and its y written: the reads and the writes are volatile
        // asm, kept in program order, so reads placed after a write would
        // wait out their latency one chunk at a time.
        float wb[2][2][8];  // [chunk & 1][gamma, beta][value]
        auto load_wb = [&](float (&dst)[2][8], int k) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            dst[0][e] = p.gamma(q * kCpg + 8 * k + e);
            dst[1][e] = p.beta(q * kCpg + 8 * k + e);
          }
        };
        load_wb(wb[0], 0);
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          if (k + 1 < kChunks) load_wb(wb[(k + 1) & 1], k + 1);
          float yv[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int c = q * kCpg + 8 * k + e;
            yv[e] = Chain::post((v[8 * k + e] - mean) * rstd * wb[k & 1][0][e] + wb[k & 1][1][e], p, c);
          }
          st_shared_v4(TmaTileWriter::chunk_addr(staging, lt, q * kChunks + k), pack2<TO>(yv[0], yv[1]),
                       pack2<TO>(yv[2], yv[3]), pack2<TO>(yv[4], yv[5]), pack2<TO>(yv[6], yv[7]));
        }
      } else {
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(stats + 8u * (lt * kGroups + q)), "f"(mean),
                     "f"(rstd)
                     : "memory");
      }
    }
    if constexpr (sizeof(TO) == 2) {
      TmaTileWriter::end<true>(map_y, me, staging, m0, n0, -1, kQ0 * kCpg / 64, kQ1 * kCpg / 64);
    } else {
      static_assert(kHgBM * kGroups * 8 <= kGnVectorBytes - kGnStatsOffset, "the statistics fit");
      named_barrier(1 + me.wg, 128);  // every row's statistics are in
      // Columns kQ0 kCpg .. + kCols - 1: a lane takes 4 adjacent columns
      // (half of a 16-byte chunk of z) of one row, kLanes lanes a row (256
      // or 512 contiguous bytes per store); warp wr of the warpgroup rows wr
      // kRows .. (+ kRows - 1), then 4 kRows on.
      constexpr int kCols = (kQ1 - kQ0) * kCpg, kLanes = kCols / 4, kRows = 32 / kLanes;
      const int wr = lt >> 5, lane = lt & 31, c0 = kQ0 * kCpg + 4 * (lane % kLanes), q = c0 / kCpg;
      float gamma[4], beta[4], extra[4];  // (extra: kSplitPre's bias)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        gamma[e] = p.gamma(c0 + e);
        beta[e] = p.beta(c0 + e);
        extra[e] = kSplitPre ? p.extra(c0 + e) : 0.0f;
      }
      const i64 col = n0 + c0;  // N is a multiple of kCpg >= 8: the 4 columns are in or out
      // (Four rows at a time where Pre is split: with no sigmoid left in
      // an iteration, each row's shared-memory loads would stall it.)
#pragma unroll(kSplitPre ? 4 : 1)
      for (int r = wr * kRows + lane / kLanes; r < kHgBM; r += 4 * kRows) {
        unsigned w[2];
        float mean, rstd;
        asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                     : "=r"(w[0]), "=r"(w[1])
                     : "r"(TmaTileWriter::chunk_addr(staging, r, c0 >> 3) + 8u * ((c0 >> 2) & 1)));
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                     : "=f"(mean), "=f"(rstd)
                     : "r"(stats + 8u * (r * kGroups + q)));
        float yv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float vv;
          if constexpr (kSplitPre) vv = Chain::pre_tail(packed_value<T>(w, e), extra[e]);
          else vv = Chain::pre(packed_value<T>(w, e), p, c0 + e);
          yv[e] = Chain::post((vv - mean) * rstd * gamma[e] + beta[e], p, c0 + e);
        }
        if (m0 + r < M && col < N)
          __stcs(reinterpret_cast<float4*>(y + (m0 + r) * N + col), make_float4(yv[0], yv[1], yv[2], yv[3]));
      }
      // The warpgroup's reads of the staging area and the cache end here
      // (the consumer's next begin() and the store's warpgroup's arrive on
      // "freed" would also order them before the next tile's writes).
      named_barrier(1 + me.wg, 128);
    }
  }
  __device__ __forceinline__ void finish(const HalfGemmLane& me) const { TmaTileWriter::finish(me); }
};

// Grid: at most one block per SM (persistent), kHgThreads threads, or
// kHgThreadsWithStore with the store's own warpgroup
// (ops.linear_gn_chain._half_threads),
// half_gemm_shared_bytes<kStages, kGnStagingBytes>() of dynamic shared memory
// (ops.gemm._half_shared_bytes).
template <typename T, typename TO, typename Chain, int kCpg, int kStages>
__global__ void __launch_bounds__(GroupNormTileStore<T, TO, Chain, kCpg>::kOwnWarpgroup ? kHgThreadsWithStore
                                                                                   : kHgThreads,
                                  1)
linear_gn_chain_wgmma(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                      const __grid_constant__ TensorMap map_y, const __grid_constant__ TensorMap map_z,
                      TO* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                      const T* __restrict__ lin_bias, const TO* __restrict__ extra_bias,
                      const TO* __restrict__ gn_weight, const TO* __restrict__ gn_bias,
                      const TO* __restrict__ mul_weight, i64 M, i64 N, i64 K, i64 groups, double eps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char gemm_shared[];
  // eps as float, converted once: left to the compiler, the conversion
  // (and its test for a value below float's range) would be redone in every
  // tile's store, on the store's critical path.
  float feps;
  asm volatile("mov.b32 %0, %1;" : "=f"(feps) : "f"(static_cast<float>(eps)));
  GroupNormTileStore<T, TO, Chain, kCpg> store{map_y,
                                               map_z,
                                               mean_out != nullptr,
                                               y,
                                               mean_out,
                                               rstd_out,
                                               lin_bias,
                                               {extra_bias, gn_weight, gn_bias, mul_weight},
                                               M,
                                               N,
                                               groups,
                                               feps};
  const DenseLoader loader{map_x, map_w, M, N, K};
  half_gemm_persistent<T, kStages, kGnStagingBytes>(reinterpret_cast<char*>(gemm_shared), loader, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

}  // namespace cf
