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

}  // namespace dflash

#endif  // DFLASH_BASE_THREADS_H_
