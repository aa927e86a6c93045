#include "base/checksum.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dflash {
namespace {

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The documented construction written out word by word, one lane at a time.
uint64_t NaiveChecksum(const std::vector<char>& data) {
  const size_t block = kChecksumBlockBytes;
  uint64_t checksum = Mix(data.size() ^ 0x9e3779b97f4a7c15ull);
  for (size_t begin = 0; begin < data.size(); begin += block) {
    const size_t bytes = std::min(block, data.size() - begin);
    std::vector<char> padded(data.begin() + begin,
                             data.begin() + begin + bytes);
    padded.resize((bytes + 127) / 128 * 128, 0);
    uint32_t lanes[32];
    for (uint32_t l = 0; l < 32; ++l) lanes[l] = 2654435761u * (l + 1);
    for (size_t at = 0; at < padded.size(); at += 4) {
      uint32_t word;
      std::memcpy(&word, padded.data() + at, 4);
      uint32_t& s = lanes[(at / 4) % 32];
      s += word * 2246822519u;
      s = (s << 13) | (s >> 19);
      s *= 2654435761u;
    }
    uint64_t sum = Mix(bytes);
    for (uint64_t l = 0; l < 32; ++l) sum += Mix(lanes[l] | (l << 32));
    checksum = Mix(checksum + sum);
  }
  return checksum;
}

std::vector<char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> bytes(n);
  for (char& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

TEST(ChecksumTest, MatchesTheConstructionOnAnyThreads) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{127}, size_t{128},
                   size_t{4099}, 3 * kChecksumBlockBytes + 77}) {
    const std::vector<char> data = RandomBytes(n, static_cast<uint32_t>(n));
    const uint64_t expected = NaiveChecksum(data);
    for (int threads : {1, 2, 3}) {
      EXPECT_EQ(ContentChecksum(data.data(), n, threads), expected)
          << n << " bytes, " << threads << " threads";
    }
  }
}

TEST(ChecksumTest, EveryBitOfEveryWordCounts) {
  std::vector<char> data = RandomBytes(600, 1);
  const uint64_t original = ContentChecksum(data.data(), data.size());
  for (size_t byte = 0; byte < data.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      data[byte] ^= static_cast<char>(1 << bit);
      EXPECT_NE(ContentChecksum(data.data(), data.size()), original)
          << "byte " << byte << " bit " << bit;
      data[byte] ^= static_cast<char>(1 << bit);
    }
  }
  // A trailing zero byte is a different buffer too.
  data.push_back(0);
  EXPECT_NE(ContentChecksum(data.data(), data.size()), original);
}

TEST(ChecksumTest, AWholeWeightScaledOrShiftedChanges) {
  std::vector<float> weight(2 * kChecksumBlockBytes / 4 + 5);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (float& w : weight) w = normal(rng);
  const size_t bytes = weight.size() * sizeof(float);
  const uint64_t original = ContentChecksum(weight.data(), bytes, 2);
  std::vector<float> doubled = weight;
  for (float& w : doubled) w *= 2;
  EXPECT_NE(ContentChecksum(doubled.data(), bytes, 2), original);
  std::vector<float> swapped = weight;
  std::swap(swapped.front(), swapped.back());
  EXPECT_NE(ContentChecksum(swapped.data(), bytes, 2), original);
  // A change in the last block only.
  std::vector<float> last = weight;
  last.back() = std::nextafter(last.back(), 1e9f);
  EXPECT_NE(ContentChecksum(last.data(), bytes, 2), original);
}

}  // namespace
}  // namespace dflash
