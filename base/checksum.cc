#include "base/checksum.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/cpu_dispatch.h"

namespace dflash {
namespace {

// xxHash32's primes and round, on 32 lanes at once: each lane's state goes
// through a bijection per word, so a changed word always changes its lane.
constexpr uint32_t kPrime1 = 2654435761u;
constexpr uint32_t kPrime2 = 2246822519u;
constexpr int kVectors = 4, kLanes = 8;
constexpr size_t kStep = kVectors * kLanes * sizeof(uint32_t);

// SplitMix64's finaliser: a bijection on 64 bits.
uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

DFLASH_CPU_DISPATCH uint64_t BlockChecksum(const char* data, size_t bytes) {
  using Words = uint32_t __attribute__((vector_size(kLanes * 4)));
  Words lanes[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    for (int l = 0; l < kLanes; ++l) lanes[v][l] = kPrime1 * (v * kLanes + l + 1);
  }
  char tail[kStep] = {};
  for (size_t at = 0; at < bytes; at += kStep) {
    const char* step = data + at;
    if (bytes - at < kStep) {
      std::memcpy(tail, step, bytes - at);
      step = tail;
    }
    for (int v = 0; v < kVectors; ++v) {
      Words words;
      std::memcpy(&words, step + v * sizeof(Words), sizeof(Words));
      Words s = lanes[v] + words * kPrime2;
      s = (s << 13) | (s >> 19);
      lanes[v] = s * kPrime1;
    }
  }
  // A sum of bijections of distinct lanes: one lane's change changes it.
  uint64_t sum = Mix(bytes);
  for (int v = 0; v < kVectors; ++v) {
    for (int l = 0; l < kLanes; ++l) {
      sum += Mix(uint64_t{lanes[v][l]} |
                 (static_cast<uint64_t>(v * kLanes + l) << 32));
    }
  }
  return sum;
}

}  // namespace

uint64_t ContentChecksum(const void* data, size_t bytes, int threads) {
  const char* p = static_cast<const char*>(data);
  const int64_t blocks =
      static_cast<int64_t>((bytes + kChecksumBlockBytes - 1) /
                           kChecksumBlockBytes);
  std::vector<uint64_t> sums(static_cast<size_t>(blocks));
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t begin = static_cast<size_t>(b) * kChecksumBlockBytes;
    sums[b] = BlockChecksum(p + begin,
                            std::min(kChecksumBlockBytes, bytes - begin));
  }
  // Chained through bijections: one block's change changes the result.
  uint64_t checksum = Mix(bytes ^ 0x9e3779b97f4a7c15ull);
  for (uint64_t sum : sums) checksum = Mix(checksum + sum);
  return checksum;
}

}  // namespace dflash
