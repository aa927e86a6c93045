#ifndef DFLASH_HEADS_CPU_PROJECTION_H_
#define DFLASH_HEADS_CPU_PROJECTION_H_

// The vocabulary projection on the CPU: VocabProjection over CBLAS
// (OpenBLAS), and the name of the kernels it runs. The CUDA head does not
// link it.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "heads/projection.h"

namespace dflash {

// The CPU projection on CBLAS (OpenBLAS), T = float or double. The weight
// and bias are borrowed and must outlive it. Sizes are checked: weight holds
// vocab * hidden values, bias vocab or none.
template <typename T>
absl::StatusOr<std::unique_ptr<VocabProjection<T>>> CreateCpuProjection(
    absl::Span<const T> weight, absl::Span<const T> bias, int64_t vocab,
    int64_t hidden);

// The CPU projection's BLAS and the kernels it picked for this CPU, e.g.
// "OpenBLAS 0.3.21 (SkylakeX kernels)". Generic kernels
// ("Prescott") on an AVX2 machine cost 4-5x in GEMM time; see the README.
std::string CpuBlasName();

}  // namespace dflash

#endif  // DFLASH_HEADS_CPU_PROJECTION_H_
