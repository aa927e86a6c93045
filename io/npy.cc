#include "io/npy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/checked_math.h"
#include "base/file.h"
#include "base/status_macros.h"

namespace dflash {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

struct TypeInfo {
  NpyType type;
  const char* descr;
  int64_t size;
};
constexpr TypeInfo kTypes[] = {
    {NpyType::kFloat32, "<f4", 4}, {NpyType::kFloat64, "<f8", 8},
    {NpyType::kInt32, "<i4", 4},   {NpyType::kInt64, "<i8", 8},
    {NpyType::kBool, "|b1", 1},    {NpyType::kUint8, "|u1", 1},
};

const TypeInfo& Info(NpyType type) {
  for (const TypeInfo& info : kTypes) {
    if (info.type == type) return info;
  }
  return kTypes[0];
}

absl::Status Error(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
}

// The value of 'key' in the header dict, up to the next top-level comma.
absl::StatusOr<std::string> Field(absl::string_view header,
                                  absl::string_view key,
                                  absl::string_view name) {
  const std::string quoted = absl::StrCat("'", key, "'");
  const size_t at = header.find(quoted);
  if (at == absl::string_view::npos) {
    return Error(name, absl::StrCat("malformed .npy header, no ", quoted,
                                    " in ", header));
  }
  absl::string_view rest = header.substr(at + quoted.size());
  rest = absl::StripLeadingAsciiWhitespace(rest);
  if (!absl::ConsumePrefix(&rest, ":")) {
    return Error(name, absl::StrCat("malformed .npy header near ", quoted));
  }
  rest = absl::StripLeadingAsciiWhitespace(rest);
  size_t end = 0;
  int depth = 0;
  for (; end < rest.size(); ++end) {
    const char c = rest[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if ((c == ',' && depth == 0) || c == '}') break;
  }
  return std::string(absl::StripTrailingAsciiWhitespace(rest.substr(0, end)));
}

}  // namespace

absl::string_view NpyDescr(NpyType type) { return Info(type).descr; }

int64_t NpyArray::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string NpyArray::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

namespace {

// Bytes before the header text and the header's length, from the first
// kPrefixSize bytes (or fewer, for a truncated file).
constexpr size_t kPrefixSize = 12;
// NumPy writes headers of a few hundred bytes; anything near this is not
// one of its files, and is refused before it is read.
constexpr size_t kMaxHeaderSize = size_t{1} << 20;
// The largest extent of an axis: far beyond any tensor that fits a machine,
// and small enough that a header alone cannot make sizes near 2^63.
constexpr int64_t kMaxExtent = int64_t{1} << 40;

// A file cut inside its header: `size` bytes, of the `needed` it takes.
absl::Status Truncated(absl::string_view name, size_t size, size_t needed,
                       absl::string_view part) {
  return Error(name, absl::StrCat("truncated .npy header: ends after ", size,
                                  " bytes, inside its ", part, " (", needed,
                                  " bytes)"));
}

absl::StatusOr<std::pair<size_t, size_t>> HeaderSpan(absl::string_view bytes,
                                                     absl::string_view name) {
  if (bytes.empty()) return Error(name, "empty file, expected a .npy file");
  // A file shorter than the magic is a .npy file cut short if what it
  // holds is the magic's beginning.
  const size_t seen = std::min(bytes.size(), kMagicSize);
  if (bytes.substr(0, seen) != absl::string_view(kMagic, seen)) {
    return Error(name, "not a .npy file (no \\x93NUMPY magic)");
  }
  constexpr absl::string_view kFixedPart = "magic, version and header length";
  if (bytes.size() < kMagicSize + 4) {
    return Truncated(name, bytes.size(), kMagicSize + 4, kFixedPart);
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) |
                 static_cast<unsigned char>(bytes[9]) << 8;
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Truncated(name, bytes.size(), 12, kFixedPart);
    for (int i = 0; i < 4; ++i) {
      header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i]))
                    << (8 * i);
    }
    offset = 12;
  } else {
    return Error(name, absl::StrCat(".npy format version ", major,
                                    " is not supported (1, 2 or 3)"));
  }
  if (header_len > kMaxHeaderSize) {
    return Error(name, absl::StrCat("a .npy header of ", header_len,
                                    " bytes is larger than the ",
                                    kMaxHeaderSize, " accepted"));
  }
  return std::make_pair(offset, header_len);
}

// The header dict (bytes[offset, offset + header_len)) as type and shape.
absl::StatusOr<NpyHeader> ParseHeaderText(absl::string_view header,
                                          size_t offset,
                                          absl::string_view name) {
  absl::StatusOr<std::string> descr = Field(header, "descr", name);
  absl::StatusOr<std::string> fortran = Field(header, "fortran_order", name);
  absl::StatusOr<std::string> shape = Field(header, "shape", name);
  for (const auto* field : {&descr, &fortran, &shape}) {
    if (!field->ok()) return field->status();
  }
  NpyHeader out;
  absl::string_view d = *descr;
  if (!absl::ConsumePrefix(&d, "'") || !absl::ConsumeSuffix(&d, "'")) {
    return Error(name, absl::StrCat("malformed descr ", *descr));
  }
  if (absl::StartsWith(d, ">")) {
    return Error(name, absl::StrCat("big-endian data (descr '", d,
                                    "') is not supported; save it "
                                    "little-endian"));
  }
  bool known = false;
  for (const TypeInfo& info : kTypes) {
    // "=" and "<" both mean little-endian on the machines we write for.
    std::string native = info.descr;
    if (native[0] == '<') native[0] = '=';
    if (d == info.descr || d == native) {
      out.type = info.type;
      known = true;
    }
  }
  if (!known) {
    return Error(name, absl::StrCat("dtype '", d,
                                    "' is not supported (float32, float64, "
                                    "int32, int64, bool, uint8)"));
  }
  if (*fortran == "True") {
    return Error(name, "Fortran-order data is not supported; save it in C "
                       "order (np.ascontiguousarray)");
  }
  if (*fortran != "False") {
    return Error(name, absl::StrCat("malformed fortran_order ", *fortran));
  }
  absl::string_view s = *shape;
  if (!absl::ConsumePrefix(&s, "(") || !absl::ConsumeSuffix(&s, ")")) {
    return Error(name, absl::StrCat("malformed shape ", *shape));
  }
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    int64_t extent;
    const bool digits =
        !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
          return absl::ascii_isdigit(static_cast<unsigned char>(c));
        });
    // Digits that do not fit 64 bits are above the limit too.
    if (digits && (!absl::SimpleAtoi(part, &extent) || extent > kMaxExtent)) {
      return Error(name, absl::StrCat("shape ", *shape, ": extent ", part,
                                      " on axis ", out.shape.size(),
                                      " is above the limit of 2^40 = ",
                                      kMaxExtent, " per axis"));
    }
    if (!absl::SimpleAtoi(part, &extent)) {
      return Error(name, absl::StrCat("malformed shape ", *shape));
    }
    if (extent < 0) {
      return Error(name, absl::StrCat("shape ", *shape, ": extent ", extent,
                                      " on axis ", out.shape.size(),
                                      " is negative"));
    }
    out.shape.push_back(extent);
  }
  // Each extent is bounded, their product is not: (2^32, 2^32, 4, 16).
  const std::optional<int64_t> elements = CheckedProduct(out.shape);
  const std::optional<int64_t> bytes =
      elements ? CheckedMul(*elements, Info(out.type).size) : std::nullopt;
  if (!bytes) {
    return Error(name, absl::StrCat("shape [", absl::StrJoin(out.shape, ", "),
                                    "] of ", d,
                                    " holds more than 2^63 bytes"));
  }
  out.elements = *elements;
  out.data_bytes = *bytes;
  out.data_offset = static_cast<int64_t>(offset + header.size());
  return out;
}

absl::Status CheckDataSize(const NpyHeader& header, int64_t data_size,
                           absl::string_view name) {
  if (data_size == header.data_bytes) return absl::OkStatus();
  return Error(name, absl::StrCat(
                         "data holds ", data_size, " bytes, shape [",
                         absl::StrJoin(header.shape, ", "), "] of ",
                         NpyDescr(header.type), " needs ", header.data_bytes,
                         " (truncated or padded file)"));
}

}  // namespace

int64_t NpyItemSize(NpyType type) { return Info(type).size; }

absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view bytes,
                                         absl::string_view name) {
  DFLASH_ASSIGN_OR_RETURN(auto span,
                          HeaderSpan(bytes, name));
  const auto [offset, header_len] = span;
  if (bytes.size() < offset + header_len) {
    return Truncated(name, bytes.size(), offset + header_len, "header text");
  }
  return ParseHeaderText(bytes.substr(offset, header_len), offset, name);
}

absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes,
                                  absl::string_view name) {
  DFLASH_ASSIGN_OR_RETURN(NpyHeader header, ParseNpyHeader(bytes, name));
  const absl::string_view data = bytes.substr(header.data_offset);
  if (absl::Status size =
          CheckDataSize(header, static_cast<int64_t>(data.size()), name);
      !size.ok()) {
    return size;
  }
  NpyArray array;
  array.type = header.type;
  array.shape = std::move(header.shape);
  array.data = std::string(data);
  return array;
}

namespace {

// The header of an open file, its data size checked against the file's.
absl::StatusOr<NpyHeader> ReadHeader(const ReadableFile& file) {
  std::string prefix(std::min<int64_t>(file.size(), kPrefixSize), '\0');
  DFLASH_RETURN_IF_ERROR(file.ReadAt(0, absl::MakeSpan(prefix)));
  DFLASH_ASSIGN_OR_RETURN(auto span,
                          HeaderSpan(prefix, file.path()));
  const auto [offset, header_len] = span;
  if (file.size() < static_cast<int64_t>(offset + header_len)) {
    return Truncated(file.path(), file.size(), offset + header_len,
                     "header text");
  }
  std::string header(header_len, '\0');
  DFLASH_RETURN_IF_ERROR(file.ReadAt(offset, absl::MakeSpan(header)));
  DFLASH_ASSIGN_OR_RETURN(NpyHeader parsed,
                          ParseHeaderText(header, offset, file.path()));
  DFLASH_RETURN_IF_ERROR(
      CheckDataSize(parsed, file.size() - parsed.data_offset, file.path()));
  return parsed;
}

}  // namespace

absl::StatusOr<NpyHeader> ReadNpyHeader(const std::string& path) {
  DFLASH_ASSIGN_OR_RETURN(ReadableFile file, ReadableFile::Open(path));
  return ReadHeader(file);
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  DFLASH_ASSIGN_OR_RETURN(ReadableFile file, ReadableFile::Open(path));
  DFLASH_ASSIGN_OR_RETURN(NpyHeader header, ReadHeader(file));
  NpyArray array;
  array.type = header.type;
  array.shape = std::move(header.shape);
  array.data.resize(static_cast<size_t>(header.data_bytes));
  if (absl::Status read =
          file.ReadAt(header.data_offset, absl::MakeSpan(array.data));
      !read.ok()) {
    return read;
  }
  return array;
}

std::string SerializeNpyHeader(NpyType type, absl::Span<const int64_t> shape) {
  std::string extents = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) extents += ",";
  std::string header =
      absl::StrCat("{'descr': '", NpyDescr(type),
                   "', 'fortran_order': False, 'shape': (", extents, "), }");
  // Pad with spaces so that the data starts 64-byte aligned; end with \n.
  const bool v2 = header.size() + 11 > 65535;
  const size_t prefix = v2 ? 12 : 10;
  const size_t total = (prefix + header.size() + 1 + 63) / 64 * 64;
  header.append(total - prefix - header.size() - 1, ' ');
  header.push_back('\n');
  std::string out(kMagic, kMagicSize);
  out.push_back(static_cast<char>(v2 ? 2 : 1));
  out.push_back(0);
  const size_t len = header.size();
  for (size_t i = 0; i < (v2 ? 4u : 2u); ++i) {
    out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  }
  return absl::StrCat(out, header);
}

std::string SerializeNpy(const NpyArray& array) {
  return absl::StrCat(SerializeNpyHeader(array.type, array.shape), array.data);
}

absl::Status WriteNpy(const std::string& path, const NpyArray& array) {
  OutputFileSet files;
  DFLASH_RETURN_IF_ERROR(
      StageNpy(files, path, array.type, array.shape, array.data));
  return files.Commit();
}

absl::Status StageNpy(OutputFileSet& files, const std::string& path,
                      NpyType type, absl::Span<const int64_t> shape,
                      absl::string_view data) {
  const std::optional<int64_t> elements = CheckedProduct(shape);
  if (!elements || *elements * NpyItemSize(type) !=
                       static_cast<int64_t>(data.size())) {
    return absl::InternalError(absl::StrCat(
        path, ": ", data.size(), " bytes do not make shape [",
        absl::StrJoin(shape, ", "), "] of ", NpyDescr(type)));
  }
  const std::string header = SerializeNpyHeader(type, shape);
  const absl::string_view pieces[] = {header, data};
  return files.Stage(path, pieces);
}

namespace {

absl::Status CheckTypeAndShape(NpyType type, const std::vector<int64_t>& actual,
                               absl::string_view name,
                               absl::Span<const int64_t> shape,
                               absl::Span<const NpyType> types) {
  bool type_ok = false;
  for (NpyType t : types) type_ok |= t == type;
  bool shape_ok = actual.size() == shape.size();
  for (size_t i = 0; shape_ok && i < shape.size(); ++i) {
    shape_ok = shape[i] < 0 || shape[i] == actual[i];
  }
  if (type_ok && shape_ok) return absl::OkStatus();
  std::vector<std::string> extents, names;
  for (int64_t d : shape) extents.push_back(d < 0 ? "*" : absl::StrCat(d));
  for (NpyType t : types) names.push_back(std::string(NpyDescr(t)));
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": expected shape [", absl::StrJoin(extents, ", "),
                   "] of ", absl::StrJoin(names, " or "), ", got [",
                   absl::StrJoin(actual, ", "), "] of ", NpyDescr(type)));
}

}  // namespace

absl::Status CheckNpy(const NpyArray& array, absl::string_view name,
                      absl::Span<const int64_t> shape,
                      absl::Span<const NpyType> types) {
  return CheckTypeAndShape(array.type, array.shape, name, shape, types);
}

absl::Status CheckNpy(const NpyHeader& header, absl::string_view name,
                      absl::Span<const int64_t> shape,
                      absl::Span<const NpyType> types) {
  return CheckTypeAndShape(header.type, header.shape, name, shape, types);
}

namespace {
template <typename From, typename To>
std::vector<To> Convert(const NpyArray& array) {
  std::vector<To> out(array.elements());
  for (int64_t i = 0; i < array.elements(); ++i) {
    From value;
    std::memcpy(&value, array.data.data() + i * sizeof(From), sizeof(From));
    out[i] = static_cast<To>(value);
  }
  return out;
}
}  // namespace

std::vector<float> NpyToFloat(const NpyArray& array) {
  if (array.type == NpyType::kFloat64) return Convert<double, float>(array);
  return Convert<float, float>(array);
}

std::vector<double> NpyToFloat64(const NpyArray& array) {
  if (array.type == NpyType::kFloat64) return Convert<double, double>(array);
  return Convert<float, double>(array);
}

namespace {

// The C-order index of element `flat` of `shape`.
std::vector<int64_t> Unflatten(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

template <typename T, typename Bad>
std::optional<NpyElement> FirstWhere(const NpyArray& array, Bad bad) {
  for (int64_t i = 0; i < array.elements(); ++i) {
    T value;
    std::memcpy(&value, array.data.data() + i * sizeof(T), sizeof(T));
    if (bad(value)) {
      return NpyElement{Unflatten(i, array.shape), static_cast<double>(value)};
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<NpyElement> FirstNonFinite(const NpyArray& array) {
  auto bad = [](auto x) { return !std::isfinite(x); };
  if (array.type == NpyType::kFloat64) return FirstWhere<double>(array, bad);
  if (array.type == NpyType::kFloat32) return FirstWhere<float>(array, bad);
  return std::nullopt;
}

std::optional<NpyElement> FirstFloat32Overflow(const NpyArray& array) {
  if (array.type != NpyType::kFloat64) return std::nullopt;
  return FirstWhere<double>(array, [](double x) {
    return std::isfinite(x) && !std::isfinite(static_cast<float>(x));
  });
}

std::vector<int64_t> NpyToInt64(const NpyArray& array) {
  switch (array.type) {
    case NpyType::kInt32:
      return Convert<int32_t, int64_t>(array);
    case NpyType::kInt64:
      return Convert<int64_t, int64_t>(array);
    default:
      return Convert<uint8_t, int64_t>(array);  // bool, uint8.
  }
}

template <typename T>
NpyArray MakeNpy(absl::Span<const T> values, std::vector<int64_t> shape) {
  NpyArray array;
  if constexpr (std::is_same_v<T, float>) array.type = NpyType::kFloat32;
  if constexpr (std::is_same_v<T, double>) array.type = NpyType::kFloat64;
  if constexpr (std::is_same_v<T, int32_t>) array.type = NpyType::kInt32;
  if constexpr (std::is_same_v<T, int64_t>) array.type = NpyType::kInt64;
  if constexpr (std::is_same_v<T, bool>) array.type = NpyType::kBool;
  if constexpr (std::is_same_v<T, uint8_t>) array.type = NpyType::kUint8;
  array.shape = std::move(shape);
  array.data.assign(reinterpret_cast<const char*>(values.data()),
                    values.size() * sizeof(T));
  return array;
}

template NpyArray MakeNpy<float>(absl::Span<const float>, std::vector<int64_t>);
template NpyArray MakeNpy<double>(absl::Span<const double>,
                                  std::vector<int64_t>);
template NpyArray MakeNpy<int32_t>(absl::Span<const int32_t>,
                                   std::vector<int64_t>);
template NpyArray MakeNpy<int64_t>(absl::Span<const int64_t>,
                                   std::vector<int64_t>);
template NpyArray MakeNpy<bool>(absl::Span<const bool>, std::vector<int64_t>);
template NpyArray MakeNpy<uint8_t>(absl::Span<const uint8_t>,
                                   std::vector<int64_t>);

}  // namespace dflash
