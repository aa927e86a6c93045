// CublasHandle::SetWorkspace: its refusals, and a CUDA projection's forward
// pass captured into a CUDA graph on a handle with a workspace of its own,
// replayed with new rows, against a float64 loop. Runs under the CUDA
// emulation, which enforces what a capture forbids, and on a GPU.
#include "heads/cuda_projection.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/cuda_stream.h"
#include "base/gpu_test.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;

struct Device {
  std::unique_ptr<CudaStream> stream;
  std::unique_ptr<CublasHandle> blas;
};

absl::StatusOr<Device> Open() {
  absl::StatusOr<std::unique_ptr<CudaStream>> stream = CudaStream::Create();
  if (!stream.ok()) return stream.status();
  absl::StatusOr<std::unique_ptr<CublasHandle>> blas =
      CublasHandle::Create(**stream);
  if (!blas.ok()) return blas.status();
  return Device{*std::move(stream), *std::move(blas)};
}

template <typename T>
T* DeviceArray(int64_t count) {
  void* data = nullptr;
  EXPECT_EQ(cudaMalloc(&data, count * sizeof(T)), cudaSuccess);
  return static_cast<T*>(data);
}

TEST(CublasWorkspaceTest, RefusesNullMisalignedAndEmptyWorkspaces) {
  absl::StatusOr<Device> device = Open();
  DFLASH_SKIP_WITHOUT_GPU(device.status());
  CublasHandle& blas = *device->blas;
  char* workspace = DeviceArray<char>(1 << 16);
  const absl::Status null = blas.SetWorkspace(nullptr, 4096);
  EXPECT_EQ(null.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(null.message(), HasSubstr("the pointer is null"));
  const absl::Status misaligned = blas.SetWorkspace(workspace + 64, 4096);
  EXPECT_EQ(misaligned.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(misaligned.message(),
              HasSubstr("is not aligned to 256 bytes, as cuBLAS requires"));
  for (int64_t bytes : {int64_t{0}, int64_t{-5}}) {
    const absl::Status empty = blas.SetWorkspace(workspace, bytes);
    EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(empty.message(),
                HasSubstr(absl::StrCat("bytes is ", bytes,
                                       "; expected a positive size")));
  }
  EXPECT_TRUE(blas.SetWorkspace(workspace, 1 << 16).ok());
  cudaFree(workspace);
}

// logits = rows W^T + bias, rows padded to the projection's stride with
// zeros, in float64.
std::vector<double> Reference(const std::vector<float>& rows,
                              const std::vector<float>& weight,
                              const std::vector<float>& bias, int64_t m,
                              int64_t vocab, int64_t hidden, int64_t stride) {
  std::vector<double> logits(m * stride, 0.0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t v = 0; v < vocab; ++v) {
      double sum = bias[v];
      for (int64_t h = 0; h < hidden; ++h) {
        sum += double{rows[r * hidden + h]} * weight[v * hidden + h];
      }
      logits[r * stride + v] = sum;
    }
  }
  return logits;
}

// With its workspace set, the projection's forward pass (GEMM, bias
// kernel, padding memset) captures without a synchronisation or an
// allocation, and each launch of the graph computes the rows then in the
// static buffer.
TEST(CublasWorkspaceTest, ACapturedForwardPassReplaysWithNewRows) {
  absl::StatusOr<Device> device = Open();
  DFLASH_SKIP_WITHOUT_GPU(device.status());
  CudaStream& stream = *device->stream;
  constexpr int64_t kVocab = 37, kHidden = 24, kRows = 5;
  constexpr int64_t kWorkspaceBytes = int64_t{4} << 20;
  std::vector<float> weight(kVocab * kHidden), bias(kVocab);
  for (int64_t i = 0; i < kVocab * kHidden; ++i) {
    weight[i] = std::sin(0.37 * i);
  }
  for (int64_t v = 0; v < kVocab; ++v) bias[v] = 0.1f * (v % 5) - 0.2f;
  float* d_weight = DeviceArray<float>(weight.size());
  float* d_bias = DeviceArray<float>(bias.size());
  char* workspace = DeviceArray<char>(kWorkspaceBytes);
  ASSERT_TRUE(
      stream.CopyToDevice(d_weight, weight.data(), weight.size() * 4).ok());
  ASSERT_TRUE(stream.CopyToDevice(d_bias, bias.data(), bias.size() * 4).ok());
  ASSERT_TRUE(device->blas->SetWorkspace(workspace, kWorkspaceBytes).ok());
  absl::StatusOr<std::unique_ptr<VocabProjection<float>>> projection =
      CreateCudaProjection<float>({d_weight, weight.size()},
                                  {d_bias, bias.size()}, kVocab, kHidden,
                                  *device->blas);
  ASSERT_TRUE(projection.ok()) << projection.status();
  const int64_t stride = (*projection)->logits_stride();
  ASSERT_GT(stride, kVocab);  // So the padding memset is captured too.
  float* d_rows = DeviceArray<float>(kRows * kHidden);
  float* d_logits = DeviceArray<float>(kRows * stride);
  // Not zeros: a padding left unwritten would show.
  ASSERT_EQ(cudaMemset(d_logits, 0x7f, kRows * stride * 4), cudaSuccess);

  ASSERT_EQ(cudaStreamBeginCapture(stream.stream(),
                                   cudaStreamCaptureModeGlobal),
            cudaSuccess);
  (*projection)->Forward(d_rows, kRows, d_logits);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream.stream(), &graph), cudaSuccess);
  ASSERT_TRUE((*projection)->status().ok()) << (*projection)->status();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int launch = 0; launch < 3; ++launch) {
    std::vector<float> rows(kRows * kHidden);
    for (int64_t i = 0; i < kRows * kHidden; ++i) {
      rows[i] = std::cos(0.11 * i + launch);
    }
    ASSERT_TRUE(
        stream.CopyToDevice(d_rows, rows.data(), rows.size() * 4).ok());
    ASSERT_EQ(cudaGraphLaunch(exec, stream.stream()), cudaSuccess);
    std::vector<float> logits(kRows * stride);
    ASSERT_TRUE(
        stream.CopyToHost(logits.data(), d_logits, logits.size() * 4).ok());
    const std::vector<double> want =
        Reference(rows, weight, bias, kRows, kVocab, kHidden, stride);
    for (int64_t i = 0; i < kRows * stride; ++i) {
      ASSERT_NEAR(logits[i], want[i], 1e-4 * (1 + std::fabs(want[i])))
          << "launch " << launch << ", row " << i / stride << ", column "
          << i % stride;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (void* d : {static_cast<void*>(d_weight), static_cast<void*>(d_bias),
                  static_cast<void*>(workspace), static_cast<void*>(d_rows),
                  static_cast<void*>(d_logits)}) {
    cudaFree(d);
  }
}

#if defined(DFLASH_CUDA_EMULATED)
// The emulated cuBLAS overwrites the start of the workspace it is given
// (a GPU's may or may not touch it): the buffer reaches cuBLAS.
TEST(CublasWorkspaceTest, TheProductsGetTheWorkspace) {
  absl::StatusOr<Device> device = Open();
  ASSERT_TRUE(device.ok()) << device.status();
  CudaStream& stream = *device->stream;
  constexpr int64_t kBytes = 1 << 16;
  char* workspace = DeviceArray<char>(kBytes);
  ASSERT_TRUE(stream.Zero(workspace, kBytes).ok());
  ASSERT_TRUE(device->blas->SetWorkspace(workspace, kBytes).ok());
  float* d_weight = DeviceArray<float>(4 * 4);
  float* d_rows = DeviceArray<float>(4);
  ASSERT_TRUE(stream.Zero(d_weight, 64).ok());
  ASSERT_TRUE(stream.Zero(d_rows, 16).ok());
  absl::StatusOr<std::unique_ptr<VocabProjection<float>>> projection =
      CreateCudaProjection<float>({d_weight, 16}, {}, 4, 4, *device->blas);
  ASSERT_TRUE(projection.ok()) << projection.status();
  float* d_logits = DeviceArray<float>((*projection)->logits_stride());
  (*projection)->Forward(d_rows, 1, d_logits);
  std::vector<char> after(kBytes);
  ASSERT_TRUE(stream.CopyToHost(after.data(), workspace, kBytes).ok());
  EXPECT_NE(after, std::vector<char>(kBytes, 0));
  for (void* d : {static_cast<void*>(workspace), static_cast<void*>(d_weight),
                  static_cast<void*>(d_rows), static_cast<void*>(d_logits)}) {
    cudaFree(d);
  }
}
#endif

}  // namespace
}  // namespace dflash
