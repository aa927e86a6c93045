#include "base/threads.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace dflash {
namespace {

TEST(ThreadsTest, ZeroMeansEveryUsableCpu) {
  EXPECT_GE(UsableCpus(), 1);
  absl::StatusOr<int> threads = ResolveThreads(0, "head.threads");
  ASSERT_TRUE(threads.ok()) << threads.status();
  EXPECT_EQ(*threads, UsableCpus());
}

TEST(ThreadsTest, MoreThanTheCpusAreClampedToThem) {
  absl::StatusOr<int> threads = ResolveThreads(kMaxThreads, "head.threads");
  ASSERT_TRUE(threads.ok()) << threads.status();
  EXPECT_EQ(*threads, std::min(kMaxThreads, UsableCpus()));
  EXPECT_EQ(*ResolveThreads(1, "head.threads"), 1);
}

TEST(ThreadsTest, CountsOutsideTheBoundAreRefused) {
  EXPECT_EQ(ResolveThreads(100000, "head.threads").status().message(),
            "head.threads: must lie in [0, 1024] (0: every usable CPU), got "
            "100000");
  EXPECT_EQ(ResolveThreads(-1, "threads").status().message(),
            "threads: must lie in [0, 1024] (0: every usable CPU), got -1");
}

// The virtual memory this process maps now, from /proc/self/status.
int64_t MappedBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoll(line.substr(7)) << 10;
  }
  return -1;
}

TEST(ThreadsTest, ThreadsThatCannotStartAreAnError) {
  if (UsableCpus() < 2) GTEST_SKIP() << "one usable CPU: nothing to start";
  // On a fresh thread (its OpenMP pool not started), under an address-space
  // limit that leaves no room for a thread's stack: pthread_create fails.
  absl::StatusOr<int> threads;
  std::thread([&] {
    rlimit old;
    ASSERT_EQ(getrlimit(RLIMIT_AS, &old), 0);
    const int64_t mapped = MappedBytes();
    ASSERT_GT(mapped, 0);
    rlimit tight = old;
    tight.rlim_cur = static_cast<rlim_t>(mapped + (1 << 20));
    ASSERT_EQ(setrlimit(RLIMIT_AS, &tight), 0);
    threads = ResolveThreads(0, "head.threads");
    ASSERT_EQ(setrlimit(RLIMIT_AS, &old), 0);
  }).join();
  ASSERT_FALSE(threads.ok());
  EXPECT_EQ(threads.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(threads.status().message().find("head.threads: cannot start"),
            std::string::npos)
      << threads.status();
}

TEST(ThreadsTest, AForkedChildRunsOneThread) {
  EXPECT_FALSE(InForkedChild());
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const absl::StatusOr<int> threads = ResolveThreads(0, "head.threads");
    _exit(InForkedChild() && threads.ok() && *threads == 1 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_FALSE(InForkedChild());
}

TEST(ThreadsTest, ForkWaitsForACallInProgress) {
  std::atomic<bool> holding{false}, released{false};
  std::thread call([&] {
    ScopedLibraryCall scope;
    {
      ScopedLibraryCall nested;  // Free on the same thread.
      holding = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    released = true;
  });
  while (!holding) std::this_thread::yield();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The child may take the lock again: it inherited it unlocked.
    { ScopedLibraryCall scope; }
    _exit(0);
  }
  // fork() returned, so the call had left.
  EXPECT_TRUE(released);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  call.join();
}

}  // namespace
}  // namespace dflash
