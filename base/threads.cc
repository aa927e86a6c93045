#include "base/threads.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dflash {
namespace {

// Calls in progress hold it shared; a fork holds it exclusively from
// HoldCallsForFork or fork()'s prepare handler to the parent's and the
// child's handlers. Writer-preferring, so a fork is not starved by calls
// that overlap.
pthread_rwlock_t calls = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
std::atomic<bool> forked_child{false};
thread_local int call_depth = 0;
// Whether this thread's outermost call holds `calls` shared (not while the
// thread holds it for a fork, which keeps every other call out already).
thread_local bool call_holds_lock = false;
// Whether this thread holds `calls` exclusively for its coming fork().
thread_local bool holds_for_fork = false;

void AfterForkInParent() {
  if (!holds_for_fork) return;
  holds_for_fork = false;
  pthread_rwlock_unlock(&calls);
}

void AfterForkInChild() {
  forked_child.store(true, std::memory_order_relaxed);
  // The lock names its writer by thread id, which the child's only thread
  // does not share: made anew (no other thread exists to hold it). A call
  // this thread was inside (a fork from within it) no longer holds it.
  const pthread_rwlock_t fresh =
      PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
  std::memcpy(&calls, &fresh, sizeof(calls));
  holds_for_fork = false;
  call_holds_lock = false;
}

[[maybe_unused]] const bool fork_handlers_registered = [] {
  return pthread_atfork(HoldCallsForFork, AfterForkInParent,
                        AfterForkInChild) == 0;
}();

void* Exit(void*) { return nullptr; }

// Starts and joins `count` threads as OpenMP would (default attributes):
// what a process or memory limit refuses is reported here instead of
// aborting inside libgomp.
absl::Status StartThreads(int count) {
  std::vector<pthread_t> started;
  started.reserve(static_cast<size_t>(count));
  int error = 0;
  for (int i = 0; i < count && error == 0; ++i) {
    pthread_t thread;
    error = pthread_create(&thread, nullptr, Exit, nullptr);
    if (error == 0) started.push_back(thread);
  }
  for (pthread_t thread : started) pthread_join(thread, nullptr);
  if (error == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "cannot start ", count + 1, " threads (only ", started.size() + 1,
      " could run: ", std::strerror(error),
      "); ask for fewer threads or raise the process limit (ulimit -u)"));
}

}  // namespace

int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

bool InForkedChild() {
  return forked_child.load(std::memory_order_relaxed);
}

absl::StatusOr<int> ResolveThreads(int64_t requested, const char* what) {
  if (requested < 0 || requested > kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": must lie in [0, ", kMaxThreads,
                     "] (0: every usable CPU), got ", requested));
  }
  if (InForkedChild()) return 1;
  const int cpus = UsableCpus();
  const int threads =
      requested == 0 ? cpus : std::min(static_cast<int>(requested), cpus);
  // libgomp keeps a pool per calling thread: once this thread has run a
  // team this large, its threads exist.
  thread_local int started = 1;
  if (threads > started) {
    if (absl::Status ok = StartThreads(threads - 1); !ok.ok()) {
      return absl::Status(ok.code(), absl::StrCat(what, ": ", ok.message()));
    }
    started = threads;
  }
  return threads;
}

ScopedLibraryCall::ScopedLibraryCall() {
  if (call_depth++ == 0 && !holds_for_fork) {
    pthread_rwlock_rdlock(&calls);
    call_holds_lock = true;
  }
}

ScopedLibraryCall::~ScopedLibraryCall() {
  if (--call_depth == 0 && call_holds_lock) {
    call_holds_lock = false;
    pthread_rwlock_unlock(&calls);
  }
}

void HoldCallsForFork() {
  // Inside a call this thread would wait for itself.
  if (holds_for_fork || call_depth > 0) return;
  pthread_rwlock_wrlock(&calls);
  holds_for_fork = true;
}

}  // namespace dflash
