#ifndef DFLASH_BASE_PROBLEM_LIST_H_
#define DFLASH_BASE_PROBLEM_LIST_H_

// ProblemList collects every problem a validator finds, one
// "path: what is wrong, got VALUE" line each, so a user sees them all at
// once; each component's validator fills one, and the config library joins
// them.

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace dflash {

// A number as problems print it (%g).
inline std::string ProblemNumber(double value) {
  return absl::StrFormat("%g", value);
}

class ProblemList {
 public:
  void Add(absl::string_view path, absl::string_view problem) {
    lines_.push_back(absl::StrCat(path, ": ", problem));
  }
  // A line another validator made, path included.
  void AddLine(std::string line) { lines_.push_back(std::move(line)); }
  void AtLeast(absl::string_view path, double value, double low) {
    if (!(value >= low) || std::isinf(value)) {
      Add(path, absl::StrCat("must be >= ", ProblemNumber(low), ", got ",
                             ProblemNumber(value)));
    }
  }
  void Above(absl::string_view path, double value, double low) {
    if (!(value > low) || std::isinf(value)) {
      Add(path, absl::StrCat("must be > ", ProblemNumber(low), ", got ",
                             ProblemNumber(value)));
    }
  }
  void Within(absl::string_view path, double value, double low, double high) {
    if (!(value >= low && value <= high)) {
      Add(path, absl::StrCat("must lie in [", ProblemNumber(low), ", ",
                             ProblemNumber(high), "], got ",
                             ProblemNumber(value)));
    }
  }
  // An enum left at its zero (UNSPECIFIED) value; `name` is its name.
  template <typename Enum>
  void Specified(absl::string_view path, Enum value, const std::string& name) {
    if (static_cast<int>(value) == 0) {
      Add(path, absl::StrCat("must be set, got ", name));
    }
  }

  bool empty() const { return lines_.empty(); }
  // InvalidArgument with a line per problem; OK when there is none.
  absl::Status ToStatus() const {
    if (lines_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrJoin(lines_, "\n"));
  }

 private:
  std::vector<std::string> lines_;
};

}  // namespace dflash

#endif  // DFLASH_BASE_PROBLEM_LIST_H_
