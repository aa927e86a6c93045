#ifndef DFLASH_BASE_THREADS_H_
#define DFLASH_BASE_THREADS_H_

// The threads of the library's CPU work (OpenMP regions, oneDNN's and
// OpenBLAS's GEMMs) inside processes that fork data-loader workers and set
// their own thread counts:
// - a requested count is bounded (kMaxThreads) and never more than the CPUs
//   this process may run on, since more only oversubscribe them;
// - a child of fork() runs single-threaded: libgomp's thread pool does not
//   survive fork, and a parallel region in the child waits for threads that
//   no longer exist (torch marks a forked child the same way);
// - fork() waits while any thread is inside a library call
//   (ScopedLibraryCall), so a child never inherits a lock held mid-call;
//   a runtime whose fork() holds a lock such a call may need to finish
//   (Python's GIL) waits beforehand instead (HoldCallsForFork);
// - threads that cannot be started (a process limit) are an error, not
//   libgomp's abort of the whole process.

#include <cstdint>

#include "absl/status/statusor.h"

namespace dflash {

// The most threads a config or caller may ask for (head.threads).
inline constexpr int kMaxThreads = 1024;

// CPUs this process may run on (its affinity mask), at least 1.
int UsableCpus();

// Whether this process is a child of fork() from a process that had loaded
// this library.
bool InForkedChild();

// The threads a run uses when `requested` are asked for (0: every usable
// CPU): min(requested, UsableCpus()), 1 in a forked child; checked that
// they can be started from this thread. Errors: requested outside
// [0, kMaxThreads] (InvalidArgument naming `what`), threads that cannot be
// started (Unavailable with the OS's reason).
absl::StatusOr<int> ResolveThreads(int64_t requested, const char* what);

// Held by every entry point of the library while it runs (nested holds on
// one thread are free): fork() in another thread waits until no call is
// inside, so the child inherits no lock or half-updated cache.
class ScopedLibraryCall {
 public:
  ScopedLibraryCall();
  ~ScopedLibraryCall();
  ScopedLibraryCall(const ScopedLibraryCall&) = delete;
  ScopedLibraryCall& operator=(const ScopedLibraryCall&) = delete;
};

// fork()'s wait for the calls in progress, done ahead of it by a caller
// that must not wait inside fork(): Python's os.fork() holds the GIL
// through fork(), and a call may need the GIL to finish (a callback into
// Python), so the binding waits here from a before-fork hook with the GIL
// released. Returns once no call is inside and keeps new calls out until
// this thread's next fork(), which then does not wait again and lets them
// in in the parent (the child starts with none); so fork() must follow on
// this thread. Calls this thread makes meanwhile do not wait. Does nothing
// on a thread inside a call (fork() from there waits for no one either) or
// already holding. Forks on several threads at once share the hold: a
// fork() on another thread meanwhile (C code's, which runs no hook, say
// with the GIL held while this thread waits for the GIL) waits only for
// the calls in progress, this thread's included, not for this thread's
// fork(); calls are let in again when the last holder's fork() is done.
void HoldCallsForFork();

}  // namespace dflash

#endif  // DFLASH_BASE_THREADS_H_
