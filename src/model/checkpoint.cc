// Training checkpoints, in the safetensors format (safetensors.cc: layout, range checks,
// checksum). A checkpoint holds the weights under their parameter names, the AdamW moments
// as "adam.m.<name>" / "adam.v.<name>", and in the metadata the step and the model config;
// the data order follows from (seed, step), so a resumed run sees the same batches.
//
// Loading trusts nothing the file says: after the format checks, the values themselves are
// checked (a step that is a non-negative integer, finite weights and moments, v >= 0), so a
// diverged run or a hand-edited file is refused naming the tensor, not trained on.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "ctxpar/error.h"
#include "model/training.h"

namespace ctxpar::model {

namespace {

// ctxpar-train-2 files carry a checksum and must; ctxpar-train-1 files (written before the
// checksum existed) load with a note that nothing verified their bytes.
const char* const kFormat = "ctxpar-train-2";
const char* const kFormatUnchecked = "ctxpar-train-1";

int64_t parse_step(const std::string& path, const std::string& text) {
  int64_t step = -1;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, step);
  CTXPAR_CHECK(!text.empty() && ec == std::errc() && p == end && step >= 0, "checkpoint ", path,
               ": its step '", text,
               "' is not a non-negative integer; the file is corrupt or "
               "was edited");
  return step;
}

// Finite values, and for Adam's second moment (a running mean of squares) none below zero.
void check_values(const std::string& path, const std::string& name, const float* x, size_t n,
                  bool second_moment) {
  for (size_t i = 0; i < n; ++i) {
    CTXPAR_CHECK(std::isfinite(x[i]), "checkpoint ", path, ": tensor ", name, " holds ", x[i],
                 " at index ", i,
                 " (the run that wrote it diverged, or the file is corrupt); "
                 "resume from an earlier checkpoint");
    CTXPAR_CHECK(!second_moment || x[i] >= 0.0f, "checkpoint ", path, ": tensor ", name, " holds ",
                 x[i], " at index ", i,
                 ", but Adam's second moment is a mean of "
                 "squares and never negative; the file is corrupt or was edited");
  }
}

}  // namespace

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
                    {{"format", kFormat},
                     {"step", std::to_string(adam.step)},
                     {"model", config.model.describe()},
                     {"seed", std::to_string(config.seed)},
                     {"seq", std::to_string(config.seq)}});
}

void load_checkpoint(const std::string& path, const TrainConfig& config,
                     std::vector<float>& weights, AdamState& adam) {
  SafetensorsFile f = read_safetensors(path);
  const std::string format = f.metadata.count("format") ? f.metadata["format"] : "";
  CTXPAR_CHECK(format == kFormat || format == kFormatUnchecked, "checkpoint ", path,
               " is not a ctxpar training checkpoint (no format '", kFormat, "' in its metadata)");
  CTXPAR_CHECK(f.checksummed || format == kFormatUnchecked, "checkpoint ", path,
               " has no checksum in its metadata; the file was edited or is corrupt");
  if (!f.checksummed)
    std::fprintf(stderr,
                 "ctxpar train: note: checkpoint %s predates checksums (%s); its bytes "
                 "are not verified\n",
                 path.c_str(), kFormatUnchecked);
  const std::string want = config.model.describe();
  CTXPAR_CHECK(f.metadata["model"] == want, "checkpoint ", path,
               " is from another model config:\n  checkpoint: ", f.metadata["model"],
               "\n  this run:   ", want,
               "\nrun with the checkpoint's model options or start fresh");
  const int64_t step = parse_step(path, f.metadata["step"]);
  auto infos = param_infos(config.model);
  const size_t total = param_count(infos);
  weights.assign(total, 0.0f);
  adam.m.assign(total, 0.0f);
  adam.v.assign(total, 0.0f);
  auto take = [&](const std::string& prefix, std::vector<float>& flat) {
    for (const auto& p : infos) {
      const std::string name = prefix + p.name;
      auto it = f.tensors.find(name);
      CTXPAR_CHECK(it != f.tensors.end(), "checkpoint ", path, " lacks tensor ", name);
      // read_safetensors has checked bytes == dtype size x shape, so F32 and the shape
      // guarantee numel * 4 bytes to copy.
      CTXPAR_CHECK(it->second.dtype == "F32" && it->second.shape == p.shape, "checkpoint ", path,
                   ": tensor ", name, " has the wrong dtype or shape");
      std::memcpy(flat.data() + p.offset, it->second.bytes.data(), p.numel * 4);
      check_values(path, name, flat.data() + p.offset, p.numel, prefix == "adam.v.");
    }
  };
  take("", weights);
  take("adam.m.", adam.m);
  take("adam.v.", adam.v);
  adam.step = step;
  if (f.metadata["seed"] != std::to_string(config.seed))
    std::fprintf(stderr,
                 "ctxpar train: note: checkpoint %s was trained with --seed %s; this run "
                 "uses %llu, so its batches differ from an uninterrupted run\n",
                 path.c_str(), f.metadata["seed"].c_str(), (unsigned long long)config.seed);
}

}  // namespace ctxpar::model
