#include "base/system_memory.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace dflash {
namespace {

// The first line of a /proc or /sys file ("" when unreadable); these
// report a size of 0, so they are read as streams.
std::string FirstLine(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

std::optional<int64_t> MemAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "MemAvailable:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    int64_t kib;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) {
      return kib * 1024;
    }
  }
  return std::nullopt;
}

// Room under the cgroup v2 limit of this process, when it has one.
std::optional<int64_t> CgroupRoomBytes() {
  // /proc/self/cgroup holds "0::/path" under cgroup v2.
  const std::string entry = FirstLine("/proc/self/cgroup");
  if (entry.rfind("0::", 0) != 0) return std::nullopt;
  const std::string dir = "/sys/fs/cgroup" + entry.substr(3);
  int64_t limit, current;
  if (!absl::SimpleAtoi(FirstLine(dir + "/memory.max"), &limit) ||
      !absl::SimpleAtoi(FirstLine(dir + "/memory.current"), &current)) {
    return std::nullopt;  // "max" (no limit), or not mounted.
  }
  return limit > current ? limit - current : 0;
}

// A "Name:   123 kB" line of /proc/self/status, in bytes.
std::optional<int64_t> StatusBytes(absl::string_view line,
                                   absl::string_view name) {
  if (!absl::ConsumePrefix(&line, name)) return std::nullopt;
  line = absl::StripAsciiWhitespace(line);
  absl::ConsumeSuffix(&line, "kB");
  int64_t kib;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib)) {
    return std::nullopt;
  }
  return kib * 1024;
}

}  // namespace

std::optional<ResidentMemory> ProcessResidentMemory() {
  std::ifstream status("/proc/self/status");
  std::string line;
  std::optional<int64_t> current, peak;
  while (std::getline(status, line)) {
    if (!current) current = StatusBytes(line, "VmRSS:");
    if (!peak) peak = StatusBytes(line, "VmHWM:");
  }
  if (!current || !peak) return std::nullopt;
  return ResidentMemory{*current, *peak};
}

bool ResetResidentPeak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

std::optional<AvailableMemory> SystemAvailableMemory() {
  std::optional<AvailableMemory> best;
  if (std::optional<int64_t> bytes = MemAvailableBytes()) {
    best = AvailableMemory{*bytes, "MemAvailable in /proc/meminfo"};
  }
  if (std::optional<int64_t> bytes = CgroupRoomBytes();
      bytes && (!best || *bytes < best->bytes)) {
    best = AvailableMemory{*bytes, "room under the cgroup's memory.max"};
  }
  return best;
}

}  // namespace dflash
