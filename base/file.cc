#include "base/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
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
  // A directory that lets files in but not out (append-only) would refuse
  // the commit's renames after all the work.
  if (::unlink(probe.c_str()) != 0) {
    return OsError(errno, dir,
                   absl::StrCat("can create files but not remove them (",
                                probe.substr(probe.rfind('/') + 1),
                                " stays); outputs could not be replaced"));
  }
  return absl::OkStatus();
}

namespace {

// The temporaries being written, for the signal handler: fixed slots of
// plain characters, so that it neither allocates nor locks.
enum SlotState : int { kFree, kClaimed, kActive };
struct TemporarySlot {
  std::atomic<int> state{kFree};
  pid_t owner = 0;  // A forked child must not remove its parent's files.
  char path[PATH_MAX];
};
constexpr int kTemporarySlots = 64;
TemporarySlot g_temporaries[kTemporarySlots];
static_assert(std::atomic<int>::is_always_lock_free,
              "the signal handler reads the slots' state");

// >= 0: the commits in progress; -1: a signal handler is ending the process.
std::atomic<int> g_commit_gate{0};
// A signal that arrived during a commit, raised again once it is done.
std::atomic<int> g_deferred_signal{0};

// The slot now holding `path`, or -1 when every slot is taken (the file is
// then left to the next run's RemoveLeftovers).
int RegisterTemporary(const std::string& path) {
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kTemporarySlots; ++i) {
    int free = kFree;
    if (!g_temporaries[i].state.compare_exchange_strong(free, kClaimed)) {
      continue;
    }
    std::memcpy(g_temporaries[i].path, path.c_str(), path.size() + 1);
    g_temporaries[i].owner = ::getpid();
    g_temporaries[i].state.store(kActive);
    return i;
  }
  return -1;
}

void UnregisterTemporary(int slot) {
  if (slot >= 0) g_temporaries[slot].state.store(kFree);
}

// Async-signal-safe: unlink and getpid only.
void RemoveRegisteredTemporaries() {
  const pid_t self = ::getpid();
  for (TemporarySlot& slot : g_temporaries) {
    if (slot.state.load() == kActive && slot.owner == self) {
      ::unlink(slot.path);
    }
  }
}

// The signals whose default action ends the process (SIGKILL and SIGSTOP
// aside, which cannot be caught).
constexpr int kTerminatingSignals[] = {SIGINT,  SIGTERM, SIGHUP,    SIGQUIT,
                                       SIGUSR1, SIGUSR2, SIGALRM,   SIGXCPU,
                                       SIGXFSZ, SIGPROF, SIGVTALRM};

extern "C" void RemoveTemporariesAndDie(int signal) {
  int idle = 0;
  if (g_commit_gate.compare_exchange_strong(idle, -1)) {
    RemoveRegisteredTemporaries();
    ::signal(signal, SIG_DFL);
    ::raise(signal);  // Delivered, by the default action, once we return.
    return;
  }
  // A commit is renaming files (on another thread: the committing one holds
  // these signals off): it raises this again when done.
  if (idle > 0) g_deferred_signal.store(signal);
}

// Holds the terminating signals off the calling thread, and the handler off
// the files, for the duration of a commit.
class CommitGuard {
 public:
  CommitGuard() {
    sigset_t held;
    sigemptyset(&held);
    for (int s : kTerminatingSignals) sigaddset(&held, s);
    sigaddset(&held, SIGPIPE);
    ::pthread_sigmask(SIG_BLOCK, &held, &saved_);
    int commits = g_commit_gate.load();
    do {
      entered_ = commits >= 0;
    } while (entered_ &&
             !g_commit_gate.compare_exchange_weak(commits, commits + 1));
  }
  CommitGuard(const CommitGuard&) = delete;
  CommitGuard& operator=(const CommitGuard&) = delete;
  ~CommitGuard() {
    if (entered_) g_commit_gate.fetch_sub(1);
    ::pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
    if (const int signal = g_deferred_signal.exchange(0); signal != 0) {
      ::raise(signal);
    }
  }
  // False when a signal handler is already ending the process.
  bool entered() const { return entered_; }

 private:
  sigset_t saved_;
  bool entered_ = false;
};

std::string RandomSuffix() {
  static std::atomic<uint64_t> counter{0};
  std::random_device device;
  const uint64_t bits = (uint64_t{device()} << 32 ^ device()) + counter++;
  return absl::StrCat(::getpid(), "-",
                      absl::Hex(bits & 0xffffffffffffULL, absl::kZeroPad12));
}

// The hidden names of `name`'s temporaries and set-aside files.
std::string HiddenName(const std::string& path, absl::string_view kind) {
  return absl::StrCat(DirectoryOf(path), "/.", BaseName(path), ".", kind, "-",
                      RandomSuffix());
}

// The pid in `.NAME.tmp-PID-...` or `.NAME.old-PID-...`, or 0.
pid_t LeftoverPid(absl::string_view entry, absl::string_view name) {
  if (!absl::ConsumePrefix(&entry, ".") || !absl::ConsumePrefix(&entry, name) ||
      !(absl::ConsumePrefix(&entry, ".tmp-") ||
        absl::ConsumePrefix(&entry, ".old-"))) {
    return 0;
  }
  const size_t dash = entry.find('-');
  int pid = 0;
  if (dash == absl::string_view::npos ||
      !absl::SimpleAtoi(entry.substr(0, dash), &pid) || pid <= 0) {
    return 0;
  }
  return pid;
}

// Removes the temporaries and set-aside files of `path`'s name that a
// process no longer alive left (killed by SIGKILL, or crashed). Best
// effort: what cannot be removed stays for the next run.
void RemoveLeftovers(const std::string& path) {
  const std::string dir = DirectoryOf(path), name = BaseName(path);
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) return;
  const pid_t self = ::getpid();
  while (const struct dirent* entry = ::readdir(listing)) {
    const pid_t pid = LeftoverPid(entry->d_name, name);
    if (pid == 0 || pid == self) continue;
    if (::kill(pid, 0) == -1 && errno == ESRCH) {
      ::unlinkat(::dirfd(listing), entry->d_name, 0);
    }
  }
  ::closedir(listing);
}

// A new temporary for `path`, registered with the signal handler before it
// exists.
struct Temporary {
  std::string path;
  int fd = -1;
  int slot = -1;
};

absl::StatusOr<Temporary> CreateTemporary(const std::string& path) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    Temporary temp;
    temp.path = HiddenName(path, "tmp");
    temp.slot = RegisterTemporary(temp.path);
    temp.fd = ::open(temp.path.c_str(),
                     O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                     0666);
    if (temp.fd >= 0) return temp;
    const int error = errno;
    UnregisterTemporary(temp.slot);
    if (error != EEXIST) {
      return OsError(error, path, "cannot create a temporary file");
    }
  }
  return absl::AlreadyExistsError(
      absl::StrCat(path, ": cannot create a temporary file: 100 names taken"));
}

void SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// A target the commit may replace or remove: absent, a regular file or a
// link (replaced itself, not written through).
absl::Status CheckReplaceable(const std::string& path, absl::string_view how) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return OsError(errno, path, "cannot inspect");
  }
  if (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": is ", FileKind(st.st_mode), ", cannot ", how,
                   " it"));
}

// A file renamed aside during a commit, and where it came from.
struct SetAside {
  std::string target, backup;
};

// Renames the set-aside files back, last first; the lines of any that
// could not be (so the user can find them), else empty.
std::string MoveBack(const std::vector<SetAside>& aside) {
  std::string lost;
  for (auto it = aside.rbegin(); it != aside.rend(); ++it) {
    if (::rename(it->backup.c_str(), it->target.c_str()) != 0) {
      absl::StrAppend(&lost, "; ", it->target, " could not be restored from ",
                      it->backup, ": ", std::strerror(errno));
    }
  }
  return lost;
}

absl::Status CommitError(int error, const std::string& path,
                         absl::string_view what, absl::string_view after) {
  return absl::Status(absl::ErrnoToStatus(error, "").code(),
                      absl::StrCat(path, ": ", what, ": ",
                                   std::strerror(error), after));
}

}  // namespace

void RemoveTemporariesOnSignals() {
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = RemoveTemporariesAndDie;
  sigemptyset(&action.sa_mask);
  for (int s : kTerminatingSignals) {
    // One the process ignores (SIGXFSZ in dflash_head) stays ignored.
    struct sigaction current;
    if (::sigaction(s, nullptr, &current) == 0 &&
        current.sa_handler == SIG_IGN) {
      continue;
    }
    ::sigaction(s, &action, nullptr);
  }
}

OutputFileSet::~OutputFileSet() { Abandon(); }

void OutputFileSet::Abandon() {
  for (const Staged& staged : staged_) {
    ::unlink(staged.temp.c_str());
    UnregisterTemporary(staged.slot);
  }
  staged_.clear();
}

absl::Status OutputFileSet::Stage(const std::string& path,
                                  absl::string_view bytes) {
  return Stage(path, absl::MakeConstSpan(&bytes, 1));
}

absl::Status OutputFileSet::Stage(const std::string& path,
                                  absl::Span<const absl::string_view> pieces) {
  RemoveLeftovers(path);
  DFLASH_ASSIGN_OR_RETURN(Temporary temp, CreateTemporary(path));
  absl::Status written;
  for (absl::string_view piece : pieces) {
    if (written.ok()) written = WriteAll(temp.fd, piece, path);
  }
  if (written.ok() && ::fsync(temp.fd) != 0) {
    written = OsError(errno, path, "cannot flush to disk");
  }
  if (::close(temp.fd) != 0 && written.ok()) {
    written = OsError(errno, path, "cannot close");
  }
  if (!written.ok()) {
    ::unlink(temp.path.c_str());
    UnregisterTemporary(temp.slot);
    return written;
  }
  staged_.push_back({std::move(temp.path), path, temp.slot});
  return absl::OkStatus();
}

void OutputFileSet::StageRemoval(const std::string& path) {
  RemoveLeftovers(path);
  removals_.push_back(path);
}

absl::Status OutputFileSet::Commit() {
  CommitGuard guard;
  if (!guard.entered()) {
    Abandon();
    return absl::AbortedError(
        "interrupted by a signal before any file was replaced");
  }
  std::vector<std::string> targets;
  for (const Staged& staged : staged_) targets.push_back(staged.target);
  for (const std::string& path : removals_) {
    if (std::find(targets.begin(), targets.end(), path) == targets.end()) {
      targets.push_back(path);
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    const bool removal = i >= staged_.size();
    if (absl::Status ok =
            CheckReplaceable(targets[i], removal ? "remove" : "replace");
        !ok.ok()) {
      Abandon();
      return ok;
    }
  }
  // (1) The old files aside.
  std::vector<SetAside> aside;
  for (size_t i = 0; i < targets.size(); ++i) {
    struct stat st;
    if (::lstat(targets[i].c_str(), &st) != 0) continue;
    SetAside moved{targets[i], HiddenName(targets[i], "old")};
    if (::rename(moved.target.c_str(), moved.backup.c_str()) != 0) {
      const int error = errno;
      const char* what = i < staged_.size()
                             ? "cannot replace it"
                             : "cannot remove the previous run's file";
      const std::string lost = MoveBack(aside);
      Abandon();
      return CommitError(error, moved.target, what,
                         lost.empty() ? "; no file was changed" : lost);
    }
    aside.push_back(std::move(moved));
  }
  // (2) The new files in place.
  for (size_t i = 0; i < staged_.size(); ++i) {
    if (::rename(staged_[i].temp.c_str(), staged_[i].target.c_str()) == 0) {
      UnregisterTemporary(staged_[i].slot);
      continue;
    }
    const int error = errno;
    const std::string target = staged_[i].target;
    for (size_t placed = 0; placed < i; ++placed) {
      ::unlink(staged_[placed].target.c_str());
    }
    staged_.erase(staged_.begin(), staged_.begin() + i);
    const std::string lost = MoveBack(aside);
    Abandon();
    return CommitError(error, target, "cannot move into place",
                       lost.empty() ? "; the previous files were restored"
                                    : lost);
  }
  staged_.clear();
  removals_.clear();
  // (3) The old files gone; a failure leaves a hidden file that a later
  // Stage() of the name removes.
  for (const SetAside& moved : aside) ::unlink(moved.backup.c_str());
  // The renames themselves reach the disk with the directory.
  std::vector<std::string> directories;
  for (const std::string& target : targets) {
    const std::string dir = DirectoryOf(target);
    if (std::find(directories.begin(), directories.end(), dir) ==
        directories.end()) {
      directories.push_back(dir);
      SyncDirectory(dir);
    }
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
