// Kernel family "gn_chain": the whole epilogue after a GEMM for the GroupNorm
// problems, in one pass over the activation:
//
//     v  = Pre(z)                      elementwise, before the norm
//     x^ = (v - mean_g) * rstd_g       GroupNorm over the channels of group g
//     y^ = x^ * gn_weight + gn_bias
//     y  = Post(y^)                    elementwise, after the norm
//
// Pre / Post are the op chain of each model (template parameter `Chain`).
// Layout: z, out, dz are contiguous [rows, channels]; group g owns channels
// [g*cpg, (g+1)*cpg).  Statistics are float, two-pass (no E[x^2]-E[x]^2).
//
// Types: z and dz are T; out, dy and the per-channel vectors are TO, which
// is T except under autocast, where a float16 / bfloat16 GEMM output meets
// float32 parameters and the GroupNorm runs, and returns, float32 (TO =
// float): dz stays in z's dtype, as autocast's cast back would make it.
//
// A "team" of `team` lanes (power of two <= 32) handles one (row, group) pair;
// each lane keeps up to kMaxVals values of its group in registers.  Groups
// wider than team*kMaxVals are processed in slices, re-reading z (from cache).
#pragma once
#include "gn_chains.cuh"

// Minimum resident blocks per SM (of 256 threads) the compiler must allow:
// caps registers per thread.  Tuned on H100 (scripts/tune_gn.py).
#ifndef CF_GN_FORWARD_MIN_BLOCKS
#define CF_GN_FORWARD_MIN_BLOCKS 8
#endif
#ifndef CF_GN_BACKWARD_MIN_BLOCKS
#define CF_GN_BACKWARD_MIN_BLOCKS 4
#endif

namespace cf {

// Forward.  Writes out (may alias z: every element is read before it is
// written, by the same thread) and, when mean_out is not null, the per
// (row, group) mean and rstd that the backward reuses.
// round_statistics (read only by chains that round like eager): normalise
// with mean and rstd rounded to T, as eager PyTorch's CUDA GroupNorm does
// before torch 2.13 (its statistics are tensors of the input's dtype there);
// the variance itself comes from the unrounded mean, as in eager.
template <typename T, typename Chain, int kMaxVals, typename TO = T>
__global__ void __launch_bounds__(256, CF_GN_FORWARD_MIN_BLOCKS) gn_chain_forward(const T* z, TO* out, float* __restrict__ mean_out,
                                 float* __restrict__ rstd_out, const TO* __restrict__ lin_bias,
                                 const TO* __restrict__ extra_bias, const TO* __restrict__ gn_weight,
                                 const TO* __restrict__ gn_bias, const TO* __restrict__ mul_weight,
                                 i64 rows, i64 channels, i64 groups, i64 team, double eps,
                                 i64 round_statistics) {
  const ColumnVectors<TO> p = column_vectors(lin_bias, extra_bias, gn_weight, gn_bias, mul_weight);
  const int t = static_cast<int>(team);
  const bool round_stats = Chain::kRoundsLikeEager && round_statistics != 0;
  // Offsets within a row in 32 bits (gn_chain checks channels < 2^30):
  // 64-bit ones cost register pairs, and this kernel runs at few registers.
  const int cpg = static_cast<int>(channels / groups);
  const int team_lane = threadIdx.x & (t - 1);
  const i64 teams_per_block = blockDim.x / t;
  const int slice = t * kMaxVals;
  const int nslices = (cpg + slice - 1) / slice;
  const i64 pairs = rows * groups;
  const float inv_cpg = 1.0f / static_cast<float>(cpg);
  const float feps = static_cast<float>(eps);
  // Block-uniform trip count: every lane reaches the team shuffles.
  for (i64 base = blockIdx.x * teams_per_block; base < pairs; base += gridDim.x * teams_per_block) {
    const i64 pair = base + threadIdx.x / t;
    const bool valid = pair < pairs;
    // 32-bit division whenever the pair count allows (a 64-bit one is far slower).
    i64 row = 0;
    int g = 0;
    if (valid) {
      if (pairs < (i64(1) << 31)) {
        row = unsigned(pair) / unsigned(groups);
        g = static_cast<int>(unsigned(pair) - unsigned(row) * unsigned(groups));
      } else {
        row = pair / groups;
        g = static_cast<int>(pair - row * groups);
      }
    }
    const i64 first = row * channels + static_cast<i64>(g) * cpg;
    const int col0 = g * cpg;  // the group's first channel
    float v[kMaxVals];
    auto load_slice = [&](int s) {
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = s * slice + team_lane + j * t;
        v[j] = (valid && c < cpg) ? Chain::pre(to_float(z[first + c]), p, col0 + c) : 0.0f;
      }
    };
    float sum = 0.0f;
    for (int s = 0; s < nslices; ++s) {
      load_slice(s);
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) sum += v[j];
    }
    float mean = team_sum(sum, t) * inv_cpg;
    float sq = 0.0f;
    for (int s = 0; s < nslices; ++s) {
      if (nslices > 1) load_slice(s);
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = s * slice + team_lane + j * t;
        const float d = v[j] - mean;
        if (c < cpg) sq += d * d;
      }
    }
    float rstd = 1.0f / sqrtf(team_sum(sq, t) * inv_cpg + feps);
    if (round_stats) {
      mean = to_float(from_float<T>(mean));
      rstd = to_float(from_float<T>(rstd));
    }
    for (int s = 0; s < nslices; ++s) {
      if (nslices > 1) load_slice(s);
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = s * slice + team_lane + j * t;
        if (valid && c < cpg) {
          const int col = col0 + c;
          const float yh = (v[j] - mean) * rstd * load_or(p.gn_weight, col, 1.0f) +
                           load_or(p.gn_bias, col, 0.0f);
          out[first + c] = from_float<TO>(Chain::template post<TO>(yh, p, col));
        }
      }
    }
    if (valid && team_lane == 0 && mean_out) {
      mean_out[pair] = mean;
      rstd_out[pair] = rstd;
    }
  }
}

// Per-element part of the backward shared by both paths below: recomputes
// x^ and y^ from z and the saved statistics, returns dy^ * gn_weight (= dx^).
template <typename V, typename Chain>
__device__ __forceinline__ float element_backward(float z, float dy, float mean, float rstd, i64 col,
                                                  const ColumnVectors<V>& p, float& xhat,
                                                  float& dyhat, float& mul_grad) {
  const float w = load_or(p.gn_weight, col, 1.0f);
  xhat = (Chain::pre(z, p, col) - mean) * rstd;
  const float yh = xhat * w + load_or(p.gn_bias, col, 0.0f);
  mul_grad = 0.0f;
  dyhat = Chain::post_backward(yh, dy, p, col, mul_grad);
  return dyhat * w;
}

template <typename Chain>
__device__ __forceinline__ void slot_values(float (&out)[Chain::kSlots], float dz, float dv,
                                            float xhat, float dyhat, float mul_grad) {
  if (Chain::kSlotDZ >= 0) out[Chain::kSlotDZ] = dz;
  if (Chain::kSlotDV >= 0) out[Chain::kSlotDV] = dv;
  if (Chain::kSlotGamma >= 0) out[Chain::kSlotGamma] = dyhat * xhat;
  if (Chain::kSlotBeta >= 0) out[Chain::kSlotBeta] = dyhat;
  if (Chain::kSlotMul >= 0) out[Chain::kSlotMul] = mul_grad;
}

// Backward.  grid = (ceil(groups / teams_per_block), chunks); block y-index
// is a chunk of rows_per_chunk rows.  Writes dz and, per chunk, the column sums
// partial[chunk][slot][channels] (double) that reduce_column_partials folds
// in order.
// dy_dense == 0: dy is a single value broadcast to every element.
template <typename T, typename Chain, int kMaxVals, typename TO = T>
__global__ void __launch_bounds__(256, CF_GN_BACKWARD_MIN_BLOCKS) gn_chain_backward(const T* __restrict__ z, const TO* __restrict__ dy, i64 dy_dense,
                                  const float* __restrict__ mean, const float* __restrict__ rstd,
                                  const TO* __restrict__ lin_bias, const TO* __restrict__ extra_bias,
                                  const TO* __restrict__ gn_weight, const TO* __restrict__ gn_bias,
                                  const TO* __restrict__ mul_weight, T* __restrict__ dz_out,
                                  double* __restrict__ partial, i64 rows, i64 channels, i64 groups,
                                  i64 team, i64 rows_per_chunk) {
  constexpr int S = Chain::kSlots;
  const ColumnVectors<TO> p = column_vectors(lin_bias, extra_bias, gn_weight, gn_bias, mul_weight);
  const int t = static_cast<int>(team);
  // Offsets within a row in 32 bits, as in the forward.
  const int cpg = static_cast<int>(channels / groups);
  const int team_lane = threadIdx.x & (t - 1);
  const int teams_per_block = blockDim.x / t;
  const int g = blockIdx.x * teams_per_block + threadIdx.x / t;
  const bool valid = g < groups;
  const int col0 = valid ? g * cpg : 0;  // the group's first channel
  const i64 row0 = blockIdx.y * rows_per_chunk;
  const i64 row1 = min(rows, row0 + rows_per_chunk);
  const int slice = t * kMaxVals;
  const int nslices = (cpg + slice - 1) / slice;
  const float inv_cpg = 1.0f / static_cast<float>(cpg);
  double* part = partial + blockIdx.y * S * channels;

  if (nslices == 1) {
    // The group fits in registers: one read of z and dy per element.
    CompensatedSum acc[S][kMaxVals];
    for (i64 r = row0; r < row1; ++r) {
      const float mu = valid ? mean[r * groups + g] : 0.0f;
      const float rs = valid ? rstd[r * groups + g] : 0.0f;
      const i64 row_start = r * channels;
      float zs[kMaxVals], xh[kMaxVals], dxh[kMaxVals], dyh[kMaxVals], mg[kMaxVals];
      float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = team_lane + j * t;
        xh[j] = dxh[j] = dyh[j] = mg[j] = zs[j] = 0.0f;
        if (valid && c < cpg) {
          const int col = col0 + c;
          const i64 i = row_start + col;
          zs[j] = to_float(z[i]);
          dxh[j] = element_backward<TO, Chain>(zs[j], to_float(dy[dy_dense ? i : 0]), mu, rs, col,
                                              p, xh[j], dyh[j], mg[j]);
          s1 += dxh[j];
          s2 += dxh[j] * xh[j];
        }
      }
      s1 = team_sum(s1, t) * inv_cpg;
      s2 = team_sum(s2, t) * inv_cpg;
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = team_lane + j * t;
        if (valid && c < cpg) {
          const int col = col0 + c;
          const float dv = rs * (dxh[j] - s1 - xh[j] * s2);
          const float d = dv * Chain::pre_grad(zs[j], p, col);
          dz_out[row_start + col] = from_float<T>(d);
          float vals[S];
          slot_values<Chain>(vals, d, dv, xh[j], dyh[j], mg[j]);
#pragma unroll
          for (int s = 0; s < S; ++s) acc[s][j].add(vals[s]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxVals; ++j) {
      const int c = team_lane + j * t;
      if (valid && c < cpg)
#pragma unroll
        for (int s = 0; s < S; ++s) part[s * channels + col0 + c] = acc[s][j].total();
    }
    return;
  }

  // Wide groups: two sweeps per row (group sums, then dz).  The column sums
  // accumulate in double directly in this chunk's partial rows, which no
  // other thread touches, in row order.
  for (i64 r = row0; r < row1; ++r) {
    const float mu = valid ? mean[r * groups + g] : 0.0f;
    const float rs = valid ? rstd[r * groups + g] : 0.0f;
    const i64 row_start = r * channels;
    float s1 = 0.0f, s2 = 0.0f;
    for (int c = team_lane; c < cpg; c += t) {
      if (!valid) break;
      const int col = col0 + c;
      const i64 i = row_start + col;
      float xh, dyh, mg;
      const float dxh = element_backward<TO, Chain>(to_float(z[i]), to_float(dy[dy_dense ? i : 0]),
                                                   mu, rs, col, p, xh, dyh, mg);
      s1 += dxh;
      s2 += dxh * xh;
    }
    s1 = team_sum(s1, t) * inv_cpg;
    s2 = team_sum(s2, t) * inv_cpg;
    for (int c = team_lane; c < cpg; c += t) {
      if (!valid) break;
      const int col = col0 + c;
      const i64 i = row_start + col;
      const float zf = to_float(z[i]);
      float xh, dyh, mg;
      const float dxh = element_backward<TO, Chain>(zf, to_float(dy[dy_dense ? i : 0]), mu, rs, col,
                                                   p, xh, dyh, mg);
      const float dv = rs * (dxh - s1 - xh * s2);
      const float d = dv * Chain::pre_grad(zf, p, col);
      dz_out[i] = from_float<T>(d);
      float vals[S];
      slot_values<Chain>(vals, d, dv, xh, dyh, mg);
#pragma unroll
      for (int s = 0; s < S; ++s)
        part[s * channels + col] = (r == row0 ? 0.0 : part[s * channels + col]) + vals[s];
    }
  }
}

}  // namespace cf
