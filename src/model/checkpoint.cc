// Checkpoints in the safetensors format: 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}, "__metadata__": {string: string}}, then the raw
// little-endian tensors. Readable by the safetensors library and by a few lines of NumPy
// (scripts/torch_check.py does that).
//
// A checkpoint holds the weights under their parameter names, the AdamW moments as
// "adam.m.<name>" / "adam.v.<name>", and in the metadata the step and the model config; the
// data order follows from (seed, step), so a resumed run sees the same batches.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ctxpar/error.h"
#include "model/training.h"

namespace ctxpar::model {

namespace {
void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t w = ::write(fd, p, bytes);
    CTXPAR_CHECK(w > 0, "checkpoint: writing ", path, " failed: ", std::strerror(errno));
    p += w;
    bytes -= size_t(w);
  }
}
}  // namespace

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // tensors start 8-byte aligned
  const uint64_t len = text.size();
  uint8_t len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = uint8_t(len >> (8 * i));

  // Write beside the target, make it durable, then rename over it: a crash leaves either the
  // old checkpoint or the new one, never a torn file.
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CTXPAR_CHECK(fd >= 0, "checkpoint: cannot create ", tmp, ": ", std::strerror(errno));
  try {
    write_all(fd, len_le, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& t : tensors) write_all(fd, t.data, t.bytes, tmp);
    CTXPAR_CHECK(::fsync(fd) == 0, "checkpoint: fsync of ", tmp, " failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    std::remove(tmp.c_str());
    throw;
  }
  ::close(fd);
  CTXPAR_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint: rename ", tmp, " -> ",
               path, " failed: ", std::strerror(errno));
  std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);  // the rename itself is durable only once the folder is
    ::close(dfd);
  }
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  CTXPAR_CHECK(in.good(), "checkpoint: cannot open ", path);
  in.seekg(0, std::ios::end);
  const uint64_t size = uint64_t(in.tellg());
  in.seekg(0);
  CTXPAR_CHECK(size >= 8, "checkpoint ", path, " is truncated: ", size,
               " bytes, not even the 8-byte header length");
  uint8_t len_le[8];
  in.read(reinterpret_cast<char*>(len_le), 8);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= uint64_t(len_le[i]) << (8 * i);
  CTXPAR_CHECK(len <= size - 8, "checkpoint ", path, " is truncated: header says ", len,
               " bytes of JSON, the file has ", size - 8, " after the length");
  std::string text(len, '\0');
  in.read(text.data(), std::streamsize(len));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw Error("checkpoint " + path + " has a malformed header: " + e.what());
  }
  SafetensorsFile out;
  const uint64_t data_start = 8 + len;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      for (auto m = it->begin(); m != it->end(); ++m) out.metadata[m.key()] = m->get<std::string>();
      continue;
    }
    LoadedTensor t;
    t.dtype = (*it)["dtype"].get<std::string>();
    t.shape = (*it)["shape"].get<std::vector<int64_t>>();
    auto offs = (*it)["data_offsets"].get<std::vector<uint64_t>>();
    CTXPAR_CHECK(offs.size() == 2 && offs[0] <= offs[1], "checkpoint ", path,
                 ": bad data_offsets for ", it.key());
    CTXPAR_CHECK(data_start + offs[1] <= size, "checkpoint ", path, " is truncated: tensor ",
                 it.key(), " ends at byte ", data_start + offs[1], ", the file has ", size,
                 " (an interrupted copy? the previous checkpoint may still be intact)");
    t.bytes.resize(offs[1] - offs[0]);
    in.seekg(std::streamoff(data_start + offs[0]));
    in.read(reinterpret_cast<char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
    CTXPAR_CHECK(in.good(), "checkpoint ", path, ": reading ", it.key(), " failed");
    out.tensors.emplace(it.key(), std::move(t));
  }
  return out;
}

void save_checkpoint(const std::string& path, const TrainConfig& config,
                     const std::vector<float>& weights, const AdamState& adam) {
  auto infos = param_infos(config.model);
  std::vector<NamedTensor> tensors;
  auto add = [&](const std::string& prefix, const std::vector<float>& flat) {
    for (const auto& p : infos)
      tensors.push_back({prefix + p.name, "F32", p.shape, flat.data() + p.offset, p.numel * 4});
  };
  add("", weights);
  if (adam.m.size() == weights.size()) {
    add("adam.m.", adam.m);
    add("adam.v.", adam.v);
  }
  write_safetensors(path, tensors,
                    {{"format", "ctxpar-train-1"},
                     {"step", std::to_string(adam.step)},
                     {"model", config.model.describe()},
                     {"seed", std::to_string(config.seed)},
                     {"seq", std::to_string(config.seq)}});
}

void load_checkpoint(const std::string& path, const TrainConfig& config,
                     std::vector<float>& weights, AdamState& adam) {
  SafetensorsFile f = read_safetensors(path);
  CTXPAR_CHECK(f.metadata.count("format") && f.metadata["format"] == "ctxpar-train-1",
               "checkpoint ", path, " is not a ctxpar training checkpoint (no format "
               "'ctxpar-train-1' in its metadata)");
  const std::string want = config.model.describe();
  CTXPAR_CHECK(f.metadata["model"] == want, "checkpoint ", path,
               " is from another model config:\n  checkpoint: ", f.metadata["model"],
               "\n  this run:   ", want, "\nrun with the checkpoint's model options or start fresh");
  auto infos = param_infos(config.model);
  const size_t total = param_count(infos);
  weights.assign(total, 0.0f);
  adam.m.assign(total, 0.0f);
  adam.v.assign(total, 0.0f);
  auto take = [&](const std::string& prefix, std::vector<float>& flat) {
    for (const auto& p : infos) {
      auto it = f.tensors.find(prefix + p.name);
      CTXPAR_CHECK(it != f.tensors.end(), "checkpoint ", path, " lacks tensor ", prefix + p.name);
      CTXPAR_CHECK(it->second.dtype == "F32" && it->second.shape == p.shape, "checkpoint ", path,
                   ": tensor ", prefix + p.name, " has the wrong dtype or shape");
      std::memcpy(flat.data() + p.offset, it->second.bytes.data(), p.numel * 4);
    }
  };
  take("", weights);
  take("adam.m.", adam.m);
  take("adam.v.", adam.v);
  adam.step = std::stoll(f.metadata["step"]);
  if (f.metadata["seed"] != std::to_string(config.seed))
    std::fprintf(stderr, "ctxpar train: note: checkpoint %s was trained with --seed %s; this run "
                 "uses %llu, so its batches differ from an uninterrupted run\n", path.c_str(),
                 f.metadata["seed"].c_str(), (unsigned long long)config.seed);
}

}  // namespace ctxpar::model
