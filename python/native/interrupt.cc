#include "python/native/interrupt.h"

#include <signal.h>

namespace dflash::python {
namespace {

std::atomic<bool> interrupted{false};
struct sigaction previous;

void OnInterrupt(int signal, siginfo_t* info, void* context) {
  interrupted.store(true, std::memory_order_relaxed);
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(signal, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(signal);
  }
}

}  // namespace

ScopedInterrupt::ScopedInterrupt() {
  interrupted.store(false, std::memory_order_relaxed);
  struct sigaction chained = {};
  chained.sa_sigaction = OnInterrupt;
  chained.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&chained.sa_mask);
  sigaction(SIGINT, &chained, &previous);
}

ScopedInterrupt::~ScopedInterrupt() {
  struct sigaction now = {};
  sigaction(SIGINT, nullptr, &now);
  if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == OnInterrupt) {
    sigaction(SIGINT, &previous, nullptr);
  }
}

const std::atomic<bool>* ScopedInterrupt::flag() const { return &interrupted; }

}  // namespace dflash::python
