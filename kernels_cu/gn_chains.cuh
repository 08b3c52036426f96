// The op chains around a GroupNorm of problems 37, 88 and 94, shared by the
// standalone GroupNorm epilogue kernels (gn_chain.cu) and the GEMM kernel
// whose store applies them (linear_gn_chain.cu):
//
//     v  = Pre(z)                      elementwise, before the norm
//     x^ = (v - mean_g) * rstd_g       GroupNorm over the channels of group g
//     y^ = x^ * gn_weight + gn_bias
//     y  = Post(y^)                    elementwise, after the norm
#pragma once
#include "cf_common.cuh"

namespace cf {

// The per-column vectors a chain may read; null where the model has none.
// Chains read them through the accessors (column c), which this type (global
// memory), LaneVectors (a lane's columns, in registers) and SharedVectors
// (a tile's columns, in shared memory) provide;
// value_type is the dtype the eager-rounding chains round to; kFast selects
// the fast activations (cf_common.cuh).
template <typename T, bool kFastMath = false>
struct ColumnVectors {
  using value_type = T;
  static constexpr bool kFast = kFastMath;
  const T* lin_bias;    // nn.Linear bias, added to the GEMM output
  const T* extra_bias;  // the model's own `bias` parameter
  const T* gn_weight;
  const T* gn_bias;
  const T* mul_weight;  // problem 88's multiply_weight
  __device__ __forceinline__ float lin(i64 c) const { return load_or(lin_bias, c, 0.0f); }
  __device__ __forceinline__ float extra(i64 c) const { return load_or(extra_bias, c, 0.0f); }
  __device__ __forceinline__ float gamma(i64 c) const { return load_or(gn_weight, c, 1.0f); }
  __device__ __forceinline__ float beta(i64 c) const { return load_or(gn_bias, c, 0.0f); }
  __device__ __forceinline__ float mul(i64 c) const { return to_float(mul_weight[c]); }
};

// N consecutive columns of every vector, loaded once into registers with
// wide loads (load_vec): the vectorised kernels read a column's values from
// here, indexed by the column's place among the N (accessors as above).
// Vectors a chain never reads are never loaded (the loads are dead code).
template <typename T, int N, bool kFastMath = false>
struct LaneVectors {
  using value_type = T;
  static constexpr bool kFast = kFastMath;
  float lin_[N], extra_[N], gamma_[N], beta_[N], mul_[N];
  template <bool kF>
  __device__ __forceinline__ void load(const ColumnVectors<T, kF>& p, i64 col0) {
    load_vec_or<T, N>(p.lin_bias ? p.lin_bias + col0 : nullptr, lin_, 0.0f);
    load_vec_or<T, N>(p.extra_bias ? p.extra_bias + col0 : nullptr, extra_, 0.0f);
    load_vec_or<T, N>(p.gn_weight ? p.gn_weight + col0 : nullptr, gamma_, 1.0f);
    load_vec_or<T, N>(p.gn_bias ? p.gn_bias + col0 : nullptr, beta_, 0.0f);
    load_vec_or<T, N>(p.mul_weight ? p.mul_weight + col0 : nullptr, mul_, 0.0f);
  }
  __device__ __forceinline__ float lin(int k) const { return lin_[k]; }
  __device__ __forceinline__ float extra(int k) const { return extra_[k]; }
  __device__ __forceinline__ float gamma(int k) const { return gamma_[k]; }
  __device__ __forceinline__ float beta(int k) const { return beta_[k]; }
  __device__ __forceinline__ float mul(int k) const { return mul_[k]; }
};

// The vectors as floats in shared memory: value i of vector v (lin, extra,
// gamma, beta, mul) at shared address base + 4 * (v * kVectorStride + i *
// kStride).  Each use loads it again (asm volatile), so the compiler cannot
// hoist the values into registers: kernels keep them here because registers
// would not hold them.  kLinInZ: the linear bias is already in z (the
// one-launch GEMM's store): lin() is 0, and bias() reads the bias itself.
template <typename T, bool kFastMath, int kVectorStride, int kStride, bool kLinInZ = false>
struct SharedVectors {
  using value_type = T;
  static constexpr bool kFast = kFastMath;
  unsigned base;  // shared-window address (shared_addr)
  __device__ __forceinline__ float at(int v, int i) const {
    float r;
    asm volatile("ld.shared.f32 %0, [%1];\n"
                 : "=f"(r) : "r"(base + 4u * (v * kVectorStride + i * kStride)));
    return r;
  }
  __device__ __forceinline__ float lin(int i) const { return kLinInZ ? 0.0f : at(0, i); }
  __device__ __forceinline__ float bias(int i) const { return at(0, i); }
  __device__ __forceinline__ float extra(int i) const { return at(1, i); }
  __device__ __forceinline__ float gamma(int i) const { return at(2, i); }
  __device__ __forceinline__ float beta(int i) const { return at(3, i); }
  __device__ __forceinline__ float mul(int i) const { return at(4, i); }
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

// The least float that rounds (to nearest, ties to even) to 1 or more in
// T: the midpoint below 1 (1 - 2^-9 in bfloat16, 1 - 2^-12 in half), which
// rounds up to 1's even significand.  So |round_T(s)| >= 1 exactly where
// |s| >= it, and a NaN fails both.
template <typename T> constexpr float kUnitRoundingThreshold = 1.0f;
template <> constexpr float kUnitRoundingThreshold<bfloat16> = 0.998046875f;
template <> constexpr float kUnitRoundingThreshold<half> = 0.999755859375f;

// Chain::pre must give bit-identical values in the forward and in the
// backward, which recomputes x^ = (pre(z) - mean) * rstd from the saved
// statistics (with one channel per group x^ is exactly 0 only then).  Plain
// `a * b + c` may be contracted into an FMA in one context and not in the
// other, so pre() spells its adds and multiplies with __fadd_rn / __fmul_rn,
// which are never contracted.

// Post = identity: the chains that end with the GroupNorm (37, 94).
struct PostIdentity {
  static constexpr bool kGroupNormIsLast = true;
  template <typename P, typename C>
  __device__ static float post(float yh, const P&, C) { return yh; }
  template <typename P, typename C>
  __device__ static float post_backward(float, float dy, const P&, C, float&) {
    return dy;
  }
  template <typename P, typename C>
  __device__ static float post_backward_exact(float, float dy, const P&, C, float&) {
    return dy;
  }
};

// Pre and its derivative alone, for a chain that computes both in one
// pre_with_grad (sharing the activation's exp).
template <typename Chain>
struct PreFromPreWithGrad {
  template <typename P, typename C>
  __device__ static float pre(float z, const P& p, C c) {
    float unused;
    return Chain::pre_with_grad(z, p, c, unused);
  }
  template <typename P, typename C>
  __device__ static float pre_grad(float z, const P& p, C c) {
    float grad;
    Chain::pre_with_grad(z, p, c, grad);
    return grad;
  }
};

// dv times Pre's derivative.  Where a chain's derivative is a gate (0 where
// hardtanh saturates), the product is 0 whatever dv is, NaN included, as
// eager's hardtanh_backward selects rather than multiplies.
template <typename Chain>
__device__ __forceinline__ float times_pre_grad(float dv, float grad) {
  if constexpr (Chain::kGatedPreGrad) return grad == 0.0f ? 0.0f : dv * grad;
  else return dv * grad;
}

// dz from dv in a group that meets a NaN or +-inf from the upstream gradient
// (`exact`, gn_chain.cuh's exact rows): where dv is not finite, a chain
// whose Pre autograd differentiates as a product of separate ops
// (kDecomposedPre) takes autograd's decomposition, whose NaN and +-inf
// differ from those of dv times the fused derivative.  TZ: z's dtype;
// x_in_z: no linear bias reaches the kernel (none, or the GEMM added it).
template <typename Chain, typename TZ, typename P, typename C>
__device__ __forceinline__ float pre_backward(float dv, float grad, float z, const P& p, C c,
                                              bool exact, bool x_in_z) {
  if constexpr (Chain::kDecomposedPre) {
    if (exact && !isfinite(dv))
      return Chain::template pre_backward_decomposed<TZ>(dv, z, p, c, x_in_z);
  }
  return times_pre_grad<Chain>(dv, grad);
}

// Problem 37: v = swish(z + lin_bias) + bias; Post = identity.
// (Eager: s = sigmoid(z); u = s * z; v = u + bias, each rounded.)
template <bool kEagerRounding>
struct ChainSwishBiasGN : PostIdentity, PreFromPreWithGrad<ChainSwishBiasGN<kEagerRounding>> {
  static constexpr bool kRoundsLikeEager = kEagerRounding;
  static constexpr bool kGatedPreGrad = false;
  static constexpr bool kDecomposedPre = true;
  static constexpr int kSlots = 4, kSlotDZ = 0, kSlotDV = 1, kSlotGamma = 2, kSlotBeta = 3,
                       kSlotMul = -1;
  // Pre and its derivative from one sigmoid (grad: d Pre / dz).
  template <typename P, typename C>
  __device__ static float pre_with_grad(float z, const P& p, C c, float& grad) {
    using T = typename P::value_type;
    const float zb = __fadd_rn(z, p.lin(c));
    const float s0 = sigmoid_of<P::kFast>(zb);
    // (zb s0 rounded before its FMA with 1 - s0, as the plain product
    // compiles; without eager rounding it is Pre's own product, s = s0,
    // computed once for both.)
    grad = s0 + __fmul_rn(zb, s0) * (1.0f - s0);
    const float s = eager_round<T, kEagerRounding>(s0);
    return eager_round<T, kEagerRounding>(
        __fadd_rn(eager_round<T, kEagerRounding>(__fmul_rn(zb, s)), p.extra(c)));
  }
  // Pre in two steps, pre_tail(pre_head(z), extra_bias), the same bits as
  // pre (without eager rounding): the swish, then its bias.  The one-launch
  // forward with a float32 y (linear_gn_chain.cu) keeps the swish between
  // its two passes rounded to z's dtype, where the reference under autocast
  // holds it too (the product of z and its sigmoid, both in z's dtype), and
  // its second pass adds the bias instead of computing the sigmoid again.
  static constexpr bool kSplitPre = true;
  template <typename P, typename C>
  __device__ static float pre_head(float z, const P& p, C c) {
    const float zb = __fadd_rn(z, p.lin(c));
    return __fmul_rn(zb, sigmoid_of<P::kFast>(zb));
  }
  __device__ static float pre_tail(float head, float extra_bias) { return __fadd_rn(head, extra_bias); }
  // x = z + lin_bias and s = sigmoid(x) as the reference holds them: in z's
  // dtype TZ where x is z itself (x_in_z) or z plus a 16-bit linear bias
  // (x rounded, then its sigmoid rounded), in float32 where a float32 bias
  // (autocast's) promoted the sum.  A 16-bit s is 1 where the float one is
  // not (x above about 6.2 in bfloat16, 8.3 in float16).  The accurate
  // sigmoid, as the reference's (the exact walk alone calls this).
  template <typename TZ, typename P, typename C>
  __device__ static void reference_x_s(float z, const P& p, C c, bool x_in_z, float& x,
                                       float& s) {
    const bool rounds = x_in_z || sizeof(typename P::value_type) == 2;
    x = x_in_z ? z : __fadd_rn(z, p.lin(c));
    if (rounds) x = eager_round<TZ, true>(x);
    s = sigmoid_of<false>(x);
    if (rounds) s = eager_round<TZ, true>(s);
  }
  // Autograd's swish: MulBackward's dv s plus SigmoidBackward's
  // ((dv x)(1 - s)) s (see pre_backward), on x and s as the reference holds
  // them: a 16-bit s of 1 makes an infinite dv's second term NaN.
  template <typename TZ, typename P, typename C>
  __device__ static float pre_backward_decomposed(float dv, float z, const P& p, C c,
                                                  bool x_in_z) {
    float x, s;
    reference_x_s<TZ>(z, p, c, x_in_z, x, s);
    return dv * s + ((dv * x) * (1.0f - s)) * s;
  }
  // v as the reference holds it (see pre_reference in gn_chain.cuh): the
  // swish in TZ where reference_x_s holds x in it, plus bias in the
  // vectors' dtype.
  template <typename TZ, typename P, typename C>
  __device__ static float pre_reference(float v, float z, const P& p, C c, bool x_in_z) {
    using TO = typename P::value_type;
    if (!x_in_z && sizeof(TO) == 4) return v;
    float x, s;
    reference_x_s<TZ>(z, p, c, x_in_z, x, s);
    return eager_round<TO, true>(__fadd_rn(eager_round<TZ, true>(__fmul_rn(x, s)), p.extra(c)));
  }
};

// Problem 88: v = z + lin_bias; y = swish(swish(y^) * mul_weight).
// (Eager: y^ rounded; a = y^ * sigmoid(y^); m = a * w; y = m * sigmoid(m),
// each sigmoid and product rounded.)
template <bool kEagerRounding>
struct ChainGNSwishMulSwish {
  static constexpr bool kRoundsLikeEager = kEagerRounding;
  static constexpr bool kGatedPreGrad = false;
  static constexpr bool kDecomposedPre = false;
  static constexpr bool kSplitPre = false;  // (Pre is one add: see ChainSwishBiasGN)
  static constexpr bool kGroupNormIsLast = false;
  static constexpr int kSlots = 4, kSlotDZ = 0, kSlotDV = -1, kSlotGamma = 1, kSlotBeta = 2,
                       kSlotMul = 3;
  template <typename P, typename C>
  __device__ static float pre_with_grad(float z, const P& p, C c, float& grad) {
    grad = 1.0f;
    return __fadd_rn(z, p.lin(c));
  }
  template <typename P, typename C>
  __device__ static float pre(float z, const P& p, C c) {
    return __fadd_rn(z, p.lin(c));
  }
  template <typename P, typename C>
  __device__ static float pre_grad(float, const P&, C) { return 1.0f; }
  // v as the reference holds it: z + lin_bias in the vectors' dtype.
  template <typename TZ, typename P, typename C>
  __device__ static float pre_reference(float v, float, const P&, C, bool) {
    return eager_round<typename P::value_type, true>(v);
  }
  template <typename P, typename C>
  __device__ static float post(float yh, const P& p, C c) {
    using T = typename P::value_type;
    const float g = eager_round<T, kEagerRounding>(yh);
    const float a = eager_round<T, kEagerRounding>(
        __fmul_rn(g, eager_round<T, kEagerRounding>(sigmoid_of<P::kFast>(g))));
    const float m = eager_round<T, kEagerRounding>(a * p.mul(c));
    return __fmul_rn(m, eager_round<T, kEagerRounding>(sigmoid_of<P::kFast>(m)));
  }
  // a = swish(y^), m = a * w, y = swish(m):  dm = dy swish'(m),
  // d(w) += dm * a,  dy^ = dm * w * swish'(y^).
  template <typename P, typename C>
  __device__ static float post_backward(float yh, float dy, const P& p, C c, float& mul_grad) {
    const float w = p.mul(c);
    float da, dmm;
    const float a = swish_and_grad<P::kFast>(yh, da);
    swish_and_grad<P::kFast>(a * w, dmm);
    const float dm = dy * dmm;
    mul_grad = dm * a;
    return dm * w * da;
  }
  // post_backward in a group that meets a NaN or +-inf (gn_chain.cuh's
  // exact rows): where dy is not finite, autograd's decomposition of each
  // swish, MulBackward's dy s plus SigmoidBackward's ((dy m)(1 - s)) s,
  // whose NaN and +-inf differ from those of the fused derivatives; on the
  // values as the reference holds them, each rounded to the output's dtype
  // (a 16-bit sigmoid is 1 where the float one is not: see
  // ChainSwishBiasGN::reference_x_s), with the accurate sigmoid.
  template <typename P, typename C>
  __device__ static float post_backward_exact(float yh, float dy, const P& p, C c,
                                              float& mul_grad) {
    if (isfinite(dy)) return post_backward(yh, dy, p, c, mul_grad);
    using T = typename P::value_type;
    const float w = p.mul(c);
    const float g = eager_round<T, true>(yh);
    const float sg = eager_round<T, true>(sigmoid_of<false>(g));
    const float a = eager_round<T, true>(__fmul_rn(g, sg));
    const float m = eager_round<T, true>(a * w);
    const float sm = eager_round<T, true>(sigmoid_of<false>(m));
    const float dm = dy * sm + ((dy * m) * (1.0f - sm)) * sm;
    mul_grad = dm * a;
    const float da = dm * w;
    return da * sg + ((da * g) * (1.0f - sg)) * sg;
  }
};

// Problem 94: v = mish(hardtanh(z + lin_bias + bias)); Post = identity.
// Both biases sit before the nonlinearity, so both gradients are sum dz.
// (Eager: z + bias rounded; hardtanh exact; mish rounded.)
template <bool kEagerRounding>
struct ChainBiasHardtanhMishGN : PostIdentity,
                                 PreFromPreWithGrad<ChainBiasHardtanhMishGN<kEagerRounding>> {
  static constexpr bool kRoundsLikeEager = kEagerRounding;
  // Pre's derivative is 0 exactly where hardtanh saturates (mish' > 0 on
  // [-1, 1]): a gate (see times_pre_grad).
  static constexpr bool kGatedPreGrad = true;
  static constexpr bool kDecomposedPre = false;  // mish's backward is one op
  // Not split: the reference under autocast holds v in float32.
  static constexpr bool kSplitPre = false;
  static constexpr int kSlots = 3, kSlotDZ = 0, kSlotDV = -1, kSlotGamma = 1, kSlotBeta = 2,
                       kSlotMul = -1;
  // Pre and its derivative sharing mish's tanh(softplus) (mish's
  // derivative at the unrounded sum).  The hardtanh gate is eager's, in
  // every mode: eager's backward zeroes the gradient where hardtanh's input
  // is at or past +-1, and that input is its sum as tensors of T: z +
  // lin_bias rounded to T, then + bias rounded again (under autocast, with
  // float32 vectors, nothing is rounded).  A sum within half a unit of T of
  // +-1 rounds across it, and the gate decides a whole term of dz: on any
  // other sum it would disagree with eager's there, an error of a whole
  // term that eager's gradient does not have.
  template <typename P, typename C>
  __device__ static float pre_with_grad(float z, const P& p, C c, float& grad) {
    using T = typename P::value_type;
    // Each vector read once (SharedVectors' reads are volatile loads).
    const float lin = p.lin(c), extra = p.extra(c);
    const float u = __fadd_rn(__fadd_rn(z, lin), extra);
    float mg;
    const float m = mish_and_grad_unit<P::kFast>(hardtanhf(eager_round<T, kEagerRounding>(u)), mg);
    if (kEagerRounding) mish_and_grad_unit<P::kFast>(hardtanhf(u), mg);
    // PyTorch's hardtanh_backward zeroes the gradient where its input is at
    // or past +-1 and passes it elsewhere, at a NaN too (|NaN| >= thr is
    // false).  Eager's last rounding of that input, s, is folded into the
    // gate: |round_T(s)| >= 1 exactly where |s| >= kUnitRoundingThreshold<T>.
    // Where the gate closes s is not NaN, so neither is u, and mg (mish' on
    // [-1, 1]) is finite and > 0: the select gives the product's bits.
    const float s = __fadd_rn(eager_round<T, true>(__fadd_rn(z, lin)), extra);
    grad = fabsf(s) >= kUnitRoundingThreshold<T> ? 0.0f : mg;
    return eager_round<T, kEagerRounding>(m);
  }
  // v as the reference holds it: with 16-bit vectors, the accurate mish of
  // hardtanh of eager's sum, rounded (autocast's float32 vectors: v itself).
  template <typename TZ, typename P, typename C>
  __device__ static float pre_reference(float v, float z, const P& p, C c, bool) {
    using T = typename P::value_type;
    if (sizeof(T) == 4) return v;
    const float eager_sum =
        eager_round<T, true>(__fadd_rn(eager_round<T, true>(__fadd_rn(z, p.lin(c))), p.extra(c)));
    float mg;
    return eager_round<T, true>(mish_and_grad_unit<false>(hardtanhf(eager_sum), mg));
  }
};

template <typename T, bool kFast = false>
__device__ __forceinline__ ColumnVectors<T, kFast> column_vectors(const T* lin_bias,
                                                                  const T* extra_bias,
                                                                  const T* gn_weight,
                                                                  const T* gn_bias,
                                                                  const T* mul_weight) {
  ColumnVectors<T, kFast> p;
  p.lin_bias = lin_bias;
  p.extra_bias = extra_bias;
  p.gn_weight = gn_weight;
  p.gn_bias = gn_bias;
  p.mul_weight = mul_weight;
  return p;
}

}  // namespace cf
