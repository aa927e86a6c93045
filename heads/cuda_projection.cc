#include "heads/cuda_projection.h"

#include <cublas_v2.h>
#include <dlfcn.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cublas_library.h"
#include "base/status_macros.h"
#include "heads/cuda_head_kernels.h"

namespace dflash {
namespace {

template <typename T>
constexpr cudaDataType_t kType =
    std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;

absl::Status BlasStatus(const CublasApi& api, cublasStatus_t status,
                        const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", api.status_string(status)));
}

// Logit rows padded to whole 16-byte vectors, for the loss's vector loads.
template <typename T>
int64_t PaddedStride(int64_t vocab) {
  constexpr int64_t kVec = 16 / sizeof(T);
  return (vocab + kVec - 1) / kVec * kVec;
}

// Row-major products written as cuBLAS's column-major ones: a row-major
// [r, c] matrix is a column-major [c, r] one; logits rows are
// logits_stride() apart.
template <typename T>
class CudaProjection final : public VocabProjection<T> {
 public:
  CudaProjection(const T* weight, const T* bias, int64_t vocab, int64_t hidden,
                 CublasHandle& blas, float* const* float_weight_gradient,
                 const float* input_gradient_scale)
      : VocabProjection<T>(vocab, hidden, PaddedStride<T>(vocab)),
        weight_(weight),
        bias_(bias),
        blas_(blas),
        float_weight_gradient_(float_weight_gradient),
        input_gradient_scale_(input_gradient_scale) {}

  // logits^T [V, m] = W [V, H] (col-major [H, V], transposed) x rows^T.
  void Forward(const T* rows, int64_t m, T* logits) override {
    if (m == 0) return;
    const int64_t v = this->vocab(), h = this->hidden();
    const int64_t ld = this->logits_stride();
    Gemm(CUBLAS_OP_T, CUBLAS_OP_N, v, m, h, weight_, h, rows, h, 1.0f, 0.0f,
         logits, kType<T>, ld, "forward GEMM");
    if (bias_ != nullptr && status_.ok()) {
      cuda::LaunchAddBias<T>(logits, bias_, m, v, ld, blas_.stream().stream());
      status_ = blas_.stream().LaunchStatus("bias add");
    }
    if (ld > v && status_.ok()) {
      // The loss loads the padding with the logits: keep it defined.
      const cudaError_t error =
          cudaMemset2DAsync(logits + v, ld * sizeof(T), 0, (ld - v) * sizeof(T),
                            m, blas_.stream().stream());
      if (error != cudaSuccess) {
        status_ = absl::InternalError(
            absl::StrCat("logits padding: ", cudaGetErrorString(error)));
      }
    }
    this->Count(m, 0);
  }

  void AddForward(const T* rows, int64_t m, T* logits) override {
    if (m == 0) return;
    const int v = this->vocab(), h = this->hidden();
    Gemm(CUBLAS_OP_T, CUBLAS_OP_N, v, m, h, weight_, h, rows, h, 1.0f, 1.0f,
         logits, kType<T>, this->logits_stride(), "correction GEMM");
    this->Count(m, 0);
  }

  // grad_rows^T [H, m] = W^T (col-major [H, V]) x grad_logits^T [V, m].
  void InputGradient(const T* grad_logits, int64_t m, T* grad_rows) override {
    if (m == 0) return;
    const int v = this->vocab(), h = this->hidden();
    Gemm(CUBLAS_OP_N, CUBLAS_OP_N, h, m, v, weight_, h, grad_logits,
         this->logits_stride(), InputAlpha(), 0.0f, grad_rows, kType<T>, h,
         "input-gradient GEMM");
    this->Count(m, 0);
  }

  void InputGradientColumns(const T* grad_logits, int64_t m, int64_t begin,
                            int64_t end, bool accumulate,
                            T* grad_rows) override {
    if (m == 0 || end <= begin) return;
    const int h = this->hidden();
    Gemm(CUBLAS_OP_N, CUBLAS_OP_N, h, m, end - begin, weight_ + begin * h, h,
         grad_logits + begin, this->logits_stride(), InputAlpha(),
         accumulate ? 1.0f : 0.0f, grad_rows, kType<T>, h,
         "input-gradient GEMM");
    this->Count(m, 0, end - begin);
  }

  // grad_W^T [H, V] += rows^T [H, m] x grad_logits [m, V].
  void AccumulateWeightGradient(const T* grad_logits, const T* rows, int64_t m,
                                T* grad_weight, T* grad_bias) override {
    if (m == 0) return;
    const int v = this->vocab(), h = this->hidden();
    float* const sum = FloatWeightGradient();
    if (sum != nullptr) {
      Gemm(CUBLAS_OP_N, CUBLAS_OP_T, h, v, m, rows, h, grad_logits,
           this->logits_stride(), 1.0f, 1.0f, sum,
           CUDA_R_32F, h, "weight-gradient GEMM");
    } else {
      Gemm(CUBLAS_OP_N, CUBLAS_OP_T, h, v, m, rows, h, grad_logits,
           this->logits_stride(), 1.0f, 1.0f, grad_weight, kType<T>, h,
           "weight-gradient GEMM");
    }
    if (grad_bias != nullptr && status_.ok()) {
      // With an FP32 weight-gradient sum, the bias's follows it (V x H
      // floats, then V).
      if (sum != nullptr) {
        cuda::LaunchAccumulateBiasGradient<T, float>(
            grad_logits, m, v, this->logits_stride(),
            sum + int64_t{v} * h, blas_.stream().stream());
      } else {
        cuda::LaunchAccumulateBiasGradient<T, T>(
            grad_logits, m, v, this->logits_stride(), grad_bias,
            blas_.stream().stream());
      }
      status_ = blas_.stream().LaunchStatus("bias gradient");
    }
    this->Count(m, 0);
  }

  absl::Status status() const override { return status_; }

 private:
  float* FloatWeightGradient() const {
    return float_weight_gradient_ != nullptr ? *float_weight_gradient_
                                             : nullptr;
  }
  float InputAlpha() const {
    return input_gradient_scale_ != nullptr ? *input_gradient_scale_ : 1.0f;
  }

  // C = alpha A B + beta C; C's type is T's, or FP32 for a weight
  // gradient summed in float.
  void Gemm(cublasOperation_t op_a, cublasOperation_t op_b, int64_t m,
            int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
            int64_t ldb, float alpha, float beta, void* c,
            cudaDataType_t c_type, int64_t ldc, const char* what) {
    if (!status_.ok()) return;
    status_ = BlasStatus(
        blas_.api(),
        blas_.api().gemm_ex(
            blas_.get(), op_a, op_b, static_cast<int>(m), static_cast<int>(n),
            static_cast<int>(k), &alpha, a, kType<T>, static_cast<int>(lda), b,
            kType<T>, static_cast<int>(ldb), &beta, c, c_type,
            static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        what);
  }

  const T* const weight_;
  const T* const bias_;
  CublasHandle& blas_;
  float* const* const float_weight_gradient_;  // Null: never a sum.
  const float* const input_gradient_scale_;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CublasHandle>> CublasHandle::Create(
    CudaStream& stream) {
  DFLASH_ASSIGN_OR_RETURN(const CublasApi* api, Cublas());
  cublasHandle_t handle = nullptr;
  DFLASH_RETURN_IF_ERROR(
      BlasStatus(*api, api->create(&handle), "cublasCreate"));
  // BF16 GEMMs accumulate in FP32 with no reduced-precision reductions in
  // split-K, so they match the CPU's FP32 accumulation.
  absl::Status ok = BlasStatus(
      *api, api->set_stream(handle, stream.stream()), "cublasSetStream");
  if (ok.ok()) {
    ok = BlasStatus(
        *api,
        api->set_math_mode(
            handle, static_cast<cublasMath_t>(
                        CUBLAS_DEFAULT_MATH |
                        CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
        "cublasSetMathMode");
  }
  if (!ok.ok()) {
    api->destroy(handle);
    return ok;
  }
  return std::unique_ptr<CublasHandle>(new CublasHandle(handle, *api, stream));
}

CublasHandle::~CublasHandle() { api_.destroy(handle_); }

namespace {

using SetWorkspaceFn = decltype(&cublasSetWorkspace_v2);

// cublasSetWorkspace_v2 of the cuBLAS `api` was opened from (CublasApi,
// base/cublas_library.h, binds only the calls every run needs), or null.
SetWorkspaceFn FindSetWorkspace(const CublasApi& api) {
#if defined(DFLASH_CUDA_EMULATED)
  (void)api;
  return &cublasSetWorkspace_v2;  // The emulation's, linked in.
#else
  // Already loaded: RTLD_NOLOAD finds it without loading anything.
  void* library = ::dlopen(api.path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return nullptr;
  auto set_workspace = reinterpret_cast<SetWorkspaceFn>(
      ::dlsym(library, "cublasSetWorkspace_v2"));
  ::dlclose(library);  // Drops only the reference NOLOAD took.
  return set_workspace;
#endif
}

}  // namespace

absl::Status CublasHandle::SetWorkspace(void* workspace, int64_t bytes) {
  constexpr uintptr_t kAlignment = 256;  // cuBLAS's requirement.
  if (workspace == nullptr) {
    return absl::InvalidArgumentError(
        "cuBLAS workspace: the pointer is null; expected device memory");
  }
  if (reinterpret_cast<uintptr_t>(workspace) % kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuBLAS workspace: the pointer ", "0x",
        absl::Hex(reinterpret_cast<uintptr_t>(workspace)),
        " is not aligned to ", kAlignment, " bytes, as cuBLAS requires"));
  }
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuBLAS workspace: bytes is ", bytes, "; expected a positive size"));
  }
  const SetWorkspaceFn set_workspace = FindSetWorkspace(api_);
  if (set_workspace == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(api_.path, ": has no cublasSetWorkspace_v2"));
  }
  return BlasStatus(
      api_, set_workspace(handle_, workspace, static_cast<size_t>(bytes)),
      "cublasSetWorkspace");
}

template <typename T>
absl::StatusOr<std::unique_ptr<VocabProjection<T>>> CreateCudaProjection(
    absl::Span<const T> weight, absl::Span<const T> bias, int64_t vocab,
    int64_t hidden, CublasHandle& blas, float* const* float_weight_gradient,
    const float* input_gradient_scale) {
  if (absl::Status valid =
          ValidateProjectionShape(weight.size(), bias.size(), vocab, hidden);
      !valid.ok()) {
    return valid;
  }
  return std::unique_ptr<VocabProjection<T>>(new CudaProjection<T>(
      weight.data(), bias.empty() ? nullptr : bias.data(), vocab, hidden, blas,
      float_weight_gradient, input_gradient_scale));
}

template absl::StatusOr<std::unique_ptr<VocabProjection<float>>>
CreateCudaProjection<float>(absl::Span<const float>, absl::Span<const float>,
                            int64_t, int64_t, CublasHandle&, float* const*,
                            const float*);
template absl::StatusOr<std::unique_ptr<VocabProjection<BFloat16>>>
CreateCudaProjection<BFloat16>(absl::Span<const BFloat16>,
                               absl::Span<const BFloat16>, int64_t, int64_t,
                               CublasHandle&, float* const*, const float*);

}  // namespace dflash
