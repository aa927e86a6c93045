#include "bench/cuda_gemm_floor.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/cublas_library.h"
#include "base/status_macros.h"
#include "base/tracking_allocator.h"
#include "bench/cuda_fill.h"

namespace dflash {
namespace {

// Best of `repeats` of the pair after a warm-up, `chunk` rows at a time.
absl::StatusOr<double> PairSeconds(CublasHandle& blas, int64_t rows,
                                   int64_t hidden, int64_t vocab,
                                   bool bfloat16, int64_t chunk, int repeats) {
  CudaStream& stream = blas.stream();
  const int64_t element = bfloat16 ? 2 : 4;
  TrackingAllocator& allocator = stream.allocator();
  auto x = TrackedBuffer<char>::Create(allocator, rows * hidden * element);
  auto w = TrackedBuffer<char>::Create(allocator, vocab * hidden * element);
  auto logits = TrackedBuffer<char>::Create(allocator, chunk * vocab * element);
  auto grad = TrackedBuffer<char>::Create(allocator, rows * hidden * element);
  for (const absl::Status& s :
       {x.status(), w.status(), logits.status(), grad.status()}) {
    if (!s.ok()) return s;
  }
  const cudaDataType_t type = bfloat16 ? CUDA_R_16BF : CUDA_R_32F;
  auto fill = [&](TrackedBuffer<char>& b, float scale, uint64_t seed) {
    if (bfloat16) {
      LaunchFillNormal(reinterpret_cast<BFloat16*>(b.data()), b.size() / 2,
                       scale, seed, stream.stream());
    } else {
      LaunchFillNormal(reinterpret_cast<float*>(b.data()), b.size() / 4, scale,
                       seed, stream.stream());
    }
  };
  fill(*x, 1.0f, 1);
  fill(*w, 0.02f, 2);
  const float one = 1, zero = 0;
  const int h = static_cast<int>(hidden), v = static_cast<int>(vocab);
  auto pair = [&]() -> absl::Status {
    for (int64_t begin = 0; begin < rows; begin += chunk) {
      const int m = static_cast<int>(std::min(chunk, rows - begin));
      const char* xs = x->data() + begin * hidden * element;
      char* gs = grad->data() + begin * hidden * element;
      cublasStatus_t s =
          blas.api().gemm_ex(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, v, m, h, &one,
                       w->data(), type, h, xs, type, h, &zero, logits->data(),
                       type, v, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (s == CUBLAS_STATUS_SUCCESS) {
        s = blas.api().gemm_ex(blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, h, m, v, &one,
                         w->data(), type, h, logits->data(), type, v, &zero, gs,
                         type, h, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      }
      if (s != CUBLAS_STATUS_SUCCESS) {
        return absl::InternalError(
            absl::StrCat("floor GEMM: ", blas.api().status_string(s)));
      }
    }
    return absl::OkStatus();
  };
  DFLASH_RETURN_IF_ERROR(pair());  // Warm-up.
  // Events destroyed on every path; every event call checked.
  struct Events {
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start != nullptr) cudaEventDestroy(start);
      if (stop != nullptr) cudaEventDestroy(stop);
    }
  } events;
  auto check = [](cudaError_t error, const char* what) {
    return error == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError(
                     absl::StrCat(what, ": ", cudaGetErrorString(error)));
  };
  DFLASH_RETURN_IF_ERROR(
      check(cudaEventCreate(&events.start), "cudaEventCreate"));
  DFLASH_RETURN_IF_ERROR(
      check(cudaEventCreate(&events.stop), "cudaEventCreate"));
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    DFLASH_RETURN_IF_ERROR(check(cudaEventRecord(events.start, stream.stream()),
                                 "cudaEventRecord"));
    DFLASH_RETURN_IF_ERROR(pair());
    DFLASH_RETURN_IF_ERROR(check(cudaEventRecord(events.stop, stream.stream()),
                                 "cudaEventRecord"));
    DFLASH_RETURN_IF_ERROR(
        check(cudaEventSynchronize(events.stop), "cudaEventSynchronize"));
    float ms = 0;
    DFLASH_RETURN_IF_ERROR(
        check(cudaEventElapsedTime(&ms, events.start, events.stop),
              "cudaEventElapsedTime"));
    best = std::min(best, ms / 1e3);
  }
  DFLASH_RETURN_IF_ERROR(stream.Synchronize());
  return best;
}

}  // namespace

absl::StatusOr<double> CudaGemmFloorSeconds(CublasHandle& blas, int64_t rows,
                                            int64_t hidden, int64_t vocab,
                                            bool bfloat16,
                                            int64_t rows_per_chunk,
                                            int repeats) {
  absl::StatusOr<double> whole =
      PairSeconds(blas, rows, hidden, vocab, bfloat16, rows, repeats);
  if (!whole.ok() || rows_per_chunk <= 0 || rows_per_chunk >= rows) {
    return whole;
  }
  DFLASH_ASSIGN_OR_RETURN(double chunked,
                          PairSeconds(blas, rows, hidden, vocab, bfloat16,
                                      rows_per_chunk, repeats));
  return std::min(*whole, chunked);
}

}  // namespace dflash
