// The CUDA entry point of a build without a CUDA toolkit.
#include "absl/status/status.h"
#include "base/bfloat16.h"
#include "python/native/cuda_run.h"

namespace dflash::python {

bool BuiltWithCuda() { return false; }

void SetCudaLibraryDirs(std::vector<std::string>) {}

void SetTorchAllocator(std::optional<TorchAllocator>) {}

template <typename T>
absl::StatusOr<HeadResult> RunOnTorchStream(const v1::ObjectiveConfig&,
                                            const HeadInputs<T>&,
                                            const HeadGradients<T>&,
                                            const HeadRowOutputs&, int,
                                            uintptr_t, bool,
                                            const DeviceMetadata*, double*,
                                            const VocabShard*) {
  return absl::UnimplementedError(
      "this dflash was built without CUDA (no toolkit when it was built)");
}

template <typename T>
absl::StatusOr<std::unique_ptr<TorchStreamRun<T>>> StartOnTorchStream(
    const v1::ObjectiveConfig&, const HeadInputs<T>&, const HeadRowOutputs&,
    int, uintptr_t, const HeadOptions&, const DeviceMetadata*) {
  return absl::UnimplementedError(
      "this dflash was built without CUDA (no toolkit when it was built)");
}

template <typename T>
absl::Status AddTopKValueGradientsOnTorchStream(
    const v1::ObjectiveConfig&, const HeadInputs<T>&, absl::Span<const int32_t>,
    absl::Span<const float>, absl::Span<const float>, int32_t,
    const HeadGradients<T>&, int, uintptr_t) {
  return absl::UnimplementedError(
      "this dflash was built without CUDA (no toolkit when it was built)");
}

absl::Status ReadDeviceResultsStatus(const v1::ObjectiveConfig&, int,
                                     uintptr_t, uintptr_t) {
  return absl::UnimplementedError(
      "this dflash was built without CUDA (no toolkit when it was built)");
}

absl::Status CopyFromDevice(int, uintptr_t, uintptr_t, void*, int64_t) {
  return absl::UnimplementedError(
      "this dflash was built without CUDA (no toolkit when it was built)");
}

template absl::StatusOr<HeadResult> RunOnTorchStream<float>(
    const v1::ObjectiveConfig&, const HeadInputs<float>&,
    const HeadGradients<float>&, const HeadRowOutputs&, int, uintptr_t, bool,
    const DeviceMetadata*, double*, const VocabShard*);
template absl::StatusOr<HeadResult> RunOnTorchStream<BFloat16>(
    const v1::ObjectiveConfig&, const HeadInputs<BFloat16>&,
    const HeadGradients<BFloat16>&, const HeadRowOutputs&, int, uintptr_t,
    bool, const DeviceMetadata*, double*, const VocabShard*);
template absl::StatusOr<std::unique_ptr<TorchStreamRun<float>>>
StartOnTorchStream<float>(const v1::ObjectiveConfig&, const HeadInputs<float>&,
                          const HeadRowOutputs&, int, uintptr_t,
                          const HeadOptions&, const DeviceMetadata*);
template absl::StatusOr<std::unique_ptr<TorchStreamRun<BFloat16>>>
StartOnTorchStream<BFloat16>(const v1::ObjectiveConfig&,
                             const HeadInputs<BFloat16>&,
                             const HeadRowOutputs&, int, uintptr_t,
                             const HeadOptions&, const DeviceMetadata*);
template absl::Status AddTopKValueGradientsOnTorchStream<float>(
    const v1::ObjectiveConfig&, const HeadInputs<float>&,
    absl::Span<const int32_t>, absl::Span<const float>, absl::Span<const float>,
    int32_t, const HeadGradients<float>&, int, uintptr_t);
template absl::Status AddTopKValueGradientsOnTorchStream<BFloat16>(
    const v1::ObjectiveConfig&, const HeadInputs<BFloat16>&,
    absl::Span<const int32_t>, absl::Span<const float>, absl::Span<const float>,
    int32_t, const HeadGradients<BFloat16>&, int, uintptr_t);

}  // namespace dflash::python
