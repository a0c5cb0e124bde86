// Reading one rank's rows of a .npy file (read_npy_rows, what each MPI rank does with --q):
// bitwise the layout's shard of the whole file, with bytes read in proportion to the rows;
// and files that are not regular files (a FIFO) refused at once instead of blocking.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "ctxpar/error.h"
#include "ctxpar/layout.h"
#include "ctxpar/npy.h"

namespace ctxpar {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("ctxpar_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

TEST(NpyRows, EachRanksRowsAreTheLayoutsShardOfTheWholeFile) {
  const fs::path dir = fresh_dir("npy_rows");
  const int64_t B = 2, T = 48, H = 3, D = 5;
  Tensor full(DType::f32, {B, T, H, D});
  fill_normal(full.view(), 11);
  const std::string path = (dir / "q.npy").string();
  write_npy(path, full.view());
  const uint64_t header = read_npy_header(path).data_offset;
  for (LayoutKind kind : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
    for (int P : {1, 2, 4}) {
      const Layout layout(kind, T, P);
      for (int r = 0; r < P; ++r) {
        SCOPED_TRACE(std::string(layout_name(kind)) + " P=" + std::to_string(P) + " rank " +
                     std::to_string(r));
        const std::vector<int64_t> rows = layout.positions(r);
        // [B, T, H, D] (token axis 1) and the same file read as if it were [B, H, T, D]
        // (token axis 2 of a [2, 48, 3, 5] array is its H axis: any axis works).
        uint64_t bytes = 0;
        Tensor got = read_npy_rows(path, 1, rows, DType::f32, &bytes);
        EXPECT_TRUE(same_bytes(got, layout.shard(read_npy(path), r, 1)));
        // The rows and the header, nothing more: T/P of the data.
        EXPECT_EQ(bytes, header + static_cast<uint64_t>(B * (T / P) * H * D * 4));
        // bf16 storage: the same conversion as the whole-file read.
        EXPECT_TRUE(same_bytes(read_npy_rows(path, 1, rows, DType::bf16),
                               layout.shard(read_npy(path, DType::bf16), r, 1)));
      }
    }
  // Token axis not 1 (PyTorch's [B, H, T, D]): rows of axis 2.
  Tensor bhtd(DType::f32, {B, H, T, D});
  fill_normal(bhtd.view(), 12);
  write_npy(path, bhtd.view());
  const Layout zigzag(LayoutKind::zigzag, T, 4);
  EXPECT_TRUE(
      same_bytes(read_npy_rows(path, 2, zigzag.positions(3)), zigzag.shard(read_npy(path), 3, 2)));
  EXPECT_THROW(read_npy_rows(path, 2, std::vector<int64_t>{5, 3}), Error);  // not increasing
  EXPECT_THROW(read_npy_rows(path, 2, std::vector<int64_t>{T}), Error);     // out of range
  fs::remove_all(dir);
}

TEST(NpyRows, FifoIsRefusedAtOnceNamingTheFile) {
  const fs::path dir = fresh_dir("npy_fifo");
  const std::string fifo = (dir / "q.npy").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  // No writer ever opens the FIFO: a blocking open would wait forever.
  for (int which = 0; which < 3; ++which) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      if (which == 0) read_npy(fifo);
      if (which == 1) read_npy_header(fifo);
      if (which == 2) read_npy_rows(fifo, 1, std::vector<int64_t>{0});
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fifo + ": not a regular file (a FIFO)"),
                std::string::npos)
          << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  }
  fs::remove_all(dir);
}

// Shape (2^40, 0), a 128-byte file: asking for the (no) rows of its empty axis walked 2^40
// empty outer rows (hours). An empty result now returns at once. Run in a child process with
// a 60 s alarm, so that the old behaviour fails the test instead of hanging it.
TEST(NpyRows, AnEmptyResultReturnsAtOnce) {
  const fs::path dir = fresh_dir("npy_rows_empty");
  const std::string path = (dir / "e.npy").string();
  {
    const std::string dict =
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 0), }";
    std::string header = dict;
    while ((10 + header.size() + 1) % 64 != 0) header += ' ';
    header += '\n';
    std::string bytes = "\x93NUMPY";
    bytes += '\x01';  // version 1.0
    bytes += '\x00';
    bytes += char(header.size() & 0xff);
    bytes += char(header.size() >> 8);
    bytes += header;
    FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);
    int code = 0;
    try {
      const Tensor t = read_npy_rows(path, 1, {}, DType::f32);
      if (t.shape() != Shape{int64_t{1} << 40, 0}) code = 3;
      const std::vector<int64_t> rows = {0, 7, 8};  // the other axis: 3 rows of nothing
      if (read_npy_rows(path, 0, rows, DType::f32).shape() != Shape{3, 0}) code = 4;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      code = 5;
    }
    std::fflush(stderr);
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_FALSE(WIFSIGNALED(status))
      << "signal " << WTERMSIG(status) << " (SIGALRM: still walking empty rows after 60 s)";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace ctxpar
