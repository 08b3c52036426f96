// The op chains around a GroupNorm of problems 37, 88 and 94, shared by the
// standalone GroupNorm epilogue kernels (gn_chain.cu) and the GEMM kernel
// whose store applies them (gemm_tf32_gn.cu):
//
//     v  = Pre(z)                      elementwise, before the norm
//     x^ = (v - mean_g) * rstd_g       GroupNorm over the channels of group g
//     y^ = x^ * gn_weight + gn_bias
//     y  = Post(y^)                    elementwise, after the norm
#pragma once
#include "cf_common.cuh"

namespace cf {

// The per-column vectors a chain may read; null where the model has none.
template <typename T>
struct ColumnVectors {
  const T* lin_bias;    // nn.Linear bias, added to the GEMM output
  const T* extra_bias;  // the model's own `bias` parameter
  const T* gn_weight;
  const T* gn_bias;
  const T* mul_weight;  // problem 88's multiply_weight
};

// Backward slots: per-column sums the backward emits, one parameter gradient
// each.  A chain names the slot index of each sum it needs (-1: not needed);
// slots are numbered 0..kSlots-1 in the order the Python side expects.
//   sum dz       -> grad of the linear bias (and of a bias added before Pre's
//                   nonlinearity)
//   sum dv       -> grad of a bias added after Pre's nonlinearity
//   sum dy^ * x^ -> grad of gn_weight;  sum dy^ -> grad of gn_bias
//   sum dm * a   -> grad of mul_weight

// kEagerRounding (used in float16 / bfloat16 only): round the chain's
// intermediates to T where eager PyTorch does (every op returns a tensor of
// the input's dtype), so that the output matches eager's to about one unit
// in the last place.  Off, the chain stays in float32 and rounds once at the
// store: closer to the exact result, but up to a few units away from eager's
// (which the normalisation magnifies where a group's spread is small).
// With it off, every eager_round is the identity and each formula below is
// exactly the unrounded one.  (The GroupNorm's own statistics are rounded,
// where eager's are, by the kernel: see round_statistics in gn_chain.cuh.)
template <typename T, bool kEagerRounding>
__device__ __forceinline__ float eager_round(float v) {
  return kEagerRounding ? to_float(from_float<T>(v)) : v;
}

// Chain::pre must give bit-identical values in the forward and in the
// backward, which recomputes x^ = (pre(z) - mean) * rstd from the saved
// statistics (with one channel per group x^ is exactly 0 only then).  Plain
// `a * b + c` may be contracted into an FMA in one context and not in the
// other, so pre() spells its adds and multiplies with __fadd_rn / __fmul_rn,
// which are never contracted.

// Post = identity: the chains that end with the GroupNorm (37, 94).
struct PostIdentity {
  template <typename T>
  __device__ static float post(float yh, const ColumnVectors<T>&, i64) { return yh; }
  template <typename T>
  __device__ static float post_backward(float, float dy, const ColumnVectors<T>&, i64, float&) {
    return dy;
  }
};

// Problem 37: v = swish(z + lin_bias) + bias; Post = identity.
// (Eager: s = sigmoid(z); u = s * z; v = u + bias, each rounded.)
template <bool kEagerRounding>
struct ChainSwishBiasGN : PostIdentity {
  static constexpr bool kRoundsLikeEager = kEagerRounding;
  static constexpr int kSlots = 4, kSlotDZ = 0, kSlotDV = 1, kSlotGamma = 2, kSlotBeta = 3,
                       kSlotMul = -1;
  template <typename T>
  __device__ static float pre(float z, const ColumnVectors<T>& p, i64 c) {
    const float zb = __fadd_rn(z, load_or(p.lin_bias, c, 0.0f));
    const float s = eager_round<T, kEagerRounding>(sigmoidf(zb));
    return eager_round<T, kEagerRounding>(
        __fadd_rn(eager_round<T, kEagerRounding>(__fmul_rn(zb, s)), load_or(p.extra_bias, c, 0.0f)));
  }
  template <typename T>
  __device__ static float pre_grad(float z, const ColumnVectors<T>& p, i64 c) {
    return swish_grad(z + load_or(p.lin_bias, c, 0.0f));
  }
};

// Problem 88: v = z + lin_bias; y = swish(swish(y^) * mul_weight).
// (Eager: y^ rounded; a = y^ * sigmoid(y^); m = a * w; y = m * sigmoid(m),
// each sigmoid and product rounded.)
template <bool kEagerRounding>
struct ChainGNSwishMulSwish {
  static constexpr bool kRoundsLikeEager = kEagerRounding;
  static constexpr int kSlots = 4, kSlotDZ = 0, kSlotDV = -1, kSlotGamma = 1, kSlotBeta = 2,
                       kSlotMul = 3;
  template <typename T>
  __device__ static float pre(float z, const ColumnVectors<T>& p, i64 c) {
    return __fadd_rn(z, load_or(p.lin_bias, c, 0.0f));
  }
  template <typename T>
  __device__ static float pre_grad(float, const ColumnVectors<T>&, i64) { return 1.0f; }
  template <typename T>
  __device__ static float post(float yh, const ColumnVectors<T>& p, i64 c) {
    const float g = eager_round<T, kEagerRounding>(yh);
    const float a = eager_round<T, kEagerRounding>(
        __fmul_rn(g, eager_round<T, kEagerRounding>(sigmoidf(g))));
    const float m = eager_round<T, kEagerRounding>(a * to_float(p.mul_weight[c]));
    return __fmul_rn(m, eager_round<T, kEagerRounding>(sigmoidf(m)));
  }
  // a = swish(y^), m = a * w, y = swish(m):  dm = dy swish'(m),
  // d(w) += dm * a,  dy^ = dm * w * swish'(y^).
  template <typename T>
  __device__ static float post_backward(float yh, float dy, const ColumnVectors<T>& p, i64 c,
                                        float& mul_grad) {
    const float w = to_float(p.mul_weight[c]);
    const float a = swishf(yh);
    const float dm = dy * swish_grad(a * w);
    mul_grad = dm * a;
    return dm * w * swish_grad(yh);
  }
};

// Problem 94: v = mish(hardtanh(z + lin_bias + bias)); Post = identity.
// Both biases sit before the nonlinearity, so both gradients are sum dz.
// (Eager: z + bias rounded; hardtanh exact; mish rounded.)
template <bool kEagerRounding>
struct ChainBiasHardtanhMishGN : PostIdentity {
  static constexpr bool kRoundsLikeEager = kEagerRounding;
  static constexpr int kSlots = 3, kSlotDZ = 0, kSlotDV = -1, kSlotGamma = 1, kSlotBeta = 2,
                       kSlotMul = -1;
  template <typename T>
  __device__ static float pre(float z, const ColumnVectors<T>& p, i64 c) {
    return eager_round<T, kEagerRounding>(mishf(hardtanhf(eager_round<T, kEagerRounding>(
        __fadd_rn(__fadd_rn(z, load_or(p.lin_bias, c, 0.0f)), load_or(p.extra_bias, c, 0.0f))))));
  }
  template <typename T>
  __device__ static float pre_grad(float z, const ColumnVectors<T>& p, i64 c) {
    const float u =
        __fadd_rn(__fadd_rn(z, load_or(p.lin_bias, c, 0.0f)), load_or(p.extra_bias, c, 0.0f));
    return hardtanh_grad(u) * mish_grad(hardtanhf(u));
  }
};

template <typename T>
__device__ __forceinline__ ColumnVectors<T> column_vectors(const T* lin_bias, const T* extra_bias,
                                                           const T* gn_weight, const T* gn_bias,
                                                           const T* mul_weight) {
  ColumnVectors<T> p;
  p.lin_bias = lin_bias;
  p.extra_bias = extra_bias;
  p.gn_weight = gn_weight;
  p.gn_bias = gn_bias;
  p.mul_weight = mul_weight;
  return p;
}

}  // namespace cf
