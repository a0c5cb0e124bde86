// The training loop on one rank of the data x context mesh.
//
//   world rank r = group * cp + c          context group: same `group`, ordered by c
//                                          data group:    same `c`, ordered by group
//
// Each step: every rank of a data group builds the group's batch (a few bytes per token),
// keeps its layout shard (inputs, labels and loss weights sharded alike), runs the model, and
// the gradients are summed over the context group (the shards of one sequence), then averaged
// over the data groups. Every rank then applies the same AdamW update to identical gradients.
#include <cblas.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "ctxpar/error.h"
#include "ctxpar/model.h"
#include "io/output_file.h"
#include "model/training.h"
#include "model/transformer.h"

namespace ctxpar {

void set_blas_threads(int threads) { openblas_set_num_threads(threads < 1 ? 1 : threads); }

namespace {

using Clock = std::chrono::steady_clock;

// The --log file. Every write is checked (a full disk fails the run naming the file, instead
// of an exit 0 behind an empty log); each line is flushed so a killed run keeps its log; close()
// makes it durable. It is made as every file ctxpar writes (io/output_file.h): a new file
// created exclusively beside the path (on a resume holding the old log's lines first), renamed
// over the path at once, then written line by line; never opened through a planted link.
class LogFile {
 public:
  void open(const std::string& path, bool append) {
    path_ = path;
    const std::string problem = output_path_problem(path);
    if (!problem.empty()) throw Error("train: TrainConfig::log_path " + path + " " + problem);
    std::string temp;
    const int fd = open_temp_beside(path, &temp);
    if (fd < 0) fail("opening");
    f_ = ::fdopen(fd, "w");
    if (!f_) {
      ::close(fd);
      ::unlink(temp.c_str());
      fail("opening");
    }
    match_umask(fd);
    if (append) {
      const int old = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      struct stat st = {};
      if (old >= 0 && ::fstat(old, &st) == 0 && S_ISREG(st.st_mode)) {
        char buf[1 << 16];
        ssize_t n;
        while ((n = ::read(old, buf, sizeof buf)) > 0)
          if (std::fwrite(buf, 1, size_t(n), f_) != size_t(n)) break;
      }
      if (old >= 0) ::close(old);
      if (std::fflush(f_) != 0) {
        ::unlink(temp.c_str());
        fail("writing");
      }
    }
    if (std::rename(temp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      ::unlink(temp.c_str());
      errno = err;
      fail("opening");
    }
  }
  bool is_open() const { return f_ != nullptr; }
  void write_line(const std::string& line) {
    if (std::fputs(line.c_str(), f_) < 0 || std::fputc('\n', f_) < 0 || std::fflush(f_) != 0)
      fail("writing");
  }
  void close() {
    if (!f_) return;
    struct stat st = {};
    // fsync of a regular file only: a terminal or a pipe cannot be synced (EINVAL).
    const bool regular = ::fstat(fileno(f_), &st) == 0 && S_ISREG(st.st_mode);
    if (std::fflush(f_) != 0 || (regular && ::fsync(fileno(f_)) != 0)) fail("writing");
    FILE* f = f_;
    f_ = nullptr;
    if (std::fclose(f) != 0) fail("closing");
  }
  ~LogFile() {
    if (f_) std::fclose(f_);
  }

 private:
  [[noreturn]] void fail(const char* what) {
    const int err = errno;
    throw Error(detail::concat("train: ", what, " TrainConfig::log_path ", path_,
                               " failed: ", std::strerror(err), " (errno ", err,
                               "); free space there or give "
                               "another TrainConfig::log_path path"));
  }
  std::string path_;
  FILE* f_ = nullptr;
};

void dump_step(const TrainConfig& config, const model::Batch& batch,
               const std::vector<float>& weights, const std::vector<float>& grads, double loss,
               int64_t step) {
  auto infos = model::param_infos(config.model);
  std::vector<model::NamedTensor> tensors;
  for (const auto& p : infos) {
    tensors.push_back({p.name, "F32", p.shape, weights.data() + p.offset, p.numel * 4});
    tensors.push_back({"grad." + p.name, "F32", p.shape, grads.data() + p.offset, p.numel * 4});
  }
  const std::vector<int64_t> bt = {batch.batch, batch.tokens};
  tensors.push_back({"batch.inputs", "U8", bt, batch.inputs.data(), batch.inputs.size()});
  tensors.push_back({"batch.labels", "U8", bt, batch.labels.data(), batch.labels.size()});
  tensors.push_back({"batch.weight", "U8", bt, batch.weight.data(), batch.weight.size()});
  const auto& m = config.model;
  char loss_text[64];
  std::snprintf(loss_text, sizeof loss_text, "%.17g", loss);
  model::write_safetensors(config.dump_path, tensors,
                           {{"format", "ctxpar-grad-dump-1"},
                            {"step", std::to_string(step)},
                            {"loss", loss_text},
                            {"layers", std::to_string(m.layers)},
                            {"dim", std::to_string(m.dim)},
                            {"heads", std::to_string(m.heads)},
                            {"kv_heads", std::to_string(m.kv_heads)},
                            {"head_dim", std::to_string(m.head_dim)},
                            {"hidden", std::to_string(m.hidden)},
                            {"rope_base", std::to_string(m.rope_base)},
                            {"norm_eps", std::to_string(m.norm_eps)},
                            {"counted", std::to_string(batch.counted)}});
}

}  // namespace

TrainResult train(Communicator& world, const TrainConfig& config,
                  const std::function<void(const StepRecord&)>& on_step) {
  // Every check before the first collective, with the same verdict on every rank.
  config.model.validate();
  CTXPAR_CHECK(config.dp >= 1 && config.cp >= 1 && config.dp * config.cp == world.size(),
               "train: TrainConfig::dp x TrainConfig::cp must equal the number of ranks: ",
               config.dp, " x ", config.cp, " != ", world.size());
  CTXPAR_CHECK(config.steps >= 1, "train: TrainConfig::steps must be >= 1, got ", config.steps);
  CTXPAR_CHECK(config.dump_path.empty() || config.dp == 1,
               "train: TrainConfig::dump_path needs TrainConfig::dp 1 (the dump holds one batch)");
  const bool packed = config.separator >= 0;  // DataSource checks packed_documents_rule
  const Layout layout(config.layout, config.seq, config.cp);
  model::DataSource data(config);
  const int group = world.rank() / config.cp, crank = world.rank() % config.cp;
  const bool leader = world.rank() == 0;

  std::unique_ptr<Communicator> cp_comm = world.split(group, crank);
  std::unique_ptr<Communicator> dp_comm = world.split(crank, group);
  StrategyOptions so;
  so.kind = config.strategy;
  so.ulysses_degree = config.ulysses_degree;
  so.ulysses_groups = config.ulysses_groups;
  so.mask = Mask::causal_mask();
  so.mask.documents = packed;
  so.kernel.threads = config.threads;
  so.device = config.device;
  std::unique_ptr<Strategy> strategy = Strategy::create(*cp_comm, so);

  const auto infos = model::param_infos(config.model);
  std::vector<float> weights, grads(model::param_count(infos));
  model::AdamState adam;
  model::init_params(config.model, weights, config.seed);
  if (!config.resume_path.empty())
    model::load_checkpoint(config.resume_path, config, weights, adam);
  const int64_t first = adam.step + 1;

  // Any --seq: the layout pads it to its granule; padding tokens (index >= seq) have no input,
  // no label and no loss weight, and attention neither sees them nor lets them see.
  std::vector<int64_t> index = layout.positions(crank);
  const int64_t tl = layout.local_tokens(), nb = config.batch;
  model::Transformer net(config.model, *strategy, layout.token_positions(crank), nb);
  std::vector<uint8_t> inputs(nb * tl), labels(nb * tl), weight(nb * tl);

  LogFile log;
  if (leader && !config.log_path.empty()) log.open(config.log_path, first > 1);

  TrainResult result;
  result.first_step = first;
  for (int64_t step = first; step <= config.steps; ++step) {
    const auto t0 = Clock::now();
    const model::Batch batch = data.batch(step, group);
    if (packed) {
      // This window's documents place its tokens (the balanced layout solves for them; zigzag
      // ignores them): every rank of the context group reads the same window and solves the
      // same deterministic problem, so all hold the same layout. Padding: invisible position,
      // RoPE angle 0 (rope.cc), document 0.
      const Layout packing(config.layout, config.seq, config.cp, {so.mask, batch.documents, {}});
      index = packing.positions(crank);
      std::vector<int64_t> rope(tl, kPaddingPosition);
      std::vector<int32_t> documents(tl, 0);
      for (int64_t i = 0; i < tl; ++i)
        if (!packing.is_padding(index[i])) {
          rope[i] = batch.document_positions[index[i]];
          documents[i] = batch.documents[index[i]];
        }
      net.set_tokens(packing.token_positions(crank), rope, std::move(documents));
    }
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < tl; ++i) {
        const bool pad = layout.is_padding(index[i]);
        const int64_t src = b * config.seq + index[i];
        inputs[b * tl + i] = pad ? 0 : batch.inputs[src];
        labels[b * tl + i] = pad ? 0 : batch.labels[src];
        weight[b * tl + i] = pad ? 0 : batch.weight[src];
      }
    std::fill(grads.begin(), grads.end(), 0.0f);
    model::LossSums sums;
    try {
      sums = net.forward_backward(weights.data(), grads.data(), inputs.data(), labels.data(),
                                  weight.data(), double(std::max<int64_t>(1, batch.counted)));
    } catch (const Error& e) {
      throw Error("train step " + std::to_string(step) + ": " + e.what());
    }
    // Sum over the shards of each sequence, then average over the data groups.
    cp_comm->allreduce(grads.data(), grads.size());
    if (config.dp > 1) {
      dp_comm->allreduce(grads.data(), grads.size());
      const float inv = 1.0f / float(config.dp);
      for (float& g : grads) g *= inv;
    }
    double totals[3] = {sums.loss, double(sums.counted), double(sums.correct)};
    world.allreduce(totals, 3);
    const double loss = totals[0] / config.dp;
    if (leader && !config.dump_path.empty() && step == first)
      dump_step(config, batch, weights, grads, loss, step);

    StepRecord rec;
    rec.step = step;
    rec.loss = loss;
    rec.accuracy = totals[1] > 0 ? totals[2] / totals[1] : 0.0;
    rec.grad_norm = model::clip_grad_norm(grads, config.clip);
    rec.lr = model::learning_rate(config, step);
    model::adamw_update(weights, grads, adam, infos, config, rec.lr);
    rec.peak_bytes = net.peak_bytes();
    std::vector<uint64_t> peaks(world.size());
    const uint64_t mine = rec.peak_bytes;
    world.allgather(&mine, peaks.data(), sizeof mine);
    for (uint64_t p : peaks) rec.peak_bytes_max = std::max<size_t>(rec.peak_bytes_max, p);
    rec.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    rec.tokens_per_second = double(config.dp * nb * config.seq) / rec.seconds;
    result.steps.push_back(rec);

    if (log.is_open()) {
      nlohmann::json j = {{"step", rec.step},
                          {"loss", rec.loss},
                          {"accuracy", rec.accuracy},
                          {"lr", rec.lr},
                          {"grad_norm", rec.grad_norm},
                          {"seconds", rec.seconds},
                          {"tokens_per_second", rec.tokens_per_second},
                          {"peak_bytes_rank0", rec.peak_bytes},
                          {"peak_bytes_max", rec.peak_bytes_max},
                          {"seq", config.seq},
                          {"ranks", world.size()}};
      log.write_line(j.dump());
    }
    const bool save_now =
        !config.save_path.empty() &&
        ((config.save_every > 0 && step % config.save_every == 0) || step == config.steps);
    if (leader && save_now) model::save_checkpoint(config.save_path, config, weights, adam);
    if (on_step) on_step(rec);
  }
  log.close();
  result.weights = std::move(weights);
  return result;
}

}  // namespace ctxpar
