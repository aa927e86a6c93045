#include "tools/cuda_emulation/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define DFLASH_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define DFLASH_EMU_TSAN 1
#endif

#if !defined(__x86_64__)
#error "the CUDA emulation's fibers switch stacks on x86-64 only"
#endif

// Saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer at *save and continues on `load`
// (a stack saved the same way, or a new fiber's first frame).
extern "C" void dflash_emu_switch(void** save, void* load);
// A new fiber's first return lands here: rbx holds the fiber, r12 the
// function to call with it.
extern "C" void dflash_emu_fiber_start();

asm(R"(
    .text
    .globl dflash_emu_switch
    .type dflash_emu_switch, @function
dflash_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw 12(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr 8(%rsp)
    fldcw 12(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size dflash_emu_switch, .-dflash_emu_switch

    .globl dflash_emu_fiber_start
    .type dflash_emu_fiber_start, @function
dflash_emu_fiber_start:
    movq %rbx, %rdi
    callq *%r12
    ud2
    .size dflash_emu_fiber_start, .-dflash_emu_fiber_start
)");

namespace dflash_emu {
namespace {

thread_local Fiber* running = nullptr;

size_t PageSize() { return static_cast<size_t>(::sysconf(_SC_PAGESIZE)); }

}  // namespace

Fiber::Fiber(void (*entry)(void*), void* argument, size_t stack_bytes) {
  const size_t page = PageSize();
  stack_bytes_ = (stack_bytes + page - 1) / page * page + page;
  stack_ = ::mmap(nullptr, stack_bytes_, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (stack_ == MAP_FAILED) {
    std::fprintf(stderr, "CUDA emulation: cannot map a fiber stack of %zu "
                         "bytes\n", stack_bytes_);
    std::abort();
  }
  ::mprotect(stack_, page, PROT_NONE);  // Overflow faults, not corrupts.
#if DFLASH_EMU_TSAN
  sanitizer_fiber_ = __tsan_create_fiber(0);
#endif
  Reset(entry, argument);
}

Fiber::~Fiber() {
#if DFLASH_EMU_TSAN
  __tsan_destroy_fiber(sanitizer_fiber_);
#endif
  ::munmap(stack_, stack_bytes_);
}

void Fiber::Reset(void (*entry)(void*), void* argument) {
  entry_ = entry;
  argument_ = argument;
  done_ = false;
  // The first frame dflash_emu_switch pops: MXCSR and control word, r15,
  // r14, r13, r12 (the start function), rbx (this), rbp, and the return
  // address. After that return the stack pointer is 16-byte aligned, so
  // the trampoline's call enters Start as the ABI wants (rsp + 8 aligned).
  auto* top = reinterpret_cast<uint64_t*>(static_cast<char*>(stack_) +
                                          stack_bytes_);
  uint64_t* frame = top - 2 - 9;
  frame[0] = 0;
  frame[1] = 0x037Full << 32 | 0x1F80;  // MXCSR, x87 control word: defaults.
  frame[2] = 0;                          // r15
  frame[3] = 0;                          // r14
  frame[4] = 0;                          // r13
  frame[5] = reinterpret_cast<uint64_t>(&Fiber::Start);  // r12
  frame[6] = reinterpret_cast<uint64_t>(this);           // rbx
  frame[7] = 0;                                           // rbp
  frame[8] = reinterpret_cast<uint64_t>(&dflash_emu_fiber_start);
  sp_ = frame;
}

bool Fiber::Resume() {
  Fiber* outer = running;
  running = this;
#if DFLASH_EMU_TSAN
  caller_sanitizer_fiber_ = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(sanitizer_fiber_, 0);
#endif
#if DFLASH_EMU_ASAN
  void* fake = nullptr;
  const size_t page = PageSize();
  __sanitizer_start_switch_fiber(&fake, static_cast<char*>(stack_) + page,
                                 stack_bytes_ - page);
#endif
  dflash_emu_switch(&caller_sp_, sp_);
#if DFLASH_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  running = outer;
  return done_;
}

void Fiber::Yield() {
  Fiber* self = running;
#if DFLASH_EMU_TSAN
  __tsan_switch_to_fiber(self->caller_sanitizer_fiber_, 0);
#endif
#if DFLASH_EMU_ASAN
  __sanitizer_start_switch_fiber(&self->fake_stack_,
                                 self->caller_stack_bottom_,
                                 self->caller_stack_size_);
#endif
  dflash_emu_switch(&self->sp_, self->caller_sp_);
#if DFLASH_EMU_ASAN
  __sanitizer_finish_switch_fiber(self->fake_stack_,
                                  &self->caller_stack_bottom_,
                                  &self->caller_stack_size_);
#endif
}

void Fiber::Start(Fiber* self) {
#if DFLASH_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &self->caller_stack_bottom_,
                                  &self->caller_stack_size_);
#endif
  self->entry_(self->argument_);
  self->done_ = true;
#if DFLASH_EMU_TSAN
  __tsan_switch_to_fiber(self->caller_sanitizer_fiber_, 0);
#endif
#if DFLASH_EMU_ASAN
  // Its stack is done with: no fake stack to keep.
  __sanitizer_start_switch_fiber(nullptr, self->caller_stack_bottom_,
                                 self->caller_stack_size_);
#endif
  dflash_emu_switch(&self->sp_, self->caller_sp_);
  __builtin_unreachable();
}

}  // namespace dflash_emu
