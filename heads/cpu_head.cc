#include "heads/cpu_head.h"

#include <memory>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/threads.h"
#include "heads/cpu_head_backend.h"
#include "heads/head_backend.h"
#include "heads/prepared_projection.h"

namespace dflash {

namespace {

// RunHead's and StartHead's checks of the target and the allocator.
template <typename T>
absl::Status CheckCpuHead(const v1::ObjectiveConfig& config,
                          const TrackingAllocator& allocator,
                          const char* call) {
  constexpr v1::HeadConfig::DType kDType = std::is_same_v<T, float>
                                               ? v1::HeadConfig::FLOAT32
                                               : v1::HeadConfig::FLOAT64;
  DFLASH_RETURN_IF_ERROR(CheckHeadTarget(config.head(), v1::HeadConfig::CPU,
                                         kDType, call,
                                         "CPU heads run FLOAT32 or FLOAT64"));
  if (allocator.device() != Device::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "allocator: ", call, " needs host memory, got a CUDA allocator"));
  }
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::StatusOr<HeadResult> RunHead(const v1::ObjectiveConfig& config,
                                   const HeadInputs<T>& inputs,
                                   const HeadGradients<T>& gradients,
                                   TrackingAllocator& allocator,
                                   const HeadRowOutputs& row_outputs,
                                   const HeadOptions& options) {
  DFLASH_RETURN_IF_ERROR(CheckCpuHead<T>(config, allocator, "RunHead"));
  ScopedLibraryCall call;
  std::unique_ptr<HeadBackend<T>> backend =
      CreateCpuHeadBackend<T>(config, allocator);
  return RunHeadOn<T>(config, inputs, gradients, *backend, row_outputs,
                      options);
}

template <typename T>
absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> StartHead(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    TrackingAllocator& allocator, const HeadRowOutputs& row_outputs,
    const HeadOptions& options) {
  DFLASH_RETURN_IF_ERROR(CheckCpuHead<T>(config, allocator, "StartHead"));
  ScopedLibraryCall call;
  return SplitHeadRun<T>::Forward(config, inputs,
                                  CreateCpuHeadBackend<T>(config, allocator),
                                  row_outputs, options);
}

absl::StatusOr<int64_t> PredictProjectionBytes(
    const v1::ObjectiveConfig& config) {
  const v1::HeadConfig& head = config.head();
  if (head.trainable() || head.dtype() != v1::HeadConfig::FLOAT32 ||
      !head.pack_weight()) {
    return 0;
  }
  return PreparedProjection::LaidOutBytes(head.vocab_size(),
                                          head.hidden_size(),
                                          head.gradient_filter() > 0);
}

template absl::StatusOr<HeadResult> RunHead<float>(const v1::ObjectiveConfig&,
                                                   const HeadInputs<float>&,
                                                   const HeadGradients<float>&,
                                                   TrackingAllocator&,
                                                   const HeadRowOutputs&,
                                                   const HeadOptions&);
template absl::StatusOr<HeadResult> RunHead<double>(
    const v1::ObjectiveConfig&, const HeadInputs<double>&,
    const HeadGradients<double>&, TrackingAllocator&, const HeadRowOutputs&,
    const HeadOptions&);

template absl::StatusOr<std::unique_ptr<SplitHeadRun<float>>> StartHead<float>(
    const v1::ObjectiveConfig&, const HeadInputs<float>&, TrackingAllocator&,
    const HeadRowOutputs&, const HeadOptions&);
template absl::StatusOr<std::unique_ptr<SplitHeadRun<double>>>
StartHead<double>(const v1::ObjectiveConfig&, const HeadInputs<double>&,
                  TrackingAllocator&, const HeadRowOutputs&,
                  const HeadOptions&);

}  // namespace dflash
