// Kernel family "gn_chain" (templates in gn_chain.cuh): the vectorised
// instantiations, one dtype throughout.  The first launch of an aligned
// shape compiles this source alone.
#include "gn_chain.cuh"
