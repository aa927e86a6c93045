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

}  // namespace dflash

#endif  // DFLASH_BASE_SYSTEM_MEMORY_H_
