// Fuzzes the .npy reader: any bytes parse or are rejected with a message
// naming the file; what parses holds exactly elements x item size bytes,
// converts, and serializes back to a file that parses to the same array.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_input.h"
#include "io/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dflash;  // NOLINT
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<NpyArray> array = ParseNpy(bytes, "fuzz.npy");
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
