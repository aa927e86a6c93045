#ifndef DFLASH_TOOLS_CUDA_EMULATION_RUNTIME_INTERNAL_H_
#define DFLASH_TOOLS_CUDA_EMULATION_RUNTIME_INTERNAL_H_

// What the emulation's cuBLAS needs of its runtime.

#include <functional>

#include "tools/cuda_emulation/emulated_cuda.h"

namespace dflash_emu {

// Runs `work` on `stream`'s worker in issue order, device memory open.
void RunInStreamOrder(cudaStream_t stream, std::function<void()> work);

}  // namespace dflash_emu

#endif  // DFLASH_TOOLS_CUDA_EMULATION_RUNTIME_INTERNAL_H_
