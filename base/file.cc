#include "base/file.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace dflash {
namespace {

absl::Status OsError(int error, absl::string_view path,
                     absl::string_view what) {
  return absl::ErrnoToStatus(error, absl::StrCat(path, ": ", what));
}

const char* FileKind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "neither a file nor a directory";
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string BaseName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Writes all of `bytes` to `fd`, retrying short writes and EINTR.
absl::Status WriteAll(int fd, absl::string_view bytes,
                      const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError(errno, path, "cannot write");
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

mode_t CurrentUmask() {
  const mode_t mask = ::umask(0);
  ::umask(mask);
  return mask;
}

}  // namespace

absl::StatusOr<ReadableFile> ReadableFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
  const int fd =
      ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return OsError(errno, path, "cannot open");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return OsError(error, path, "cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": is ", FileKind(st.st_mode), ", expected a regular file"));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return ReadableFile(path, fd, static_cast<int64_t>(st.st_size));
}

ReadableFile::ReadableFile(ReadableFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_), size_(other.size_) {
  other.fd_ = -1;
}

ReadableFile& ReadableFile::operator=(ReadableFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    size_ = other.size_;
    other.fd_ = -1;
  }
  return *this;
}

ReadableFile::~ReadableFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status ReadableFile::ReadAt(int64_t offset, absl::Span<char> out) const {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done,
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError(errno, path_, "cannot read");
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(
          path_, ": ended at byte ", offset + static_cast<int64_t>(done),
          ", expected ", offset + static_cast<int64_t>(out.size()),
          " (was it changed while being read?)"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             int64_t max_bytes) {
  DFLASH_ASSIGN_OR_RETURN(ReadableFile file, ReadableFile::Open(path));
  if (file.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": holds ", file.size(), " bytes, more than the ",
                     max_bytes, " expected at most"));
  }
  std::string bytes(static_cast<size_t>(file.size()), '\0');
  DFLASH_RETURN_IF_ERROR(file.ReadAt(0, absl::MakeSpan(bytes)));
  return bytes;
}

absl::Status PrepareOutputDirectory(const std::string& dir) {
  if (dir.empty()) {
    return absl::InvalidArgumentError("output directory: empty path");
  }
  // Each prefix ending before a '/', then the whole path.
  for (size_t end = dir.find('/', 1);; end = dir.find('/', end + 1)) {
    const std::string prefix = dir.substr(0, end);
    struct stat st;
    if (::stat(prefix.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) {
        return absl::InvalidArgumentError(absl::StrCat(
            dir, ": ", prefix == dir ? "" : absl::StrCat(prefix, " "), "is ",
            FileKind(st.st_mode), ", expected a directory"));
      }
    } else if (errno != ENOENT) {
      return OsError(errno, dir, absl::StrCat("cannot inspect ", prefix));
    } else if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) {
      return OsError(errno, dir, absl::StrCat("cannot create ", prefix));
    }
    if (end == std::string::npos) break;
  }
  // Permission bits do not tell (root ignores them; a read-only mount does
  // not show in them): create a file to find out.
  std::string probe = absl::StrCat(dir, "/.dflash-probe-XXXXXX");
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    return OsError(errno, dir, "cannot create files in this directory");
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

OutputFileSet::~OutputFileSet() {
  for (const auto& [temp, target] : staged_) ::unlink(temp.c_str());
}

absl::Status OutputFileSet::Stage(const std::string& path,
                                  absl::string_view bytes) {
  return Stage(path, absl::MakeConstSpan(&bytes, 1));
}

absl::Status OutputFileSet::Stage(const std::string& path,
                                  absl::Span<const absl::string_view> pieces) {
  std::string temp =
      absl::StrCat(DirectoryOf(path), "/.", BaseName(path), ".tmp-XXXXXX");
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) return OsError(errno, path, "cannot create a temporary file");
  absl::Status written;
  for (absl::string_view piece : pieces) {
    if (written.ok()) written = WriteAll(fd, piece, path);
  }
  if (written.ok() && ::fchmod(fd, 0666 & ~CurrentUmask()) != 0) {
    written = OsError(errno, path, "cannot set permissions");
  }
  if (written.ok() && ::fsync(fd) != 0) {
    written = OsError(errno, path, "cannot flush to disk");
  }
  if (::close(fd) != 0 && written.ok()) {
    written = OsError(errno, path, "cannot close");
  }
  if (!written.ok()) {
    ::unlink(temp.c_str());
    return written;
  }
  staged_.emplace_back(std::move(temp), path);
  return absl::OkStatus();
}

void OutputFileSet::StageRemoval(const std::string& path) {
  removals_.push_back(path);
}

absl::Status OutputFileSet::Commit() {
  // A directory in a target's place would fail its rename midway: refuse
  // before anything moves.
  for (const auto& [temp, target] : staged_) {
    struct stat st;
    if (::lstat(target.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(target, ": is a directory, cannot replace it"));
    }
  }
  std::vector<std::string> directories;
  while (!staged_.empty()) {
    const auto [temp, target] = staged_.front();
    if (::rename(temp.c_str(), target.c_str()) != 0) {
      return OsError(errno, target, "cannot move into place");
    }
    staged_.erase(staged_.begin());
    directories.push_back(DirectoryOf(target));
  }
  for (const std::string& path : removals_) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return OsError(errno, path, "cannot remove the previous run's file");
    }
    directories.push_back(DirectoryOf(path));
  }
  removals_.clear();
  // The renames themselves reach the disk with the directory.
  for (const std::string& dir : directories) {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fsync(fd);
    ::close(fd);
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view bytes) {
  OutputFileSet files;
  DFLASH_RETURN_IF_ERROR(files.Stage(path, bytes));
  return files.Commit();
}

}  // namespace dflash
