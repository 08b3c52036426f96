// Kernel family "gn_chain" (templates in gn_chain.cuh): the instantiations
// that keep the op chain in float32 (every dtype).
#include "gn_chain.cuh"
