// The gn_chain kernels (gn_chain.cuh) with kEagerRounding, for float16 /
// bfloat16: a source of their own, so that the first use of the default
// kernels does not compile these too (they double the compile time).
#include "gn_chain.cuh"
