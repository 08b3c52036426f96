// Shared device helpers for every cupy-fused kernel.
//
// The kernels are compiled by NVRTC at run time.  To stay independent of where
// (or whether) the CUDA toolkit headers are installed, nothing here includes a
// toolkit header: half and bfloat16 are plain 16-bit storage types converted
// with PTX / bit arithmetic, and all arithmetic is done in float.
#pragma once

namespace cf {

typedef long long i64;

// 16-bit storage types.  Layout-compatible with torch.float16 / torch.bfloat16.
struct half { unsigned short bits; };
struct bfloat16 { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bfloat16 x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ half from_float<half>(float f) {
  half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
// Round-to-nearest-even: cvt.rn.bf16.f32 from sm_80 on, integer arithmetic
// below it (the same bits for every number; a NaN stays a quiet NaN).
template <> __device__ __forceinline__ bfloat16 from_float<bfloat16>(float f) {
  bfloat16 b;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One instruction where the architecture has it: same bits.
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
  return b;
#endif
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = static_cast<unsigned short>(u >> 16);
  }
  return b;
}

// n / d for 32-bit n < 2^31 and 1 <= d < 2^31 in three instructions (a
// multiply-high, an add and a shift; Granlund and Montgomery), where the
// compiler's 32-bit division takes about twenty.  `packed`: the host's
// multiplier | shift << 32 (ops/_common.py, fast_divisor).
struct FastDiv {
  unsigned m, s;
  __device__ __forceinline__ explicit FastDiv(i64 packed)
      : m(static_cast<unsigned>(packed)), s(static_cast<unsigned>(packed >> 32)) {}
  __device__ __forceinline__ unsigned div(unsigned n) const { return (__umulhi(n, m) + n) >> s; }
};

// ---- vector access: N consecutive values in one to two wide transactions ----
// The memory-bound kernels move 16 bytes per load or store where the layout
// allows: a 2- or 4-byte access per value leaves the load/store units, not
// the memory, setting the pace.  In Packed::load, load_vec and store_vec,
// `p` must be aligned to N * sizeof(T) bytes (at most 16), and
// N * sizeof(T) must be 4, 8, 16 or 32.

// Value k of values of T packed in 32-bit words as they lie in memory.
template <typename T>
__device__ __forceinline__ float packed_value(const unsigned* w, int k) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[k]);
  } else {
    T v;
    v.bits = static_cast<unsigned short>(w[k / 2] >> (16 * (k % 2)));
    return to_float(v);
  }
}

// N values of T held as the raw 32-bit words of one wide load, converted to
// float on use: a row of loads kept in flight costs half the registers for
// a 16-bit T.
template <typename T, int N>
struct Packed {
  static constexpr int kWords = N * static_cast<int>(sizeof(T)) / 4;
  static_assert(kWords == 1 || kWords == 2 || kWords % 4 == 0, "4, 8, 16 or 32 bytes");
  unsigned w[kWords];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kWords == 1) {
      w[0] = *reinterpret_cast<const unsigned*>(p);
    } else if constexpr (kWords == 2) {
      const uint2 r = *reinterpret_cast<const uint2*>(p);
      w[0] = r.x; w[1] = r.y;
    } else {
#pragma unroll
      for (int c = 0; c < kWords / 4; ++c) {
        const uint4 r = reinterpret_cast<const uint4*>(p)[c];
        w[4 * c] = r.x; w[4 * c + 1] = r.y; w[4 * c + 2] = r.z; w[4 * c + 3] = r.w;
      }
    }
  }
  __device__ __forceinline__ void unpack(float (&out)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = packed_value<T>(w, k);
  }
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  Packed<T, N> v;
  v.load(p);
  v.unpack(out);
}

// As load_vec; a null `p` (an absent per-channel vector) gives `fallback`.
template <typename T, int N>
__device__ __forceinline__ void load_vec_or(const T* p, float (&out)[N], float fallback) {
  if (p) {
    load_vec<T, N>(p, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = fallback;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  constexpr int kWords = N * static_cast<int>(sizeof(T)) / 4;
  static_assert(kWords == 1 || kWords == 2 || kWords % 4 == 0, "4, 8, 16 or 32 bytes");
  unsigned w[kWords];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if constexpr (sizeof(T) == 4) {
      w[k] = __float_as_uint(in[k]);
    } else {
      const unsigned bits = from_float<T>(in[k]).bits;
      w[k / 2] = k % 2 ? (w[k / 2] | (bits << 16)) : bits;
    }
  }
  if constexpr (kWords == 1) {
    *reinterpret_cast<unsigned*>(p) = w[0];
  } else if constexpr (kWords == 2) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int c = 0; c < kWords / 4; ++c)
      reinterpret_cast<uint4*>(p)[c] = make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);
  }
}

// Loads a value of a per-column / per-channel vector, or `fallback` when the
// vector is absent (null pointer): chains name every vector they may use.
template <typename T>
__device__ __forceinline__ float load_or(const T* p, i64 i, float fallback) {
  return p ? to_float(p[i]) : fallback;
}

// ---- activations and their derivatives ----
// kFast = false: float, libm's expf and the reciprocals of
// rcp_of_denominator (below).  kFast (the vectorised GroupNorm kernels on a
// float16 / bfloat16 z): one hardware exp2 and an approximate divide
// instead.  Their few units of float32 rounding sit far below the input's
// own (2^-8 or 2^-11), and a half-precision z leaves these kernels bound by
// instruction issue, not memory.  The activations use __fmul_rn so that a
// caller's add is never contracted into them: the same input gives the same
// bits wherever they are inlined.

// 1 / d for d >= 1 or NaN (a sigmoid's denominator 1 + exp(-x); mish's
// n + 2 and 1 + e below): the hardware reciprocal refined by one Newton
// step (two FMAs), the IEEE reciprocal's own fast path, the same bits
// wherever 1 / d is normal, without its range tests and slow-path branch,
// whose instructions the float32 GroupNorm kernels, bound by issue, would
// pay on every value.  Where 1 / d would be subnormal (d > 2^126: for a
// sigmoid, x below about -87.3) or d is infinite it gives 0, which moves a
// sigmoid by less than 2^-126; NaN stays NaN.
__device__ __forceinline__ float rcp_of_denominator(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  r = fmaf(r, fmaf(-d, r, 1.0f), r);
  return d > 0x1p126f ? 0.0f : r;
}
__device__ __forceinline__ float sigmoidf(float x) { return rcp_of_denominator(1.0f + expf(-x)); }

// The fast forms' hardware exp and reciprocal, flushing subnormals: without
// -ftz, __expf and __fdividef wrap MUFU.EX2 / MUFU.RCP in range tests and
// rescaling, a third of these kernels' instructions per element.  They
// differ only where a result or divisor is subnormal: exp(x) for x below
// about -87, which the callers add to 1 or scale by a value below 1, so
// that it only ever moves a result already below float's normal range.
__device__ __forceinline__ float exp_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

template <bool kFast>
__device__ __forceinline__ float sigmoid_of(float x) {
  if constexpr (kFast) return rcp_ftz(1.0f + exp_ftz(-x));
  else return sigmoidf(x);
}
// swish(x) and its derivative from one sigmoid.
template <bool kFast>
__device__ __forceinline__ float swish_and_grad(float x, float& grad) {
  const float s = sigmoid_of<kFast>(x);
  const float xs = __fmul_rn(x, s);
  // (x s rounded before its FMA with 1 - s, as `x * s * (1 - s)` compiles:
  // the same bits, with the product computed once for both results.)
  grad = s + xs * (1.0f - s);
  return xs;
}
// mish(x) and its derivative sharing one tanh(softplus(x)), for x within
// [-1, 1] or NaN (hardtanh's output, the only input mish has here):
// tanh(log1p(e)) = n / (n + 2) with n = e (e + 2), e = exp(x), one exp for
// both.  Fast: the hardware's exp2 and reciprocal; else expf and
// rcp_of_denominator, about as accurate as libm's tanhf(log1pf(expf(x)))
// in a fraction of its instructions (docs/performance.md).  On that range
// n stays finite, so there is no clamp and no branch for large x (past
// x = 43.7 the reciprocal of n + 2 flushes to 0 and t with it, past 44.4 n
// overflows and t is NaN); a NaN stays a NaN.  t is rounded (__fmul_rn)
// rather than contracted into the derivative's final add, so that the
// output and the derivative use the same t.
template <bool kFast>
__device__ __forceinline__ float mish_and_grad_unit(float x, float& grad) {
  const float e = kFast ? exp_ftz(x) : expf(x);
  const float n = e * (e + 2.0f);
  const float t = __fmul_rn(n, kFast ? rcp_ftz(n + 2.0f) : rcp_of_denominator(n + 2.0f));
  const float s = e * (kFast ? rcp_ftz(1.0f + e) : rcp_of_denominator(1.0f + e));
  grad = t + x * (1.0f - t * t) * s;
  return __fmul_rn(x, t);
}
// relu that keeps a NaN, as torch.relu does (fmaxf would return the 0).
// ptxas makes one max.NaN of it.
__device__ __forceinline__ float relu_keep_nan(float v) { return v <= 0.0f ? 0.0f : v; }

// float -> TF32 (low 13 mantissa bits zero), rounding to nearest with ties
// away from zero, as cvt.rna.tf32.f32 does, in two integer instructions
// (the cvt is several instructions on sm_80/sm_90, and the GEMMs run this
// once per fragment element).  A carry out of the mantissa correctly bumps the
// exponent; values that round past FLT_MAX become inf, as with the cvt.
// A NaN with a high mantissa (the GPU's own NaN is 0x7fffffff) would carry
// into the sign bit and become a zero: see to_tf32_keep_nan.
__device__ __forceinline__ unsigned to_tf32(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}
// to_tf32 that keeps a NaN a NaN, so that a NaN operand reaches the output:
// for a TF32 copy of an operand, and the "big" part of a split (through the
// big x big product).  (The
// small part needs no such care: x - big is NaN only where big is already
// NaN or infinite, and for an infinite x a small part of zero is what the
// correction products need.)
__device__ __forceinline__ unsigned to_tf32_keep_nan(float x) {
  return x != x ? 0x7fffe000u : to_tf32(x);
}
// NaN must come through, as in torch.nn.functional.hardtanh (fminf/fmaxf
// would return the bound).  Not written as relu_keep_nan is (selects that
// compile to NaN-propagating min/max, no NaN test): fewer instructions, but
// from NVRTC 13.0 a slower kernel for 94's forward under autocast
// (docs/performance.md, "Memory-bound kernels").
__device__ __forceinline__ float hardtanhf(float x) {
  return x != x ? x : fminf(fmaxf(x, -1.0f), 1.0f);
}

// The 32-bit shared-window address of a shared-memory pointer.
__device__ __forceinline__ unsigned shared_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// ---- reductions ----
// Compensated (Neumaier) summation in float: the parameter gradients are sums
// over every row of the batch, and a plain running float sum of 10^4..10^5
// terms loses several bits against PyTorch's tree reductions.  The rounding
// error of each add is carried in `comp` (exact under IEEE round-to-nearest;
// NVRTC does not reassociate without fast-math).
struct CompensatedSum {
  float sum, comp;
  __device__ __forceinline__ CompensatedSum() : sum(0.0f), comp(0.0f) {}
  __device__ __forceinline__ void add(float x) {
    const float t = sum + x;
    comp += fabsf(sum) >= fabsf(x) ? (sum - t) + x : (x - t) + sum;
    sum = t;
  }
  // The compensated total in double, so that it loses nothing when partial
  // sums are combined (see reduce_column_partials).  An infinite term (or an
  // overflow) leaves the running sum infinite and comp the NaN of inf - inf:
  // the total is then the running sum alone, +-inf (or NaN for infinities of
  // both signs), as torch's sum gives it.  A finite running sum means every
  // term and partial sum was finite, and comp with them.
  __device__ __forceinline__ double total() const {
    return isfinite(sum) ? static_cast<double>(sum) + static_cast<double>(comp) : static_cast<double>(sum);
  }
  // The same total rounded to float.
  __device__ __forceinline__ float total_float() const { return isfinite(sum) ? sum + comp : sum; }
};

// A plain float running sum with CompensatedSum's interface, for sums of a
// bounded number of terms whose result is rounded to a 16-bit dtype: n adds
// err by at most n 2^-24 of the sum of the terms' magnitudes (2^-15 for
// 512), against that dtype's own rounding of 2^-11 (float16) or 2^-8
// (bfloat16) of the result, and cost one instruction per term instead of
// six.
struct FloatSum {
  float sum;
  __device__ __forceinline__ FloatSum() : sum(0.0f) {}
  __device__ __forceinline__ void add(float x) { sum += x; }
  __device__ __forceinline__ double total() const { return static_cast<double>(sum); }
};
// ColumnSum<kPlain>::type: FloatSum where kPlain, else CompensatedSum.
template <bool kPlain> struct ColumnSum { using type = CompensatedSum; };
template <> struct ColumnSum<true> { using type = FloatSum; };

// Sum over an aligned team of `team` lanes (a power of two <= 32) inside a
// warp.  Every lane of the warp must call it (full mask); the xor pattern keeps
// each team's lanes together, and the fixed order makes the result
// bitwise reproducible.
__device__ __forceinline__ float team_sum(float v, int team) {
  for (int offset = team >> 1; offset > 0; offset >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
// N team sums at once (the same values as N team_sum calls): one loop's
// control and divergence checks for all of them, which in the GroupNorm
// kernels, bound by issue, cost more per row than the shuffles themselves
// (gn_chain.cuh: a row's two sums, or two rows' two sums each).
template <int N>
__device__ __forceinline__ void team_sums(float (&a)[N], int team) {
  for (int offset = team >> 1; offset > 0; offset >>= 1) {
    float o[N];
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = __shfl_xor_sync(0xffffffffu, a[i], offset);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] += o[i];
  }
}

// Two named values' team sums, as team_sums<2> sums them.  Its own loop
// rather than that call through an array of the two, which NVRTC 13.0
// compiled into a slower float32 GroupNorm backward for problem 37
// (docs/performance.md, "Memory-bound kernels").
__device__ __forceinline__ void team_sum2(float& a, float& b, int team) {
  for (int offset = team >> 1; offset > 0; offset >>= 1) {
    const float oa = __shfl_xor_sync(0xffffffffu, a, offset);
    const float ob = __shfl_xor_sync(0xffffffffu, b, offset);
    a += oa;
    b += ob;
  }
}

// Block-wide sum in double, for blockDim.x a multiple of 32 (<= 1024):
// combines per-thread partial sums of a parameter gradient without a further
// rounding per tree level.  `scratch` holds 32 doubles of shared memory; the
// fixed order makes it bitwise reproducible.  Result valid in every thread.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace cf
