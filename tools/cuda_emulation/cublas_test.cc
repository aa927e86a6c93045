// The emulation's cuBLAS against a naive triple loop: every op pair, odd
// leading dimensions, FP32 and BF16 inputs, alpha and beta, and cuBLAS's
// refusals of leading dimensions too small for the stored shapes; its
// workspace rules, and a GEMM captured into a graph and replayed.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "base/bfloat16.h"
#include "gtest/gtest.h"
#include "tools/cuda_emulation/copies_test_util.h"
#include "tools/cuda_emulation/include/cublas_v2.h"

namespace {

using ::dflash_emu_test::ToDevice;
using ::dflash_emu_test::ToHost;

struct Case {
  cublasOperation_t a_op, b_op;
  int m, n, k, lda, ldb, ldc;
};

class CublasTest : public ::testing::TestWithParam<Case> {};

// Column-major: element (i, j) of an ld-strided matrix is at i + j * ld.
double At(const std::vector<float>& x, int ld, int i, int j) {
  return x[i + static_cast<size_t>(j) * ld];
}

TEST_P(CublasTest, GemmExMatchesATripleLoop) {
  const Case c = GetParam();
  std::mt19937 rng(c.m * 131 + c.n * 17 + c.k);
  std::uniform_real_distribution<float> u(-1, 1);
  const int a_rows = c.a_op == CUBLAS_OP_N ? c.m : c.k;
  const int a_cols = c.a_op == CUBLAS_OP_N ? c.k : c.m;
  const int b_rows = c.b_op == CUBLAS_OP_N ? c.k : c.n;
  const int b_cols = c.b_op == CUBLAS_OP_N ? c.n : c.k;
  std::vector<float> a(static_cast<size_t>(c.lda) * a_cols),
      b(static_cast<size_t>(c.ldb) * b_cols),
      cm(static_cast<size_t>(c.ldc) * c.n);
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  for (float& x : cm) x = u(rng);
  const float alpha = 0.75f, beta = -0.5f;
  std::vector<double> want(cm.begin(), cm.end());
  for (int j = 0; j < c.n; ++j) {
    for (int i = 0; i < c.m; ++i) {
      double sum = 0;
      for (int l = 0; l < c.k; ++l) {
        const double x = c.a_op == CUBLAS_OP_N ? At(a, c.lda, i, l)
                                               : At(a, c.lda, l, i);
        const double y = c.b_op == CUBLAS_OP_N ? At(b, c.ldb, l, j)
                                               : At(b, c.ldb, j, l);
        sum += x * y;
      }
      want[i + static_cast<size_t>(j) * c.ldc] =
          alpha * sum + beta * At(cm, c.ldc, i, j);
    }
  }
  (void)a_rows;
  (void)b_rows;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(handle, stream), CUBLAS_STATUS_SUCCESS);
  float* da = ToDevice(a);
  float* db = ToDevice(b);
  float* dc = ToDevice(cm);
  ASSERT_EQ(cublasGemmEx(handle, c.a_op, c.b_op, c.m, c.n, c.k, &alpha, da,
                         CUDA_R_32F, c.lda, db, CUDA_R_32F, c.ldb, &beta, dc,
                         CUDA_R_32F, c.ldc, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<float> got = ToHost(dc, cm.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-5 * (1 + std::abs(want[i]))) << i;
  }

  // BF16 inputs and output, FP32 accumulation: the rounded result.
  std::vector<dflash::BFloat16> a16(a.size()), b16(b.size()), c16(cm.size());
  for (size_t i = 0; i < a.size(); ++i) a16[i] = dflash::ToBFloat16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) b16[i] = dflash::ToBFloat16(b[i]);
  for (size_t i = 0; i < cm.size(); ++i) c16[i] = dflash::ToBFloat16(cm[i]);
  auto* da16 = ToDevice(a16);
  auto* db16 = ToDevice(b16);
  auto* dc16 = ToDevice(c16);
  ASSERT_EQ(cublasGemmEx(handle, c.a_op, c.b_op, c.m, c.n, c.k, &alpha, da16,
                         CUDA_R_16BF, c.lda, db16, CUDA_R_16BF, c.ldb, &beta,
                         dc16, CUDA_R_16BF, c.ldc, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  const std::vector<dflash::BFloat16> got16 = ToHost(dc16, cm.size());
  for (int j = 0; j < c.n; ++j) {
    for (int i = 0; i < c.m; ++i) {
      double sum = 0;
      for (int l = 0; l < c.k; ++l) {
        const size_t ai = c.a_op == CUBLAS_OP_N
                              ? i + static_cast<size_t>(l) * c.lda
                              : l + static_cast<size_t>(i) * c.lda;
        const size_t bi = c.b_op == CUBLAS_OP_N
                              ? l + static_cast<size_t>(j) * c.ldb
                              : j + static_cast<size_t>(l) * c.ldb;
        sum += double{dflash::ToFloat(a16[ai])} * dflash::ToFloat(b16[bi]);
      }
      const size_t ci = i + static_cast<size_t>(j) * c.ldc;
      const double expected = alpha * sum + beta * dflash::ToFloat(c16[ci]);
      EXPECT_NEAR(dflash::ToFloat(got16[ci]), expected,
                  1e-2 * (1 + std::abs(expected)));
    }
  }
  // Between the columns (ldc > m) nothing changes.
  for (int j = 0; j < c.n; ++j) {
    for (int i = c.m; i < c.ldc; ++i) {
      const size_t ci = i + static_cast<size_t>(j) * c.ldc;
      EXPECT_EQ(got[ci], cm[ci]);
    }
  }
  for (void* p : {static_cast<void*>(da), static_cast<void*>(db),
                  static_cast<void*>(dc), static_cast<void*>(da16),
                  static_cast<void*>(db16), static_cast<void*>(dc16)}) {
    cudaFree(p);
  }
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(
    OpsAndLeadingDimensions, CublasTest,
    ::testing::Values(Case{CUBLAS_OP_N, CUBLAS_OP_N, 5, 7, 3, 5, 3, 5},
                      Case{CUBLAS_OP_N, CUBLAS_OP_N, 5, 7, 3, 9, 4, 6},
                      Case{CUBLAS_OP_T, CUBLAS_OP_N, 5, 7, 3, 3, 3, 5},
                      Case{CUBLAS_OP_T, CUBLAS_OP_N, 5, 7, 3, 7, 5, 11},
                      Case{CUBLAS_OP_N, CUBLAS_OP_T, 5, 7, 3, 5, 7, 5},
                      Case{CUBLAS_OP_N, CUBLAS_OP_T, 5, 7, 3, 8, 9, 7},
                      Case{CUBLAS_OP_T, CUBLAS_OP_T, 5, 7, 3, 3, 7, 5},
                      Case{CUBLAS_OP_T, CUBLAS_OP_T, 6, 4, 9, 13, 5, 9},
                      Case{CUBLAS_OP_N, CUBLAS_OP_N, 33, 1, 17, 35, 19, 33}));

TEST(CublasArgumentsTest, LeadingDimensionsTooSmallAreInvalid) {
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const float one = 1;
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 4096), cudaSuccess);
  auto gemm = [&](cublasOperation_t ta, cublasOperation_t tb, int lda,
                  int ldb, int ldc) {
    return cublasGemmEx(handle, ta, tb, 4, 5, 6, &one, d, CUDA_R_32F, lda, d,
                        CUDA_R_32F, ldb, &one, d, CUDA_R_32F, ldc,
                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  EXPECT_EQ(gemm(CUBLAS_OP_N, CUBLAS_OP_N, 3, 6, 4),
            CUBLAS_STATUS_INVALID_VALUE);  // lda < m.
  EXPECT_EQ(gemm(CUBLAS_OP_T, CUBLAS_OP_N, 5, 6, 4),
            CUBLAS_STATUS_INVALID_VALUE);  // lda < k.
  EXPECT_EQ(gemm(CUBLAS_OP_N, CUBLAS_OP_N, 4, 5, 4),
            CUBLAS_STATUS_INVALID_VALUE);  // ldb < k.
  EXPECT_EQ(gemm(CUBLAS_OP_N, CUBLAS_OP_T, 4, 4, 4),
            CUBLAS_STATUS_INVALID_VALUE);  // ldb < n.
  EXPECT_EQ(gemm(CUBLAS_OP_N, CUBLAS_OP_N, 4, 6, 3),
            CUBLAS_STATUS_INVALID_VALUE);  // ldc < m.
  EXPECT_EQ(gemm(CUBLAS_OP_N, CUBLAS_OP_N, 4, 6, 4), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 4, 5, 6, &one, d,
                         CUDA_R_32F, 4, d, CUDA_R_16BF, 6, &one, d, CUDA_R_32F,
                         4, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(d);
  cublasDestroy(handle);
}

TEST(CublasWorkspaceTest, CublasRulesForACallersWorkspace) {
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  ASSERT_EQ(cublasSetStream(handle, stream), CUBLAS_STATUS_SUCCESS);
  constexpr size_t kBytes = 1 << 20;
  unsigned char* workspace = nullptr;
  ASSERT_EQ(cudaMalloc(&workspace, kBytes), cudaSuccess);
  std::vector<unsigned char> host(kBytes);
  EXPECT_EQ(cublasSetWorkspace(nullptr, workspace, kBytes),
            CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(cublasSetWorkspace(handle, workspace + 128, kBytes - 256),
            CUBLAS_STATUS_INVALID_VALUE);  // Not 256-byte aligned.
  EXPECT_EQ(cublasSetWorkspace(handle, host.data() + (256 - reinterpret_cast<
                                   uintptr_t>(host.data()) % 256),
                               4096),
            CUBLAS_STATUS_INVALID_VALUE);  // Host memory.
  EXPECT_EQ(cublasSetWorkspace(handle, nullptr, 0), CUBLAS_STATUS_SUCCESS);

  const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
  float* d_a = ToDevice(a);
  float* d_b = ToDevice(b);
  float* d_c = ToDevice(std::vector<float>(4, 0.0f));
  const float one = 1, zero = 0;
  auto gemm = [&] {
    return cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, d_a,
                        CUDA_R_32F, 2, d_b, CUDA_R_32F, 2, &zero, d_c,
                        CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
  };
  auto workspace_untouched = [&] {
    EXPECT_EQ(cudaMemset(workspace, 0, kBytes), cudaSuccess);
    EXPECT_EQ(gemm(), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return ToHost(workspace, kBytes) ==
           std::vector<unsigned char>(kBytes, 0);
  };
  // A GEMM uses the workspace it is given as scratch; cublasSetStream goes
  // back to cuBLAS's own.
  EXPECT_TRUE(workspace_untouched());
  ASSERT_EQ(cublasSetWorkspace(handle, workspace, kBytes),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_FALSE(workspace_untouched());
  ASSERT_EQ(cublasSetStream(handle, stream), CUBLAS_STATUS_SUCCESS);
  EXPECT_TRUE(workspace_untouched());
  // Column-major [[1, 3], [2, 4]] x [[5, 7], [6, 8]].
  EXPECT_EQ(ToHost(d_c, 4), (std::vector<float>{23, 34, 31, 46}));
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  for (void* d : {static_cast<void*>(workspace), static_cast<void*>(d_a),
                  static_cast<void*>(d_b), static_cast<void*>(d_c)}) {
    cudaFree(d);
  }
}

// A GEMM queued while its stream captures runs at each launch of the
// graph, on the inputs then in memory; alpha and beta are the values at
// the call, as cuBLAS's host pointer mode bakes them into the graph.
TEST(CublasCaptureTest, ACapturedGemmReplays) {
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  ASSERT_EQ(cublasSetStream(handle, stream), CUBLAS_STATUS_SUCCESS);
  void* workspace = nullptr;
  ASSERT_EQ(cudaMalloc(&workspace, 1 << 16), cudaSuccess);
  ASSERT_EQ(cublasSetWorkspace(handle, workspace, 1 << 16),
            CUBLAS_STATUS_SUCCESS);
  constexpr int kM = 3, kN = 4, kK = 5;
  float* d_a = ToDevice(std::vector<float>(kM * kK, 0.0f));
  float* d_b = ToDevice(std::vector<float>(kK * kN, 0.0f));
  float* d_c = ToDevice(std::vector<float>(kM * kN, 0.0f));
  float alpha = 2, beta = 0;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
            cudaSuccess);
  ASSERT_EQ(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, kM, kN, kK, &alpha,
                         d_a, CUDA_R_32F, kM, d_b, CUDA_R_32F, kK, &beta, d_c,
                         CUDA_R_32F, kM, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  alpha = 100;  // Read at the call: the graph keeps 2.
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph), cudaSuccess);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (int launch = 0; launch < 3; ++launch) {
    std::vector<float> a(kM * kK), b(kK * kN);
    for (float& x : a) x = u(rng);
    for (float& x : b) x = u(rng);
    ASSERT_EQ(cudaMemcpyAsync(d_a, a.data(), a.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(d_b, b.data(), b.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> c = ToHost(d_c, kM * kN);
    for (int j = 0; j < kN; ++j) {
      for (int i = 0; i < kM; ++i) {
        double sum = 0;
        for (int l = 0; l < kK; ++l) sum += At(a, kM, i, l) * At(b, kK, l, j);
        EXPECT_NEAR(At(c, kM, i, j), 2 * sum, 1e-5)
            << launch << " " << i << " " << j;
      }
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  for (void* d : {workspace, static_cast<void*>(d_a), static_cast<void*>(d_b),
                  static_cast<void*>(d_c)}) {
    cudaFree(d);
  }
}

}  // namespace
