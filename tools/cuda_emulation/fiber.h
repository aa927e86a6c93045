#ifndef DFLASH_TOOLS_CUDA_EMULATION_FIBER_H_
#define DFLASH_TOOLS_CUDA_EMULATION_FIBER_H_

// Cooperative fibers on one OS thread: the threads of an emulated block.
// A switch saves the callee-saved registers and the stack pointer (x86-64,
// System V): tens of nanoseconds, no system call, so a block of 512
// threads can meet at thousands of barriers. Stacks have a guard page
// below them; ASan and TSan are told of every switch.

#include <cstddef>

namespace dflash_emu {

class Fiber {
 public:
  // A fiber that will run entry(argument) on a stack of `stack_bytes`.
  Fiber(void (*entry)(void*), void* argument, size_t stack_bytes);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Sets it to run entry(argument) from the start, on the stack it has.
  void Reset(void (*entry)(void*), void* argument);

  // Runs the fiber until it calls Yield() or its entry returns; returns
  // true if it returned.
  bool Resume();

  // From inside the running fiber: back to the Resume() that ran it.
  static void Yield();

 private:
  // A new fiber's first frame calls this (through dflash_emu_fiber_start).
  static void Start(Fiber* self);

  void* stack_ = nullptr;  // Guard page included.
  size_t stack_bytes_ = 0;
  void* sp_ = nullptr;
  void* caller_sp_ = nullptr;
  void (*entry_)(void*) = nullptr;
  void* argument_ = nullptr;
  bool done_ = false;
  void* sanitizer_fiber_ = nullptr;  // TSan's fiber, where there is one.
  void* caller_sanitizer_fiber_ = nullptr;
  const void* caller_stack_bottom_ = nullptr;
  size_t caller_stack_size_ = 0;
  void* fake_stack_ = nullptr;
};

}  // namespace dflash_emu

#endif  // DFLASH_TOOLS_CUDA_EMULATION_FIBER_H_
