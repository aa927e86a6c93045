#ifndef DFLASH_TOOLS_CUDA_EMULATION_RUNTIME_INTERNAL_H_
#define DFLASH_TOOLS_CUDA_EMULATION_RUNTIME_INTERNAL_H_

// What the emulation's cuBLAS needs of its runtime.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tools/cuda_emulation/emulated_cuda.h"

namespace dflash_emu {

// Runs `work` on `stream`'s worker in issue order, device memory open;
// `words`: the device addresses it uses, as `what`. On a capturing stream,
// recorded into the capture; an error where the call is forbidden.
cudaError_t RunInStreamOrder(cudaStream_t stream, std::function<void()> work,
                             const std::vector<uintptr_t>& words,
                             const std::string& what);

}  // namespace dflash_emu

#endif  // DFLASH_TOOLS_CUDA_EMULATION_RUNTIME_INTERNAL_H_
