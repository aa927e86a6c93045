#ifndef DFLASH_BASE_SYSTEM_MEMORY_H_
#define DFLASH_BASE_SYSTEM_MEMORY_H_

// How much memory a process can still allocate, so a job can refuse sizes
// it cannot hold before it allocates them.

#include <cstdint>
#include <optional>
#include <string>

namespace dflash {

struct AvailableMemory {
  int64_t bytes = 0;
  std::string source;  // "MemAvailable", "cgroup memory.max", ...
};

// The smaller of /proc/meminfo's MemAvailable and the room left under this
// process's cgroup (v2 memory.max minus memory.current); nullopt where
// neither can be read.
std::optional<AvailableMemory> SystemAvailableMemory();

// This process's resident memory now and at its peak (VmRSS and VmHWM of
// /proc/self/status); nullopt where they cannot be read.
struct ResidentMemory {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};
std::optional<ResidentMemory> ProcessResidentMemory();

// Lowers the peak ProcessResidentMemory reports to the current resident
// memory (/proc/self/clear_refs), so a later peak is a section's own;
// false where the kernel does not allow it.
bool ResetResidentPeak();

}  // namespace dflash

#endif  // DFLASH_BASE_SYSTEM_MEMORY_H_
