// The safetensors format: 8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets}, "__metadata__": {string: string}} padded with spaces,
// then the data section: the raw little-endian tensors, back to back. Readable by the
// safetensors library and by a few lines of NumPy (scripts/torch_check.py does that).
//
// A file is hostile input until checked: every byte range is checked against dtype x shape,
// the ranges must tile the data section exactly (the safetensors library's own rule), and the
// checksum below must match. Only then is a byte of tensor data trusted.
//
// Checksum (__metadata__["checksum"] = "fnv1a64:<16 hex digits>"): 64-bit FNV-1a over the
// header JSON with the checksum entry removed (and __metadata__ removed if that empties it),
// dumped compactly with sorted keys (Python: json.dumps(h, sort_keys=True,
// separators=(',', ':'), ensure_ascii=False)), followed by the whole data section. FNV-1a's
// step (xor a byte, multiply by an odd prime) is a bijection of the state, so any change
// confined to one byte, a flipped bit included, always changes the sum.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "ctxpar/error.h"
#include "ctxpar/hash.h"
#include "ctxpar/npy.h"
#include "core/untrusted_json.h"
#include "model/training.h"

namespace ctxpar::model {

namespace {

// The safetensors library refuses headers over 100 MB; so do we, before allocating one.
constexpr uint64_t kMaxHeaderBytes = io::kMaxJsonBytes;
const char* const kChecksumKey = "checksum";

struct Fnv1a64 {
  uint64_t h = kFnv1a64Offset;
  void add(const void* data, size_t bytes) { h = fnv1a64(data, bytes, h); }
  std::string text() const {
    char buf[32];
    std::snprintf(buf, sizeof buf, "fnv1a64:%016llx", (unsigned long long)h);
    return buf;
  }
};

// The header as the checksum sees it (see the top of the file).
std::string checksummed_header(nlohmann::json header) {
  auto meta = header.find("__metadata__");
  if (meta != header.end() && meta->is_object()) {
    meta->erase(kChecksumKey);
    if (meta->empty()) header.erase(meta);
  }
  return header.dump();
}

// Bytes per element of the safetensors dtypes; 0 for an unknown one.
uint64_t dtype_bytes(const std::string& dtype) {
  static const std::pair<const char*, uint64_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  for (const auto& [name, bytes] : kSizes)
    if (dtype == name) return bytes;
  return 0;
}

// Closes the descriptor on every path out of read_safetensors.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void read_at(int fd, void* out, uint64_t bytes, uint64_t offset, const std::string& path) {
  uint8_t* p = static_cast<uint8_t*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    CTXPAR_CHECK(n >= 0, "checkpoint ", path, ": read failed: ", std::strerror(errno));
    CTXPAR_CHECK(n > 0, "checkpoint ", path,
                 " is truncated: it ended while being read "
                 "(is another process writing it?)");
    p += n, offset += uint64_t(n), bytes -= uint64_t(n);
  }
}

struct Range {
  uint64_t begin, end;
  std::string name;
};

// One tensor entry: its JSON types, a known dtype, and data_offsets spanning exactly
// dtype x shape bytes (products checked for overflow). Returns the range.
Range check_entry(const std::string& path, const std::string& name, const nlohmann::json& e,
                  LoadedTensor& t) {
  const std::string where = "checkpoint " + path + ": tensor " + name;
  CTXPAR_CHECK(
      e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"),
      where, " needs an object with dtype, shape and data_offsets, got ", e.dump());
  CTXPAR_CHECK(e["dtype"].is_string(), where, ": dtype must be a string, got ", e["dtype"].dump());
  t.dtype = e["dtype"].get<std::string>();
  const uint64_t elem = dtype_bytes(t.dtype);
  CTXPAR_CHECK(elem > 0, where, ": unknown dtype '", t.dtype, "'");
  CTXPAR_CHECK(e["shape"].is_array(), where, ": shape must be a list, got ", e["shape"].dump());
  uint64_t bytes = elem;
  for (const auto& d : e["shape"]) {
    CTXPAR_CHECK(d.is_number_unsigned(), where, ": shape ", e["shape"].dump(),
                 " must hold non-negative integers");
    const uint64_t n = d.get<uint64_t>();
    CTXPAR_CHECK(n <= uint64_t(INT64_MAX) && !__builtin_mul_overflow(bytes, n, &bytes), where,
                 ": shape ", e["shape"].dump(), " overflows 64 bits");
    t.shape.push_back(int64_t(n));
  }
  const auto& offs = e["data_offsets"];
  CTXPAR_CHECK(offs.is_array() && offs.size() == 2 && offs[0].is_number_unsigned() &&
                   offs[1].is_number_unsigned(),
               where, ": data_offsets must be [begin, end] (non-negative integers), got ",
               offs.dump());
  Range r{offs[0].get<uint64_t>(), offs[1].get<uint64_t>(), name};
  CTXPAR_CHECK(r.begin <= r.end, where, ": data_offsets ", offs.dump(), " end before they begin");
  CTXPAR_CHECK(r.end - r.begin == bytes, where, ": data_offsets ", offs.dump(), " hold ",
               r.end - r.begin, " bytes, its dtype ", t.dtype, " and shape ", e["shape"].dump(),
               " need ", bytes);
  return r;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  Fnv1a64 sum;
  const std::string summed = checksummed_header(header);
  sum.add(summed.data(), summed.size());
  for (const auto& t : tensors) sum.add(t.data, t.bytes);
  header["__metadata__"][kChecksumKey] = sum.text();

  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // tensors start 8-byte aligned
  const uint64_t len = text.size();
  uint8_t len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = uint8_t(len >> (8 * i));
  std::vector<std::span<const uint8_t>> pieces = {
      {len_le, 8}, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}};
  for (const auto& t : tensors) pieces.push_back({static_cast<const uint8_t*>(t.data), t.bytes});
  // A crash leaves either the old file or the new one, never a torn one; the temporary is
  // created exclusively beside it (see write_file_atomic).
  write_file_atomic(path, pieces);
  const std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // the rename itself is durable only once the folder is
    ::close(dfd);
  }
}

SafetensorsFile read_safetensors(const std::string& path) {
  // O_NONBLOCK: a FIFO must be refused below, not block the open.
  Fd f{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  CTXPAR_CHECK(f.fd >= 0, "checkpoint: cannot open ", path, ": ", std::strerror(errno));
  struct stat st = {};
  CTXPAR_CHECK(::fstat(f.fd, &st) == 0, "checkpoint: cannot stat ", path, ": ",
               std::strerror(errno));
  CTXPAR_CHECK(!S_ISDIR(st.st_mode), "checkpoint ", path,
               " is a folder; give the checkpoint file (the TrainConfig::save_path path), not its "
               "folder");
  CTXPAR_CHECK(S_ISREG(st.st_mode), "checkpoint ", path,
               " is not a regular file (a device or a FIFO?); give the TrainConfig::save_path "
               "file");
  const uint64_t size = uint64_t(st.st_size);
  CTXPAR_CHECK(size >= 8, "checkpoint ", path, " is truncated: ", size,
               " bytes, not even the 8-byte header length");
  uint8_t len_le[8];
  read_at(f.fd, len_le, 8, 0, path);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= uint64_t(len_le[i]) << (8 * i);
  CTXPAR_CHECK(len <= size - 8, "checkpoint ", path, " is truncated: header says ", len,
               " bytes of JSON, the file has ", size - 8, " after the length");
  CTXPAR_CHECK(len <= kMaxHeaderBytes, "checkpoint ", path, " has a header of ", len,
               " bytes, over the safetensors limit of ", kMaxHeaderBytes,
               ": not a safetensors file, or a corrupt one");
  std::string text(len, '\0');
  read_at(f.fd, text.data(), len, 8, path);
  // Only spaces may follow the JSON (the padding): the checksum does not cover them.
  const size_t last = text.find_last_not_of(' ');
  CTXPAR_CHECK(last != std::string::npos && text[last] == '}', "checkpoint ", path,
               " has a malformed header: it must be a JSON object padded with spaces");
  // Bounded in depth before it is parsed: copying it (the checksum) or printing a part of it
  // (an error message) recurses once per level.
  const nlohmann::json header = io::parse_untrusted_json(
      std::string_view(text).substr(0, last + 1), "checkpoint " + path, "header",
      "not a safetensors file, or a corrupt one (a checkpoint's header nests 3 levels); resume "
      "from another checkpoint or start fresh");
  CTXPAR_CHECK(header.is_object(), "checkpoint ", path, ": the header must be a JSON object");

  SafetensorsFile out;
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      CTXPAR_CHECK(it->is_object(), "checkpoint ", path, ": __metadata__ must be an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        CTXPAR_CHECK(m->is_string(), "checkpoint ", path, ": __metadata__ entry ", m.key(),
                     " must be a string, got ", m->dump());
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    LoadedTensor t;
    ranges.push_back(check_entry(path, it.key(), *it, t));
    out.tensors.emplace(it.key(), std::move(t));
  }
  // The ranges must tile the data section: no overlap, no hole, nothing past the end.
  const uint64_t data_start = 8 + len, data_bytes = size - data_start;
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    CTXPAR_CHECK(r.begin >= covered, "checkpoint ", path, ": tensors ", ranges[i - 1].name, " and ",
                 r.name, " overlap (bytes ", r.begin, "..", covered, ")");
    CTXPAR_CHECK(r.end <= data_bytes, "checkpoint ", path, " is truncated: tensor ", r.name,
                 " ends at byte ", data_start + r.end, ", the file has ", size,
                 " (an interrupted copy? the previous checkpoint may still be intact)");
    CTXPAR_CHECK(r.begin == covered, "checkpoint ", path, ": bytes ", covered, "..", r.begin,
                 " of the data section belong to no tensor");
    covered = r.end;
  }
  CTXPAR_CHECK(covered == data_bytes, "checkpoint ", path, ": the last ", data_bytes - covered,
               " bytes of the file belong to no tensor");

  Fnv1a64 sum;
  const std::string summed = checksummed_header(header);
  sum.add(summed.data(), summed.size());
  for (const Range& r : ranges) {
    std::vector<uint8_t>& bytes = out.tensors.at(r.name).bytes;
    bytes.resize(r.end - r.begin);
    read_at(f.fd, bytes.data(), bytes.size(), data_start + r.begin, path);
    sum.add(bytes.data(), bytes.size());  // in offset order: the data section as stored
  }
  auto stored = out.metadata.find(kChecksumKey);
  out.checksummed = stored != out.metadata.end();
  CTXPAR_CHECK(!out.checksummed || stored->second == sum.text(), "checkpoint ", path,
               " fails its checksum (stored ", stored->second, ", computed ", sum.text(),
               "): the file is corrupt (a flipped bit, a bad copy); resume from another "
               "checkpoint or start fresh");
  return out;
}

}  // namespace ctxpar::model
