// The emulation's cuBLAS against a naive triple loop: every op pair, odd
// leading dimensions, FP32 and BF16 inputs, alpha and beta, and cuBLAS's
// refusals of leading dimensions too small for the stored shapes.
#include <cmath>
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

}  // namespace
