#ifndef DFLASH_LOSSES_ROW_ERROR_H_
#define DFLASH_LOSSES_ROW_ERROR_H_

// Errors about one row of a chunk ("row 4: logit 0 is not finite (nan)")
// carry the row's index and the detail as a status payload, so a caller
// that knows where the chunk's rows came from (a thread's share of a chunk,
// a head's compacted rows) can name the row in its own terms instead of
// parsing the message.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace dflash {

// InvalidArgument "`row_name`: `detail`"; `row_name` defaults to "row R".
absl::Status RowError(int64_t row, absl::string_view detail,
                      absl::string_view row_name = "");

struct RowErrorInfo {
  int64_t row = 0;
  std::string detail;
};

// The row and detail of an error made by RowError; nullopt for any other.
std::optional<RowErrorInfo> GetRowError(const absl::Status& status);

}  // namespace dflash

#endif  // DFLASH_LOSSES_ROW_ERROR_H_
