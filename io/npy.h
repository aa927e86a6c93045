#ifndef DFLASH_IO_NPY_H_
#define DFLASH_IO_NPY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/file.h"

namespace dflash {

// Element types of the NumPy .npy files dflash reads and writes.
enum class NpyType { kFloat32, kFloat64, kInt32, kInt64, kBool, kUint8 };

// The descr string of a type ("<f4", "|b1", ...).
absl::string_view NpyDescr(NpyType type);

// An array as stored: little-endian, C order.
struct NpyArray {
  NpyType type = NpyType::kFloat32;
  std::vector<int64_t> shape;
  std::string data;  // Raw little-endian bytes, size = elements * item size.

  int64_t elements() const;
  std::string ShapeString() const;  // "[2, 3]"
};

// Bytes per element of `type`.
int64_t NpyItemSize(NpyType type);

// What a .npy header says, with sizes computed overflow-checked.
struct NpyHeader {
  NpyType type = NpyType::kFloat32;
  std::vector<int64_t> shape;
  int64_t elements = 0;
  int64_t data_offset = 0;  // Where the data starts in the file.
  int64_t data_bytes = 0;   // elements x item size.
};

// Parses the bytes of a .npy file (format versions 1, 2 and 3). Big-endian
// data, Fortran order, other dtypes, malformed headers, shapes whose bytes
// overflow 64 bits, and data of another size than the shape's are errors
// that start with `name`. ParseNpyHeader needs only the header's bytes.
absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view bytes,
                                         absl::string_view name);
absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes,
                                  absl::string_view name);

// The same from a file, which must be a regular file (see //base:file); the
// data's size is checked against the file's before anything is allocated
// for it. ReadNpyHeader reads the header alone, so a caller can add up what
// several files will need first.
absl::StatusOr<NpyHeader> ReadNpyHeader(const std::string& path);
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// Version 1.0 bytes of `array` (2.0 if the header needs it); the header
// alone, for data kept elsewhere.
std::string SerializeNpy(const NpyArray& array);
std::string SerializeNpyHeader(NpyType type, absl::Span<const int64_t> shape);
// Writes all-or-nothing (a temporary renamed into place; see //base:file).
absl::Status WriteNpy(const std::string& path, const NpyArray& array);
// Stages `data` (raw little-endian values) as a .npy file in `files`,
// without copying it; a size that does not match the shape is an error.
absl::Status StageNpy(OutputFileSet& files, const std::string& path,
                      NpyType type, absl::Span<const int64_t> shape,
                      absl::string_view data);

// Typed views and conversions; a wrong type or shape is an error naming
// `name`, its shape and type and what was expected. A -1 in `shape` matches
// any extent.
absl::Status CheckNpy(const NpyArray& array, absl::string_view name,
                      absl::Span<const int64_t> shape,
                      absl::Span<const NpyType> types);
// The same from a header, before the data is read.
absl::Status CheckNpy(const NpyHeader& header, absl::string_view name,
                      absl::Span<const int64_t> shape,
                      absl::Span<const NpyType> types);
// float32 data as floats (float64 is rounded).
std::vector<float> NpyToFloat(const NpyArray& array);
// float32 or float64 data as doubles.
std::vector<double> NpyToFloat64(const NpyArray& array);

// An element of an array: its index and value.
struct NpyElement {
  std::vector<int64_t> index;
  double value = 0;
};
// The first NaN or infinity of float data (in C order); nullopt if none.
std::optional<NpyElement> FirstNonFinite(const NpyArray& array);
// The first finite float64 value that rounds to infinity as float32.
std::optional<NpyElement> FirstFloat32Overflow(const NpyArray& array);
// Integer or bool data as int64.
std::vector<int64_t> NpyToInt64(const NpyArray& array);

template <typename T>
NpyArray MakeNpy(absl::Span<const T> values, std::vector<int64_t> shape);

}  // namespace dflash

#endif  // DFLASH_IO_NPY_H_
