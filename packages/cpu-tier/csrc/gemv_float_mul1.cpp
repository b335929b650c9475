// One share of the kernel instantiations of an ISA variant (see the dispatch section of kernels.h).
#define CT_DEFINE_GEMV_FLOAT_MUL1
#include "kernels.h"
