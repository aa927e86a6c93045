#include "heads/projection.h"

#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"

namespace dflash {

absl::Status ValidateProjectionShape(size_t weight_size, size_t bias_size,
                                     int64_t vocab, int64_t hidden) {
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (vocab <= 0 || hidden <= 0 || vocab > kMaxDim || hidden > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "projection: vocab and hidden must lie in [1, 2^31), got ", vocab,
        " and ", hidden));
  }
  if (static_cast<int64_t>(weight_size) != vocab * hidden) {
    return absl::InvalidArgumentError(absl::StrCat(
        "projection: weight must hold vocab x hidden = ", vocab, " x ", hidden,
        " values, got ", weight_size));
  }
  if (bias_size != 0 && static_cast<int64_t>(bias_size) != vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("projection: bias must hold vocab = ", vocab,
                     " values or none, got ", bias_size));
  }
  return absl::OkStatus();
}

}  // namespace dflash
