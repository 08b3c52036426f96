// Kernel family "scale_add": out = alpha * x + y, elementwise.  The smallest fused op: used
// by `python -m cupy_fused`, the runtime tests and the host-overhead benchmark.
#include <cf_common.cuh>  // (<>: the include path alone, not the working folder)

namespace cf {

template <typename T>
__global__ void scale_add(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                          double alpha, i64 n) {
  const float a = static_cast<float>(alpha);
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<i64>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(a * to_float(x[i]) + to_float(y[i]));
}

}  // namespace cf
