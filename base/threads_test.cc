#include "base/threads.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
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

// Runs `body` on a thread of its own: false when it has not finished in
// 20 s, a hang (the thread is left behind).
bool Finishes(std::function<void()> body) {
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  std::thread([done, body = std::move(body)] {
    body();
    std::lock_guard<std::mutex> lock(done->mu);
    done->done = true;
    done->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(done->mu);
  return done->cv.wait_for(lock, std::chrono::seconds(20),
                           [&] { return done->done; });
}

// Whether child `pid` exited 0.
bool ExitedCleanly(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

TEST(ThreadsTest, ForkAfterHoldingCallsLetsACallNeedingTheForkersLockEnd) {
  // `gil` plays Python's GIL: the forking thread holds it through fork(),
  // and the call in progress needs it to end (its exchange's callback).
  // Waiting for the call inside fork() with it held would never end; the
  // hook (HoldCallsForFork with it released) lets the call end first.
  std::mutex gil;
  std::atomic<bool> inside{false}, forking{false}, left{false};
  std::thread call([&] {
    ScopedLibraryCall scope;
    inside = true;
    while (!forking) std::this_thread::yield();
    { std::lock_guard<std::mutex> callback(gil); }
    left = true;
  });
  std::atomic<bool> left_before_fork{false}, child_ok{false},
      entered_after{false};
  const bool finished = Finishes([&] {
    std::unique_lock<std::mutex> held(gil);
    while (!inside) std::this_thread::yield();
    forking = true;
    held.unlock();  // The hook: waits with the lock released.
    HoldCallsForFork();
    left_before_fork = left.load();
    held.lock();
    { ScopedLibraryCall own; }  // The holder's own calls do not wait.
    const pid_t pid = fork();   // Does not wait again.
    if (pid == 0) {
      alarm(20);  // A hang kills the child.
      { ScopedLibraryCall scope; }  // Its lock is free in the child.
      _exit(0);
    }
    held.unlock();
    child_ok = pid > 0 && ExitedCleanly(pid);
    { ScopedLibraryCall scope; }  // Calls enter again in the parent.
    entered_after = true;
  });
  if (!finished) {
    call.detach();
    FAIL() << "the fork and the call wait for each other";
  }
  call.join();
  EXPECT_TRUE(left_before_fork);
  EXPECT_TRUE(child_ok);
  EXPECT_TRUE(entered_after);
}

TEST(ThreadsTest, AChildForkedInsideACallCallsAgain) {
  pid_t pid = -1;
  {
    ScopedLibraryCall scope;
    HoldCallsForFork();  // Inside a call: does not wait for itself.
    pid = fork();
    if (pid == 0) alarm(20);  // A hang kills the child.
  }  // In the child: leaves a call that holds no lock there.
  if (pid == 0) {
    // The lock is whole: a fork's hold and its fork take it.
    HoldCallsForFork();
    const pid_t grandchild = fork();
    if (grandchild == 0) _exit(0);
    _exit(grandchild > 0 && ExitedCleanly(grandchild) ? 0 : 1);
  }
  ASSERT_GT(pid, 0);
  EXPECT_TRUE(ExitedCleanly(pid));
  { ScopedLibraryCall scope; }  // The parent's lock was left free.
}

TEST(ThreadsTest, AForkJoiningAHoldWaitsForTheHoldersCall) {
  // A call the holding thread makes before its fork() (a later before-fork
  // hook) does not wait, but another thread's fork still waits for it.
  struct State {
    std::atomic<bool> inside{false}, left{false}, forked{false},
        left_before_fork{false}, child_ok{false}, holder_child_ok{false};
  };
  auto state = std::make_shared<State>();
  const bool finished = Finishes([state] {
    std::thread holder([state] {
      HoldCallsForFork();
      {
        ScopedLibraryCall own;
        state->inside = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        state->left = true;
      }
      while (!state->forked) std::this_thread::yield();
      const pid_t pid = fork();
      if (pid == 0) _exit(0);
      state->holder_child_ok = pid > 0 && ExitedCleanly(pid);
    });
    while (!state->inside) std::this_thread::yield();
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(20);  // A hang kills the child.
      { ScopedLibraryCall scope; }
      _exit(0);
    }
    state->left_before_fork = state->left.load();
    state->forked = true;
    state->child_ok = pid > 0 && ExitedCleanly(pid);
    holder.join();
  });
  // On a hang the threads left behind keep calls out: these tests come last.
  ASSERT_TRUE(finished) << "a fork waits for another thread's hold";
  EXPECT_TRUE(state->left_before_fork);
  EXPECT_TRUE(state->child_ok);
  EXPECT_TRUE(state->holder_child_ok);
  { ScopedLibraryCall scope; }
}

TEST(ThreadsTest, AForkDuringAnotherThreadsHoldSharesIt) {
  // Thread `hook` has held calls for its fork (os.fork()'s before-fork hook)
  // and needs `gil` back before its fork(); the other thread holds `gil`
  // through a fork() of its own (C code, no hooks). The second fork joins
  // the hold instead of waiting for it, both forks go through, and calls
  // enter again once both are done.
  struct State {
    std::mutex gil;
    std::atomic<bool> holding{false}, hook_child_ok{false},
        forker_child_ok{false}, entered_after{false};
  };
  // Shared, so that threads a hang leaves behind outlive the test safely.
  auto state = std::make_shared<State>();
  const bool finished = Finishes([state] {
    std::unique_lock<std::mutex> held(state->gil);
    std::thread hook([state] {
      HoldCallsForFork();
      state->holding = true;
      std::lock_guard<std::mutex> taken(state->gil);
      const pid_t pid = fork();  // Does not wait again.
      if (pid == 0) {
        alarm(20);  // A hang kills the child.
        { ScopedLibraryCall scope; }
        _exit(0);
      }
      state->hook_child_ok = pid > 0 && ExitedCleanly(pid);
    });
    while (!state->holding) std::this_thread::yield();
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(20);
      { ScopedLibraryCall scope; }  // Nothing is held in the child.
      _exit(0);
    }
    held.unlock();
    state->forker_child_ok = pid > 0 && ExitedCleanly(pid);
    hook.join();
    { ScopedLibraryCall scope; }  // Both holds were let go.
    state->entered_after = true;
  });
  // On a hang the threads left behind keep calls out: these tests come last.
  ASSERT_TRUE(finished) << "a fork waits for another thread's hold, which "
                           "waits for it";
  EXPECT_TRUE(state->hook_child_ok);
  EXPECT_TRUE(state->forker_child_ok);
  EXPECT_TRUE(state->entered_after);
}

}  // namespace
}  // namespace dflash
