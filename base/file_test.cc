#include "base/file.h"

#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "base/immutable_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string TestDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(root ? root : "/tmp") + "/" + name;
  ::mkdir(dir.c_str(), 0777);
  return dir;
}

std::string Contents(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

void Put(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Entries of `dir` whose names start with '.' (temporaries and probes).
int HiddenEntries(const std::string& dir) {
  const std::string command =
      "ls -A " + dir + " | grep -c '^\\.' > " + dir + ".count; true";
  EXPECT_EQ(std::system(command.c_str()), 0);
  return std::atoi(Contents(dir + ".count").c_str());
}

TEST(ReadableFileTest, ReadsARegularFile) {
  const std::string path = TestDir("read") + "/data";
  Put(path, "0123456789");
  absl::StatusOr<ReadableFile> file = ReadableFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 10);
  std::string out(4, '\0');
  ASSERT_TRUE(file->ReadAt(3, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, "3456");
  const absl::Status past = file->ReadAt(8, absl::MakeSpan(out));
  EXPECT_EQ(past.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(past.message(), HasSubstr("ended at byte 10, expected 12"));
  EXPECT_EQ(*ReadFileToString(path, 10), "0123456789");
  EXPECT_EQ(ReadFileToString(path, 9).status().message(),
            path + ": holds 10 bytes, more than the 9 expected at most");
}

TEST(ReadableFileTest, MissingFileNamesTheOsReason) {
  const std::string path = TestDir("missing") + "/nothing";
  const absl::Status status = ReadableFile::Open(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(),
            path + ": cannot open: No such file or directory");
}

TEST(ReadableFileTest, RefusesWhatIsNotARegularFile) {
  const std::string dir = TestDir("kinds");
  EXPECT_EQ(ReadableFile::Open(dir).status().message(),
            dir + ": is a directory, expected a regular file");
  // A FIFO with no writer: opening it must neither block nor read.
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(ReadableFile::Open(fifo).status().message(),
            fifo + ": is a FIFO (named pipe), expected a regular file");
  EXPECT_EQ(ReadableFile::Open("/dev/zero").status().message(),
            "/dev/zero: is a character device, expected a regular file");
}

TEST(PrepareOutputDirectoryTest, CreatesMissingParents) {
  const std::string dir = TestDir("prepare") + "/a/b/c";
  ASSERT_TRUE(PrepareOutputDirectory(dir).ok());
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(HiddenEntries(dir), 0);               // The probe file is gone.
  EXPECT_TRUE(PrepareOutputDirectory(dir).ok());  // Existing: fine.
}

TEST(PrepareOutputDirectoryTest, AFileInThePathIsAnError) {
  const std::string root = TestDir("prepare_file");
  Put(root + "/plain", "x");
  EXPECT_EQ(PrepareOutputDirectory(root + "/plain").message(),
            root + "/plain: is a regular file, expected a directory");
  EXPECT_EQ(PrepareOutputDirectory(root + "/plain/sub").message(),
            root + "/plain/sub: " + root +
                "/plain is a regular file, expected a directory");
}

// An append-only directory takes new files but lets none go: the commit's
// renames would fail after the work, so it is refused first.
TEST(PrepareOutputDirectoryTest, AnAppendOnlyDirectoryIsAnError) {
  const std::string dir = TestDir("append_only");
  std::string message;
  {
    ImmutableFile append_only(dir, /*append_only=*/true);
    if (!append_only.set()) {
      GTEST_SKIP() << "chattr +a is refused on this filesystem";
    }
    message = std::string(PrepareOutputDirectory(dir).message());
  }
  EXPECT_THAT(message, ::testing::StartsWith(
                           dir + ": can create files but not remove them "
                                 "(.dflash-probe-"));
  EXPECT_THAT(message, ::testing::HasSubstr(
                           " stays); outputs could not be replaced: "
                           "Operation not permitted"));
}

// Root ignores permission bits, so an unwritable directory is one the
// kernel refuses: sysfs.
TEST(PrepareOutputDirectoryTest, AnUnwritableDirectoryIsAnError) {
  const absl::Status status = PrepareOutputDirectory("/sys");
  if (status.ok()) GTEST_SKIP() << "/sys is writable here";
  EXPECT_THAT(status.message(),
              HasSubstr("/sys: cannot create files in this directory: "));
}

TEST(OutputFileSetTest, NothingChangesBeforeCommit) {
  const std::string dir = TestDir("set");
  Put(dir + "/a", "old a");
  Put(dir + "/stale", "old");
  {
    OutputFileSet files;
    ASSERT_TRUE(files.Stage(dir + "/a", "new a").ok());
    ASSERT_TRUE(files.Stage(dir + "/b", "new b").ok());
    files.StageRemoval(dir + "/stale");
    files.StageRemoval(dir + "/never_there");
    EXPECT_EQ(Contents(dir + "/a"), "old a");
    EXPECT_FALSE(std::ifstream(dir + "/b").good());
    ASSERT_TRUE(files.Commit().ok());
  }
  EXPECT_EQ(Contents(dir + "/a"), "new a");
  EXPECT_EQ(Contents(dir + "/b"), "new b");
  EXPECT_FALSE(std::ifstream(dir + "/stale").good());
  EXPECT_EQ(HiddenEntries(dir), 0);
}

TEST(OutputFileSetTest, AnAbandonedSetLeavesNoTrace) {
  const std::string dir = TestDir("abandoned");
  Put(dir + "/a", "old a");
  {
    OutputFileSet files;
    ASSERT_TRUE(files.Stage(dir + "/a", "new a").ok());
  }
  EXPECT_EQ(Contents(dir + "/a"), "old a");
  EXPECT_EQ(HiddenEntries(dir), 0);
}

// A full disk, as the file-size limit makes one: the failed write is an
// error naming the file and the reason, and no target changes.
TEST(OutputFileSetTest, AFailedWriteChangesNothing) {
  const std::string dir = TestDir("full");
  Put(dir + "/a", "old a");
  Put(dir + "/b", "old b");
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  absl::Status second;
  {
    OutputFileSet files;
    EXPECT_TRUE(files.Stage(dir + "/a", "small").ok());
    second = files.Stage(dir + "/b", std::string(1000, 'x'));
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  EXPECT_EQ(second.message(), dir + "/b: cannot write: File too large");
  EXPECT_EQ(Contents(dir + "/a"), "old a");
  EXPECT_EQ(Contents(dir + "/b"), "old b");
  EXPECT_EQ(HiddenEntries(dir), 0);
}

// Every entry of `dir` (hidden ones too) and its bytes; a directory's are
// "<dir>".
std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> entries;
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) return entries;
  while (const struct dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    const std::string path = dir + "/" + name;
    const bool is_dir = ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    entries[name] = is_dir ? "<dir>" : Contents(path);
  }
  ::closedir(listing);
  return entries;
}

// The old set of a commit that must fail: a, b and a stale c. The new set
// replaces a and b, adds d and removes c.
void PutOldSet(const std::string& dir) {
  Put(dir + "/a", "old a");
  Put(dir + "/b", "old b");
  Put(dir + "/c", "old c");
}

absl::Status CommitNewSet(const std::string& dir) {
  OutputFileSet files;
  for (const char* name : {"a", "b", "d"}) {
    const absl::Status staged =
        files.Stage(dir + "/" + name, std::string("new ") + name);
    if (!staged.ok()) return staged;
  }
  files.StageRemoval(dir + "/c");
  return files.Commit();
}

TEST(OutputFileSetTest, ADirectoryInATargetsPlaceMovesNothing) {
  const std::string dir = TestDir("blocked");
  PutOldSet(dir);
  std::remove((dir + "/b").c_str());
  ::mkdir((dir + "/b").c_str(), 0777);
  const auto before = Snapshot(dir);
  EXPECT_EQ(std::string(CommitNewSet(dir).message()),
            dir + "/b: is a directory, cannot replace it");
  EXPECT_EQ(Snapshot(dir), before);
}

TEST(OutputFileSetTest, ADirectoryInAStaleFilesPlaceMovesNothing) {
  const std::string dir = TestDir("blocked_stale");
  PutOldSet(dir);
  std::remove((dir + "/c").c_str());
  ::mkdir((dir + "/c").c_str(), 0777);
  const auto before = Snapshot(dir);
  EXPECT_EQ(std::string(CommitNewSet(dir).message()),
            dir + "/c: is a directory, cannot remove it");
  EXPECT_EQ(Snapshot(dir), before);
}

// The rename of b is refused after a was set aside: a comes back, the new
// files go, and the directory is as it was.
TEST(OutputFileSetTest, AnImmutableTargetChangesNothing) {
  const std::string dir = TestDir("immutable");
  PutOldSet(dir);
  const auto before = Snapshot(dir);
  ImmutableFile pinned(dir + "/b");
  if (!pinned.set()) GTEST_SKIP() << "chattr +i is refused on this filesystem";
  EXPECT_EQ(std::string(CommitNewSet(dir).message()),
            dir + "/b: cannot replace it: Operation not permitted; no file "
                  "was changed");
  EXPECT_EQ(Snapshot(dir), before);
}

TEST(OutputFileSetTest, AnImmutableStaleFileChangesNothing) {
  const std::string dir = TestDir("immutable_stale");
  PutOldSet(dir);
  const auto before = Snapshot(dir);
  ImmutableFile pinned(dir + "/c");
  if (!pinned.set()) GTEST_SKIP() << "chattr +i is refused on this filesystem";
  EXPECT_EQ(std::string(CommitNewSet(dir).message()),
            dir + "/c: cannot remove the previous run's file: Operation not "
                  "permitted; no file was changed");
  EXPECT_EQ(Snapshot(dir), before);
}

// A file bind-mounted onto b cannot be renamed (EBUSY). The mount needs a
// mount namespace of its own, so the commit runs in a child that reports
// by its exit code.
TEST(OutputFileSetTest, ABindMountedTargetChangesNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "bind mounts need root";
  const std::string dir = TestDir("bind_mounted");
  PutOldSet(dir);
  const std::string source = TestDir("bind_source") + "/file";
  Put(source, "mounted b");
  enum { kPassed, kCommitted, kWrongMessage, kChanged, kNoMount = 77 };
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount(source.c_str(), (dir + "/b").c_str(), nullptr, MS_BIND,
                nullptr) != 0) {
      ::_exit(kNoMount);
    }
    const auto before = Snapshot(dir);
    const absl::Status status = CommitNewSet(dir);
    if (status.ok()) ::_exit(kCommitted);
    if (status.message() != dir + "/b: cannot replace it: Device or resource "
                                  "busy; no file was changed") {
      ::_exit(kWrongMessage);
    }
    ::_exit(Snapshot(dir) == before ? kPassed : kChanged);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == kNoMount) {
    GTEST_SKIP() << "unshare(CLONE_NEWNS) or mount --bind is refused here";
  }
  EXPECT_EQ(WEXITSTATUS(status), kPassed)
      << "1: committed, 2: another message, 3: the directory changed";
  EXPECT_EQ(Contents(dir + "/b"), "old b");
}

// A rename into place refused after the old files went aside (here b's
// temporary vanished): the new files placed go, the old ones come back.
TEST(OutputFileSetTest, ARefusedRenameIntoPlaceRestoresTheOldSet) {
  const std::string dir = TestDir("into_place");
  PutOldSet(dir);
  const auto before = Snapshot(dir);
  OutputFileSet files;
  for (const char* name : {"a", "b", "d"}) {
    ASSERT_TRUE(files.Stage(dir + "/" + name, std::string("new ") + name).ok());
  }
  files.StageRemoval(dir + "/c");
  for (const auto& [name, bytes] : Snapshot(dir)) {
    if (bytes == "new b") std::remove((dir + "/" + name).c_str());
  }
  EXPECT_EQ(std::string(files.Commit().message()),
            dir + "/b: cannot move into place: No such file or directory; the "
                  "previous files were restored");
  EXPECT_EQ(Snapshot(dir), before);
}

// A process that has exited: its pid names no live process (until reused).
pid_t DeadPid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

// What a run killed by SIGKILL leaves is removed by the next Stage() of the
// same name; a live process's files, and other names, are left alone.
TEST(OutputFileSetTest, StageRemovesTheLeftoversOfDeadProcesses) {
  const std::string dir = TestDir("leftovers");
  const std::string dead = std::to_string(DeadPid());
  const std::string self = std::to_string(::getpid());
  for (const std::string& name :
       {".a.tmp-" + dead + "-000000000001", ".a.old-" + dead + "-000000000002",
        ".a.tmp-" + self + "-000000000003", ".b.tmp-" + dead + "-000000000004",
        std::string(".a.tmp-x")}) {
    Put(dir + "/" + name, "left over");
  }
  OutputFileSet files;
  ASSERT_TRUE(files.Stage(dir + "/a", "new a").ok());
  std::vector<std::string> hidden;
  for (const auto& [name, bytes] : Snapshot(dir)) hidden.push_back(name);
  ASSERT_EQ(hidden.size(), 4u);
  EXPECT_EQ(hidden[0], ".a.tmp-" + self + "-000000000003");
  EXPECT_THAT(hidden[1], StartsWith(".a.tmp-" + self + "-"));  // Ours.
  EXPECT_EQ(hidden[2], ".a.tmp-x");
  EXPECT_EQ(hidden[3], ".b.tmp-" + dead + "-000000000004");
  files.StageRemoval(dir + "/b");
  EXPECT_EQ(Snapshot(dir).count(".b.tmp-" + dead + "-000000000004"), 0u);
}

// SIGINT, SIGTERM or SIGHUP while a set is staged: its temporaries are
// removed and the process ends by that signal.
TEST(OutputFileSetDeathTest, ATerminatingSignalRemovesTheTemporaries) {
  // SIGQUIT, SIGXCPU and SIGXFSZ are handled alike, but their default
  // action would write a core file here.
  for (const int signal :
       {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM}) {
    SCOPED_TRACE(signal);
    const std::string dir = TestDir("signal_" + std::to_string(signal));
    EXPECT_EXIT(
        {
          RemoveTemporariesOnSignals();
          OutputFileSet files;
          if (files.Stage(dir + "/a", std::string(1 << 20, 'x')).ok()) {
            std::fprintf(stderr, "staged %zu\n", Snapshot(dir).size());
          }
          ::raise(signal);
        },
        ::testing::KilledBySignal(signal), "staged 1");
    EXPECT_TRUE(Snapshot(dir).empty());
  }
}

// A link to a device in a target's place is replaced, not written through.
TEST(OutputFileSetTest, ReplacesALinkInsteadOfWritingThroughIt) {
  const std::string dir = TestDir("link");
  ASSERT_EQ(::symlink("/dev/full", (dir + "/out").c_str()), 0);
  ASSERT_TRUE(WriteFileAtomically(dir + "/out", "bytes").ok());
  struct stat st;
  ASSERT_EQ(::lstat((dir + "/out").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(Contents(dir + "/out"), "bytes");
}

}  // namespace
}  // namespace dflash
