// Kernel family "gn_chain" (cupy_fused/ops/gn_chain.py): the GroupNorm-chain
// kernels of gn_chain.cuh, scalar and vectorised, same-dtype, eager-rounding
// and autocast (float32 output) forms.  Instantiations are compiled one at a
// time on first use, so one unit serves them all.
#include <gn_chain.cuh>  // (<>: the include path alone, not the working folder)
