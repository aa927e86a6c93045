#ifndef DFLASH_BASE_IMMUTABLE_FILE_H_
#define DFLASH_BASE_IMMUTABLE_FILE_H_

// For tests of writes that must change nothing when a file cannot be
// replaced: `chattr +i` (or, with append_only, `chattr +a`: entries may be
// added, none removed) on a file or directory while in scope, undone after
// (or the test framework could not remove its directory). set() is false
// where the filesystem or the privileges refuse it; the test then says so
// and skips.

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace dflash {

class ImmutableFile {
 public:
  explicit ImmutableFile(const std::string& path, bool append_only = false)
      : path_(path), flag_(append_only ? "a" : "i") {
    set_ = std::system(("chattr +" + flag_ + " " + path_ + " 2>/dev/null")
                           .c_str()) == 0;
  }
  ImmutableFile(const ImmutableFile&) = delete;
  ImmutableFile& operator=(const ImmutableFile&) = delete;
  ~ImmutableFile() {
    if (set_) {
      EXPECT_EQ(std::system(("chattr -" + flag_ + " " + path_).c_str()), 0);
    }
  }
  bool set() const { return set_; }

 private:
  std::string path_, flag_;
  bool set_ = false;
};

}  // namespace dflash

#endif  // DFLASH_BASE_IMMUTABLE_FILE_H_
