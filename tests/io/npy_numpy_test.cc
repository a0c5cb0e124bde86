// .npy against NumPy itself (/usr/bin/python3 with Debian's python3-numpy): our writer ->
// NumPy -> our reader, and NumPy's writer -> our reader, for every dtype and format version.
// The expected values travel as raw little-endian .bin files written by the other side, so
// neither side checks itself.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ctxpar/npy.h"

namespace ctxpar {
namespace {

namespace fs = std::filesystem;
constexpr const char* kPython = "/usr/bin/python3";

bool have_numpy() {
  static const bool ok = std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0;
  return ok;
}

class NpyNumpy : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_numpy()) GTEST_SKIP() << kPython << " with numpy is not installed";
    dir_ = fs::temp_directory_path() /
           ("ctxpar_npy_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // Runs a Python script (numpy imported as np, D = the test's directory); returns its status.
  int python(const std::string& body) {
    std::string script = "import numpy as np, sys\nD = '" + dir_.string() + "'\n" + body;
    std::ofstream(path("script.py")) << script;
    return std::system((std::string(kPython) + " " + path("script.py")).c_str());
  }
  template <typename T>
  std::vector<T> read_bin(const std::string& name) {
    std::ifstream in(path(name), std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
    std::vector<T> out(bytes.size() / sizeof(T));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
    return out;
  }
  template <typename T>
  void write_bin(const std::string& name, const T* p, size_t n) {
    std::ofstream(path(name), std::ios::binary)
        .write(reinterpret_cast<const char*>(p), n * sizeof(T));
  }
  fs::path dir_;
};

TEST_F(NpyNumpy, OurWriterNumpyReadsAndWritesBackEqual) {
  // f32 [2, 3, 4, 5], i32 [7, 3], i64 [11]; NumPy loads each, checks dtype, shape, order and
  // values against the raw bytes, and saves a copy that we read back.
  Tensor f(DType::f32, {2, 3, 4, 5});
  fill_normal(f.view(), 7);
  f.ptr<float>()[0] = INFINITY;
  f.ptr<float>()[1] = -0.0f;
  Tensor i32(DType::i32, {7, 3});
  for (int64_t i = 0; i < i32.numel(); ++i) i32.ptr<int32_t>()[i] = int32_t(i * 104729 - 1000000);
  std::vector<int64_t> i64(11);
  for (size_t i = 0; i < i64.size(); ++i) i64[i] = int64_t(i) * 3000000000ll - 7;

  write_npy(path("f.npy"), f.view());
  write_npy(path("i32.npy"), i32.view());
  write_npy(path("i64.npy"), i64);
  write_bin(path("f.bin"), f.ptr<float>(), f.numel());
  write_bin(path("i32.bin"), i32.ptr<int32_t>(), i32.numel());
  write_bin(path("i64.bin"), i64.data(), i64.size());

  ASSERT_EQ(python(R"(
for name, dt, shape in [('f', np.float32, (2, 3, 4, 5)), ('i32', np.int32, (7, 3)), ('i64', np.int64, (11,))]:
    a = np.load(D + '/' + name + '.npy')
    want = np.fromfile(D + '/' + name + '.bin', dtype=dt).reshape(shape)
    assert a.dtype == dt, (name, a.dtype)
    assert a.shape == shape, (name, a.shape)
    assert a.flags['C_CONTIGUOUS']
    assert np.array_equal(a, want) and np.array_equal(np.signbit(a), np.signbit(want)), name
    np.save(D + '/' + name + '_back.npy', a)
)"),
            0);
  Tensor f2 = read_npy(path("f_back.npy"));
  ASSERT_EQ(f2.shape(), f.shape());
  EXPECT_EQ(std::memcmp(f2.data(), f.data(), f.bytes()), 0);
  Tensor i2 = read_npy(path("i32_back.npy"));
  ASSERT_EQ(i2.dtype(), DType::i32);
  ASSERT_EQ(i2.shape(), i32.shape());
  EXPECT_EQ(std::memcmp(i2.data(), i32.data(), i32.bytes()), 0);
  EXPECT_EQ(read_npy_ints(path("i64_back.npy")), i64);
}

TEST_F(NpyNumpy, BF16TensorIsWrittenAsFloat32) {
  Tensor b(DType::bf16, {3, 8});
  fill_normal(b.view(), 3);
  write_npy(path("b.npy"), b.view());
  std::vector<float> widened(b.numel());
  for (size_t i = 0; i < widened.size(); ++i) widened[i] = bf16_to_f32(b.ptr<uint16_t>()[i]);
  write_bin(path("b.bin"), widened.data(), widened.size());
  EXPECT_EQ(python(R"(
a = np.load(D + '/b.npy')
assert a.dtype == np.float32 and a.shape == (3, 8)
assert np.array_equal(a, np.fromfile(D + '/b.bin', dtype=np.float32).reshape(3, 8))
)"),
            0);
}

TEST_F(NpyNumpy, NumpyWritesEveryDtypeAndVersionWeReadEqual) {
  ASSERT_EQ(python(R"(
rng = np.random.default_rng(5)
f = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
f[0, 0, 0, :3] = [np.inf, -np.inf, 1e-40]   # a subnormal too
arrays = {
  'f32': f,
  'f16': rng.standard_normal((4, 6, 5)).astype(np.float16),
  'i32': rng.integers(-2**31, 2**31 - 1, size=(9, 2), dtype=np.int32),
  'i64': rng.integers(-2**62, 2**62, size=(13,), dtype=np.int64),
}
for name, a in arrays.items():
    np.save(D + '/' + name + '.npy', a)
    # The expected values: floats as float32 (NumPy's own f16 -> f32), ints as stored.
    (a.astype(np.float32) if a.dtype.kind == 'f' else a).tofile(D + '/' + name + '.bin')
    for v in [(2, 0), (3, 0)]:
        with open(D + '/' + name + '_v%d.npy' % v[0], 'wb') as fh:
            np.lib.format.write_array(fh, a, version=v)
# Every float16 bit pattern (subnormals, inf, NaN included) for the conversion.
allh = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
np.save(D + '/allh.npy', allh)
allh.astype(np.float32).tofile(D + '/allh.bin')
)"),
            0);
  struct Case {
    const char* name;
    DType dtype;
    Shape shape;
  };
  for (const Case& c : {Case{"f32", DType::f32, {2, 5, 3, 4}}, Case{"f16", DType::f32, {4, 6, 5}},
                        Case{"i32", DType::i32, {9, 2}}, Case{"i64", DType::i64, {13}}}) {
    for (const char* suffix : {"", "_v2", "_v3"}) {
      SCOPED_TRACE(std::string(c.name) + suffix);
      Tensor t = read_npy(path(std::string(c.name) + suffix + ".npy"));
      ASSERT_EQ(t.dtype(), c.dtype);
      ASSERT_EQ(t.shape(), c.shape);
      std::vector<char> want;
      {
        std::ifstream in(path(std::string(c.name) + ".bin"), std::ios::binary);
        want.assign(std::istreambuf_iterator<char>(in), {});
      }
      ASSERT_EQ(want.size(), t.bytes());
      EXPECT_EQ(std::memcmp(want.data(), t.data(), t.bytes()), 0);
    }
  }
  // float16: all 65536 patterns equal NumPy's conversion bit for bit (NaN: both NaN).
  Tensor h = read_npy(path("allh.npy"));
  std::vector<float> want = read_bin<float>("allh.bin");
  ASSERT_EQ(static_cast<size_t>(h.numel()), want.size());
  int mismatches = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    float got = h.ptr<float>()[i];
    bool same = std::isnan(want[i]) ? std::isnan(got) : std::memcmp(&got, &want[i], 4) == 0;
    if (!same && ++mismatches < 5)
      ADD_FAILURE() << "f16 pattern " << i << ": " << got << " vs " << want[i];
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_F(NpyNumpy, FloatsReadAsBF16MatchTorchRounding) {
  // Reference: PyTorch's own float32 -> bfloat16 rounding (round to nearest even).
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "torch is not installed";
  ASSERT_EQ(python(R"(
import torch
rng = np.random.default_rng(11)
a = (rng.standard_normal((3, 64, 2, 8)) * 100).astype(np.float32)
np.save(D + '/a.npy', a)
np.save(D + '/h.npy', a.astype(np.float16))
torch.from_numpy(a).bfloat16().view(torch.int16).numpy().tofile(D + '/a_bf16.bin')
torch.from_numpy(a.astype(np.float16).astype(np.float32)).bfloat16().view(torch.int16).numpy().tofile(D + '/h_bf16.bin')
)"),
            0);
  for (const char* name : {"a", "h"}) {
    SCOPED_TRACE(name);
    Tensor t = read_npy(path(std::string(name) + ".npy"), DType::bf16);
    ASSERT_EQ(t.dtype(), DType::bf16);
    std::vector<uint16_t> want = read_bin<uint16_t>(std::string(name) + "_bf16.bin");
    ASSERT_EQ(static_cast<size_t>(t.numel()), want.size());
    EXPECT_EQ(std::memcmp(t.data(), want.data(), t.bytes()), 0);
  }
}

TEST_F(NpyNumpy, NumpyFortranOrderIsRejectedOneDimensionalIsFine) {
  ASSERT_EQ(python(R"(
np.save(D + '/fortran.npy', np.asfortranarray(np.ones((3, 4), dtype=np.float32)))
np.save(D + '/fortran1d.npy', np.asfortranarray(np.arange(5, dtype=np.float32)))
np.save(D + '/f64.npy', np.ones((2, 2)))
np.save(D + '/big.npy', np.ones((2, 2), dtype='>f4'))
)"),
            0);
  try {
    read_npy(path("fortran.npy"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fortran.npy: Fortran-order"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read_npy(path("fortran1d.npy")).ptr<float>()[4], 4.0f);
  EXPECT_THROW(
      {
        try {
          read_npy(path("f64.npy"));
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("unsupported dtype '<f8'"), std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  EXPECT_THROW(
      {
        try {
          read_npy(path("big.npy"));
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("big-endian"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
}

}  // namespace
}  // namespace ctxpar
