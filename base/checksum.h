#ifndef DFLASH_BASE_CHECKSUM_H_
#define DFLASH_BASE_CHECKSUM_H_

// A 64-bit fingerprint of a buffer, to tell whether memory a cache was made
// from has changed since (a frozen weight written in place behind the
// cache's back). Not cryptographic: a change confined to one aligned 32-bit
// word always changes it; other changes leave it equal with a chance of
// about 2^-32 or less. Reads at memory speed on the given threads, and the
// value does not depend on how many there are.

#include <cstddef>
#include <cstdint>

namespace dflash {

// Bytes hashed as one unit; units are combined in order.
inline constexpr size_t kChecksumBlockBytes = size_t{1} << 20;

// `threads` >= 1: OpenMP threads over the blocks.
uint64_t ContentChecksum(const void* data, size_t bytes, int threads = 1);

}  // namespace dflash

#endif  // DFLASH_BASE_CHECKSUM_H_
