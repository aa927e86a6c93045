#ifndef DFLASH_PYTHON_NATIVE_INTERRUPT_H_
#define DFLASH_PYTHON_NATIVE_INTERRUPT_H_

// Ctrl-C during a long call: Python's SIGINT handler only marks the signal
// for the interpreter, which acts on it after the call returns. While a
// ScopedInterrupt lives, a handler chained in front of it also sets a flag
// the head reads before each GEMM (HeadOptions::interrupt), so the call
// stops within one GEMM and Python's own handler then raises
// KeyboardInterrupt.

#include <atomic>

namespace dflash::python {

class ScopedInterrupt {
 public:
  // Installs the chained SIGINT handler (and clears the flag); the handler
  // it finds runs after it, as before. One scope at a time, from the thread
  // that handles Python's signals.
  ScopedInterrupt();
  // Puts the handler it found back, unless someone replaced the chain since.
  ~ScopedInterrupt();
  ScopedInterrupt(const ScopedInterrupt&) = delete;
  ScopedInterrupt& operator=(const ScopedInterrupt&) = delete;

  // Set once SIGINT arrived within this scope.
  const std::atomic<bool>* flag() const;
};

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_INTERRUPT_H_
