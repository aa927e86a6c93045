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

// Who is inside the library and who forks, under `mu`: a call waits while
// a fork holds or waits (a fork is not starved by calls that overlap), a
// fork waits until no call is inside. Forks of several threads at once
// share the hold: one whose thread does not hold yet (a fork() from C code
// while another thread's before-fork hook holds) joins it, since no call
// is inside, instead of waiting for a hold that may wait for it (through
// the GIL); calls are let in again when the last holder's fork() is done.
// Counts, not a pthread rwlock, whose writer must be the thread that took
// it: each holder lets go of its own share here.
pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
int calls_inside = 0;   // Outermost calls in progress, holders' included.
int forks_holding = 0;  // Threads holding calls out for their fork().
int forks_waiting = 0;  // Threads waiting in HoldCallsForFork.
std::atomic<bool> forked_child{false};
thread_local int call_depth = 0;
// Whether this thread's outermost call is counted in calls_inside.
thread_local bool call_counted = false;
// Whether this thread holds calls out for its coming fork().
thread_local bool holds_for_fork = false;

void AfterForkInParent() {
  if (!holds_for_fork) return;
  holds_for_fork = false;
  pthread_mutex_lock(&mu);
  if (--forks_holding == 0) pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&mu);
}

void AfterForkInChild() {
  forked_child.store(true, std::memory_order_relaxed);
  // The child's only thread: no other holds, waits or calls here. `mu` may
  // have been held by a thread that does not exist here, so both are made
  // anew. A call this thread was inside (a fork from within it) is no
  // longer counted, and its end uncounts nothing.
  const pthread_mutex_t fresh_mu = PTHREAD_MUTEX_INITIALIZER;
  const pthread_cond_t fresh_changed = PTHREAD_COND_INITIALIZER;
  std::memcpy(&mu, &fresh_mu, sizeof(mu));
  std::memcpy(&changed, &fresh_changed, sizeof(changed));
  calls_inside = forks_holding = forks_waiting = 0;
  holds_for_fork = false;
  call_counted = false;
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
  if (call_depth++ > 0) return;
  pthread_mutex_lock(&mu);
  // A holder's own calls do not wait: its fork() keeps other calls out,
  // and the hold would wait for itself. They are counted, so another
  // thread's fork still waits for them.
  while (!holds_for_fork && (forks_holding > 0 || forks_waiting > 0)) {
    pthread_cond_wait(&changed, &mu);
  }
  ++calls_inside;
  call_counted = true;
  pthread_mutex_unlock(&mu);
}

ScopedLibraryCall::~ScopedLibraryCall() {
  if (--call_depth > 0 || !call_counted) return;
  call_counted = false;
  pthread_mutex_lock(&mu);
  if (--calls_inside == 0) pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&mu);
}

void HoldCallsForFork() {
  // Inside a call this thread would wait for itself.
  if (holds_for_fork || call_depth > 0) return;
  pthread_mutex_lock(&mu);
  ++forks_waiting;
  while (calls_inside > 0) pthread_cond_wait(&changed, &mu);
  --forks_waiting;
  ++forks_holding;
  holds_for_fork = true;
  pthread_mutex_unlock(&mu);
}

}  // namespace dflash
