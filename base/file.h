#ifndef DFLASH_BASE_FILE_H_
#define DFLASH_BASE_FILE_H_

// Files read and written with every failure reported: errors name the path
// and the OS's reason (strerror). Reads refuse anything that is not a
// regular file (a FIFO would block, a device never ends). Writes are
// all-or-nothing: bytes go to a temporary beside the target and are renamed
// into place only once complete and flushed to disk.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dflash {

// An open regular file, so a caller can read a header and check sizes
// before it reads (and allocates for) the rest.
class ReadableFile {
 public:
  // Errors: the path cannot be opened (NotFound, PermissionDenied, ...,
  // with strerror), or is a directory, FIFO, device or socket
  // (InvalidArgument saying which).
  static absl::StatusOr<ReadableFile> Open(const std::string& path);

  ReadableFile(ReadableFile&& other) noexcept;
  ReadableFile& operator=(ReadableFile&& other) noexcept;
  ReadableFile(const ReadableFile&) = delete;
  ReadableFile& operator=(const ReadableFile&) = delete;
  ~ReadableFile();

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }

  // Reads exactly out.size() bytes from `offset`; a read error or a file
  // shorter than that is an error naming the path.
  absl::Status ReadAt(int64_t offset, absl::Span<char> out) const;

 private:
  ReadableFile(std::string path, int fd, int64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}

  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// The whole of a regular file; larger than `max_bytes` is an error.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             int64_t max_bytes);

// Creates `dir` and its missing parents (as mkdir -p does), then proves a
// file can be created in it. Errors say which: a path component that is
// not a directory, a directory that cannot be created or written (with
// strerror).
absl::Status PrepareOutputDirectory(const std::string& dir);

// A set of files replaced together. Stage() writes each file's bytes to a
// temporary in the target's directory (every write checked, fsync'd and
// closed); Commit() then renames them into place and removes the paths
// given to StageRemoval(). Until Commit() no target changes, and a set
// destroyed uncommitted removes its temporaries. A failure during Commit()
// itself (a rename refused midway) is reported; earlier renames stand.
class OutputFileSet {
 public:
  OutputFileSet() = default;
  OutputFileSet(const OutputFileSet&) = delete;
  OutputFileSet& operator=(const OutputFileSet&) = delete;
  ~OutputFileSet();

  absl::Status Stage(const std::string& path, absl::string_view bytes);
  // The file's bytes as consecutive pieces (a header and a data view).
  absl::Status Stage(const std::string& path,
                     absl::Span<const absl::string_view> pieces);
  void StageRemoval(const std::string& path);
  absl::Status Commit();

 private:
  std::vector<std::pair<std::string, std::string>> staged_;  // temp, target
  std::vector<std::string> removals_;
};

// One file written all-or-nothing (an OutputFileSet of one).
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view bytes);

}  // namespace dflash

#endif  // DFLASH_BASE_FILE_H_
