#include "base/cublas_library.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

const std::string kName =
    "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);

std::string TestDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(root ? root : "/tmp") + "/" + name;
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  return dir;
}

// The toolkit the build used has this build's cuBLAS: opened from a
// folder given first, every entry point bound.
TEST(CublasLibraryTest, OpensTheToolkitsFromAGivenFolder) {
  absl::StatusOr<CublasApi> api =
      OpenCublas({"/nonexistent", DFLASH_TEST_CUDA_LIB_DIR}, false);
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_EQ(api->path, std::string(DFLASH_TEST_CUDA_LIB_DIR) + "/" + kName);
  EXPECT_NE(api->create, nullptr);
  EXPECT_NE(api->gemm_ex, nullptr);
  EXPECT_STREQ(api->status_string(CUBLAS_STATUS_SUCCESS),
               "success");
  absl::StatusOr<const CublasApi*> loaded = Cublas();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
}

// Nowhere: the file, each place looked, other majors seen, and what to do.
TEST(CublasLibraryTest, NotFoundSaysWhereItLooked) {
  const std::string dir = TestDir("other_major");
  std::ofstream(dir + "/libcublas.so.12") << "not a library";
  const absl::Status status = OpenCublas({"/nonexistent", dir}, false).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()),
              StartsWith(kName + " (cuBLAS " +
                         std::to_string(CUBLAS_VER_MAJOR) +
                         ", which this dflash was built with): not found in "
                         "/nonexistent, " +
                         dir + "; other cuBLAS versions there: " + dir +
                         "/libcublas.so.12"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("Install torch's CUDA build"));
}

// A file of the right name that is not a loadable library says why.
TEST(CublasLibraryTest, AnUnloadableFileSaysWhy) {
  const std::string dir = TestDir("corrupt");
  std::ofstream(dir + "/" + kName) << "not a library";
  const absl::Status status = OpenCublas({dir}, false).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()), HasSubstr(dir + "/" + kName + ": "));
}

// A library without cuBLAS's entry points is refused by name.
TEST(CublasLibraryTest, ALibraryWithoutTheEntryPointsIsRefused) {
  const std::string dir = TestDir("impostor");
  const std::string cudart =
      std::string(DFLASH_TEST_CUDA_LIB_DIR) + "/libcudart.so";
  ASSERT_EQ(::symlink(cudart.c_str(), (dir + "/" + kName).c_str()), 0);
  const absl::Status status = OpenCublas({dir}, false).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(),
            dir + "/" + kName +
                ": has no cublasCreate_v2; not the cuBLAS this dflash needs");
}

}  // namespace
}  // namespace dflash
