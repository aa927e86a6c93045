// The CUDA emulation stands in for the toolkit's header (tests only).
#include "tools/cuda_emulation/emulated_cuda.h"
