// The gn_chain kernels (gn_chain.cuh), scalar and vectorised, for autocast:
// z and dz in float16 / bfloat16, the output, its gradient and the
// per-channel vectors in float32.  A source of its own, so that the first
// use of the default kernels does not compile these too.
#include "gn_chain.cuh"
