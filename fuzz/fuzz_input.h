#ifndef DFLASH_FUZZ_FUZZ_INPUT_H_
#define DFLASH_FUZZ_FUZZ_INPUT_H_

// Reads typed values off a fuzzer's bytes (zeros once they run out), and
// the check a fuzz target uses for a property that must hold: it prints
// what broke and aborts, which libFuzzer records as a crash.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace dflash {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  // The next sizeof(T) bytes as a T (raw bits: any float, NaN included).
  template <typename T>
  T Raw() {
    static_assert(std::is_trivially_copyable_v<T>);
    T value{};
    const size_t n = size_ < sizeof(T) ? size_ : sizeof(T);
    std::memcpy(&value, data_, n);
    data_ += n;
    size_ -= n;
    return value;
  }
  // An integer in [lo, hi].
  int64_t Int(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    const uint64_t x = Raw<uint64_t>();
    return span == 0 ? static_cast<int64_t>(x)
                     : lo + static_cast<int64_t>(x % span);
  }
  bool Bool() { return Raw<uint8_t>() & 1; }
  size_t remaining() const { return size_; }

 private:
  const uint8_t* data_;
  size_t size_;
};

}  // namespace dflash

#define FUZZ_CHECK(condition, ...)                                 \
  do {                                                             \
    if (!(condition)) {                                            \
      std::fprintf(stderr, "FUZZ_CHECK failed: %s: ", #condition); \
      std::fprintf(stderr, __VA_ARGS__);                           \
      std::fprintf(stderr, "\n");                                  \
      std::abort();                                                \
    }                                                              \
  } while (0)

#endif  // DFLASH_FUZZ_FUZZ_INPUT_H_
