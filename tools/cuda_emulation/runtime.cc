// The emulated CUDA runtime: device memory, streams, events and kernel
// execution on the CPU (see emulated_cuda.h).
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tools/cuda_emulation/emulated_cuda.h"
#include "tools/cuda_emulation/fiber.h"
#include "tools/cuda_emulation/runtime_internal.h"

namespace dflash_emu {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------- errors

// Errors of calls (launch configurations, bad arguments): per host thread,
// cleared by cudaGetLastError. Errors inside kernels are sticky, as a
// GPU's context is after a fault: every later synchronisation returns it.
thread_local cudaError_t last_error = cudaSuccess;
std::atomic<int> sticky_error{cudaSuccess};

cudaError_t Fail(cudaError_t error, const std::string& why) {
  std::fprintf(stderr, "CUDA emulation: %s\n", why.c_str());
  last_error = error;
  return error;
}

void FailAsync(cudaError_t error, const std::string& why) {
  std::fprintf(stderr, "CUDA emulation: %s\n", why.c_str());
  int none = cudaSuccess;
  sticky_error.compare_exchange_strong(none, error);
}

cudaError_t Sticky() { return static_cast<cudaError_t>(sticky_error.load()); }

// --------------------------------------------------------- device memory

struct Allocation {
  uintptr_t begin = 0;
  size_t bytes = 0;
  uintptr_t pages = 0;  // Its pages: [pages, begin + round-up(bytes, 256)).
  size_t page_bytes = 0;
  bool freed = false;
};

// Device memory is carved, never reused, from one reserved range: each
// allocation ends (its size rounded up to 256 bytes, CUDA's alignment) at
// a page that is never opened, and its pages are opened to the process
// only while a kernel or a copy runs. A freed allocation stays closed.
class DeviceMemory {
 public:
  static DeviceMemory& Get() {
    static DeviceMemory* memory = new DeviceMemory();
    return *memory;
  }

  void* Allocate(size_t bytes) {
    if (bytes == 0) return nullptr;
    const size_t rounded = (bytes + 255) / 256 * 256;
    const size_t page_bytes = (rounded + page_ - 1) / page_ * page_;
    std::lock_guard<std::mutex> lock(mu_);
    if (next_ + page_bytes + page_ > end_) return nullptr;
    Allocation a;
    a.pages = next_;
    a.page_bytes = page_bytes;
    a.begin = next_ + page_bytes - rounded;
    a.bytes = bytes;
    next_ += page_bytes + page_;  // And a guard page after it.
    if (::mprotect(reinterpret_cast<void*>(a.pages), page_bytes,
                   open_ > 0 ? PROT_READ | PROT_WRITE : PROT_NONE) != 0) {
      return nullptr;
    }
    allocations_[a.begin] = a;
    return reinterpret_cast<void*>(a.begin);
  }

  // False for a pointer that is not a live allocation's start.
  bool Free(void* pointer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(pointer));
    if (it == allocations_.end() || it->second.freed) return false;
    Allocation& a = it->second;
    a.freed = true;
    void* pages = reinterpret_cast<void*>(a.pages);
    ::mprotect(pages, a.page_bytes, PROT_NONE);
    ::madvise(pages, a.page_bytes, MADV_DONTNEED);
    return true;
  }

  // Makes a freed allocation live again: a captured cudaMallocAsync,
  // replayed, hands out the address it had at capture.
  void Revive(void* pointer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(pointer));
    if (it == allocations_.end() || !it->second.freed) return;
    it->second.freed = false;
    ::mprotect(reinterpret_cast<void*>(it->second.pages),
               it->second.page_bytes,
               open_ > 0 ? PROT_READ | PROT_WRITE : PROT_NONE);
  }

  // Opens live allocations to the process while a kernel or copy runs.
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    if (open_++ > 0) return;
    for (auto& [begin, a] : allocations_) {
      if (!a.freed) {
        ::mprotect(reinterpret_cast<void*>(a.pages), a.page_bytes,
                   PROT_READ | PROT_WRITE);
      }
    }
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--open_ > 0) return;
    for (auto& [begin, a] : allocations_) {
      if (!a.freed) {
        ::mprotect(reinterpret_cast<void*>(a.pages), a.page_bytes,
                   PROT_NONE);
      }
    }
  }

  bool InRange(uintptr_t address) const {
    return address >= start_ && address < end_;
  }

  // The allocation whose pages or guard page hold `address`. Lock-free
  // for the signal handler: the map is only read there, and the process
  // is about to stop.
  const Allocation* Near(uintptr_t address) const {
    auto it = allocations_.upper_bound(address + page_ * 2);
    while (it != allocations_.begin()) {
      --it;
      const Allocation& a = it->second;
      if (address >= a.pages && address < a.pages + a.page_bytes + page_) {
        return &a;
      }
      if (a.pages + a.page_bytes + page_ <= address) break;
    }
    return nullptr;
  }

  // The live allocation holding [address, address + bytes), or null.
  const Allocation* Holding(uintptr_t address, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.upper_bound(address);
    if (it == allocations_.begin()) return nullptr;
    --it;
    const Allocation& a = it->second;
    if (a.freed || address < a.begin || address + bytes > a.begin + a.bytes) {
      return nullptr;
    }
    return &a;
  }

  // The live allocation holding `address`, or null.
  const Allocation* Live(uintptr_t address) {
    return Holding(address, 1);
  }

  // The allocation `address` is in (live or freed, up to its rounded
  // end), for messages.
  std::string Describe(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.upper_bound(address);
    if (it == allocations_.begin()) return "not in any allocation";
    --it;
    const Allocation& a = it->second;
    char text[160];
    std::snprintf(text, sizeof(text),
                  "offset %zu of a%s allocation of %zu bytes at %p",
                  static_cast<size_t>(address - a.begin),
                  a.freed ? " freed" : "", a.bytes,
                  reinterpret_cast<void*>(a.begin));
    return text;
  }

 private:
  DeviceMemory() {
    page_ = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    // A GPU's worth of address space and more; sanitizers' memory layouts
    // allow less, so halve down to what the large-tensor tests still need.
    size_t reserved = size_t{1} << 40;
    void* base = MAP_FAILED;
    while (true) {
      base = ::mmap(nullptr, reserved, PROT_NONE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (base != MAP_FAILED || reserved == (size_t{1} << 35)) break;
      reserved /= 2;
    }
    if (base == MAP_FAILED) {
      std::fprintf(stderr,
                   "CUDA emulation: cannot reserve 32 GiB of address space "
                   "for device memory\n");
      std::abort();
    }
    start_ = reinterpret_cast<uintptr_t>(base);
    end_ = start_ + reserved;
    next_ = start_ + page_;
  }

  std::mutex mu_;
  size_t page_ = 4096;
  uintptr_t start_ = 0, end_ = 0, next_ = 0;
  int open_ = 0;
  std::map<uintptr_t, Allocation> allocations_;  // By begin.
};

class OpenScope {
 public:
  OpenScope() { DeviceMemory::Get().Open(); }
  ~OpenScope() { DeviceMemory::Get().Close(); }
};

// ------------------------------------------------------ kernel execution

enum class ThreadState { kRunnable, kBarrier, kShuffle, kDone };

struct ThreadSlot {
  ThreadIndex index;
  ThreadState state = ThreadState::kRunnable;
  unsigned shuffle_mask = 0;
  uint64_t shuffle_bits = 0;
  int shuffle_lane_mask = 0, shuffle_width = 32;
  uint64_t shuffle_result = 0;
};

struct Block {
  const char* kernel = "";
  const std::function<void()>* body = nullptr;
  std::vector<ThreadSlot> threads;
  int current = -1;
  std::string fault;
  std::vector<char> shared;
  size_t shared_used = 0;
  std::map<const void*, std::pair<size_t, size_t>> shared_slots;
};

thread_local Block* running_block = nullptr;

// Fibers (and their stacks) of this worker thread, kept across blocks.
std::vector<std::unique_ptr<Fiber>>& Fibers() {
  thread_local std::vector<std::unique_ptr<Fiber>> fibers;
  return fibers;
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr size_t kStackBytes = 512 << 10;
#else
constexpr size_t kStackBytes = 128 << 10;
#endif

void ThreadMain(void* slot) {
  (void)slot;
  (*running_block->body)();
}

std::string BlockName(const Block& block) {
  const uint3 b = block.threads[0].index.block_idx;
  char text[160];
  std::snprintf(text, sizeof(text), "kernel %s, block (%u, %u, %u)",
                block.kernel, b.x, b.y, b.z);
  return text;
}

const char* StateName(ThreadState state) {
  switch (state) {
    case ThreadState::kRunnable:
      return "running";
    case ThreadState::kBarrier:
      return "at __syncthreads";
    case ThreadState::kShuffle:
      return "at a shuffle";
    case ThreadState::kDone:
      return "returned";
  }
  return "?";
}

// Completes the shuffles whose every named lane has arrived; the fault
// when a warp waits for lanes that cannot come.
bool ResolveShuffles(Block& block, bool stuck) {
  const int n = static_cast<int>(block.threads.size());
  bool progressed = false;
  for (int warp = 0; warp * kWarpSize < n; ++warp) {
    const int first = warp * kWarpSize;
    const int lanes = std::min(kWarpSize, n - first);
    int leader = -1;
    for (int l = 0; l < lanes; ++l) {
      if (block.threads[first + l].state == ThreadState::kShuffle) {
        leader = l;
        break;
      }
    }
    if (leader < 0) continue;
    const unsigned mask = block.threads[first + leader].shuffle_mask;
    bool complete = true;
    std::string missing;
    for (int l = 0; l < kWarpSize; ++l) {
      if (!(mask >> l & 1)) continue;
      if (l >= lanes) {
        missing += " lane " + std::to_string(l) + " (no such thread)";
        complete = false;
        continue;
      }
      const ThreadSlot& t = block.threads[first + l];
      if (t.state != ThreadState::kShuffle) {
        complete = false;
        missing += " lane " + std::to_string(l) + " (" + StateName(t.state) +
                   ")";
      } else if (t.shuffle_mask != mask) {
        block.fault = BlockName(block) + ": lanes of warp " +
                      std::to_string(warp) +
                      " shuffle with different masks";
        return false;
      }
    }
    if (!complete) {
      if (stuck) {
        char text[64];
        std::snprintf(text, sizeof(text), "0x%08x", mask);
        block.fault = BlockName(block) + ": __shfl_xor_sync with mask " +
                      text + " in warp " + std::to_string(warp) +
                      " waits for" + missing +
                      "; every lane the mask names must reach it";
      }
      continue;
    }
    for (int l = 0; l < lanes; ++l) {
      ThreadSlot& t = block.threads[first + l];
      if (!(mask >> l & 1)) continue;
      int source = l ^ t.shuffle_lane_mask;
      if (source / t.shuffle_width != l / t.shuffle_width) source = l;
      if (source >= lanes || !(mask >> source & 1)) {
        block.fault = BlockName(block) + ": lane " + std::to_string(l) +
                      " of warp " + std::to_string(warp) +
                      " reads lane " + std::to_string(source) +
                      ", which is not in the shuffle's mask";
        return false;
      }
      t.shuffle_result = block.threads[first + source].shuffle_bits;
    }
    for (int l = 0; l < lanes; ++l) {
      if (mask >> l & 1) {
        block.threads[first + l].state = ThreadState::kRunnable;
      }
    }
    progressed = true;
  }
  return progressed;
}

// Runs one block to its end or its fault (then `block.fault` says what).
void RunBlock(Block& block) {
  const int n = static_cast<int>(block.threads.size());
  std::vector<std::unique_ptr<Fiber>>& fibers = Fibers();
  while (static_cast<int>(fibers.size()) < n) {
    fibers.push_back(std::make_unique<Fiber>(&ThreadMain, nullptr,
                                             kStackBytes));
  }
  for (int i = 0; i < n; ++i) fibers[i]->Reset(&ThreadMain, nullptr);
  Block* outer = running_block;
  running_block = &block;
  int done = 0;
  while (done < n && block.fault.empty()) {
    bool ran = false;
    for (int i = 0; i < n && block.fault.empty(); ++i) {
      ThreadSlot& t = block.threads[i];
      if (t.state != ThreadState::kRunnable) continue;
      ran = true;
      block.current = i;
      if (fibers[i]->Resume()) {
        t.state = ThreadState::kDone;
        ++done;
      }
    }
    block.current = -1;
    if (ran || !block.fault.empty() || done == n) continue;
    // Every thread waits: shuffles that can complete do.
    if (ResolveShuffles(block, /*stuck=*/false)) continue;
    if (!block.fault.empty()) break;
    int at_barrier = 0, at_shuffle = 0;
    for (const ThreadSlot& t : block.threads) {
      at_barrier += t.state == ThreadState::kBarrier;
      at_shuffle += t.state == ThreadState::kShuffle;
    }
    if (at_shuffle > 0) {
      ResolveShuffles(block, /*stuck=*/true);
      if (block.fault.empty()) {
        block.fault = BlockName(block) +
                      ": threads wait at __syncthreads while others wait "
                      "at a warp shuffle: a deadlock";
      }
      break;
    }
    if (done > 0) {
      block.fault = BlockName(block) + ": __syncthreads reached by " +
                    std::to_string(at_barrier) + " of " + std::to_string(n) +
                    " threads (" + std::to_string(done) +
                    " had returned): every thread of a block must reach "
                    "it, or a GPU waits forever";
      break;
    }
    for (ThreadSlot& t : block.threads) t.state = ThreadState::kRunnable;
  }
  running_block = outer;
}

ThreadSlot& CurrentSlot() {
  Block* block = running_block;
  if (block == nullptr || block->current < 0) {
    std::fprintf(stderr,
                 "CUDA emulation: threadIdx, __syncthreads or a shuffle "
                 "used outside a kernel\n");
    std::abort();
  }
  return block->threads[block->current];
}

// --------------------------------------------------------------- streams

class Stream;

// Every stream, for a device-wide synchronisation.
std::mutex& StreamsMu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::vector<Stream*>& Streams() {
  static auto* streams = new std::vector<Stream*>();
  return *streams;
}

// A stream: its work runs in issue order on a worker thread of its own.
class Stream {
 public:
  explicit Stream(bool blocking = true)
      : blocking_(blocking), worker_([this] { Work(); }) {
    std::lock_guard<std::mutex> lock(StreamsMu());
    Streams().push_back(this);
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(StreamsMu());
      Streams().erase(std::find(Streams().begin(), Streams().end(), this));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    ready_.notify_all();
    worker_.join();
  }

  void Enqueue(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      ++issued_;
    }
    ready_.notify_all();
  }

  void Synchronize() { WaitDone(Issued()); }

  uint64_t Issued() {
    std::lock_guard<std::mutex> lock(mu_);
    return issued_;
  }
  void WaitDone(uint64_t target) {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [&] { return done_ >= target; });
  }
  bool blocking() const { return blocking_; }

  bool Idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ == issued_;
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ready_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
      ++done_;
      idle_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable ready_, idle_;
  std::deque<std::function<void()>> tasks_;
  uint64_t issued_ = 0, done_ = 0;
  bool stop_ = false;
  const bool blocking_;
  std::thread worker_;
};

Stream& DefaultStream() {
  static Stream* stream = new Stream(/*blocking=*/false);
  return *stream;
}


Stream& Of(cudaStream_t stream) {
  return stream == nullptr ? DefaultStream()
                           : *reinterpret_cast<Stream*>(stream);
}

// Which device work is ordered before which, from the calls that order it
// (issue order on a stream, events, the legacy default stream, the host
// waiting), as vector clocks kept at the calls. An allocation that work on
// two streams uses with no such order between the uses is a data race a
// GPU runs into at random: reported here every time, when the second use
// is queued, and the process stops.
class Ordering {
 public:
  using Knowledge = std::map<const void*, uint64_t>;

  static Ordering& Get() {
    static Ordering* ordering = new Ordering();
    return *ordering;
  }

  // A task queued on `stream` (blocking or the default one, by CUDA's
  // legacy rules) that uses `words` (device addresses) as `what`.
  void Queue(const Stream* stream, bool is_default, bool blocking,
             const std::vector<uintptr_t>& words, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    Knowledge& clock = streams_[stream];
    Merge(clock, host_);
    {
      std::lock_guard<std::mutex> streams_lock(StreamsMu());
      for (Stream* other : Streams()) {
        const bool ordered = is_default ? other->blocking()
                                        : blocking && other == &DefaultStream();
        if (ordered && other != stream) Merge(clock, streams_[other]);
      }
    }
    const uint64_t task = ++clock[stream];
    for (uintptr_t word : words) {
      const Allocation* a = DeviceMemory::Get().Live(word);
      if (a == nullptr) continue;
      Use& last = uses_[a->begin];
      if (last.stream != nullptr && last.stream != stream &&
          clock[last.stream] < last.task) {
        char text[512];
        std::snprintf(text, sizeof(text),
                      "CUDA emulation: %s on stream %p uses the device "
                      "allocation of %zu bytes at %p that %s on stream %p "
                      "used, and no event or synchronisation orders the "
                      "two: a data race on a GPU (a missing "
                      "cudaStreamWaitEvent?)\n",
                      what.c_str(), static_cast<const void*>(stream),
                      a->bytes, reinterpret_cast<void*>(a->begin),
                      last.what.c_str(),
                      static_cast<const void*>(last.stream));
        std::fputs(text, stderr);
        std::abort();
      }
      last = {stream, task, what};
    }
  }

  void Record(const void* event, const Stream* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    events_[event] = streams_[stream];
  }
  void Wait(const Stream* stream, const void* event) {
    std::lock_guard<std::mutex> lock(mu_);
    Merge(streams_[stream], events_[event]);
  }
  // The host waited for `stream`'s work, or an event's.
  void HostWaited(const Stream* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    Merge(host_, streams_[stream]);
  }
  void HostWaitedEvent(const void* event) {
    std::lock_guard<std::mutex> lock(mu_);
    Merge(host_, events_[event]);
  }
  void Forget(const void* stream_or_event) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.erase(stream_or_event);
  }

 private:
  struct Use {
    const void* stream = nullptr;
    uint64_t task = 0;
    std::string what;
  };

  static void Merge(Knowledge& into, const Knowledge& from) {
    for (const auto& [stream, task] : from) {
      uint64_t& known = into[stream];
      if (task > known) known = task;
    }
  }

  std::mutex mu_;
  std::map<const void*, Knowledge> streams_, events_;
  Knowledge host_;
  std::map<uintptr_t, Use> uses_;  // By allocation.
};

void SynchronizeAll() {
  DefaultStream();
  std::vector<Stream*> streams;
  {
    std::lock_guard<std::mutex> lock(StreamsMu());
    streams = Streams();
  }
  for (Stream* stream : streams) {
    stream->Synchronize();
    Ordering::Get().HostWaited(stream);
  }
}

// --------------------------------------------------------- stream capture

// A task a capture recorded instead of queueing: what Enqueue was given.
struct Node {
  std::function<void()> task;
  std::vector<uintptr_t> words;
  std::string what;
};

struct Capture {
  const Stream* stream = nullptr;
  bool blocking = false;  // The stream's: the legacy stream waits for it.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  unsigned long long id = 0;
  bool invalidated = false;
  std::vector<Node> nodes;
  // Its cudaMallocAsync allocations: live while it captures (for the
  // calls' checks), then freed until a replay allocates them.
  std::vector<void*> allocations;
};

// The captures under way, by stream; every access under mu.
struct Captures {
  static Captures& Get() {
    static Captures* captures = new Captures();
    return *captures;
  }
  std::mutex mu;
  std::map<const Stream*, std::shared_ptr<Capture>> by_stream;
  unsigned long long last_id = 0;
};

// The calling thread's capture interaction mode
// (cudaThreadExchangeStreamCaptureMode).
thread_local cudaStreamCaptureMode thread_capture_mode =
    cudaStreamCaptureModeGlobal;

const char* ModeName(cudaStreamCaptureMode mode) {
  switch (mode) {
    case cudaStreamCaptureModeGlobal:
      return "global";
    case cudaStreamCaptureModeThreadLocal:
      return "thread-local";
    case cudaStreamCaptureModeRelaxed:
      return "relaxed";
  }
  return "?";
}

std::string Describe(const Capture& capture) {
  char text[128];
  std::snprintf(text, sizeof(text), "capture %llu (%s mode) on stream %p",
                capture.id, ModeName(capture.mode),
                static_cast<const void*>(capture.stream));
  return text;
}

std::shared_ptr<Capture> CaptureOf(const Stream* stream) {
  Captures& captures = Captures::Get();
  std::lock_guard<std::mutex> lock(captures.mu);
  auto it = captures.by_stream.find(stream);
  return it == captures.by_stream.end() ? nullptr : it->second;
}

// The capture under way with this id, or null.
std::shared_ptr<Capture> CaptureById(unsigned long long id) {
  Captures& captures = Captures::Get();
  std::lock_guard<std::mutex> lock(captures.mu);
  for (const auto& [stream, capture] : captures.by_stream) {
    if (capture->id == id) return capture;
  }
  return nullptr;
}

// Fails a call that `capture` forbids, invalidating it.
cudaError_t Forbid(Capture& capture, cudaError_t error,
                   const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(Captures::Get().mu);
    capture.invalidated = true;
  }
  return Fail(error, why + "; " + Describe(capture) + " is invalidated");
}

// A call about `stream` that fails while `stream` captures: `why` says
// what the call is and why.
cudaError_t ForbiddenWhileCapturing(const Stream* stream,
                                    const std::string& why) {
  const std::shared_ptr<Capture> capture = CaptureOf(stream);
  if (capture == nullptr) return cudaSuccess;
  return Forbid(*capture, cudaErrorStreamCaptureUnsupported, why);
}

// A "potentially unsafe" call (cudaStreamBeginCapture's list in
// emulated_cuda.h): forbidden while this thread captures in global or
// thread-local mode, and, where this thread's own mode is global, while
// any thread captures in global mode. Invalidates each capture that
// forbids it.
cudaError_t Unsafe(const std::string& call) {
  if (thread_capture_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  std::string forbidding;
  {
    Captures& captures = Captures::Get();
    std::lock_guard<std::mutex> lock(captures.mu);
    for (const auto& [stream, capture] : captures.by_stream) {
      const bool own = capture->thread == std::this_thread::get_id() &&
                       capture->mode != cudaStreamCaptureModeRelaxed;
      const bool global =
          thread_capture_mode == cudaStreamCaptureModeGlobal &&
          capture->mode == cudaStreamCaptureModeGlobal;
      if (!own && !global) continue;
      capture->invalidated = true;
      forbidding += (forbidding.empty() ? "" : ", ") + Describe(*capture);
    }
  }
  if (forbidding.empty()) return cudaSuccess;
  return Fail(cudaErrorStreamCaptureUnsupported,
              call + ": not permitted during stream capture (" + forbidding +
                  ", now invalidated)");
}

// Work for the legacy default stream, which waits for every blocking
// stream: forbidden while one captures (its work is not there to wait
// for), which invalidates that capture.
cudaError_t LegacyStreamCheck(cudaStream_t stream, const std::string& what) {
  if (stream != nullptr) return cudaSuccess;
  std::string forbidding;
  {
    Captures& captures = Captures::Get();
    std::lock_guard<std::mutex> lock(captures.mu);
    for (const auto& [s, capture] : captures.by_stream) {
      if (!capture->blocking) continue;
      capture->invalidated = true;
      forbidding += (forbidding.empty() ? "" : ", ") + Describe(*capture);
    }
  }
  if (forbidding.empty()) return cudaSuccess;
  return Fail(cudaErrorStreamCaptureImplicit,
              what + " on the legacy default stream, which would wait for " +
                  "a capturing blocking stream (" + forbidding +
                  ", now invalidated)");
}

// A launch that fails during a capture invalidates it, as on a GPU.
void InvalidateCapture(cudaStream_t stream) {
  Captures& captures = Captures::Get();
  std::lock_guard<std::mutex> lock(captures.mu);
  auto it = captures.by_stream.find(&Of(stream));
  if (it != captures.by_stream.end()) it->second->invalidated = true;
}

// Records the task in `stream`'s capture, if it captures.
bool Record(const Stream* stream, std::function<void()>& task,
            const std::vector<uintptr_t>& words, const std::string& what) {
  Captures& captures = Captures::Get();
  std::lock_guard<std::mutex> lock(captures.mu);
  auto it = captures.by_stream.find(stream);
  if (it == captures.by_stream.end()) return false;
  it->second->nodes.push_back({std::move(task), words, what});
  return true;
}

struct Graph {
  std::vector<Node> nodes;
};

Graph& Of(cudaGraph_t graph) { return *reinterpret_cast<Graph*>(graph); }
Graph& Of(cudaGraphExec_t exec) { return *reinterpret_cast<Graph*>(exec); }

// ------------------------------------------------------ page-locked memory

// cudaMallocHost's allocations, by start: the host memory a copy may use
// asynchronously and a captured copy may use at all.
class PinnedMemory {
 public:
  static PinnedMemory& Get() {
    static PinnedMemory* memory = new PinnedMemory();
    return *memory;
  }
  void* Allocate(size_t bytes) {
    void* pointer = std::malloc(bytes);
    if (pointer == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    blocks_[reinterpret_cast<uintptr_t>(pointer)] = bytes;
    return pointer;
  }
  bool Free(void* pointer) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (blocks_.erase(reinterpret_cast<uintptr_t>(pointer)) == 0) {
        return false;
      }
    }
    std::free(pointer);
    return true;
  }
  // Whether [pointer, pointer + bytes) lies in one allocation.
  bool Holds(const void* pointer, size_t bytes) {
    const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.upper_bound(address);
    if (it == blocks_.begin()) return false;
    --it;
    return address + bytes <= it->first + it->second;
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, size_t> blocks_;
};

// Queues `task` on `stream` with the legacy default stream's ordering, as
// CUDA's: work on the default stream waits for the work already queued on
// every blocking stream, and work on a blocking stream for the default
// stream's. `words`: the device addresses it uses, as `what`. On a
// capturing stream, records it instead.
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> task,
                    const std::vector<uintptr_t>& words = {},
                    const std::string& what = "") {
  Stream& target = Of(stream);
  if (Record(&target, task, words, what)) return cudaSuccess;
  if (const cudaError_t error = LegacyStreamCheck(stream, what);
      error != cudaSuccess) {
    return error;
  }
  Ordering::Get().Queue(&target, stream == nullptr, target.blocking(), words,
                        what);
  std::vector<std::pair<Stream*, uint64_t>> before;
  if (stream == nullptr) {
    std::lock_guard<std::mutex> lock(StreamsMu());
    for (Stream* other : Streams()) {
      if (other != &target && other->blocking()) {
        before.emplace_back(other, other->Issued());
      }
    }
  } else if (target.blocking()) {
    before.emplace_back(&DefaultStream(), DefaultStream().Issued());
  }
  if (before.empty()) {
    target.Enqueue(std::move(task));
    return cudaSuccess;
  }
  target.Enqueue([before = std::move(before), task = std::move(task)] {
    for (const auto& [other, issued] : before) other->WaitDone(issued);
    task();
  });
  return cudaSuccess;
}

struct Event {
  std::mutex mu;
  std::condition_variable done;
  uint64_t recorded = 0, completed = 0;
  // The capture it was last recorded in (0: none).
  unsigned long long capture = 0;
  Clock::time_point time;
};

Event& Of(cudaEvent_t event) { return *reinterpret_cast<Event*>(event); }

// --------------------------------------------------------- fault handler

struct sigaction previous_segv;

void OnSegv(int signal, siginfo_t* info, void* context) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  DeviceMemory& memory = DeviceMemory::Get();
  if (!memory.InRange(address)) {
    // Not ours: the previous handler (a sanitizer's) or the default.
    ::sigaction(SIGSEGV, &previous_segv, nullptr);
    return;
  }
  const bool write =
      (static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_ERR] & 2) !=
      0;
  const Allocation* a = memory.Near(address);
  const Block* block = running_block;
  char who[200];
  if (block != nullptr && !block->threads.empty()) {
    const uint3 b = block->threads[0].index.block_idx;
    std::snprintf(who, sizeof(who), "kernel %s (block (%u, %u, %u))",
                  block->kernel, b.x, b.y, b.z);
  } else {
    std::snprintf(who, sizeof(who), "host code");
  }
  char text[512];
  if (a == nullptr) {
    std::snprintf(text, sizeof(text),
                  "CUDA emulation: %s %s device memory at %p, in no "
                  "allocation\n",
                  who, write ? "wrote" : "read",
                  reinterpret_cast<void*>(address));
  } else if (a->freed) {
    std::snprintf(text, sizeof(text),
                  "CUDA emulation: %s %s freed device memory: offset %zd of "
                  "an allocation of %zu bytes at %p, already freed\n",
                  who, write ? "wrote" : "read",
                  static_cast<ssize_t>(address - a->begin), a->bytes,
                  reinterpret_cast<void*>(a->begin));
  } else if (address >= a->pages + a->page_bytes || address < a->begin) {
    std::snprintf(text, sizeof(text),
                  "CUDA emulation: %s %s out of bounds: offset %zd of an "
                  "allocation of %zu bytes at %p\n",
                  who, write ? "wrote" : "read",
                  static_cast<ssize_t>(address - a->begin), a->bytes,
                  reinterpret_cast<void*>(a->begin));
  } else {
    std::snprintf(text, sizeof(text),
                  "CUDA emulation: %s %s device memory: offset %zd of an "
                  "allocation of %zu bytes at %p; host code reaches device "
                  "memory only through cudaMemcpy\n",
                  who, write ? "wrote" : "read",
                  static_cast<ssize_t>(address - a->begin), a->bytes,
                  reinterpret_cast<void*>(a->begin));
  }
  ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
  (void)signal;
  ::signal(SIGSEGV, SIG_DFL);  // The access repeats and ends the process.
}

void InstallFaultHandler() {
  static const bool installed = [] {
    struct sigaction action = {};
    action.sa_sigaction = OnSegv;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGSEGV, &action, &previous_segv);
    return true;
  }();
  (void)installed;
}

// What a pointer is, for the copies' checks.
bool IsDevice(const void* pointer) {
  return DeviceMemory::Get().InRange(reinterpret_cast<uintptr_t>(pointer));
}

cudaError_t CheckCopy(void* dst, const void* src, size_t bytes,
                      cudaMemcpyKind kind, const char* what) {
  const bool to_device = kind == cudaMemcpyHostToDevice ||
                         kind == cudaMemcpyDeviceToDevice;
  const bool from_device = kind == cudaMemcpyDeviceToHost ||
                           kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault || kind == cudaMemcpyHostToHost) {
    return cudaSuccess;
  }
  char text[256];
  for (const auto& [pointer, device, side] :
       {std::tuple<const void*, bool, const char*>{dst, to_device,
                                                   "destination"},
        {src, from_device, "source"}}) {
    if (IsDevice(pointer) != device) {
      std::snprintf(text, sizeof(text),
                    "%s: the %s %p is %s memory, but the copy's kind says "
                    "%s",
                    what, side, pointer, IsDevice(pointer) ? "device" : "host",
                    device ? "device" : "host");
      return Fail(cudaErrorInvalidValue, text);
    }
    if (device && bytes > 0 &&
        DeviceMemory::Get().Holding(reinterpret_cast<uintptr_t>(pointer),
                                    bytes) == nullptr) {
      std::snprintf(text, sizeof(text),
                    "%s: %zu bytes from the %s %p leave its allocation (%s)",
                    what, bytes, side, pointer,
                    DeviceMemory::Get()
                        .Describe(reinterpret_cast<uintptr_t>(pointer))
                        .c_str());
      return Fail(cudaErrorInvalidValue, text);
    }
  }
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------- device-side calls

const ThreadIndex& Current() { return CurrentSlot().index; }

void SyncThreads() {
  CurrentSlot().state = ThreadState::kBarrier;
  Fiber::Yield();
}

uint64_t ShuffleXor(unsigned mask, uint64_t bits, int lane_mask, int width) {
  ThreadSlot& t = CurrentSlot();
  const int lane = running_block->current % kWarpSize;
  if (!(mask >> lane & 1)) {
    char text[128];
    std::snprintf(text, sizeof(text),
                  "lane %d calls __shfl_xor_sync with mask 0x%08x, which does "
                  "not name it",
                  lane, mask);
    KernelFault(text);
  }
  if (width <= 0 || width > kWarpSize || (width & (width - 1)) != 0) {
    KernelFault("__shfl_xor_sync: width " + std::to_string(width) +
                " is not a power of two up to 32");
  }
  t.shuffle_mask = mask;
  t.shuffle_bits = bits;
  t.shuffle_lane_mask = lane_mask;
  t.shuffle_width = width;
  t.state = ThreadState::kShuffle;
  Fiber::Yield();
  return t.shuffle_result;
}

void* Shared(const void* tag, size_t bytes, size_t align) {
  CurrentSlot();
  Block& block = *running_block;
  auto it = block.shared_slots.find(tag);
  if (it != block.shared_slots.end()) {
    return block.shared.data() + it->second.first;
  }
  const size_t offset = (block.shared_used + align - 1) / align * align;
  if (offset + bytes > kMaxSharedBytes) {
    KernelFault("shared memory: " + std::to_string(offset + bytes) +
                " bytes in a block, more than the 48 KiB a GPU gives");
  }
  block.shared_used = offset + bytes;
  std::fill_n(block.shared.data() + offset, bytes, char(0xFF));
  block.shared_slots[tag] = {offset, bytes};
  return block.shared.data() + offset;
}

[[noreturn]] void KernelFault(const std::string& what) {
  Block* block = running_block;
  if (block == nullptr || block->current < 0) {
    std::fprintf(stderr, "CUDA emulation: %s\n", what.c_str());
    std::abort();
  }
  if (block->fault.empty()) block->fault = BlockName(*block) + ": " + what;
  // Parks the thread for good: the block ends with the fault.
  block->threads[block->current].state = ThreadState::kDone;
  while (true) Fiber::Yield();
}

cudaError_t RunInStreamOrder(cudaStream_t stream, std::function<void()> work,
                             const std::vector<uintptr_t>& words,
                             const std::string& what) {
  return Enqueue(
      stream,
      [work = std::move(work)] {
        if (Sticky() != cudaSuccess) return;
        OpenScope open;
        work();
      },
      words, what);
}

bool GpuHidden() {
  const char* gpus = std::getenv("DFLASH_EMULATED_GPUS");
  return gpus != nullptr && std::string(gpus) == "0";
}

bool IsDevicePointerOrNull(const void* pointer) {
  return pointer == nullptr || IsDevice(pointer);
}

bool IsDevicePointer(uintptr_t word) {
  return DeviceMemory::Get().InRange(word);
}

void Launch(const char* name, dim3 grid, dim3 block, size_t shared_bytes,
            cudaStream_t stream, std::function<void()> thread_body,
            std::function<std::string()> check_arguments,
            std::vector<uintptr_t> device_words) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  char text[256];
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64 ||
      grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu ||
      grid.y > 65535 || grid.z > 65535) {
    std::snprintf(text, sizeof(text),
                  "kernel %s: launch of grid (%u, %u, %u) x block (%u, %u, "
                  "%u) is beyond a GPU's limits (1024 threads a block)",
                  name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
    InvalidateCapture(stream);
    Fail(cudaErrorInvalidConfiguration, text);
    return;
  }
  if (shared_bytes > kMaxSharedBytes) {
    std::snprintf(text, sizeof(text),
                  "kernel %s: %zu bytes of dynamic shared memory, more than "
                  "48 KiB",
                  name, shared_bytes);
    InvalidateCapture(stream);
    Fail(cudaErrorInvalidValue, text);
    return;
  }
  auto body = std::make_shared<std::function<void()>>(std::move(thread_body));
  Enqueue(stream, [name, grid, block, body, check_arguments] {
    if (Sticky() != cudaSuccess) return;
    if (const std::string problems = check_arguments(); !problems.empty()) {
      FailAsync(cudaErrorIllegalAddress,
                std::string("kernel ") + name + ": " + problems +
                    "a kernel reads and writes device memory only");
      return;
    }
    OpenScope open;
    Block b;
    b.kernel = name;
    b.body = body.get();
    b.shared.resize(kMaxSharedBytes);
    b.threads.resize(block.x * block.y * block.z);
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          b.fault.clear();
          b.shared_used = 0;
          b.shared_slots.clear();
          int i = 0;
          for (unsigned tz = 0; tz < block.z; ++tz) {
            for (unsigned ty = 0; ty < block.y; ++ty) {
              for (unsigned tx = 0; tx < block.x; ++tx, ++i) {
                ThreadSlot& t = b.threads[i];
                t = ThreadSlot();
                t.index = {{tx, ty, tz}, {x, y, z}, block, grid};
              }
            }
          }
          RunBlock(b);
          if (!b.fault.empty()) {
            FailAsync(cudaErrorLaunchFailure, b.fault);
            return;
          }
        }
      }
    }
  }, device_words, std::string("kernel ") + name);
}

}  // namespace dflash_emu

// ------------------------------------------------------------ runtime API

using dflash_emu::DeviceMemory;
using dflash_emu::Fail;
using dflash_emu::Of;

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources:
      return "too many resources requested for launch";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorIllegalState:
      return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation:
      return "operation would make the capture depend on uncaptured work";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing "
             "blocking stream";
    case cudaErrorCapturedEvent:
      return "operation not permitted on an event last recorded in a "
             "capturing stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from "
             "another thread";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  const cudaError_t sticky = dflash_emu::Sticky();
  if (sticky != cudaSuccess) return sticky;
  const cudaError_t error = dflash_emu::last_error;
  dflash_emu::last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError() {
  const cudaError_t sticky = dflash_emu::Sticky();
  return sticky != cudaSuccess ? sticky : dflash_emu::last_error;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = dflash_emu::GpuHidden() ? 0 : 1;
  return *count == 0 ? cudaErrorNoDevice : cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (dflash_emu::GpuHidden()) return cudaErrorNoDevice;
  return device == 0 ? cudaSuccess
                     : Fail(cudaErrorInvalidDevice,
                            "cudaSetDevice: the emulation has device 0 only");
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp();
  std::snprintf(prop->name, sizeof(prop->name), "dflash CUDA emulation");
  prop->totalGlobalMem = size_t{16} << 30;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->maxThreadsPerBlock = 1024;
  prop->sharedMemPerBlock = dflash_emu::kMaxSharedBytes;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMemoryPoolsSupported ? 1 : 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t error = dflash_emu::Unsafe("cudaDeviceSynchronize");
      error != cudaSuccess) {
    return error;
  }
  dflash_emu::SynchronizeAll();
  return dflash_emu::Sticky();
}

// Also ends every capture, as a reset destroys a context's streams.
cudaError_t cudaDeviceReset() {
  {
    dflash_emu::Captures& captures = dflash_emu::Captures::Get();
    std::lock_guard<std::mutex> lock(captures.mu);
    captures.by_stream.clear();
  }
  dflash_emu::SynchronizeAll();
  dflash_emu::sticky_error = cudaSuccess;
  dflash_emu::last_error = cudaSuccess;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int) {
  static int token;
  *pool = reinterpret_cast<cudaMemPool_t>(&token);
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) {
  return cudaSuccess;
}

namespace dflash_emu {
namespace {

cudaError_t Allocate(void** pointer, size_t bytes, const char* what) {
  if (GpuHidden()) return cudaErrorNoDevice;
  InstallFaultHandler();
  *pointer = DeviceMemory::Get().Allocate(bytes);
  if (*pointer == nullptr && bytes > 0) {
    return Fail(cudaErrorMemoryAllocation,
                std::string(what) + ": " + std::to_string(bytes) + " bytes");
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace dflash_emu

cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  if (const cudaError_t error = dflash_emu::Unsafe("cudaMalloc");
      error != cudaSuccess) {
    return error;
  }
  return dflash_emu::Allocate(pointer, bytes, "cudaMalloc");
}

cudaError_t cudaFree(void* pointer) {
  if (const cudaError_t error = dflash_emu::Unsafe("cudaFree");
      error != cudaSuccess) {
    return error;
  }
  if (pointer == nullptr) return cudaSuccess;
  cudaDeviceSynchronize();
  if (!DeviceMemory::Get().Free(pointer)) {
    char text[128];
    std::snprintf(text, sizeof(text),
                  "cudaFree(%p): not a live device allocation", pointer);
    return Fail(cudaErrorInvalidValue, text);
  }
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** pointer, size_t bytes) {
  if (const cudaError_t error = dflash_emu::Unsafe("cudaMallocHost");
      error != cudaSuccess) {
    return error;
  }
  *pointer = bytes == 0 ? nullptr
                        : dflash_emu::PinnedMemory::Get().Allocate(bytes);
  if (*pointer == nullptr && bytes > 0) {
    return Fail(cudaErrorMemoryAllocation,
                "cudaMallocHost: " + std::to_string(bytes) + " bytes");
  }
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* pointer) {
  if (const cudaError_t error = dflash_emu::Unsafe("cudaFreeHost");
      error != cudaSuccess) {
    return error;
  }
  if (pointer == nullptr) return cudaSuccess;
  // A copy queued from or to it may still run: as cudaFreeHost, wait.
  dflash_emu::SynchronizeAll();
  if (!dflash_emu::PinnedMemory::Get().Free(pointer)) {
    char text[128];
    std::snprintf(text, sizeof(text),
                  "cudaFreeHost(%p): not a cudaMallocHost allocation",
                  pointer);
    return Fail(cudaErrorInvalidValue, text);
  }
  return cudaSuccess;
}

// On a capturing stream: an address fixed at capture, freed when the
// capture ends until each replay allocates it again (as a graph's
// allocation node does).
cudaError_t cudaMallocAsync(void** pointer, size_t bytes,
                            cudaStream_t stream) {
  const std::shared_ptr<dflash_emu::Capture> capture =
      dflash_emu::CaptureOf(&Of(stream));
  if (const cudaError_t error =
          dflash_emu::Allocate(pointer, bytes, "cudaMallocAsync");
      error != cudaSuccess || capture == nullptr || *pointer == nullptr) {
    return error;
  }
  void* const allocated = *pointer;
  {
    std::lock_guard<std::mutex> lock(dflash_emu::Captures::Get().mu);
    capture->allocations.push_back(allocated);
  }
  return dflash_emu::Enqueue(
      stream, [allocated] { DeviceMemory::Get().Revive(allocated); }, {},
      "cudaMallocAsync");
}

cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream) {
  if (pointer == nullptr) return cudaSuccess;
  dflash_emu::Stream& target = Of(stream);
  const std::shared_ptr<dflash_emu::Capture> capture =
      dflash_emu::CaptureOf(&target);
  if (DeviceMemory::Get().Holding(reinterpret_cast<uintptr_t>(pointer), 1) ==
      nullptr) {
    char text[128];
    std::snprintf(text, sizeof(text),
                  "cudaFreeAsync(%p): not a live device allocation", pointer);
    return Fail(cudaErrorInvalidValue, text);
  }
  const std::vector<uintptr_t> words = {reinterpret_cast<uintptr_t>(pointer)};
  // Freed when the stream reaches it (at once where it has nothing queued,
  // as a GPU's frees an idle stream's memory): later work on another stream
  // that was not ordered after it faults.
  if (capture == nullptr && target.Idle()) {
    if (const cudaError_t error =
            dflash_emu::LegacyStreamCheck(stream, "cudaFreeAsync");
        error != cudaSuccess) {
      return error;
    }
    dflash_emu::Ordering::Get().Queue(&target, stream == nullptr,
                                      target.blocking(), words,
                                      "cudaFreeAsync");
    DeviceMemory::Get().Free(pointer);
    return cudaSuccess;
  }
  return dflash_emu::Enqueue(
      stream, [pointer] { DeviceMemory::Get().Free(pointer); }, words,
      "cudaFreeAsync");
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                            cudaMemcpyKind kind, cudaStream_t stream) {
  if (const cudaError_t error =
          dflash_emu::CheckCopy(dst, src, bytes, kind, "cudaMemcpy");
      error != cudaSuccess) {
    return error;
  }
  // The host side, where it is pageable (not cudaMallocHost's).
  const void* pageable = nullptr;
  for (const void* side : {static_cast<const void*>(dst), src}) {
    if (!dflash_emu::IsDevice(side) &&
        !dflash_emu::PinnedMemory::Get().Holds(side, bytes)) {
      pageable = side;
    }
  }
  if (pageable != nullptr) {
    char text[256];
    std::snprintf(text, sizeof(text),
                  "cudaMemcpyAsync: the host memory %p is pageable; a "
                  "captured copy reads or writes host memory when the graph "
                  "runs, so it must be page-locked (cudaMallocHost)",
                  pageable);
    if (cudaError_t error =
            dflash_emu::ForbiddenWhileCapturing(&Of(stream), text);
        error != cudaSuccess ||
        (error = dflash_emu::Unsafe(
             "cudaMemcpyAsync with pageable host memory")) != cudaSuccess) {
      return error;
    }
  }
  const std::vector<uintptr_t> words = {reinterpret_cast<uintptr_t>(dst),
                                        reinterpret_cast<uintptr_t>(src)};
  if (pageable == nullptr) {
    // Device or page-locked memory: read and written when the stream gets
    // there, the call returning at once.
    return dflash_emu::Enqueue(
        stream,
        [dst, src, bytes] {
          dflash_emu::OpenScope open;
          std::memmove(dst, src, bytes);
        },
        words, "cudaMemcpy");
  }
  // Host memory here is pageable, as malloc's is on a GPU machine: a copy
  // from it is staged at the call (the caller may reuse its buffer when the
  // call returns), and a copy to it returns once it is done.
  if (kind == cudaMemcpyHostToDevice) {
    auto staged = std::make_shared<std::vector<char>>(
        static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    return dflash_emu::Enqueue(
        stream,
        [dst, staged] {
          dflash_emu::OpenScope open;
          std::memcpy(dst, staged->data(), staged->size());
        },
        {reinterpret_cast<uintptr_t>(dst)}, "cudaMemcpy");
  }
  if (const cudaError_t error = dflash_emu::Enqueue(
          stream,
          [dst, src, bytes] {
            dflash_emu::OpenScope open;
            std::memmove(dst, src, bytes);
          },
          words, "cudaMemcpy");
      error != cudaSuccess) {
    return error;
  }
  if (kind == cudaMemcpyDeviceToHost) return cudaStreamSynchronize(stream);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind) {
  if (const cudaError_t error = dflash_emu::Unsafe("cudaMemcpy");
      error != cudaSuccess) {
    return error;
  }
  const cudaError_t error = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  if (error != cudaSuccess) return error;
  return cudaStreamSynchronize(nullptr);
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes,
                            cudaStream_t stream) {
  if (const cudaError_t error = dflash_emu::CheckCopy(
          dst, dst, bytes, cudaMemcpyDeviceToDevice, "cudaMemset");
      error != cudaSuccess) {
    return error;
  }
  return dflash_emu::Enqueue(
      stream,
      [dst, value, bytes] {
        dflash_emu::OpenScope open;
        std::memset(dst, value, bytes);
      },
      {reinterpret_cast<uintptr_t>(dst)}, "cudaMemset");
}

cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (const cudaError_t error = dflash_emu::Unsafe("cudaMemset");
      error != cudaSuccess) {
    return error;
  }
  const cudaError_t error = cudaMemsetAsync(dst, value, bytes, nullptr);
  if (error != cudaSuccess) return error;
  return cudaStreamSynchronize(nullptr);
}

cudaError_t cudaMemset2DAsync(void* dst, size_t pitch, int value,
                              size_t width, size_t height,
                              cudaStream_t stream) {
  if (height == 0 || width == 0) return cudaSuccess;
  if (width > pitch) {
    return Fail(cudaErrorInvalidValue, "cudaMemset2D: width above pitch");
  }
  if (const cudaError_t error = dflash_emu::CheckCopy(
          dst, dst, pitch * (height - 1) + width, cudaMemcpyDeviceToDevice,
          "cudaMemset2D");
      error != cudaSuccess) {
    return error;
  }
  return dflash_emu::Enqueue(
      stream,
      [dst, pitch, value, width, height] {
        dflash_emu::OpenScope open;
        for (size_t row = 0; row < height; ++row) {
          std::memset(static_cast<char*>(dst) + row * pitch, value, width);
        }
      },
      {reinterpret_cast<uintptr_t>(dst)}, "cudaMemset2D");
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, 0);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  if (dflash_emu::GpuHidden()) return cudaErrorNoDevice;
  *stream = reinterpret_cast<cudaStream_t>(
      new dflash_emu::Stream(!(flags & cudaStreamNonBlocking)));
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return cudaErrorInvalidResourceHandle;
  {
    // Its capture, if any, ends with it.
    dflash_emu::Captures& captures = dflash_emu::Captures::Get();
    std::lock_guard<std::mutex> lock(captures.mu);
    captures.by_stream.erase(&Of(stream));
  }
  delete &Of(stream);  // Finishes its work first.
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (cudaError_t error = dflash_emu::ForbiddenWhileCapturing(
          &Of(stream),
          "cudaStreamSynchronize of a capturing stream: its work runs "
          "when the graph is launched");
      error != cudaSuccess ||
      (stream == nullptr &&
       (error = dflash_emu::Unsafe(
            "cudaStreamSynchronize of the legacy default stream")) !=
           cudaSuccess)) {
    return error;
  }
  Of(stream).Synchronize();
  dflash_emu::Ordering::Get().HostWaited(&Of(stream));
  return dflash_emu::Sticky();
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (cudaError_t error = dflash_emu::ForbiddenWhileCapturing(
          &Of(stream),
          "cudaStreamQuery of a capturing stream: its work runs when the "
          "graph is launched");
      error != cudaSuccess ||
      (stream == nullptr &&
       (error = dflash_emu::Unsafe(
            "cudaStreamQuery of the legacy default stream")) !=
           cudaSuccess)) {
    return error;
  }
  if (dflash_emu::Sticky() != cudaSuccess) return dflash_emu::Sticky();
  if (!Of(stream).Idle()) return cudaErrorNotReady;
  dflash_emu::Ordering::Get().HostWaited(&Of(stream));
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  if (dflash_emu::GpuHidden()) return cudaErrorNoDevice;
  *event = reinterpret_cast<cudaEvent_t>(new dflash_emu::Event());
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  return cudaEventCreate(event);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  dflash_emu::Ordering::Get().Forget(event);
  delete &Of(event);
  return cudaSuccess;
}

// In a capture, a record only marks the event as the capture's (what a
// wait on it from the capturing stream orders is in-stream order already).
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  dflash_emu::Event& e = Of(event);
  if (const std::shared_ptr<dflash_emu::Capture> capture =
          dflash_emu::CaptureOf(&Of(stream))) {
    std::lock_guard<std::mutex> lock(e.mu);
    e.capture = capture->id;
    return cudaSuccess;
  }
  if (const cudaError_t error =
          dflash_emu::LegacyStreamCheck(stream, "cudaEventRecord");
      error != cudaSuccess) {
    return error;
  }
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    e.capture = 0;
    generation = ++e.recorded;
  }
  dflash_emu::Enqueue(stream, [&e, generation] {
    std::lock_guard<std::mutex> lock(e.mu);
    e.completed = std::max(e.completed, generation);
    e.time = dflash_emu::Clock::now();
    e.done.notify_all();
  });
  dflash_emu::Ordering::Get().Record(event, &Of(stream));
  return cudaSuccess;
}

namespace dflash_emu {
namespace {

// The capture under way that `event` was last recorded in, or null.
std::shared_ptr<Capture> CaptureOfEvent(Event& event) {
  unsigned long long id;
  {
    std::lock_guard<std::mutex> lock(event.mu);
    id = event.capture;
  }
  return id == 0 ? nullptr : CaptureById(id);
}

// Waiting for or querying an event recorded in a capture, from the host.
cudaError_t HostUseOfEvent(cudaEvent_t event, const char* call) {
  if (const std::shared_ptr<Capture> capture = CaptureOfEvent(Of(event))) {
    return Forbid(*capture, cudaErrorCapturedEvent,
                  std::string(call) +
                      ": the event was recorded in a capture, which runs "
                      "nothing until its graph is launched");
  }
  return Unsafe(call);
}

}  // namespace
}  // namespace dflash_emu

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                unsigned) {
  dflash_emu::Event& e = Of(event);
  const std::shared_ptr<dflash_emu::Capture> waiter =
      dflash_emu::CaptureOf(&Of(stream));
  const std::shared_ptr<dflash_emu::Capture> recorded_in =
      dflash_emu::CaptureOfEvent(e);
  if (recorded_in != nullptr) {
    // In-stream order already orders a wait within the capturing stream.
    if (waiter == recorded_in) return cudaSuccess;
    return dflash_emu::Forbid(
        *recorded_in, cudaErrorStreamCaptureUnsupported,
        "cudaStreamWaitEvent: another stream waits for an event recorded in "
        "a capture; CUDA would join that stream to the capture, which the "
        "emulation does not model (it captures one stream)");
  }
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    generation = e.recorded;
  }
  if (waiter != nullptr) {
    if (generation == 0) return cudaSuccess;  // An empty event orders nothing.
    return dflash_emu::Forbid(
        *waiter, cudaErrorStreamCaptureIsolation,
        "cudaStreamWaitEvent: the capturing stream waits for an event "
        "recorded outside the capture, a dependency the graph cannot hold");
  }
  if (const cudaError_t error =
          dflash_emu::LegacyStreamCheck(stream, "cudaStreamWaitEvent");
      error != cudaSuccess) {
    return error;
  }
  dflash_emu::Ordering::Get().Wait(&Of(stream), event);
  dflash_emu::Enqueue(stream, [&e, generation] {
    std::unique_lock<std::mutex> lock(e.mu);
    e.done.wait(lock, [&] { return e.completed >= generation; });
  });
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (const cudaError_t error =
          dflash_emu::HostUseOfEvent(event, "cudaEventSynchronize");
      error != cudaSuccess) {
    return error;
  }
  dflash_emu::Event& e = Of(event);
  std::unique_lock<std::mutex> lock(e.mu);
  const uint64_t generation = e.recorded;
  e.done.wait(lock, [&] { return e.completed >= generation; });
  lock.unlock();
  dflash_emu::Ordering::Get().HostWaitedEvent(event);
  return dflash_emu::Sticky();
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (const cudaError_t error =
          dflash_emu::HostUseOfEvent(event, "cudaEventQuery");
      error != cudaSuccess) {
    return error;
  }
  dflash_emu::Event& e = Of(event);
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.completed < e.recorded) return cudaErrorNotReady;
  }
  dflash_emu::Ordering::Get().HostWaitedEvent(event);
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start,
                                 cudaEvent_t end) {
  for (cudaEvent_t event : {start, end}) {
    if (const std::shared_ptr<dflash_emu::Capture> capture =
            dflash_emu::CaptureOfEvent(Of(event))) {
      return dflash_emu::Forbid(*capture, cudaErrorCapturedEvent,
                                "cudaEventElapsedTime: an event recorded in "
                                "a capture");
    }
  }
  dflash_emu::Event& a = Of(start);
  dflash_emu::Event& b = Of(end);
  std::scoped_lock lock(a.mu, b.mu);
  if (a.completed < a.recorded || b.completed < b.recorded) {
    return cudaErrorNotReady;
  }
  *ms = std::chrono::duration<float, std::milli>(b.time - a.time).count();
  return cudaSuccess;
}

// ------------------------------------------------------- stream capture

cudaError_t cudaStreamBeginCapture(cudaStream_t stream,
                                   cudaStreamCaptureMode mode) {
  if (stream == nullptr) {
    return Fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamBeginCapture: the legacy default stream cannot "
                "capture; capture on a stream of your own");
  }
  if (mode != cudaStreamCaptureModeGlobal &&
      mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed) {
    return Fail(cudaErrorInvalidValue,
                "cudaStreamBeginCapture: mode " + std::to_string(mode) +
                    " is none of global (0), thread-local (1), relaxed (2)");
  }
  dflash_emu::Stream& target = Of(stream);
  auto capture = std::make_shared<dflash_emu::Capture>();
  capture->stream = &target;
  capture->blocking = target.blocking();
  capture->mode = mode;
  capture->thread = std::this_thread::get_id();
  dflash_emu::Captures& captures = dflash_emu::Captures::Get();
  std::lock_guard<std::mutex> lock(captures.mu);
  if (captures.by_stream.count(&target) > 0) {
    return Fail(cudaErrorIllegalState,
                "cudaStreamBeginCapture: the stream already captures");
  }
  capture->id = ++captures.last_id;
  captures.by_stream[&target] = std::move(capture);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (graph == nullptr) {
    return Fail(cudaErrorInvalidValue, "cudaStreamEndCapture: graph is null");
  }
  *graph = nullptr;
  std::shared_ptr<dflash_emu::Capture> capture;
  {
    dflash_emu::Captures& captures = dflash_emu::Captures::Get();
    std::lock_guard<std::mutex> lock(captures.mu);
    auto it = captures.by_stream.find(&Of(stream));
    if (it == captures.by_stream.end()) {
      return Fail(cudaErrorIllegalState,
                  "cudaStreamEndCapture: the stream is not capturing");
    }
    if (it->second->mode != cudaStreamCaptureModeRelaxed &&
        it->second->thread != std::this_thread::get_id()) {
      return Fail(cudaErrorStreamCaptureWrongThread,
                  "cudaStreamEndCapture: " + dflash_emu::Describe(*it->second) +
                      " began on another thread");
    }
    capture = std::move(it->second);
    captures.by_stream.erase(it);
  }
  // The graph's allocations exist only while a launch runs.
  for (void* allocated : capture->allocations) {
    DeviceMemory::Get().Free(allocated);
  }
  if (capture->invalidated) {
    return Fail(cudaErrorStreamCaptureInvalidated,
                "cudaStreamEndCapture: " + dflash_emu::Describe(*capture) +
                    " was invalidated by a call it forbids (reported "
                    "above); no graph");
  }
  *graph = reinterpret_cast<cudaGraph_t>(
      new dflash_emu::Graph{std::move(capture->nodes)});
  return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream,
                                     cudaStreamCaptureStatus* status,
                                     unsigned long long* id) {
  if (stream == nullptr) {
    // The legacy stream is never captured, but waits for blocking streams.
    dflash_emu::Captures& captures = dflash_emu::Captures::Get();
    std::lock_guard<std::mutex> lock(captures.mu);
    for (const auto& [s, capture] : captures.by_stream) {
      if (capture->blocking) {
        return Fail(cudaErrorStreamCaptureImplicit,
                    "cudaStreamIsCapturing of the legacy default stream "
                    "while a blocking stream captures");
      }
    }
  }
  const std::shared_ptr<dflash_emu::Capture> capture =
      dflash_emu::CaptureOf(&Of(stream));
  std::lock_guard<std::mutex> lock(dflash_emu::Captures::Get().mu);
  *status = capture == nullptr   ? cudaStreamCaptureStatusNone
            : capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                   : cudaStreamCaptureStatusActive;
  if (id != nullptr && capture != nullptr) *id = capture->id;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                  cudaStreamCaptureStatus* status) {
  return cudaStreamGetCaptureInfo(stream, status, nullptr);
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (*mode != cudaStreamCaptureModeGlobal &&
      *mode != cudaStreamCaptureModeThreadLocal &&
      *mode != cudaStreamCaptureModeRelaxed) {
    return Fail(cudaErrorInvalidValue,
                "cudaThreadExchangeStreamCaptureMode: mode " +
                    std::to_string(*mode) + " is not a capture mode");
  }
  std::swap(*mode, dflash_emu::thread_capture_mode);
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long) {
  if (exec == nullptr || graph == nullptr) {
    return Fail(cudaErrorInvalidValue,
                "cudaGraphInstantiate: a null graph or executable");
  }
  // A copy: the graph may be destroyed while its executable lives.
  *exec = reinterpret_cast<cudaGraphExec_t>(new dflash_emu::Graph(Of(graph)));
  return cudaSuccess;
}

// Queues the recording on `stream` (records it, where `stream` captures):
// the race check and the legacy stream's ordering apply at each launch.
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle,
                "cudaGraphLaunch: a null executable graph");
  }
  for (const dflash_emu::Node& node : Of(exec).nodes) {
    if (const cudaError_t error =
            dflash_emu::Enqueue(stream, node.task, node.words, node.what);
        error != cudaSuccess) {
      return error;
    }
  }
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete &Of(exec);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete &Of(graph);
  return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes,
                              size_t* count) {
  if (graph == nullptr || count == nullptr) {
    return Fail(cudaErrorInvalidValue, "cudaGraphGetNodes: a null argument");
  }
  std::vector<dflash_emu::Node>& all = Of(graph).nodes;
  if (nodes == nullptr) {
    *count = all.size();
    return cudaSuccess;
  }
  *count = std::min(*count, all.size());
  for (size_t i = 0; i < *count; ++i) {
    nodes[i] = reinterpret_cast<cudaGraphNode_t>(&all[i]);
  }
  return cudaSuccess;
}
