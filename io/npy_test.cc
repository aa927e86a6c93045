#include "io/npy.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <sys/stat.h>

#include <cstdlib>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

std::string Fixture(const std::string& name) {
  std::ifstream file("io/testdata/" + name, std::ios::binary);
  std::ostringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

absl::StatusOr<NpyArray> ReadFixture(const std::string& name) {
  return ReadNpy("io/testdata/" + name);
}

// Files written by NumPy itself (io/make_testdata.py).
TEST(NpyTest, ReadsWhatNumPyWrites) {
  auto f32 = ReadFixture("float32_2x3.npy");
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ(f32->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(NpyToFloat(*f32),
            (std::vector<float>{0, 0.25f, 0.5f, 0.75f, 1, 1.25f}));
  auto f64 = ReadFixture("float64_3.npy");
  ASSERT_TRUE(f64.ok());
  EXPECT_EQ(f64->type, NpyType::kFloat64);
  EXPECT_EQ(NpyToFloat(*f64)[1], -2.25f);
  auto i32 = ReadFixture("int32_2x2.npy");
  ASSERT_TRUE(i32.ok());
  EXPECT_EQ(NpyToInt64(*i32), (std::vector<int64_t>{1, -2, 3, 2147483647}));
  auto i64 = ReadFixture("int64_4.npy");
  ASSERT_TRUE(i64.ok());
  EXPECT_EQ(NpyToInt64(*i64), (std::vector<int64_t>{0, -1, 1LL << 40, 7}));
  auto b = ReadFixture("bool_2x3.npy");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(NpyToInt64(*b), (std::vector<int64_t>{1, 0, 1, 0, 0, 1}));
  auto u8 = ReadFixture("uint8_5.npy");
  ASSERT_TRUE(u8.ok());
  EXPECT_EQ(NpyToInt64(*u8), (std::vector<int64_t>{0, 1, 2, 254, 255}));
  auto scalar = ReadFixture("scalar_float32.npy");
  ASSERT_TRUE(scalar.ok());
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(NpyToFloat(*scalar), (std::vector<float>{3.5f}));
  auto v2 = ReadFixture("v2_float32_2.npy");
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(NpyToFloat(*v2), (std::vector<float>{1, 2}));
  auto v3 = ReadFixture("v3_int64_2.npy");
  ASSERT_TRUE(v3.ok()) << v3.status();
  EXPECT_EQ(NpyToInt64(*v3), (std::vector<int64_t>{5, 6}));
}

TEST(NpyTest, WritesTheBytesNumPyWrites) {
  const std::vector<float> values = {0, 0.25f, 0.5f, 0.75f, 1, 1.25f};
  EXPECT_EQ(SerializeNpy(MakeNpy<float>(values, {2, 3})),
            Fixture("float32_2x3.npy"));
  const std::vector<int64_t> ints = {0, -1, 1LL << 40, 7};
  EXPECT_EQ(SerializeNpy(MakeNpy<int64_t>(ints, {4})), Fixture("int64_4.npy"));
}

template <typename T>
void ExpectRoundTrip(std::vector<T> values, std::vector<int64_t> shape) {
  const NpyArray array = MakeNpy<T>(values, shape);
  auto back = ParseNpy(SerializeNpy(array), "round trip");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->type, array.type);
  EXPECT_EQ(back->shape, shape);
  EXPECT_EQ(back->data, array.data);
}

TEST(NpyTest, EveryTypeRoundTrips) {
  ExpectRoundTrip<float>({1.5f, -0.0f, 3e38f, 1e-45f}, {2, 2});
  ExpectRoundTrip<double>({1.5, -1e-300, 7}, {3});
  ExpectRoundTrip<int32_t>({-5, 9, 0, 1, 2, 3}, {1, 2, 3});
  ExpectRoundTrip<int64_t>({-(1LL << 50)}, {1});
  ExpectRoundTrip<uint8_t>({0, 255}, {2});
  ExpectRoundTrip<float>({}, {0, 4});
  const bool flags[] = {true, false, true};
  const NpyArray array = MakeNpy<bool>(absl::MakeConstSpan(flags), {3});
  auto back = ParseNpy(SerializeNpy(array), "bool");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(NpyToInt64(*back), (std::vector<int64_t>{1, 0, 1}));
  // A header too long for version 1 is written as version 2.
  std::vector<float> many(1, 1.0f);
  std::vector<int64_t> shape(25000, 1);
  EXPECT_EQ(SerializeNpy(MakeNpy<float>(many, shape))[6], 2);
  ExpectRoundTrip<float>(many, shape);
}

TEST(NpyTest, RejectsWhatItCannotRead) {
  EXPECT_EQ(ReadFixture("big_endian_float32.npy").status().message(),
            "io/testdata/big_endian_float32.npy: big-endian data (descr "
            "'>f4') is not supported; save it little-endian");
  EXPECT_EQ(ReadFixture("fortran_float32_2x3.npy").status().message(),
            "io/testdata/fortran_float32_2x3.npy: Fortran-order data is not "
            "supported; save it in C order (np.ascontiguousarray)");
  EXPECT_EQ(ReadFixture("complex64.npy").status().message(),
            "io/testdata/complex64.npy: dtype '<c8' is not supported "
            "(float32, float64, int32, int64, bool, uint8)");
  EXPECT_EQ(ReadNpy("io/testdata/missing.npy").status().code(),
            absl::StatusCode::kNotFound);
  const std::string good = Fixture("float32_2x3.npy");
  EXPECT_EQ(ParseNpy(good.substr(0, good.size() - 3), "cut").status().message(),
            "cut: data holds 21 bytes, shape [2, 3] of <f4 needs 24 "
            "(truncated or padded file)");
  EXPECT_EQ(ParseNpy(good.substr(0, 40), "short").status().message(),
            "short: truncated .npy header: ends after 40 bytes, inside its "
            "header text (128 bytes)");
  EXPECT_EQ(ParseNpy("PK\x03\x04 not numpy at all", "zip").status().message(),
            "zip: not a .npy file (no \\x93NUMPY magic)");
  std::string v4 = good;
  v4[6] = 4;
  EXPECT_EQ(ParseNpy(v4, "v4").status().message(),
            "v4: .npy format version 4 is not supported (1, 2 or 3)");
  std::string bad_shape = good;
  bad_shape.replace(bad_shape.find("(2, 3)"), 6, "(2, x)");
  EXPECT_EQ(ParseNpy(bad_shape, "bad").status().message(),
            "bad: malformed shape (2, x)");
  std::string no_shape = good;
  no_shape.replace(no_shape.find("'shape'"), 7, "'shope'");
  EXPECT_NE(ParseNpy(no_shape, "bad").status().message().find(
                "malformed .npy header, no 'shape'"),
            absl::string_view::npos);
}

TEST(NpyTest, CheckNamesTheFileShapeAndExpectation) {
  auto f32 = ReadFixture("float32_2x3.npy");
  ASSERT_TRUE(f32.ok());
  EXPECT_TRUE(CheckNpy(*f32, "x", {2, -1}, {NpyType::kFloat32}).ok());
  EXPECT_EQ(CheckNpy(*f32, "hidden.npy", {2, 3, 4}, {NpyType::kFloat32})
                .message(),
            "hidden.npy: expected shape [2, 3, 4] of <f4, got [2, 3] of <f4");
  EXPECT_EQ(CheckNpy(*f32, "ids.npy", {-1, 3},
                     {NpyType::kInt32, NpyType::kInt64})
                .message(),
            "ids.npy: expected shape [*, 3] of <i4 or <i8, got [2, 3] of <f4");
}

std::string TestDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(root ? root : "/tmp") + "/" + name;
  ::mkdir(dir.c_str(), 0777);
  return dir;
}

// A header whose extents are each in range but whose product overflows 64
// bits, and no data: refused from the header, before any allocation.
TEST(NpyTest, ShapesWhoseBytesOverflowAreRefused) {
  std::string header =
      "{'descr': '<f4', 'fortran_order': False, "
      "'shape': (4294967296, 4294967296, 4, 16), }";
  header.append(118 - header.size(), ' ');
  header.push_back('\n');
  const std::string bytes =
      std::string("\x93NUMPY\x01\x00", 8) + std::string(1, char(118)) +
      std::string(1, '\0') + header;
  const std::string expected =
      ": shape [4294967296, 4294967296, 4, 16] of <f4 holds more than 2^63 "
      "bytes";
  EXPECT_EQ(ParseNpy(bytes, "huge").status().message(), "huge" + expected);
  const std::string path = TestDir("overflow") + "/hidden.npy";
  std::ofstream(path, std::ios::binary) << bytes;
  EXPECT_EQ(ReadNpy(path).status().message(), path + expected);
  EXPECT_EQ(ReadNpyHeader(path).status().message(), path + expected);
}

TEST(NpyTest, FileSizeIsCheckedBeforeTheDataIsRead) {
  const std::string dir = TestDir("sizes");
  const std::string good = Fixture("float32_2x3.npy");
  auto header = ReadNpyHeader("io/testdata/float32_2x3.npy");
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(header->elements, 6);
  EXPECT_EQ(header->data_bytes, 24);
  EXPECT_EQ(header->data_offset, static_cast<int64_t>(good.size()) - 24);
  std::ofstream(dir + "/padded.npy", std::ios::binary) << good << "extra";
  EXPECT_EQ(ReadNpy(dir + "/padded.npy").status().message(),
            dir + "/padded.npy: data holds 29 bytes, shape [2, 3] of <f4 "
                  "needs 24 (truncated or padded file)");
  std::ofstream(dir + "/cut.npy", std::ios::binary) << good.substr(0, 9);
  EXPECT_EQ(ReadNpy(dir + "/cut.npy").status().message(),
            dir + "/cut.npy: truncated .npy header: ends after 9 bytes, "
                  "inside its magic, version and header length (10 bytes)");
  std::string long_header = good.substr(0, 12);
  long_header[6] = 2;
  long_header[8] = 0;
  long_header[9] = 0;
  long_header[10] = 0x20;  // 2 MiB.
  long_header[11] = 0;
  std::ofstream(dir + "/long.npy", std::ios::binary) << long_header;
  EXPECT_EQ(ReadNpy(dir + "/long.npy").status().message(),
            dir + "/long.npy: a .npy header of 2097152 bytes is larger than "
                  "the 1048576 accepted");
}

// A file cut short inside its magic, version or length is truncated, not
// something else than a .npy file.
TEST(NpyTest, AFileCutInItsFirstBytesIsTruncated) {
  const std::string dir = TestDir("first_bytes");
  const std::string good = Fixture("float32_2x3.npy");
  std::ofstream(dir + "/eight.npy", std::ios::binary) << good.substr(0, 8);
  EXPECT_EQ(ReadNpyHeader(dir + "/eight.npy").status().message(),
            dir + "/eight.npy: truncated .npy header: ends after 8 bytes, "
                  "inside its magic, version and header length (10 bytes)");
  EXPECT_EQ(ParseNpy(good.substr(0, 3), "three").status().message(),
            "three: truncated .npy header: ends after 3 bytes, inside its "
            "magic, version and header length (10 bytes)");
  std::string v2 = good.substr(0, 11);
  v2[6] = 2;
  EXPECT_EQ(ParseNpy(v2, "v2").status().message(),
            "v2: truncated .npy header: ends after 11 bytes, inside its "
            "magic, version and header length (12 bytes)");
  std::ofstream(dir + "/empty.npy", std::ios::binary);
  EXPECT_EQ(ReadNpy(dir + "/empty.npy").status().message(),
            dir + "/empty.npy: empty file, expected a .npy file");
}

std::string WithShape(const std::string& shape) {
  std::string bytes = Fixture("float32_2x3.npy");
  bytes.replace(bytes.find("(2, 3)"), 6, shape);
  return bytes;
}

TEST(NpyTest, AnExtentAboveTheLimitNamesTheLimit) {
  EXPECT_EQ(ParseNpyHeader(WithShape("(2, 1099511627777)"), "big")
                .status()
                .message(),
            "big: shape (2, 1099511627777): extent 1099511627777 on axis 1 "
            "is above the limit of 2^40 = 1099511627776 per axis");
  EXPECT_EQ(
      ParseNpyHeader(WithShape("(99999999999999999999,)"), "huge")
          .status()
          .message(),
      "huge: shape (99999999999999999999,): extent 99999999999999999999 on "
      "axis 0 is above the limit of 2^40 = 1099511627776 per axis");
  EXPECT_EQ(ParseNpyHeader(WithShape("(2, -3)"), "negative").status().message(),
            "negative: shape (2, -3): extent -3 on axis 1 is negative");
}

TEST(NpyTest, OnlyRegularFilesAreRead) {
  const std::string dir = TestDir("kinds");
  ::mkdir((dir + "/hidden.npy").c_str(), 0777);
  EXPECT_EQ(ReadNpy(dir + "/hidden.npy").status().message(),
            dir + "/hidden.npy: is a directory, expected a regular file");
  ASSERT_EQ(::mkfifo((dir + "/keep.npy").c_str(), 0600), 0);
  EXPECT_EQ(ReadNpy(dir + "/keep.npy").status().message(),
            dir + "/keep.npy: is a FIFO (named pipe), expected a regular file");
  EXPECT_EQ(ReadNpy("/dev/zero").status().message(),
            "/dev/zero: is a character device, expected a regular file");
  EXPECT_EQ(ReadNpy(dir + "/none.npy").status().message(),
            dir + "/none.npy: cannot open: No such file or directory");
  EXPECT_THAT(
      WriteNpy(dir + "/no/such/dir.npy", MakeNpy<float>({}, {0})).message(),
      ::testing::HasSubstr("dir.npy: cannot create a temporary file: No such "
                           "file or directory"));
}

TEST(NpyTest, FindsNonFiniteValuesAndFloat32Overflow) {
  const float inf = INFINITY;
  const std::vector<float> f = {1, 2, 3, 4, 5, inf};
  auto at = FirstNonFinite(MakeNpy<float>(f, {2, 3}));
  ASSERT_TRUE(at.has_value());
  EXPECT_EQ(at->index, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(at->value, inf);
  const std::vector<double> d = {1, 1e300, NAN, 1e-300};
  auto nan = FirstNonFinite(MakeNpy<double>(d, {2, 2}));
  ASSERT_TRUE(nan.has_value());
  EXPECT_EQ(nan->index, (std::vector<int64_t>{1, 0}));
  auto big = FirstFloat32Overflow(MakeNpy<double>(d, {4}));
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->index, (std::vector<int64_t>{1}));
  EXPECT_EQ(big->value, 1e300);
  const std::vector<double> fine = {1, -3.4e38, 1e-300};
  EXPECT_FALSE(FirstNonFinite(MakeNpy<double>(fine, {3})).has_value());
  EXPECT_FALSE(FirstFloat32Overflow(MakeNpy<double>(fine, {3})).has_value());
  EXPECT_EQ(NpyToFloat64(MakeNpy<double>(fine, {3})), fine);
}

}  // namespace
}  // namespace dflash
