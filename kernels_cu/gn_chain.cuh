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
// The scalar backward's teams may also span warps (see wide_team_sums).
#pragma once
#include "gn_chains.cuh"

// kMinBlocks (every kernel below): the minimum resident blocks per SM (of
// 256 threads) the compiler must allow, which caps registers per thread.
// A launch shape, chosen per instantiation by the op (LaunchShapes in
// cupy_fused/ops/gn_chain.py, tuned with scripts/tune_gn.py).

namespace cf {

// Whether the chain's activations run fast (sigmoid_of in cf_common.cuh):
// for a float16 / bfloat16 z, except in the chains that round like eager.
// Every kernel of a dtype and chain, scalar or vectorised, forward or
// backward, makes the same choice, so that the backward recomputes exactly
// the forward's normalised values.
template <typename T, typename Chain>
__device__ constexpr bool fast_math() {
  return sizeof(T) == 2 && !Chain::kRoundsLikeEager;
}

// (row, group) of a (row, group) pair index: a 32-bit division whenever the
// pair count allows (a 64-bit one is far slower).
__device__ __forceinline__ void split_pair(i64 pair, i64 pairs, i64 groups, i64& row, int& g) {
  if (pairs < (i64(1) << 31)) {
    row = unsigned(pair) / unsigned(groups);
    g = static_cast<int>(unsigned(pair) - unsigned(row) * unsigned(groups));
  } else {
    row = pair / groups;
    g = static_cast<int>(pair - row * groups);
  }
}

// A GroupNorm statistic rounded to T as eager rounds it (see
// gn_chain_forward).  With kKeepTies, a value within kStatisticTieUlps
// float32 units of a midpoint between two values of T is kept in float:
// eager's own float32 statistic (reduced in another order) may round the
// other way there, a whole unit of T apart.  The float32 bits that T drops
// give the distance to the midpoint: 16 for bfloat16, 13 for float16
// (normal range; in float16's subnormal range the test is approximate, and
// such a statistic moves the outputs by far less than a unit).
constexpr int kStatisticTieUlps = 16;
template <typename T> struct DroppedFloatBits { static constexpr int value = 0; };
template <> struct DroppedFloatBits<half> { static constexpr int value = 13; };
template <> struct DroppedFloatBits<bfloat16> { static constexpr int value = 16; };
template <typename T, bool kKeepTies>
__device__ __forceinline__ float round_statistic(float v) {
  constexpr int kDropped = DroppedFloatBits<T>::value;
  if constexpr (kKeepTies && kDropped > 0) {
    constexpr int kHalf = 1 << (kDropped - 1);
    const int low = static_cast<int>(__float_as_uint(v) & ((1u << kDropped) - 1u));
    if (abs(low - kHalf) <= kStatisticTieUlps) return v;
  }
  return to_float(from_float<T>(v));
}

// The GroupNorm's rstd: eager's formula (rsqrtf) where the chain rounds like
// eager, so that its rounding to T agrees with eager's as often as it can,
// and where the activations run fast (a float16 / bfloat16 z: rsqrtf's
// two units of float32 error sit far below the input's own, and it saves
// the IEEE square root and divide on every row); 1 / sqrtf otherwise.
__device__ __forceinline__ float group_rstd(float var_plus_eps, bool rsqrt) {
  return rsqrt ? rsqrtf(var_plus_eps) : 1.0f / sqrtf(var_plus_eps);
}

// A group's rstd from its summed squared deviations, then its mean and
// rstd rounded as eager rounds them where the chain rounds like eager
// (round_stats; see gn_chain_forward).  Shared by every forward kernel that
// normalises: both here and linear_gn_chain_wgmma.
template <typename T, typename Chain>
__device__ __forceinline__ void finish_statistics(float sq_sum, float inv_cpg, float feps,
                                                  bool round_stats, float& mean, float& rstd) {
  rstd = group_rstd(sq_sum * inv_cpg + feps, round_stats || fast_math<T, Chain>());
  if (round_stats) {
    mean = round_statistic<T, Chain::kGroupNormIsLast>(mean);
    rstd = round_statistic<T, Chain::kGroupNormIsLast>(rstd);
  }
}

// Forward.  Writes out (may alias z: every element is read before it is
// written, by the same thread) and, when mean_out is not null, the per
// (row, group) mean and rstd that the backward reuses.
// round_statistics (read only by chains that round like eager): normalise
// with mean and rstd rounded to T, as eager PyTorch's CUDA GroupNorm does
// before torch 2.13 (its statistics are tensors of the input's dtype there);
// the variance itself comes from the unrounded mean, as in eager, and rstd
// from rsqrtf, as in eager.  Eager reduces in another order, so its float32
// statistic can still differ from ours in the last bits, and then round to
// the other neighbour in T when it lies near a midpoint.  Where the
// GroupNorm is the chain's last step, such a statistic is kept in float: the
// outputs are then within a unit of either of eager's.  Where ops follow it
// (problem 88), every later rounding would amplify the half-unit offset, so
// the statistic is rounded as eager's is.
template <typename T, typename Chain, int kMaxVals, typename TO, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) gn_chain_forward(const T* z, TO* out, float* __restrict__ mean_out,
                                 float* __restrict__ rstd_out, const TO* __restrict__ lin_bias,
                                 const TO* __restrict__ extra_bias, const TO* __restrict__ gn_weight,
                                 const TO* __restrict__ gn_bias, const TO* __restrict__ mul_weight,
                                 i64 rows, i64 channels, i64 groups, i64 team, double eps,
                                 i64 round_statistics) {
  constexpr bool kFast = fast_math<T, Chain>();
  const ColumnVectors<TO, kFast> p =
      column_vectors<TO, kFast>(lin_bias, extra_bias, gn_weight, gn_bias, mul_weight);
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
    i64 row = 0;
    int g = 0;
    if (valid) split_pair(pair, pairs, groups, row, g);
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
    // A lane's sum of add(sum, j, c) over its values (j: the value's index
    // in v, c: its channel in the group); reload: load the one slice again
    // (a group of many slices is loaded slice by slice in any case).  A
    // wide group's lane holds many slices: their values are summed a slice
    // at a time, and the slices' sums added with compensation (one running
    // sum of all a lane's values, at thousands of channels a group, fell
    // outside the error the library holds to).
    auto lane_sum = [&](bool reload, auto add) {
      float sum = 0.0f;
      if (nslices == 1) {
        if (reload) load_slice(0);
#pragma unroll
        for (int j = 0; j < kMaxVals; ++j) add(sum, j, team_lane + j * t);
        return sum;
      }
      CompensatedSum slices;
      for (int s = 0; s < nslices; ++s) {
        load_slice(s);
        float part = 0.0f;
#pragma unroll
        for (int j = 0; j < kMaxVals; ++j) add(part, j, s * slice + team_lane + j * t);
        slices.add(part);
      }
      return slices.total_float();
    };
    const float sum = lane_sum(true, [&](float& acc, int j, int) { acc += v[j]; });
    float mean = team_sum(sum, t) * inv_cpg;
    const float sq = lane_sum(false, [&](float& acc, int j, int c) {
      const float d = v[j] - mean;
      if (c < cpg) acc += d * d;
    });
    float rstd;
    finish_statistics<T, Chain>(team_sum(sq, t), inv_cpg, feps, round_stats, mean, rstd);
    for (int s = 0; s < nslices; ++s) {
      if (nslices > 1) load_slice(s);
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = s * slice + team_lane + j * t;
        if (valid && c < cpg) {
          const int col = col0 + c;
          const float yh = (v[j] - mean) * rstd * p.gamma(col) + p.beta(col);
          out[first + c] = from_float<TO>(Chain::post(yh, p, col));
        }
      }
    }
    if (valid && team_lane == 0 && mean_out) {
      mean_out[pair] = mean;
      rstd_out[pair] = rstd;
    }
  }
}

// Per-element part of the backward shared by every path below: recomputes
// x^ and y^ from Pre's value v and the saved statistics, returns
// dy^ * gn_weight (= dx^).  P, C: ColumnVectors and a column, or
// LaneVectors and a lane's column index.  kExact: in an exact row (below),
// Post's backward as autograd computes it where it differs.
template <typename Chain, bool kExact = false, typename P, typename C>
__device__ __forceinline__ float element_backward_from_pre(float v, float dy, float mean, float rstd,
                                                           C col, const P& p, float& xhat,
                                                           float& dyhat, float& mul_grad) {
  const float w = p.gamma(col);
  xhat = (v - mean) * rstd;
  const float yh = xhat * w + p.beta(col);
  mul_grad = 0.0f;
  dyhat = kExact ? Chain::post_backward_exact(yh, dy, p, col, mul_grad)
                 : Chain::post_backward(yh, dy, p, col, mul_grad);
  return dyhat * w;
}

// The GroupNorm's input gradient.  A group whose sums s1 = mean dx^ and
// s2 = mean dx^ x^ are finite takes the centred form,
// dv = rstd (dx^ - s1 - x^ s2), the accurate one.  A NaN or +-inf from the
// upstream gradient makes a group's sums non-finite; the row is then done
// again as an exact row, where such a group takes torch's own uncentred form
// (its GroupNorm backward): dv = rstd dx^ + c2 v + c3 with
// c2 = (sd mean - sdv) rstd^3 / D, c3 = -c2 mean - sd rstd / D, sd = sum dx^
// and sdv = sum dx^ v.  Every dv of such a group is NaN or +-inf, and the
// two forms put NaN and +-inf in different places: the uncentred one where
// torch does.  Which of NaN and +-inf c2 v + c3 gives depends on v's sign
// and on whether it is 0, so v there is the chain's pre_reference: v as the
// reference holds it (rounded to 16 bits where the reference's tensor is),
// not our float32 v.
__device__ __forceinline__ bool group_sums_finite(float s1, float s2) {
  return isfinite(s1) && isfinite(s2);
}
struct UncentredGroup {
  float c1, c2, c3;
  __device__ __forceinline__ float dv(float dxh, float v) const { return c1 * dxh + c2 * v + c3; }
};
__device__ __forceinline__ UncentredGroup uncentred_group(float sd, float sdv, float mean,
                                                          float rstd, float inv_cpg) {
  const float c2 = (sd * mean - sdv) * rstd * rstd * rstd * inv_cpg;
  return UncentredGroup{rstd, c2, -c2 * mean - sd * rstd * inv_cpg};
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
// slot_values in a row that may be exact: in a group in the uncentred form,
// where dy^ is not finite, gn_weight's term is torch's
// (dy^ v - dy^ mean) rstd (it sums dy^ v and dy^ per channel and applies the
// statistics afterwards), whose NaN and +-inf differ from dy^ x^'s.
template <typename Chain>
__device__ __forceinline__ void slot_values_exact(float (&out)[Chain::kSlots], float dz, float dv,
                                                  float xhat, float dyhat, float mul_grad,
                                                  bool uncentred, float v, float mean,
                                                  float rstd) {
  slot_values<Chain>(out, dz, dv, xhat, dyhat, mul_grad);
  if (Chain::kSlotGamma >= 0 && uncentred && !isfinite(dyhat))
    out[Chain::kSlotGamma] = (dyhat * v - dyhat * mean) * rstd;
}

// The backward kernels' parameters (gn_chain_backward, gn_chain_backward_vec,
// whose own signatures spell them out: the launch reads a kernel's
// parameters from its source) and their names, for the functions that do a
// kernel's work.
#define CF_GN_BACKWARD_PARAMS                                                              \
  const T *__restrict__ z, const TO *__restrict__ dy, i64 dy_dense,                        \
      const float *__restrict__ mean, const float *__restrict__ rstd,                      \
      const TO *__restrict__ lin_bias, const TO *__restrict__ extra_bias,                  \
      const TO *__restrict__ gn_weight, const TO *__restrict__ gn_bias,                    \
      const TO *__restrict__ mul_weight, T *__restrict__ dz_out, double *__restrict__ partial, \
      i64 rows, i64 channels, i64 groups, i64 team, i64 rows_per_chunk
#define CF_GN_BACKWARD_ARGS                                                                \
  z, dy, dy_dense, mean, rstd, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, dz_out, \
      partial, rows, channels, groups, team, rows_per_chunk

// Rows whose GroupNorm sums are not finite (a NaN or +-inf from the upstream
// gradient, as a rule).  Such a group's sums leave a term that is not finite
// in the column sums of its lanes: dy^ (gn_bias's), dy^ x^ (gn_weight's),
// or dv and dz (a gn_weight that is not finite; where every dz of such a
// group is gated to 0, the two forms below agree).  So a kernel walks its
// rows as always, and where a warp's sums then show one (an overflow of
// finite sums only costs time), the warp (the block, where the scalar
// backward's teams span warps) walks its rows again as exact rows (see
// UncentredGroup), with autograd's forms where they differ, and
// what the first walk stored and summed is replaced.  The walks are one
// function with kExact a constant: the first is inlined into the kernel,
// holding none of the exact rows' work, and the second is a call
// (__noinline__), so that it takes none of the first's registers.

// The scalar backward's teams: up to 32 lanes, or, in gn_chain_backward's
// kWide instantiations, team / 32 adjacent warps that share each row's
// group: where a block has more warps than its groups fill (few groups of
// many channels: backward_team_shape in gn_chain.py), which would
// otherwise idle.  A wide team's sums meet in shared memory, its warps'
// sums added in warp order (the same in every lane).  Every lane of the
// block calls them (the team width is the same in the whole block, and so
// are its row walks).  A template parameter rather than a branch on the
// team: the branch's registers made the kernels with teams within a warp
// spill more.
// team: a multiple of 32 (the kWide instantiations only: a team within a
// warp would find no warps here).
template <int N>
__device__ __forceinline__ void wide_team_sums(float (&v)[N], int team) {
  __shared__ float scratch[N][32];
  const int warp = threadIdx.x >> 5, first = warp & ~(team / 32 - 1);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    v[i] = team_sum(v[i], 32);
    if ((threadIdx.x & 31) == 0) scratch[i][warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float s = 0.0f;
    for (int w = first; w < first + team / 32; ++w) s += scratch[i][w];
    v[i] = s;
  }
  __syncthreads();  // (the next call writes scratch again)
}
// A row's group sums: sd = sum dx^, then s1 = sd / cpg and s2 = (sum dx^ x^)
// / cpg in place.  Returns sd.
template <bool kWide>
__device__ __forceinline__ float backward_group_sums(float& s1, float& s2, int team,
                                                     float inv_cpg) {
  if (!kWide) {
    const float sd = team_sum(s1, team);
    s1 = sd * inv_cpg;
    s2 = team_sum(s2, team) * inv_cpg;
    return sd;
  }
  float v[2] = {s1, s2};
  wide_team_sums(v, team);
  s1 = v[0] * inv_cpg;
  s2 = v[1] * inv_cpg;
  return v[0];
}
template <bool kWide>
__device__ __forceinline__ float backward_team_sum(float a, int team) {
  if (!kWide) return team_sum(a, team);
  float v[1] = {a};
  wide_team_sums(v, team);
  return v[0];
}
// Whether every lane's walk was finite: the warp's lanes, or the block's
// where teams span warps, so that an exact walk is taken by whole teams.
template <bool kWide>
__device__ __forceinline__ bool walk_finite(bool finite) {
  return kWide ? __syncthreads_and(finite) != 0 : __all_sync(0xffffffffu, finite);
}

// The scalar backward's walk (kExact: see above; kWide: teams spanning
// warps).  Returns false where the warp's sums (the block's, kWide) show a
// group that is not finite; the walk has then not written its column sums
// (or wrote sums that the exact walk replaces).
template <bool kExact, bool kWide, typename T, typename Chain, int kMaxVals, typename TO>
__device__ __forceinline__ bool gn_chain_backward_rows(CF_GN_BACKWARD_PARAMS) {
  constexpr int S = Chain::kSlots;
  constexpr bool kFast = fast_math<T, Chain>();
  const ColumnVectors<TO, kFast> p =
      column_vectors<TO, kFast>(lin_bias, extra_bias, gn_weight, gn_bias, mul_weight);
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
    auto do_row = [&](i64 r) {
      const float mu = valid ? mean[r * groups + g] : 0.0f;
      const float rs = valid ? rstd[r * groups + g] : 0.0f;
      const i64 row_start = r * channels;
      float zs[kMaxVals], vs[kMaxVals], xh[kMaxVals], dxh[kMaxVals], dyh[kMaxVals],
          mg[kMaxVals];
      float s1 = 0.0f, s2 = 0.0f, sdv = 0.0f;
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = team_lane + j * t;
        xh[j] = dxh[j] = dyh[j] = mg[j] = zs[j] = vs[j] = 0.0f;
        if (valid && c < cpg) {
          const int col = col0 + c;
          const i64 i = row_start + col;
          zs[j] = to_float(z[i]);
          vs[j] = Chain::pre(zs[j], p, col);
          const float dyf = to_float(dy[dy_dense ? i : 0]);
          dxh[j] = kExact ? element_backward_from_pre<Chain, true>(vs[j], dyf, mu, rs, col, p,
                                                                   xh[j], dyh[j], mg[j])
                         : element_backward_from_pre<Chain>(vs[j], dyf, mu, rs, col, p, xh[j],
                                                            dyh[j], mg[j]);
          s1 += dxh[j];
          s2 += dxh[j] * xh[j];
          if (kExact) {
            vs[j] = Chain::template pre_reference<T>(vs[j], zs[j], p, col, lin_bias == nullptr);
            sdv += dxh[j] * vs[j];
          }
        }
      }
      const float sd = backward_group_sums<kWide>(s1, s2, t, inv_cpg);
      UncentredGroup u = {};
      bool uncentred = false;
      if (kExact) {
        u = uncentred_group(sd, backward_team_sum<kWide>(sdv, t), mu, rs, inv_cpg);
        uncentred = !group_sums_finite(s1, s2);
      }
#pragma unroll
      for (int j = 0; j < kMaxVals; ++j) {
        const int c = team_lane + j * t;
        if (valid && c < cpg) {
          const int col = col0 + c;
          const float dv = uncentred ? u.dv(dxh[j], vs[j]) : rs * (dxh[j] - s1 - xh[j] * s2);
          const float d =
              pre_backward<Chain, T>(dv, Chain::pre_grad(zs[j], p, col), zs[j], p, col,
                                     uncentred, lin_bias == nullptr);
          dz_out[row_start + col] = from_float<T>(d);
          float vals[S];
          slot_values_exact<Chain>(vals, d, dv, xh[j], dyh[j], mg[j], uncentred, vs[j], mu, rs);
#pragma unroll
          for (int s = 0; s < S; ++s) acc[s][j].add(vals[s]);
        }
      }
    };
    for (i64 r = row0; r < row1; ++r) do_row(r);
    if (!kExact) {
      bool finite = true;
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < kMaxVals; ++j) finite = finite && isfinite(acc[s][j].sum);
      if (!walk_finite<kWide>(finite)) return false;
    }
#pragma unroll
    for (int j = 0; j < kMaxVals; ++j) {
      const int c = team_lane + j * t;
      if (valid && c < cpg)
#pragma unroll
        for (int s = 0; s < S; ++s) part[s * channels + col0 + c] = acc[s][j].total();
    }
    return true;
  }

  // Wide groups: two sweeps per row (group sums, then dz).  The column sums
  // accumulate in double directly in this chunk's partial rows, which no
  // other thread touches, in row order (an exact walk starts them afresh).
  // Sums that are not finite show in s1 * s2, added up over the rows.
  float non_finite = 0.0f;
  auto wide_row = [&](i64 r) {
    const float mu = valid ? mean[r * groups + g] : 0.0f;
    const float rs = valid ? rstd[r * groups + g] : 0.0f;
    const i64 row_start = r * channels;
    // dx^ of a channel, and x^, dy^, Post's parameter term and v.
    auto element = [&](int col, float zf, float& xh, float& dyh, float& mg, float& v) {
      const i64 i = row_start + col;
      v = Chain::pre(zf, p, col);
      const float dyf = to_float(dy[dy_dense ? i : 0]);
      const float dxh =
          kExact ? element_backward_from_pre<Chain, true>(v, dyf, mu, rs, col, p, xh, dyh, mg)
                 : element_backward_from_pre<Chain>(v, dyf, mu, rs, col, p, xh, dyh, mg);
      if (kExact) v = Chain::template pre_reference<T>(v, zf, p, col, lin_bias == nullptr);
      return dxh;
    };
    float s1 = 0.0f, s2 = 0.0f, sdv = 0.0f;
    for (int c = team_lane; c < cpg; c += t) {
      if (!valid) break;
      const int col = col0 + c;
      float xh, dyh, mg, v;
      const float dxh = element(col, to_float(z[row_start + col]), xh, dyh, mg, v);
      s1 += dxh;
      s2 += dxh * xh;
      if (kExact) sdv += dxh * v;
    }
    const float sd = backward_group_sums<kWide>(s1, s2, t, inv_cpg);
    non_finite += s1 * s2;
    UncentredGroup u = {};
    bool uncentred = false;
    if (kExact) {
      u = uncentred_group(sd, backward_team_sum<kWide>(sdv, t), mu, rs, inv_cpg);
      uncentred = !group_sums_finite(s1, s2);
    }
    for (int c = team_lane; c < cpg; c += t) {
      if (!valid) break;
      const int col = col0 + c;
      const i64 i = row_start + col;
      const float zf = to_float(z[i]);
      float xh, dyh, mg, v;
      const float dxh = element(col, zf, xh, dyh, mg, v);
      const float dv = uncentred ? u.dv(dxh, v) : rs * (dxh - s1 - xh * s2);
      const float d = pre_backward<Chain, T>(dv, Chain::pre_grad(zf, p, col), zf, p, col,
                                            uncentred, lin_bias == nullptr);
      dz_out[i] = from_float<T>(d);
      float vals[S];
      slot_values_exact<Chain>(vals, d, dv, xh, dyh, mg, uncentred, v, mu, rs);
#pragma unroll
      for (int s = 0; s < S; ++s)
        part[s * channels + col] = (r == row0 ? 0.0 : part[s * channels + col]) + vals[s];
    }
  };
  for (i64 r = row0; r < row1; ++r) wide_row(r);
  return kExact || walk_finite<kWide>(isfinite(non_finite));
}

template <bool kWide, typename T, typename Chain, int kMaxVals, typename TO>
__device__ __noinline__ void gn_chain_backward_exact(CF_GN_BACKWARD_PARAMS) {
  gn_chain_backward_rows<true, kWide, T, Chain, kMaxVals, TO>(CF_GN_BACKWARD_ARGS);
}

// Backward.  grid = (ceil(groups / teams_per_block), chunks); block y-index
// is a chunk of rows_per_chunk rows.  Writes dz and, per chunk, the column sums
// partial[chunk][slot][channels] (double) that reduce_column_partials folds
// in order.
// dy_dense == 0: dy is a single value broadcast to every element.
// kWide: teams of team / 32 > 1 whole warps (see wide_team_sums).
template <typename T, typename Chain, int kMaxVals, typename TO, int kMinBlocks,
          bool kWide = false>
__global__ void __launch_bounds__(256, kMinBlocks) gn_chain_backward(
    const T* __restrict__ z, const TO* __restrict__ dy, i64 dy_dense,
    const float* __restrict__ mean, const float* __restrict__ rstd,
    const TO* __restrict__ lin_bias, const TO* __restrict__ extra_bias,
    const TO* __restrict__ gn_weight, const TO* __restrict__ gn_bias,
    const TO* __restrict__ mul_weight, T* __restrict__ dz_out, double* __restrict__ partial,
    i64 rows, i64 channels, i64 groups, i64 team, i64 rows_per_chunk) {
  if (!gn_chain_backward_rows<false, kWide, T, Chain, kMaxVals, TO>(CF_GN_BACKWARD_ARGS))
    gn_chain_backward_exact<kWide, T, Chain, kMaxVals, TO>(CF_GN_BACKWARD_ARGS);
}

// ---- Vectorised kernels ----
// The same computation with every access 16 bytes wide (kE values of z), in
// a layout where lanes own fixed columns and warps walk rows:
//
//   * a lane owns one vector of kE consecutive channels; a team of `team`
//     lanes (a power of two <= 32) owns a group, so a warp spans 32 / team
//     groups, and blockIdx.x picks which (a "slice");
//   * the kWarps warps of a block walk the rows of the block's chunk
//     (blockIdx.y), warp w taking rows row0 + w, row0 + w + kWarps, ...,
//     with the next rows' loads in flight while a row is computed;
//   * each lane loads its columns' per-channel vectors once (LaneVectors).
//
// Preconditions (ops/gn_chain.py, vector_shape): channels per group a
// multiple of kE and at most 32 * kE; z, dy and every vector 16-byte
// aligned (out and dz are new allocations).  Sums run in another order than
// the scalar kernels', so the two agree to rounding; each is bitwise
// reproducible.

// Warps per block: the launch's blocks are 32 * kWarps threads
// (ROW_WARPS in ops/gn_chain.py, which a CPU test ties to this value).
constexpr int kWarps = 8;

// Where a lane of the vectorised kernels sits.
struct VecLane {
  int g;          // its group (>= groups: a lane past the last group)
  int team_lane;  // its place in the group's team
  int col;        // its first channel
  bool active;    // it owns channels (every lane still joins the team sums)
  bool leader;    // the first lane of a real group
};

template <int kE>
__device__ __forceinline__ VecLane vec_lane(int cpg, i64 groups, int t) {
  const int lane = threadIdx.x & 31;
  VecLane l;
  l.g = blockIdx.x * (32 / t) + lane / t;
  l.team_lane = lane & (t - 1);
  const bool real = l.g < groups;
  l.active = real && l.team_lane < cpg / kE;
  l.leader = real && l.team_lane == 0;
  l.col = (real ? l.g * cpg : 0) + l.team_lane * kE;
  return l;
}

// Whether every lane of this block's warps owns channels (VecLane::active):
// channels per group fill the team (cpg = team * kE) and the block's slice
// of groups lies inside the tensor.  The row loops then run a copy of their
// code without the idle lanes' selects (walk_rows<true>), in fewer
// instructions (these kernels are bound by issue), with the same results
// except where the two copies contract a product and a sum into one FMA
// differently (test_gn_chain: below a unit of float32).
template <int kE>
__device__ __forceinline__ bool whole_warps(int cpg, i64 groups, int t) {
  return cpg == t * kE && (static_cast<i64>(blockIdx.x) + 1) * (32 / t) <= groups;
}

// A warp's walk over its rows first, first + kWarps, ... < row1 of the
// vectorised kernels: do_row(kWhole, buffer, r, cursor at row r) on the two
// row buffers in turn (each loads the row 2 kWarps ahead into its buffer);
// `at` a Cursor at row `first` (ahead(elements, stats) moves it), `step`
// and `stats_step` its moves over kWarps rows.  kWhole: see whole_warps; a
// constant in each copy of the loop, which the inlined do_row folds (NVRTC
// 12 refuses a generic lambda, which could take it as a type, in device
// code: it compiles one as host code).
template <bool kWhole, typename Cursor, typename Buffer, typename DoRow>
__device__ __forceinline__ void walk_rows(i64 first, i64 row1, Cursor at, i64 step, i64 stats_step,
                                          Buffer& even, Buffer& odd, DoRow& do_row) {
  for (i64 r = first; r < row1; r += 2 * kWarps, at = at.ahead(2 * step, 2 * stats_step)) {
    do_row(kWhole, even, r, at);
    if (r + kWarps < row1) do_row(kWhole, odd, r + kWarps, at.ahead(step, stats_step));
  }
}
template <typename Cursor, typename Buffer, typename DoRow>
__device__ __forceinline__ void walk_row_pairs(i64 first, i64 row1, Cursor at, i64 step, i64 stats_step,
                                               Buffer& even, Buffer& odd, bool whole, DoRow& do_row) {
  if (whole) {
    walk_rows<true>(first, row1, at, step, stats_step, even, odd, do_row);
  } else {
    walk_rows<false>(first, row1, at, step, stats_step, even, odd, do_row);
  }
}
// The same walk two rows at a time: do_row2(kWhole, even, odd, r, cursor
// at row r) for rows r and r + kWarps where both are below row1, a last
// row alone by do_row.
template <bool kWhole, typename Cursor, typename Buffer, typename DoRow, typename DoRow2>
__device__ __forceinline__ void walk_rows_by_two(i64 first, i64 row1, Cursor at, i64 step, i64 stats_step,
                                                 Buffer& even, Buffer& odd, DoRow& do_row, DoRow2& do_row2) {
  for (i64 r = first; r < row1; r += 2 * kWarps, at = at.ahead(2 * step, 2 * stats_step)) {
    if (r + kWarps < row1) {
      do_row2(kWhole, even, odd, r, at);
    } else {
      do_row(kWhole, even, r, at);
    }
  }
}
template <typename Cursor, typename Buffer, typename DoRow, typename DoRow2>
__device__ __forceinline__ void walk_row_pairs(i64 first, i64 row1, Cursor at, i64 step, i64 stats_step,
                                               Buffer& even, Buffer& odd, bool whole, DoRow& do_row,
                                               DoRow2& do_row2) {
  if (whole) {
    walk_rows_by_two<true>(first, row1, at, step, stats_step, even, odd, do_row, do_row2);
  } else {
    walk_rows_by_two<false>(first, row1, at, step, stats_step, even, odd, do_row, do_row2);
  }
}

// The backward's column vectors on a 16-bit z: held in registers
// (LaneVectors), with the lane's column sums and two rows of loads, they
// push the kernel past its 128 registers at 2 blocks per SM with 16-byte
// accesses (eight values per lane), and it spills.  So they sit in shared
// memory instead, one copy per block (every warp of a block covers the same
// columns), laid out [vector][quad][lane][4]: a lane reads four channels of
// a vector in one 16-byte load, and a warp's loads cover 512 contiguous
// bytes (no bank conflicts).
// BackwardVectors: registers, or (kShared) shared memory `smem` of kSlots
// floats, filled by the first warp (a barrier follows).  quad(lv, q): the
// lane's channels kQ q .. kQ q + kQ - 1 of every vector (kQ = 4, or kE where
// fewer), in registers, for the elements of one row (the shared form loads
// them again for every row, so that they never hold registers across rows).
template <int kE>
constexpr int kQuadOf = kE < 4 ? kE : 4;

template <bool kShared, typename TO, int kE, bool kFast>
struct BackwardVectors {
  static constexpr int kQ = kQuadOf<kE>;
  static constexpr int kSlots = 1;
  using type = LaneVectors<TO, kE, kFast>;
  static __device__ __forceinline__ type make(const ColumnVectors<TO, kFast>& p,
                                              const VecLane& l, float*) {
    type lv = {};
    if (l.active) lv.load(p, l.col);
    return lv;
  }
  static __device__ __forceinline__ LaneVectors<TO, kQ, kFast> quad(const type& lv, int q) {
    LaneVectors<TO, kQ, kFast> r;
#pragma unroll
    for (int k = 0; k < kQ; ++k) {
      r.lin_[k] = lv.lin_[kQ * q + k];
      r.extra_[k] = lv.extra_[kQ * q + k];
      r.gamma_[k] = lv.gamma_[kQ * q + k];
      r.beta_[k] = lv.beta_[kQ * q + k];
      r.mul_[k] = lv.mul_[kQ * q + k];
    }
    return r;
  }
};

template <typename TO, int kE, bool kFast>
struct BackwardVectors<true, TO, kE, kFast> {
  static_assert(kE % 4 == 0, "whole quads of channels");
  static constexpr int kQ = 4;
  static constexpr int kQuads = kE / 4;
  static constexpr int kSlots = 5 * kE * 32;
  struct type {
    unsigned base;  // shared address of the lane's first quad
  };
  static __device__ __forceinline__ type make(const ColumnVectors<TO, kFast>& p,
                                              const VecLane& l, float* smem) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
      LaneVectors<TO, kE, kFast> v = {};
      if (l.active) v.load(p, l.col);
      auto at = [&](int vector, int k) -> float& {
        return smem[((vector * kQuads + k / 4) * 32 + lane) * 4 + k % 4];
      };
#pragma unroll
      for (int k = 0; k < kE; ++k) {
        at(0, k) = v.lin_[k];
        at(1, k) = v.extra_[k];
        at(2, k) = v.gamma_[k];
        at(3, k) = v.beta_[k];
        at(4, k) = v.mul_[k];
      }
    }
    __syncthreads();
    return type{shared_addr(smem + 4 * lane)};
  }
  // asm volatile: loaded for each row, never hoisted into registers that
  // would live across the row loop.
  static __device__ __forceinline__ void load4(unsigned addr, float (&out)[4]) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3])
                 : "r"(addr));
  }
  static __device__ __forceinline__ LaneVectors<TO, 4, kFast> quad(const type& lv, int q) {
    LaneVectors<TO, 4, kFast> r;
    constexpr unsigned kVector = kQuads * 32 * 16;  // bytes of one vector
    const unsigned a = lv.base + q * 32 * 16;
    load4(a + 0 * kVector, r.lin_);
    load4(a + 1 * kVector, r.extra_);
    load4(a + 2 * kVector, r.gamma_);
    load4(a + 3 * kVector, r.beta_);
    load4(a + 4 * kVector, r.mul_);
    return r;
  }
};

// The rows [row0, row1) of this block's chunk.
__device__ __forceinline__ void chunk_rows(i64 rows, i64 rows_per_chunk, i64& row0, i64& row1) {
  row0 = static_cast<i64>(blockIdx.y) * rows_per_chunk;
  row1 = min(rows, row0 + rows_per_chunk);
}

template <typename T> constexpr bool kIsBfloat16 = false;
template <> constexpr bool kIsBfloat16<bfloat16> = true;

// Whether the vectorised forward takes a warp's rows two at a time
// (do_row2) or one by one (do_row): two where y has z's dtype, except for
// problem 94's chain (the one whose Pre has a gated derivative) on
// bfloat16.  Timed against each other in turns (H200, docs/performance.md,
// "Memory-bound kernels"), two rows were the faster in every other case
// with y in z's dtype, one row in that one and wherever a 16-bit z has a
// float32 y (autocast).
template <typename T, typename TO, typename Chain>
__device__ constexpr bool forward_pairs_rows() {
  return sizeof(T) == sizeof(TO) && !(Chain::kGatedPreGrad && kIsBfloat16<T>);
}

// Forward: grid = (slices, chunks).
template <typename T, typename Chain, int kE, typename TO, int kMinBlocks>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks) gn_chain_forward_vec(
    const T* __restrict__ z, TO* __restrict__ out, float* __restrict__ mean_out,
    float* __restrict__ rstd_out, const TO* __restrict__ lin_bias,
    const TO* __restrict__ extra_bias, const TO* __restrict__ gn_weight,
    const TO* __restrict__ gn_bias, const TO* __restrict__ mul_weight, i64 rows, i64 channels,
    i64 groups, i64 team, double eps, i64 round_statistics, i64 rows_per_chunk) {
  constexpr bool kFast = fast_math<T, Chain>();
  const ColumnVectors<TO, kFast> p =
      column_vectors<TO, kFast>(lin_bias, extra_bias, gn_weight, gn_bias, mul_weight);
  const int t = static_cast<int>(team);
  const bool round_stats = Chain::kRoundsLikeEager && round_statistics != 0;
  const int cpg = static_cast<int>(channels / groups);
  const VecLane l = vec_lane<kE>(cpg, groups, t);
  const float inv_cpg = 1.0f / static_cast<float>(cpg);
  const float feps = static_cast<float>(eps);
  i64 row0, row1;
  chunk_rows(rows, rows_per_chunk, row0, row1);
  LaneVectors<TO, kE, kFast> lv = {};
  if (l.active) lv.load(p, l.col);

  // The lane's addresses in row r, advanced by whole steps of rows (as in
  // gn_chain_backward_vec).
  struct Cursor {
    const T* z;
    TO* out;
    i64 pair;  // the (row, group) pair's index into mean_out / rstd_out
    __device__ __forceinline__ Cursor ahead(i64 elements, i64 pairs) const {
      return Cursor{z + elements, out + elements, pair + pairs};
    }
  };
  const i64 step = kWarps * channels, pair_step = kWarps * groups;
  auto load_row = [&](Packed<T, kE>& b, i64 r, const Cursor& at) {
    if (l.active && r < row1) b.load(at.z);
  };
  auto do_row = [&](bool whole, Packed<T, kE>& b, i64 r, const Cursor& at) {
    const bool active = whole || l.active;
    float v[kE];
    b.unpack(v);
    load_row(b, r + 2 * kWarps, at.ahead(2 * step, 2 * pair_step));
    float sum = 0.0f;
    // Every lane computes Pre (an idle lane on zeros) and selects: a branch
    // per value would cost more than the arithmetic.  (`active` is the
    // constant true in whole warps: no selects there.)
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      const float pre = Chain::pre(v[k], lv, k);
      v[k] = active ? pre : 0.0f;
      sum += v[k];
    }
    float mean = team_sum(sum, t) * inv_cpg;
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      const float d = v[k] - mean;
      if (active) sq += d * d;
    }
    float rstd;
    finish_statistics<T, Chain>(team_sum(sq, t), inv_cpg, feps, round_stats, mean, rstd);
    if (active) {
      float o[kE];
#pragma unroll
      for (int k = 0; k < kE; ++k)
        o[k] = Chain::post((v[k] - mean) * rstd * lv.gamma(k) + lv.beta(k), lv, k);
      store_vec<TO, kE>(at.out, o);
    }
    if (l.leader && mean_out) {
      mean_out[at.pair] = mean;
      rstd_out[at.pair] = rstd;
    }
  };
  // Rows r (from b0) and r + kWarps (from b1) side by side, each as do_row
  // computes it, bit for bit: the two rows' independent chains of dependent
  // instructions (the team sums' shuffles, the activations' MUFU
  // operations) overlap, and one loop's control serves both team sums.
  // (One body for one or two rows, with arrays of two, spilled at the 80
  // registers of 3 blocks per SM: hence a lambda of its own.)
  auto do_row2 = [&](bool whole, Packed<T, kE>& b0, Packed<T, kE>& b1, i64 r, const Cursor& at) {
    const bool active = whole || l.active;
    const Cursor at1 = at.ahead(step, pair_step);
    float v0[kE], v1[kE];
    b0.unpack(v0);
    b1.unpack(v1);
    load_row(b0, r + 2 * kWarps, at.ahead(2 * step, 2 * pair_step));
    load_row(b1, r + 3 * kWarps, at1.ahead(2 * step, 2 * pair_step));
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      const float pre0 = Chain::pre(v0[k], lv, k);
      const float pre1 = Chain::pre(v1[k], lv, k);
      v0[k] = active ? pre0 : 0.0f;
      v1[k] = active ? pre1 : 0.0f;
      sum0 += v0[k];
      sum1 += v1[k];
    }
    team_sum2(sum0, sum1, t);
    float mean0 = sum0 * inv_cpg, mean1 = sum1 * inv_cpg;
    float sq0 = 0.0f, sq1 = 0.0f;
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      const float d0 = v0[k] - mean0;
      const float d1 = v1[k] - mean1;
      if (active) {
        sq0 += d0 * d0;
        sq1 += d1 * d1;
      }
    }
    team_sum2(sq0, sq1, t);
    float rstd0, rstd1;
    finish_statistics<T, Chain>(sq0, inv_cpg, feps, round_stats, mean0, rstd0);
    finish_statistics<T, Chain>(sq1, inv_cpg, feps, round_stats, mean1, rstd1);
    if (active) {
      float o0[kE], o1[kE];
#pragma unroll
      for (int k = 0; k < kE; ++k) {
        o0[k] = Chain::post((v0[k] - mean0) * rstd0 * lv.gamma(k) + lv.beta(k), lv, k);
        o1[k] = Chain::post((v1[k] - mean1) * rstd1 * lv.gamma(k) + lv.beta(k), lv, k);
      }
      store_vec<TO, kE>(at.out, o0);
      store_vec<TO, kE>(at1.out, o1);
    }
    if (l.leader && mean_out) {
      mean_out[at.pair] = mean0;
      rstd_out[at.pair] = rstd0;
      mean_out[at1.pair] = mean1;
      rstd_out[at1.pair] = rstd1;
    }
  };
  // Two rows of loads in flight per lane; warp-uniform trip counts (the
  // team sums need every lane of the warp).
  constexpr bool kPairRows = forward_pairs_rows<T, TO, Chain>();
  Packed<T, kE> even = {}, odd = {};
  const i64 first = row0 + threadIdx.x / 32;
  const Cursor start{z, out, 0};
  Cursor at = start.ahead(first * channels + l.col, first * groups + l.g);
  load_row(even, first, at);
  load_row(odd, first + kWarps, at.ahead(step, pair_step));
  if constexpr (kPairRows) {
    walk_row_pairs(first, row1, at, step, pair_step, even, odd, whole_warps<kE>(cpg, groups, t), do_row,
                   do_row2);
  } else {
    walk_row_pairs(first, row1, at, step, pair_step, even, odd, whole_warps<kE>(cpg, groups, t), do_row);
  }
}

// The vectorised backward's walk over the warp's rows (kExact: see
// gn_chain_backward_rows): stores dz and adds each row's terms to acc.  lv:
// the kernel's column vectors (BackwardVectors).
template <bool kExact, typename T, typename Chain, int kE, typename TO, typename LV>
__device__ __forceinline__ void gn_chain_backward_vec_rows(CF_GN_BACKWARD_PARAMS, const LV& lv,
                                                           float (&acc)[Chain::kSlots][kE]) {
  constexpr int S = Chain::kSlots;
  constexpr bool kFast = fast_math<T, Chain>();
  const ColumnVectors<TO, kFast> p =
      column_vectors<TO, kFast>(lin_bias, extra_bias, gn_weight, gn_bias, mul_weight);
  const int t = static_cast<int>(team);
  const int cpg = static_cast<int>(channels / groups);
  const VecLane l = vec_lane<kE>(cpg, groups, t);
  const bool real = l.g < groups;
  const float inv_cpg = 1.0f / static_cast<float>(cpg);
  i64 row0, row1;
  chunk_rows(rows, rows_per_chunk, row0, row1);

  using Vectors = BackwardVectors<sizeof(T) == 2, TO, kE, kFast>;

  struct Row {
    Packed<T, kE> z;
    Packed<TO, kE> dy;
    float mu, rs;
  };
  // The lane's addresses in row r (z, dy and dz at its columns; the mean
  // at its group), advanced by whole steps of rows: a row's offsets
  // recomputed from r would cost 64-bit products on every row, in a kernel
  // bound by issue.  1/std is read at a fixed distance from the mean (both
  // planes of one allocation, ops/gn_chain.py's _stats_pointers) rather
  // than through a fifth pointer stepped on every row.  dy moves by
  // dy_dense times as far: a dy broadcast from one value (dy_dense 0) is
  // kE copies of it, which every lane reads for every row, so that the row
  // loop holds no branch on dy_dense.
  struct Cursor {
    const T* z;
    const TO* dy;
    T* dz;
    const float* mu;
    int dy_dense;
    __device__ __forceinline__ Cursor ahead(i64 elements, i64 stats) const {
      return Cursor{z + elements, dy + elements * dy_dense, dz + elements, mu + stats, dy_dense};
    }
  };
  const i64 rs_from_mu = rstd - mean;
  // A row's loads, with no test of the row (the caller's: load_next); in
  // whole warps with no test at all.
  auto load_row = [&](bool whole, Row& b, const Cursor& at) {
    if (whole || l.active) {
      b.z.load(at.z);
      b.dy.load(at.dy);
    }
    if (whole || real) {
      b.mu = *at.mu;
      b.rs = at.mu[rs_from_mu];
    }
  };
  const i64 step = kWarps * channels, stats_step = kWarps * groups;
  // The buffer's next row, r + 2 kWarps.  Where dy has z's dtype, past the
  // chunk's last row the loads take row r again (wasted, never out of
  // bounds), so that in whole warps no branch surrounds them either: a
  // branch would keep the buffer's old registers alive beside the new
  // loads, and copy them back on every row.  Under autocast they stay
  // behind the test: there the new row's registers (a float32 dy is twice
  // z's) cannot all be live beside the old ones without spilling.
  auto load_next = [&](bool whole, Row& b, i64 r, const Cursor& at) {
    const bool more = r + 2 * kWarps < row1;
    if constexpr (sizeof(TO) == sizeof(T)) {
      load_row(whole, b, at.ahead(more ? 2 * step : 0, more ? 2 * stats_step : 0));
    } else {
      if (more) load_row(whole, b, at.ahead(2 * step, 2 * stats_step));
    }
  };
  auto do_row = [&](bool whole, Row& b, i64 r, const Cursor& at) {
    const bool active = whole || l.active;
    float zs[kE], dys[kE];
    b.z.unpack(zs);
    b.dy.unpack(dys);
    const float mu = real ? b.mu : 0.0f;
    const float rs = real ? b.rs : 0.0f;
    load_next(whole, b, r, at);
    float xh[kE], dxh[kE], dyh[kE], mg[kE], pg[kE], vs[kE];
    float s1 = 0.0f, s2 = 0.0f, sdv = 0.0f;
    // Every lane computes (an idle lane on zeros) and an idle lane's terms
    // are zeroed: a branch per value would cost more than the arithmetic.
    // (`active` is the constant true in whole warps: no selects there.)
#pragma unroll
    for (int q = 0; q < kE / Vectors::kQ; ++q) {
      const LaneVectors<TO, Vectors::kQ, kFast> qv = Vectors::quad(lv, q);
#pragma unroll
      for (int kk = 0; kk < Vectors::kQ; ++kk) {
        const int k = Vectors::kQ * q + kk;
        const float v = Chain::pre_with_grad(zs[k], qv, kk, pg[k]);
        const float d = element_backward_from_pre<Chain, kExact>(v, dys[k], mu, rs, kk, qv, xh[k],
                                                                 dyh[k], mg[k]);
        dxh[k] = active ? d : 0.0f;
        xh[k] = active ? xh[k] : 0.0f;
        s1 += dxh[k];
        s2 += dxh[k] * xh[k];
        if (kExact) {
          vs[k] = Chain::template pre_reference<T>(v, zs[k], qv, kk, lin_bias == nullptr);
          sdv += dxh[k] * vs[k];
        }
      }
    }
    team_sum2(s1, s2, t);
    UncentredGroup u = {};
    if (kExact) u = uncentred_group(s1, team_sum(sdv, t), mu, rs, inv_cpg);
    s1 *= inv_cpg;
    s2 *= inv_cpg;
    if (active) {
      float d[kE];
      if constexpr (kExact) {
        const bool uncentred = !group_sums_finite(s1, s2);
#pragma unroll
        for (int q = 0; q < kE / Vectors::kQ; ++q) {
          const LaneVectors<TO, Vectors::kQ, kFast> qv = Vectors::quad(lv, q);
#pragma unroll
          for (int kk = 0; kk < Vectors::kQ; ++kk) {
            const int k = Vectors::kQ * q + kk;
            const float dv =
                uncentred ? u.dv(dxh[k], vs[k]) : rs * (dxh[k] - s1 - xh[k] * s2);
            d[k] = pre_backward<Chain, T>(dv, pg[k], zs[k], qv, kk, uncentred, lin_bias == nullptr);
            float vals[S];
            slot_values_exact<Chain>(vals, d[k], dv, xh[k], dyh[k], mg[k], uncentred, vs[k], mu,
                                     rs);
#pragma unroll
            for (int s = 0; s < S; ++s) acc[s][k] += vals[s];
          }
        }
      } else {
#pragma unroll
        for (int k = 0; k < kE; ++k) {
          const float dv = rs * (dxh[k] - s1 - xh[k] * s2);
          d[k] = times_pre_grad<Chain>(dv, pg[k]);
          float vals[S];
          slot_values<Chain>(vals, d[k], dv, xh[k], dyh[k], mg[k]);
#pragma unroll
          for (int s = 0; s < S; ++s) acc[s][k] += vals[s];
        }
      }
      store_vec<T, kE>(at.dz, d);
    }
  };
  // Rows r (from b0) and r + kWarps (from b1) side by side, as
  // gn_chain_forward_vec's do_row2: do_row's formulas for each value, the
  // terms added to acc row r's first.  Outside the exact walk, on a float32
  // z only: with 16-bit values (their vectors reread from shared memory)
  // it spills at the 128 registers of 2 blocks per SM.
  auto do_row2 = [&](bool whole, Row& b0, Row& b1, i64 r, const Cursor& at) {
    const bool active = whole || l.active;
    const Cursor at1 = at.ahead(step, stats_step);
    float zs[2][kE], dys[2][kE];
    b0.z.unpack(zs[0]);
    b1.z.unpack(zs[1]);
    b0.dy.unpack(dys[0]);
    b1.dy.unpack(dys[1]);
    const float mu[2] = {real ? b0.mu : 0.0f, real ? b1.mu : 0.0f};
    const float rs[2] = {real ? b0.rs : 0.0f, real ? b1.rs : 0.0f};
    load_next(whole, b0, r, at);
    load_next(whole, b1, r + kWarps, at1);
    float xh[2][kE], dxh[2][kE], dyh[2][kE], mg[2][kE], pg[2][kE];
    float s1[2] = {0.0f, 0.0f}, s2[2] = {0.0f, 0.0f};
#pragma unroll
    for (int q = 0; q < kE / Vectors::kQ; ++q) {
      const LaneVectors<TO, Vectors::kQ, kFast> qv = Vectors::quad(lv, q);
#pragma unroll
      for (int kk = 0; kk < Vectors::kQ; ++kk) {
        const int k = Vectors::kQ * q + kk;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const float v = Chain::pre_with_grad(zs[n][k], qv, kk, pg[n][k]);
          const float d = element_backward_from_pre<Chain>(v, dys[n][k], mu[n], rs[n], kk, qv,
                                                           xh[n][k], dyh[n][k], mg[n][k]);
          dxh[n][k] = active ? d : 0.0f;
          xh[n][k] = active ? xh[n][k] : 0.0f;
          s1[n] += dxh[n][k];
          s2[n] += dxh[n][k] * xh[n][k];
        }
      }
    }
    float sums[4] = {s1[0], s2[0], s1[1], s2[1]};
    team_sums(sums, t);
    // (The means as products of their own, __fmul_rn: no FMA absorbs them.)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s1[n] = __fmul_rn(sums[2 * n], inv_cpg);
      s2[n] = __fmul_rn(sums[2 * n + 1], inv_cpg);
    }
    if (active) {
      float d[2][kE];
#pragma unroll
      for (int k = 0; k < kE; ++k) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const float dv = rs[n] * (dxh[n][k] - s1[n] - xh[n][k] * s2[n]);
          d[n][k] = times_pre_grad<Chain>(dv, pg[n][k]);
          float vals[S];
          slot_values<Chain>(vals, d[n][k], dv, xh[n][k], dyh[n][k], mg[n][k]);
#pragma unroll
          for (int s = 0; s < S; ++s) acc[s][k] += vals[s];
        }
      }
      store_vec<T, kE>(at.dz, d[0]);
      store_vec<T, kE>(at1.dz, d[1]);
    }
  };
  Row even = {}, odd = {};
  const int warp = threadIdx.x / 32;
  const i64 first = row0 + warp;
  Cursor at{z, dy, dz_out, mean, static_cast<int>(dy_dense)};
  at = at.ahead(first * channels + l.col, first * groups + l.g);
  if (first < row1) load_row(false, even, at);
  if (first + kWarps < row1) load_row(false, odd, at.ahead(step, stats_step));
  if constexpr (!kExact && sizeof(T) == 4) {
    walk_row_pairs(first, row1, at, step, stats_step, even, odd, whole_warps<kE>(cpg, groups, t), do_row,
                   do_row2);
  } else {
    walk_row_pairs(first, row1, at, step, stats_step, even, odd, whole_warps<kE>(cpg, groups, t), do_row);
  }
}

// The exact walk: the warp's column sums afresh, into fresh[slot * kE + k].
template <typename T, typename Chain, int kE, typename TO, typename LV>
__device__ __noinline__ void gn_chain_backward_vec_exact(CF_GN_BACKWARD_PARAMS, LV lv,
                                                         float* fresh) {
  float acc[Chain::kSlots][kE];
#pragma unroll
  for (int s = 0; s < Chain::kSlots; ++s)
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[s][k] = 0.0f;
  gn_chain_backward_vec_rows<true, T, Chain, kE, TO>(CF_GN_BACKWARD_ARGS, lv, acc);
#pragma unroll
  for (int s = 0; s < Chain::kSlots; ++s)
#pragma unroll
    for (int k = 0; k < kE; ++k) fresh[s * kE + k] = acc[s][k];
}

// Backward: grid = (slices, chunks).  Writes dz and, per chunk, the column
// sums partial[chunk][slot][channels] (double) that reduce_column_partials
// folds in order.  A lane sums its columns over its rows in float
// (ops/gn_chain.py bounds the rows per warp); the block's warps are then
// combined in double, in warp order, through shared memory.
// dy_dense == 0: dy is one value broadcast to every element, given as at
// least kE copies of it (ops/gn_chain.py, BROADCAST_DY_VALUES).
template <typename T, typename Chain, int kE, typename TO, int kMinBlocks>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks) gn_chain_backward_vec(
    const T* __restrict__ z, const TO* __restrict__ dy, i64 dy_dense,
    const float* __restrict__ mean, const float* __restrict__ rstd,
    const TO* __restrict__ lin_bias, const TO* __restrict__ extra_bias,
    const TO* __restrict__ gn_weight, const TO* __restrict__ gn_bias,
    const TO* __restrict__ mul_weight, T* __restrict__ dz_out, double* __restrict__ partial,
    i64 rows, i64 channels, i64 groups, i64 team, i64 rows_per_chunk) {
  constexpr int S = Chain::kSlots;
  constexpr bool kFast = fast_math<T, Chain>();
  const ColumnVectors<TO, kFast> p =
      column_vectors<TO, kFast>(lin_bias, extra_bias, gn_weight, gn_bias, mul_weight);
  const int t = static_cast<int>(team);
  const int cpg = static_cast<int>(channels / groups);
  const VecLane l = vec_lane<kE>(cpg, groups, t);
  using Vectors = BackwardVectors<sizeof(T) == 2, TO, kE, kFast>;
  __shared__ __align__(16) float vector_smem[Vectors::kSlots];  // 16-byte loads (quad)
  const typename Vectors::type lv = Vectors::make(p, l, vector_smem);
  float acc[S][kE];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[s][k] = 0.0f;
  gn_chain_backward_vec_rows<false, T, Chain, kE, TO>(CF_GN_BACKWARD_ARGS, lv, acc);
  bool finite = true;
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int k = 0; k < kE; ++k) finite = finite && isfinite(acc[s][k]);
  if (!__all_sync(0xffffffffu, finite)) {
    float fresh[S * kE];
    gn_chain_backward_vec_exact<T, Chain, kE, TO>(CF_GN_BACKWARD_ARGS, lv, fresh);
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int k = 0; k < kE; ++k) acc[s][k] = fresh[s * kE + k];
  }

  // The warps' sums of each column, added in warp order.
  __shared__ float sums[kWarps][32 * kE];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  double* part = partial + static_cast<i64>(blockIdx.y) * S * channels;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s) __syncthreads();  // the previous slot's reads are done
#pragma unroll
    for (int k = 0; k < kE; ++k) sums[warp][lane * kE + k] = acc[s][k];
    __syncthreads();
    for (int e = threadIdx.x; e < 32 * kE; e += 32 * kWarps) {
      double total = 0.0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += sums[w][e];
      const int owner = e / kE;  // the lane whose column this is
      const int g = blockIdx.x * (32 / t) + owner / t;
      const int team_lane = owner & (t - 1);
      if (g < groups && team_lane < cpg / kE)
        part[s * channels + g * cpg + team_lane * kE + (e - owner * kE)] = total;
    }
  }
}

#undef CF_GN_BACKWARD_PARAMS
#undef CF_GN_BACKWARD_ARGS

}  // namespace cf
