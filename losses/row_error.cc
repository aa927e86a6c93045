#include "losses/row_error.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"

namespace dflash {
namespace {

constexpr char kRowUrl[] = "dflash/row";
constexpr char kDetailUrl[] = "dflash/row_detail";

}  // namespace

absl::Status RowError(int64_t row, absl::string_view detail,
                      absl::string_view row_name) {
  absl::Status status = absl::InvalidArgumentError(
      row_name.empty() ? absl::StrCat("row ", row, ": ", detail)
                       : absl::StrCat(row_name, ": ", detail));
  status.SetPayload(kRowUrl, absl::Cord(absl::StrCat(row)));
  status.SetPayload(kDetailUrl, absl::Cord(detail));
  return status;
}

std::optional<RowErrorInfo> GetRowError(const absl::Status& status) {
  const absl::optional<absl::Cord> row = status.GetPayload(kRowUrl);
  const absl::optional<absl::Cord> detail = status.GetPayload(kDetailUrl);
  RowErrorInfo info;
  if (!row || !detail || !absl::SimpleAtoi(std::string(*row), &info.row)) {
    return std::nullopt;
  }
  info.detail = std::string(*detail);
  return info;
}

}  // namespace dflash
