#ifndef DFLASH_BASE_FILE_H_
#define DFLASH_BASE_FILE_H_

// Files read and written with every failure reported: errors name the path
// and the OS's reason (strerror). Reads refuse anything that is not a
// regular file (a FIFO would block, a device never ends). Writes are
// all-or-nothing: bytes go to a temporary beside the target and are renamed
// into place only once complete and flushed to disk; a set of files is
// replaced as one (OutputFileSet).

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

// A set of files replaced as one. Stage() writes each file's bytes to a
// temporary `.NAME.tmp-PID-RANDOM` in the target's directory (every write
// checked, fsync'd and closed); StageRemoval() names a file the new set
// does not hold. Until Commit() no target changes, and a set destroyed
// uncommitted removes its temporaries.
//
// Commit() holds those signals and SIGPIPE off, refuses a target
// that is neither a regular file nor a link (a directory) before anything
// changes, then (1) renames each existing target aside to a hidden
// `.NAME.old-PID-RANDOM` beside it, (2) renames the temporaries into
// place, (3) removes the set-aside files. A rename refused in (1) (an
// immutable or bind-mounted file) moves the set-aside files back, and one
// refused in (2) also removes the new files already placed: either way the
// error names the file and the reason, and the old set is as it was. So
// at every moment the files present are a subset of the old set or a
// subset of the new one, never a mix: a concurrent reader may find a file
// missing during the commit, never an old file beside a new one. Only a
// SIGKILL or a crash inside the commit can leave a subset; its hidden
// files are then removed by a later Stage() of the same names.
//
// Stage() and StageRemoval() first remove such leftovers of the target's
// name, temporaries and set-aside files of processes no longer alive.
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
  struct Staged {
    std::string temp, target;
    int slot;  // In the registry of temporaries the signal handler removes.
  };
  // Removes every temporary not yet renamed into place.
  void Abandon();

  std::vector<Staged> staged_;
  std::vector<std::string> removals_;
};

// Installs handlers of the signals that end a process by default (SIGINT,
// SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGXCPU, SIGXFSZ,
// SIGPROF, SIGVTALRM; not those the process ignores) that remove the
// temporaries of every OutputFileSet being written and then end the
// process by the same signal (its exit status says which); a signal that
// arrives during a Commit() takes effect once the commit is done. Call
// once, early in main.
void RemoveTemporariesOnSignals();

// One file written all-or-nothing (an OutputFileSet of one).
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view bytes);

}  // namespace dflash

#endif  // DFLASH_BASE_FILE_H_
