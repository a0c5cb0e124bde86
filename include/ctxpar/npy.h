// NumPy .npy files in and out, so users can feed their own tensors and compare the outputs
// with NumPy or PyTorch. See docs/cli-files.md.
//
// Read: float32 and float16 (to an fp32 or bf16 Tensor), int32 and int64 (kept as stored:
// document ids, positions); C order; format versions 1.0, 2.0 and 3.0; 1 to 4 dimensions.
// Write: float32 (bf16 tensors are widened to float32), int32, int64; format 1.0 (2.0 when
// the header needs it); C order.
//
// Every problem with a file is a ctxpar::Error with one line "<file>: <problem>" — bad magic,
// unsupported version, garbage header, unsupported or big-endian dtype, Fortran order,
// truncated data, a header whose shape does not match the data's size, absurd shapes. The
// reader checks the header's size against the bytes actually present before allocating, so
// a lying header cannot make it allocate more than the file holds.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ctxpar/tensor.h"

namespace ctxpar {

// The element type as stored in the file.
enum class NpyType : uint8_t { f16, f32, i32, i64 };
const char* npy_type_name(NpyType t);  // "float16", "float32", "int32", "int64"

struct NpyHeader {
  NpyType type = NpyType::f32;
  Shape shape;               // C order
  int version = 1;           // major format version: 1, 2 or 3
  uint64_t data_offset = 0;  // bytes from the start of the file to the first element
  uint64_t data_bytes = 0;   // numel * element size, equal to what follows the header
};

// Parses and checks a header. `head` holds the file's first bytes (at least the whole header);
// `file_size` is the size of the whole file, for the data-size check. `name` names the file
// in errors.
NpyHeader parse_npy_header(std::span<const uint8_t> head, uint64_t file_size,
                           const std::string& name);

// A whole .npy image in memory -> Tensor. Floats become `float_dtype` (f32 or bf16); ints
// stay int32 / int64. This is the function the fuzzer drives.
Tensor parse_npy(std::span<const uint8_t> bytes, DType float_dtype = DType::f32,
                 const std::string& name = "<memory>");

// Reads a file; the data goes straight into the Tensor (no second copy of the file). Anything
// but a regular file (a FIFO, a folder, a device) is refused at once, before any read.
Tensor read_npy(const std::string& path, DType float_dtype = DType::f32);

// Only the header (shape, type), checked against the file's size: what a reader of a slice
// needs to know first.
NpyHeader read_npy_header(const std::string& path);

// The rows `tokens` (increasing indices) of axis `token_dim`, read straight from the file:
// the result has the file's shape with that axis cut to tokens.size(), and is bitwise the
// same as slicing read_npy(path). Memory and bytes read are those of the rows (one rank's
// shard), not of the file. `bytes_read`, if given, is increased by the bytes read (header
// included).
Tensor read_npy_rows(const std::string& path, int token_dim, std::span<const int64_t> tokens,
                     DType float_dtype = DType::f32, uint64_t* bytes_read = nullptr);

// Reads an int32 or int64 array of any shape as int64 values in C order (document ids,
// positions). A float array is an error naming the expected dtypes.
std::vector<int64_t> read_npy_ints(const std::string& path);

// The .npy image of a tensor (f32 and bf16 as float32, i32, i64; any strides).
std::vector<uint8_t> npy_bytes(const TensorView& t);

// Writes `t` to `path` atomically (see write_file_atomic).
void write_npy(const std::string& path, const TensorView& t);
// Integer vectors (e.g. positions) as a 1-D array, or with an explicit shape.
void write_npy(const std::string& path, std::span<const int64_t> values, const Shape& shape = {});
void write_npy(const std::string& path, std::span<const int32_t> values, const Shape& shape = {});

// Writes bytes to a temporary name in the same directory, fsyncs, and renames it over `path`:
// a reader (or a crash, or Ctrl-C) sees the old file, the complete new one, or none — never a
// partial one. Throws ctxpar::Error naming the path and the system error.
void write_file_atomic(const std::string& path, std::span<const uint8_t> bytes);
void write_file_atomic(const std::string& path, const std::string& text);
// The same for a file made of several pieces, written in order (no concatenated copy): a
// checkpoint's header and tensors. The temporary is created exclusively (mkstemp), so a file
// or link planted at a guessable name is never written through, and two writers of one path
// never share a temporary.
void write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> pieces);

}  // namespace ctxpar
