// Byte-level data: sequences of T + 1 bytes give T inputs and their T next-token labels.
//
// The built-in long-range task (no --data): each sequence is
//
//   [ block: L distinct bytes from 128..255 ][ filler: random bytes 0..127 ][ copy of block ]
//    0                                     L                          T+1-L              T+1
//
// with loss only on the copy. Copy byte i sits T+1-L tokens after its source, more than T/2
// back (L <= T/4), so a model that does not look that far back can do no better than chance
// on it: loss log(128) once it knows the copy uses the upper half, 1/128 accuracy. The block's
// bytes are distinct, so "find where the current byte appeared in the block and read the
// next one" (an induction head) answers exactly; the filler cannot be confused with it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ctxpar/error.h"
#include "model/training.h"

namespace ctxpar::model {

namespace {
struct Rng {  // splitmix64: small, portable, reproducible everywhere
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(next() % n); }
};

// Opens a regular file for reading its sequences as the steps need them. Anything else is
// refused before a byte is read: /dev/zero would grow without bound, a FIFO would block (hence
// O_NONBLOCK on the open), a folder has no bytes.
int open_data_file(const std::string& path, int64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  CTXPAR_CHECK(fd >= 0, "train: cannot open TrainConfig::data_path ", path, ": ",
               std::strerror(errno));
  struct stat st = {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  if (!regular) ::close(fd);
  CTXPAR_CHECK(regular, "train: TrainConfig::data_path ", path,
               " is not a regular file (a device, FIFO or folder); TrainConfig::data_path reads "
               "a file's bytes, so save the stream to a file first");
  *size = int64_t(st.st_size);
  return fd;
}
// Packed documents in row b of the batch: a separator ends its document (the token after it
// starts the next), and its target, the next document's first token, is not predicted.
void cut_documents(Batch& batch, int64_t b, int separator) {
  const int64_t t = batch.tokens;
  batch.documents.resize(batch.batch * t);
  batch.document_positions.resize(batch.batch * t);
  int32_t document = 0;
  int64_t start = 0;
  for (int64_t p = 0; p < t; ++p) {
    batch.documents[b * t + p] = document;
    batch.document_positions[b * t + p] = p - start;
    if (batch.inputs[b * t + p] == separator) {
      batch.weight[b * t + p] = 0;
      ++document;
      start = p + 1;
    }
  }
}
}  // namespace

}  // namespace ctxpar::model

namespace ctxpar {

std::string packed_documents_rule(const TrainConfig& config) {
  if (config.separator == -1)
    return config.layout != LayoutKind::balanced
               ? ""
               : "TrainConfig::layout balanced balances the work of packed documents and needs "
                 "TrainConfig::separator (the token that ends a document in "
                 "TrainConfig::data_path); without documents use zigzag, the causal mask's balance";
  if (config.separator < 0 || config.separator >= config.model.vocab)
    return detail::concat("TrainConfig::separator ", config.separator,
                          " is not a token id: the vocabulary is 0..", config.model.vocab - 1,
                          " (the bytes of the file); give the byte that ends a document, e.g. 10 "
                          "for a newline or 0 for NUL");
  if (config.data_path.empty())
    return "TrainConfig::separator needs TrainConfig::data_path: the built-in task has no "
           "documents; give the file of packed documents, or drop TrainConfig::separator";
  if (config.batch != 1)
    return detail::concat("TrainConfig::separator needs TrainConfig::batch 1, got ", config.batch,
                          " (each sequence has its own documents, and attention takes one "
                          "documents mask for all rows); for more sequences a step use "
                          "TrainConfig::dp");
  if (!config.dump_path.empty())
    return "TrainConfig::dump_path writes a plain causal batch (what scripts/torch_check.py "
           "checks) and cannot hold packed documents; drop TrainConfig::dump_path or "
           "TrainConfig::separator";
  return "";
}

}  // namespace ctxpar

namespace ctxpar::model {

DataSource::DataSource(const TrainConfig& config) : config_(config) {
  const int64_t t = config.seq;
  CTXPAR_CHECK(t >= 8, "train: TrainConfig::seq must be >= 8, got ", t);
  CTXPAR_CHECK(config.batch >= 1, "train: TrainConfig::batch must be >= 1, got ", config.batch);
  const std::string packing = packed_documents_rule(config);
  CTXPAR_CHECK(packing.empty(), "train: ", packing);
  if (!config.data_path.empty()) {
    int64_t size = 0;
    fd_ = open_data_file(config.data_path, &size);
    file_bytes_ = size;
    CTXPAR_CHECK(size >= t + 1, "train: TrainConfig::data_path ", config.data_path, " has ", size,
                 " bytes; one sequence of TrainConfig::seq ", t, " needs ", t + 1,
                 " (use a shorter TrainConfig::seq or a larger file)");
    return;
  }
  copy_len_ = config.copy_len > 0 ? config.copy_len : std::min<int64_t>(128, t / 4);
  CTXPAR_CHECK(copy_len_ >= 1 && copy_len_ <= 128 && copy_len_ <= t / 4,
               "train: TrainConfig::copy_len must be in [1, min(128, T/4)] so that the copy lies "
               "more than T/2 back, got ",
               copy_len_, " with T = ", t);
}

DataSource::~DataSource() {
  if (fd_ >= 0) ::close(fd_);
}

// The bytes [start, start + n) of the file; a file that shrank since it was opened is named.
void DataSource::read_sequence(uint64_t start, uint8_t* to, size_t n) const {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, to + done, n - done, off_t(start + done));
    if (got < 0 && errno == EINTR) continue;
    CTXPAR_CHECK(got >= 0, "train: reading TrainConfig::data_path ", config_.data_path,
                 " failed: ", std::strerror(errno));
    CTXPAR_CHECK(got > 0, "train: TrainConfig::data_path ", config_.data_path,
                 " shrank while training (had ", file_bytes_, " bytes, ends before byte ",
                 start + done + 1,
                 "); is another "
                 "process writing it?");
    done += size_t(got);
  }
  bytes_read_.fetch_add(n, std::memory_order_relaxed);
}

Batch DataSource::batch(int64_t step, int group) const {
  const int64_t t = config_.seq, nb = config_.batch;
  Batch out;
  out.batch = nb;
  out.tokens = t;
  out.inputs.resize(nb * t);
  out.labels.resize(nb * t);
  out.weight.resize(nb * t);
  std::vector<uint8_t> seq(t + 1);
  for (int64_t b = 0; b < nb; ++b) {
    // Sequence number in the stream of all groups' sequences, step after step.
    const uint64_t index = (uint64_t(step - 1) * config_.dp + group) * nb + b;
    if (fd_ >= 0) {
      const uint64_t count = (uint64_t(file_bytes_) - 1) / t;
      const uint64_t start = (index % count) * t;
      read_sequence(start, seq.data(), size_t(t + 1));
      for (int64_t i = 0; i < t; ++i) out.weight[b * t + i] = 1;
    } else {
      Rng rng{config_.seed * 0x9e3779b97f4a7c15ull ^ (index + 1) * 0xd1b54a32d192ed03ull};
      const int64_t l = copy_len_;
      uint8_t perm[128];
      for (int i = 0; i < 128; ++i) perm[i] = static_cast<uint8_t>(128 + i);
      for (int i = 127; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
      for (int64_t i = 0; i < l; ++i) seq[i] = perm[i];
      for (int64_t i = l; i < t + 1 - l; ++i) seq[i] = static_cast<uint8_t>(rng.below(128));
      for (int64_t i = 0; i < l; ++i) seq[t + 1 - l + i] = seq[i];
      // Input position p predicts seq[p + 1]; the copy starts at p + 1 = T + 1 - L.
      for (int64_t p = 0; p < t; ++p) out.weight[b * t + p] = p >= t - l;
    }
    for (int64_t p = 0; p < t; ++p) {
      out.inputs[b * t + p] = seq[p];
      out.labels[b * t + p] = seq[p + 1];
    }
    if (config_.separator >= 0) cut_documents(out, b, config_.separator);
    for (int64_t p = 0; p < t; ++p) out.counted += out.weight[b * t + p];
  }
  return out;
}

}  // namespace ctxpar::model
