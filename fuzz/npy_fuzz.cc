// Fuzzes the .npy reader: any bytes parse or are rejected with a message
// naming the file; a header's sizes never overflow (shapes whose bytes pass
// 2^63 are refused) and decide whether the file parses; what parses holds
// exactly elements x item size bytes, converts, and serializes back to a
// file that parses to the same array.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_input.h"
#include "io/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dflash;  // NOLINT
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<NpyArray> array = ParseNpy(bytes, "fuzz.npy");
  // The header alone says what the whole file would: sizes that fit 64
  // bits (or an error), and the data size ParseNpy then checks.
  absl::StatusOr<NpyHeader> header = ParseNpyHeader(bytes, "fuzz.npy");
  if (header.ok()) {
    FUZZ_CHECK(
        header->elements >= 0 && header->data_bytes >= 0 &&
            header->data_bytes / NpyItemSize(header->type) == header->elements,
        "header sizes overflowed");
    FUZZ_CHECK(array.ok() == (static_cast<int64_t>(size) ==
                              header->data_offset + header->data_bytes),
               "ParseNpy disagrees with its header about the data size");
  } else {
    FUZZ_CHECK(!array.ok(), "a file parses whose header does not");
  }
  if (!array.ok()) {
    FUZZ_CHECK(array.status().message().rfind("fuzz.npy", 0) == 0,
               "an error that does not name the file: %s",
               std::string(array.status().message()).c_str());
    return 0;
  }
  const int64_t elements = array->elements();
  FUZZ_CHECK(elements >= 0, "negative element count");
  switch (array->type) {
    case NpyType::kFloat32:
    case NpyType::kFloat64:
      FUZZ_CHECK(static_cast<int64_t>(NpyToFloat(*array).size()) == elements,
                 "float conversion size");
      break;
    default:
      FUZZ_CHECK(static_cast<int64_t>(NpyToInt64(*array).size()) == elements,
                 "integer conversion size");
      break;
  }
  absl::StatusOr<NpyArray> again = ParseNpy(SerializeNpy(*array), "again");
  FUZZ_CHECK(again.ok(), "its own serialization does not parse: %s",
             std::string(again.status().message()).c_str());
  FUZZ_CHECK(again->type == array->type && again->shape == array->shape &&
                 again->data == array->data,
             "round trip changed the array");
  return 0;
}
