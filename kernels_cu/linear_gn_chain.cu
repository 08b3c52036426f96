// Kernel family "linear_gn_chain" (cupy_fused/ops/linear_gn_chain.py): the Hopper 3xTF32 GEMM of gemm_tf32.cuh with
// a GroupNorm op chain (gn_chains.cuh) applied in its store.  A source of its
// own: it is opt-in (ops.linear_gn), and compiling it with gemm_tf32.cu would
// add its six instantiations to every first use of the GEMM.
#include "gemm_tf32.cuh"
#include "gn_chains.cuh"

namespace cf {

// Forward of a linear layer followed by a GroupNorm op chain (gn_chains.cuh),
// in one launch on Hopper:
//     z = x W^T + lin_bias,  y = Post(GroupNorm(Pre(z)))
// for groups of cpg = N / groups channels with cpg a power of two <= 128, so
// that every group lies inside one 128-column tile and its statistics need
// only the block's own values.  Opt-in (ops.linear_gn): on H100 it is not
// faster than the GEMM followed by the gn_chain kernel, because with one
// block per SM nothing hides the epilogue's latency (GEMM_NOTES.md).
//
// After the mainloop each consumer warp holds 16 whole rows of the tile (its
// sums cover rows 16 * (warp % 4) .. + 15 of its warpgroup, all 128 columns,
// spread over the warp's lanes).  It stages them through shared memory so
// that a lane then owns 4 adjacent columns of a row: groups of >= 4 channels
// are then teams of cpg / 4 lanes (butterfly sums, fixed order), smaller ones
// lie inside a lane, and every store is a coalesced 16-byte one.  (Working on
// the accumulator registers directly, with butterflies over the quad and the
// lane's column blocks, measured slower.)  The statistics are float and
// two-pass over the register-resident values (no E[x^2] - E[x]^2), as in
// gn_chain_forward.
//
// Outputs: y [M, N]; with z_out not null also z [M, N] and mean / rstd
// [M, groups] (what gn_chain_backward reads).  x: [M, K], W: [N, K],
// K-major, 16-byte aligned rows; vectors: N floats or null.
constexpr int kGnStageStride = kWgBN + 4;  // words; conflict-free float2 writes, float4 reads

template <int kStages, int kPasses, typename Chain>
__global__ void __launch_bounds__(kWgThreads, 1)
gemm_tf32_wgmma_gn(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                   float* __restrict__ z_out, float* __restrict__ mean_out,
                   float* __restrict__ rstd_out, const float* __restrict__ lin_bias,
                   const float* __restrict__ extra_bias, const float* __restrict__ gn_weight,
                   const float* __restrict__ gn_bias, const float* __restrict__ mul_weight, i64 M,
                   i64 N, i64 K, i64 lda, i64 ldb, i64 groups, double eps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(2 * 64 * kGnStageStride * 4 <= kStages * WgmmaConfig<kStages, kPasses, true, true>::kStageBytes,
                "the staged tile fits in the pipeline's shared memory");
  extern __shared__ __align__(128) float4 wgmma_shared[];
  char* const smem = reinterpret_cast<char*>(wgmma_shared);
  i64 m0, n0;
  grouped_tile(M, N, kWgBM, kWgBN, m0, n0);
  auto store = [&](const float (&sum)[64], const ConsumerLane& me) {
    // The staging area overlaps the pipeline: wait until both consumer
    // warpgroups are past their last MMA (barrier 1 is the producer's).
    asm volatile("bar.sync 2, 256;\n" ::: "memory");
    float* const stage = reinterpret_cast<float*>(smem + kWgBarrierBytes) + 16 * me.warp * kGnStageStride;
    const int local_row = me.row & 15;  // within the warp's 16 rows
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const i64 col = n0 + 8 * i + 2 * me.t;
      const float b0 = (lin_bias && col < N) ? lin_bias[col] : 0.0f;
      const float b1 = (lin_bias && col + 1 < N) ? lin_bias[col + 1] : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(stage + (local_row + h) * kGnStageStride + 8 * i + 2 * me.t) =
            make_float2(__fadd_rn(sum[4 * i + 2 * h], b0), __fadd_rn(sum[4 * i + 2 * h + 1], b1));
    }
    __syncwarp();  // a warp reads back only the rows it wrote

    // lin_bias is in z now: the chain sees it as absent.
    const ColumnVectors<float> p = column_vectors<float>(nullptr, extra_bias, gn_weight, gn_bias, mul_weight);
    const int cpg = static_cast<int>(N / groups);  // a power of two <= 128
    const int cpg_shift = __ffs(cpg) - 1;
    const float inv_cpg = 1.0f / static_cast<float>(cpg);
    const float feps = static_cast<float>(eps);
    const i64 col = n0 + 4 * me.lane;
    const bool vec_store = (N % 4 == 0) && ((reinterpret_cast<unsigned long long>(y) & 15) == 0) &&
                           ((reinterpret_cast<unsigned long long>(z_out) & 15) == 0);
    // Sums of each value's group: in-lane for cpg <= 4, then over the cpg / 4
    // lanes of a team.  Warp-uniform control flow (every lane shuffles).
    auto group_sums = [&](const float (&v)[4], float (&s)[4]) {
      if (cpg == 1) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] = v[e];
      } else if (cpg == 2) {
        s[0] = s[1] = v[0] + v[1];
        s[2] = s[3] = v[2] + v[3];
      } else {
        float total = (v[0] + v[1]) + (v[2] + v[3]);
        for (int offset = 1; offset < (cpg >> 2); offset <<= 1)
          total += __shfl_xor_sync(0xffffffffu, total, offset);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] = total;
      }
    };
    for (int r = 0; r < 16; ++r) {
      const i64 row = m0 + 64 * (me.warp >> 2) + 16 * (me.warp & 3) + r;
      if (row >= M) break;  // warp-uniform
      const float4 zv = *reinterpret_cast<const float4*>(stage + r * kGnStageStride + 4 * me.lane);
      const float z[4] = {zv.x, zv.y, zv.z, zv.w};
      float v[4], s[4], d2[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = col + e < N ? Chain::pre(z[e], p, col + e) : 0.0f;
      group_sums(v, s);
      float mean[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mean[e] = s[e] * inv_cpg;
        const float dv = v[e] - mean[e];
        d2[e] = col + e < N ? dv * dv : 0.0f;
      }
      group_sums(d2, s);
      float out[4], rstd[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        rstd[e] = 1.0f / sqrtf(s[e] * inv_cpg + feps);
        out[e] = 0.0f;
        if (col + e < N) {
          const float yh = (v[e] - mean[e]) * rstd[e] * p.gamma(col + e) + p.beta(col + e);
          out[e] = Chain::post(yh, p, col + e);
        }
      }
      float* const yrow = y + row * N;
      float* const zrow = z_out ? z_out + row * N : nullptr;
      if (vec_store && col < N) {
        *reinterpret_cast<float4*>(yrow + col) = make_float4(out[0], out[1], out[2], out[3]);
        if (zrow) *reinterpret_cast<float4*>(zrow + col) = zv;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e < N) {
            yrow[col + e] = out[e];
            if (zrow) zrow[col + e] = z[e];
          }
      }
      // Statistics (mean_out and rstd_out are both set or both null): one lane
      // per (row, group) writes them, the one holding its first column.
      if (mean_out) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e < N && ((col + e) & (cpg - 1)) == 0) {
            const i64 pair = row * groups + ((col + e) >> cpg_shift);
            mean_out[pair] = mean[e];
            rstd_out[pair] = rstd[e];
          }
      }
    }
  };
  wgmma_tile_product<kStages, kPasses, true, true>(smem, a, b, M, N, K, lda, ldb, m0, n0, store);
#else
  __trap();  // launched only on sm_90 devices, where the sm_90a build is used
#endif
}

}  // namespace cf
