#include "base/status_macros.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace dflash {
namespace {

absl::Status FailIf(bool fail) {
  return fail ? absl::InvalidArgumentError("failed") : absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<int>> MakeIf(bool fail, int value) {
  if (fail) return absl::NotFoundError("none");
  return std::make_unique<int>(value);
}

absl::StatusOr<int> Twice(bool fail_check, bool fail_make) {
  DFLASH_RETURN_IF_ERROR(FailIf(fail_check));
  DFLASH_ASSIGN_OR_RETURN(std::unique_ptr<int> value, MakeIf(fail_make, 21));
  int sum = 0;  // Assigning to an existing variable.
  DFLASH_ASSIGN_OR_RETURN(sum, absl::StatusOr<int>(2 * *value));
  return sum;
}

TEST(StatusMacrosTest, ReturnOrContinue) {
  EXPECT_EQ(*Twice(false, false), 42);
  EXPECT_EQ(Twice(true, false).status().message(), "failed");
  EXPECT_EQ(Twice(false, true).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace dflash
