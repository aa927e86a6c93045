#include "base/file.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;

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

TEST(OutputFileSetTest, ADirectoryInATargetsPlaceMovesNothing) {
  const std::string dir = TestDir("blocked");
  Put(dir + "/a", "old a");
  ::mkdir((dir + "/b").c_str(), 0777);
  OutputFileSet files;
  ASSERT_TRUE(files.Stage(dir + "/a", "new a").ok());
  ASSERT_TRUE(files.Stage(dir + "/b", "new b").ok());
  EXPECT_EQ(files.Commit().message(),
            dir + "/b: is a directory, cannot replace it");
  EXPECT_EQ(Contents(dir + "/a"), "old a");
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
