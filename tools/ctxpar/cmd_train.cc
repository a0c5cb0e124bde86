// ctxpar train: train a byte-level transformer whose attention is context-parallel.
// See docs/training.md.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention_job.h"
#include "ctxpar/gloo.h"
#include "commands.h"
#include "core/environment.h"
#include "ctxpar/comm.h"
#include "ctxpar/error.h"
#include "ctxpar/model.h"
#include "io/output_file.h"
#include "options.h"
#include "progress.h"
#include "rank_agreement.h"

extern char** environ;

namespace ctxpar::cli {

namespace {

// Draws the loss and accuracy curves of a JSON-lines log with matplotlib. The paths reach
// Python as argument strings (sys.argv), never through a shell: a file name may hold quotes,
// $(...) or spaces and is still only a file name. Python runs isolated (-I: neither the
// working folder nor PYTHONPATH is searched, so a json.py planted there is not imported), and
// writes the PNG into a file ctxpar created exclusively beside the target (its descriptor is
// passed, not a path), which is then renamed over the target: never written through a link.
void plot_loss(const std::string& log_path, const std::string& png_path) {
  const char* script =
      "import json,sys,math,os\n"
      "import matplotlib; matplotlib.use('Agg')\n"
      "import matplotlib.pyplot as plt\n"
      "rs=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]\n"
      "s=[r['step'] for r in rs]\n"
      "fig,ax=plt.subplots(1,2,figsize=(10,4))\n"
      "ax[0].plot(s,[r['loss'] for r in rs],label='loss (counted tokens)')\n"
      "ax[0].axhline(math.log(256),ls='--',c='gray',label='log 256')\n"
      "ax[0].axhline(math.log(128),ls=':',c='gray',label='log 128 (no long-range context)')\n"
      "ax[0].set_xlabel('step'); ax[0].set_ylabel('cross-entropy (nats)'); ax[0].legend()\n"
      "ax[1].plot(s,[r['accuracy'] for r in rs],c='C1')\n"
      "ax[1].set_xlabel('step'); ax[1].set_ylabel('accuracy on counted tokens')\n"
      "t=rs[-1]; fig.suptitle('ctxpar train: T=%d, %d ranks'%(t.get('seq',0),t.get('ranks',1)))\n"
      "fig.tight_layout()\n"
      "with os.fdopen(int(sys.argv[2]),'wb') as f: fig.savefig(f,dpi=100,format='png')\n";
  const char* python = "/usr/bin/python3";
  std::string temp;
  const int fd = open_temp_beside(png_path, &temp);
  if (fd < 0) {
    std::fprintf(stderr, "ctxpar train: cannot create the plot beside %s: %s\n", png_path.c_str(),
                 std::strerror(errno));
    return;
  }
  match_umask(fd);
  const std::string fd_text = std::to_string(fd);
  // python3 -I -c SCRIPT A B: sys.argv is ['-c', A, B]; nothing after -c SCRIPT is an option.
  std::vector<char*> argv = {const_cast<char*>(python),
                             const_cast<char*>("-I"),
                             const_cast<char*>("-c"),
                             const_cast<char*>(script),
                             const_cast<char*>(log_path.c_str()),
                             const_cast<char*>(fd_text.c_str()),
                             nullptr};
  std::fflush(stdout);  // our lines before Python's, when stdout is a file
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, python, nullptr, nullptr, argv.data(), environ);
  ::close(fd);
  if (spawned != 0) {
    ::unlink(temp.c_str());
    std::fprintf(stderr, "ctxpar train: could not start %s for the plot\n", python);
    return;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ::unlink(temp.c_str());
    std::fprintf(stderr,
                 "ctxpar train: plotting failed (see above; needs matplotlib under "
                 "%s)\n",
                 python);
    return;
  }
  // Checked again: the target may have become a link or a device during the run.
  const std::string problem = output_path_problem(png_path);
  if (!problem.empty() || std::rename(temp.c_str(), png_path.c_str()) != 0) {
    const std::string why = problem.empty() ? std::strerror(errno) : problem;
    ::unlink(temp.c_str());
    std::fprintf(stderr, "ctxpar train: --plot %s %s\n", png_path.c_str(), why.c_str());
    return;
  }
  std::printf("loss curve: %s\n", png_path.c_str());
}

// Every file the run will write, checked before the first step (exit 2 naming the option),
// instead of a missing folder found after the whole run.
void check_output_paths(const std::vector<std::pair<const char*, std::string>>& outputs) {
  for (const auto& [option, path] : outputs) {
    if (path.empty()) continue;
    const std::string problem = output_path_problem(path);
    if (!problem.empty())
      throw UsageError(
          detail::concat("--", option, " ", path, " ", problem,
                         std::string(option) == "plot" ? " (--no-plot: no loss curve)" : ""));
  }
}

// Ranks of this job on this machine: they share its memory. OpenMPI, MPICH and torchrun say
// how many (environment::Launcher::local_size, 0 when none does).
int ranks_on_this_machine(bool one_per_process, int ranks) {
  if (!one_per_process) return ranks;
  return std::max(1, environment::launcher().local_size);
}

// Every option that changes the trained weights or the schedule of the ranks' messages, for
// the ranks to agree on under mpirun (rank_agreement.h): numbers exactly, files by
// path, size and a sample of their bytes. --threads too: the BLAS thread count may change a
// sum's order, and the copies of the model must stay bitwise equal. Left out: what rank 0
// alone writes (--log, --plot, --save, --dump-grads) and --quiet.
Signature train_signature(const TrainConfig& c) {
  auto num = [](auto v) { return std::to_string(v); };
  auto real = [](double v) {  // shortest text that reads back as exactly v
    char s[40];
    return std::string(s, std::to_chars(s, s + sizeof s, v).ptr);
  };
  auto file = [](const std::string& p) { return p.empty() ? "" : p + ", " + file_fingerprint(p); };
  return {{"data", file(c.data_path)},
          {"resume", file(c.resume_path)},
          {"seq", num(c.seq)},
          {"steps", num(c.steps)},
          {"batch", num(c.batch)},
          {"seed", num(c.seed)},
          {"dp", num(c.dp)},
          {"cp", num(c.cp)},
          {"strategy", strategy_name(c.strategy)},
          {"ulysses-degree", num(c.ulysses_degree)},
          {"layout", layout_name(c.layout)},
          {"threads", num(c.threads)},
          {"layers", num(c.model.layers)},
          {"dim", num(c.model.dim)},
          {"heads", num(c.model.heads)},
          {"kv-heads", num(c.model.kv_heads)},
          {"head-dim", num(c.model.head_dim)},
          {"hidden", num(c.model.hidden)},
          {"lr", real(c.lr)},
          {"min-lr", real(c.min_lr)},
          {"warmup", num(c.warmup)},
          {"weight-decay", real(c.weight_decay)},
          {"clip", real(c.clip)},
          {"copy-len", num(c.copy_len)},
          {"separator", num(c.separator)},
          {"dump-grads", c.dump_path.empty() ? "" : "given"}};
}

}  // namespace

namespace {

// The library's train messages name TrainConfig / ModelConfig fields; the command's user
// knows them by their flags. One table, both directions' only home.
constexpr std::pair<const char*, const char*> kTrainFlags[] = {
    {"TrainConfig::log_path", "--log"},
    {"TrainConfig::data_path", "--data"},
    {"TrainConfig::separator", "--separator"},
    {"TrainConfig::layout", "--layout"},
    {"TrainConfig::save_path", "--save"},
    {"TrainConfig::resume_path", "--resume"},
    {"TrainConfig::dump_path", "--dump-grads"},
    {"TrainConfig::copy_len", "--copy-len"},
    {"TrainConfig::seq", "--seq"},
    {"TrainConfig::batch", "--batch"},
    {"TrainConfig::steps", "--steps"},
    {"TrainConfig::dp", "--dp"},
    {"TrainConfig::cp", "--cp"},
    {"ModelConfig::layers", "--layers"},
    {"ModelConfig::dim", "--dim"},
    {"ModelConfig::hidden", "--hidden"},
    {"ModelConfig::heads", "--heads"},
    {"ModelConfig::kv_heads", "--kv-heads"},
    {"ModelConfig::head_dim", "--head-dim"},
};

bool identifier_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

}  // namespace

std::string with_train_flags(std::string message) {
  for (const auto& [field, flag] : kTrainFlags) {
    const std::string f = field;
    for (size_t at = message.find(f); at != std::string::npos; at = message.find(f, at)) {
      const size_t end = at + f.size();
      if (end < message.size() && identifier_char(message[end])) {  // a longer field's name
        at = end;
        continue;
      }
      message.replace(at, f.size(), flag);
      at += std::strlen(flag);
    }
  }
  return message;
}

namespace {
int train_command(int argc, char** argv);
}  // namespace

int cmd_train(int argc, char** argv) {
  try {
    return train_command(argc, argv);
  } catch (const UsageError& e) {
    throw UsageError(with_train_flags(e.what()));
  } catch (const Error& e) {
    throw Error(with_train_flags(e.what()));
  }
}

namespace {

// What `ctxpar train` runs: the parsed, checked options (train_from_options).
struct TrainRun {
  TrainConfig config;
  TransportKind transport = TransportKind::threads;
  int ranks = 1;
  std::string png;  // the loss curve to draw from the --log ("" = none)
  bool quiet = false;
};

Options train_options() {
  Options o(
      "train",
      "Train a byte-level decoder-only transformer whose attention is split across ranks\n"
      "(context parallelism). Without --data it trains on a built-in long-range task: L\n"
      "distinct bytes, random filler, then the same L bytes again; the loss counts only\n"
      "the copy, which lies more than T/2 tokens back (chance: loss log 128, accuracy 1/128).");
  o.add("seq", "8192", "tokens per sequence T (64K / 1M suffixes accepted)")
      .add("steps", "300", "optimizer steps")
      .add("batch", "1", "sequences per data group per step")
      .add("seed", "1", "seed for weights and the built-in task")
      .add("ranks", "4", "ranks on the threads transport (ignored under mpirun and torchrun)")
      .add("dp", "1", "data-parallel groups")
      .add("cp", "0", "ranks per context group (0: ranks / dp)")
      .add("strategy", "ring", "attention strategy: ring | allgather | ulysses | hybrid")
      .add("ulysses-degree", "0", "hybrid: ranks per Ulysses group (0 = all)")
      .add("layout", "auto",
           "token layout: auto (balanced with --separator, else zigzag) | zigzag | balanced (by "
           "the packed documents' work; needs --separator) | contiguous | striped")
      .add("threads", "1", "BLAS and kernel threads per rank (not given: OMP_NUM_THREADS when set)")
      .add_device()
      .add("transport", "auto",
           "auto | threads | mpi | gloo (auto: mpi under mpirun, gloo under torchrun)")
      .add("layers", "2", "transformer blocks")
      .add("dim", "64", "model width")
      .add("heads", "4", "query heads")
      .add("kv-heads", "2", "key/value heads (GQA)")
      .add("head-dim", "16", "head dimension (16..256, even)")
      .add("hidden", "192", "SwiGLU inner width")
      .add("lr", "3e-3", "peak learning rate")
      .add("min-lr", "1e-3", "final learning rate of the cosine decay")
      .add("warmup", "10", "warm-up steps")
      .add("weight-decay", "0.1", "AdamW decoupled weight decay")
      .add("clip", "1.0", "clip gradients to this global norm (0: off)")
      .add("data", "", "train on the bytes of this file instead of the built-in task")
      .add("separator", "",
           "--data holds packed documents, each ended by this byte (e.g. 10: one a line): "
           "attention and RoPE positions per document, no loss across a boundary (--batch 1)")
      .add("copy-len", "0", "built-in task: copied block length (0: min(128, T/4))")
      .add("log", "", "JSON-lines log, one record per step")
      .add("plot", "", "PNG loss curve (default: the --log path with .png)")
      .flag("no-plot", "no loss curve beside the --log")
      .add("save", "", "checkpoint file (safetensors), written atomically")
      .add("save-every", "0", "checkpoint every N steps (0: only at the end)")
      .add("resume", "", "continue from this checkpoint")
      .add("dump-grads", "", "write weights, batch and gradients of the first step (safetensors)")
      .flag("quiet", "no per-step lines")
      .example("ctxpar train --seq 8192 --ranks 4 --steps 300 --log train.jsonl")
      .example("ctxpar train --seq 16384 --ranks 2 --strategy allgather --layout contiguous")
      .example("mpirun -n 4 ctxpar train --seq 8192 --dp 2 --cp 2")
      .example("ctxpar train --data book.txt --seq 2048 --save ck.safetensors --save-every 50")
      .example("ctxpar train --data lines.txt --separator 10 --seq 4096 --ranks 4");
  return o;
}

// The options of a parsed command line, checked (a UsageError naming the option): the
// model, the ranks and the files the run writes, which the ranks of a launcher's job agree on.
TrainRun train_from_options(const Options& o) {
  TrainRun run;
  TrainConfig& c = run.config;
  constexpr int64_t kMaxSteps = int64_t{1} << 40;
  c.seq = o.i64("seq", 1, kMaxTokens);
  c.steps = o.i64("steps", 1, kMaxSteps);
  c.batch = o.i64("batch", 1, kMaxBatch);
  c.seed = static_cast<uint64_t>(o.i64("seed", 0, kMaxSeed));
  c.strategy = parse_strategy(o.str("strategy"));
  c.ulysses_degree = o.i32("ulysses-degree", 0, kMaxProcesses);
  c.ulysses_groups = ulysses_groups_from_env();
  c.device = device_of(o);
  if (o.given("separator"))
    c.separator = o.i32("separator", 0, std::numeric_limits<int>::max(), "a token id");
  // auto: balanced under packed documents, else zigzag (the runs without --separator keep
  // their bits).
  Mask mask = Mask::causal_mask();
  mask.documents = c.separator >= 0;
  c.layout = choose_layout(o.str("layout"), mask);
  c.threads = threads_option(o);
  c.model.layers = o.i32("layers", 1, 1 << 16);
  c.model.dim = o.i32("dim", 1, 1 << 20);
  c.model.heads = o.i32("heads", 1, kMaxHeads);
  c.model.kv_heads = o.i32("kv-heads", 1, kMaxHeads);
  c.model.head_dim = o.i32("head-dim", 16, 256);
  c.model.hidden = o.i32("hidden", 1, 1 << 20);
  c.lr = o.num("lr", 0, 10);
  c.min_lr = o.num("min-lr", 0, 10);
  c.warmup = o.i64("warmup", 0, kMaxSteps);
  c.weight_decay = o.num("weight-decay", 0, 10);
  c.clip = o.num("clip", 0, 1e9);
  c.data_path = o.str("data");
  c.copy_len = o.i64("copy-len", 0, 128);
  c.log_path = o.str("log");
  c.save_path = o.str("save");
  c.save_every = o.i64("save-every", 0, kMaxSteps);
  c.resume_path = o.str("resume");
  c.dump_path = o.str("dump-grads");
  if (c.threads < 1) throw UsageError("--threads must be >= 1");

  using enum TransportKind;
  const TransportKind transport = run.transport =
      transport_option(o.str("transport"), {threads, mpi, gloo});
  if (transport == gloo && !torchrun_job())
    throw UsageError(
        "--transport gloo needs the job started by torchrun, e.g. torchrun "
        "--nproc-per-node 4 --no-python ctxpar train ...; or use --transport threads");
  // One rank per process (mpirun's or torchrun's): the world communicator.
  const bool one_per_process = transport_traits(transport).one_rank_per_process;
  auto world = [&]() -> Communicator& { return process_world(transport, 120); };
  if (one_per_process && c.device.kind != DeviceKind::cpu)
    throw UsageError(
        "--device sim runs on the threads transport only; use --device cpu under "
        "mpirun or torchrun");
  const int ranks = run.ranks =
      one_per_process ? world().size() : o.i32("ranks", 1, kMaxThreadsRanks, kThreadsRanksNote);
  if (ranks < 1) throw UsageError("--ranks must be >= 1");
  c.dp = o.i32("dp", 1, kMaxProcesses);
  const int cp = o.i32("cp", 0, kMaxProcesses);
  c.cp = cp > 0 ? cp : ranks / std::max(1, c.dp);
  if (c.dp < 1 || int64_t{c.dp} * c.cp != ranks)
    throw UsageError("--dp x --cp must equal the number of ranks (" + std::to_string(ranks) +
                     "), got " + std::to_string(c.dp) + " x " + std::to_string(c.cp));
  // One BLAS thread per rank unless told: ranks already fill the cores.
  set_blas_threads(c.threads);
  c.model.validate();
  if (const std::string rule = packed_documents_rule(c); !rule.empty()) throw UsageError(rule);
  // Under mpirun every process parsed its own command line: refuse ranks that differ in an
  // option that changes the result or the schedule, within seconds and naming it.
  if (one_per_process) agree_on_options(world(), train_signature(c), "train");
  check_train_memory(c, ranks_on_this_machine(one_per_process, ranks), memory_limit());
  std::string& png = run.png = o.on("no-plot") ? "" : o.str("plot");
  if (o.on("no-plot") && o.given("plot"))
    throw UsageError("--plot and --no-plot contradict each other; give one");
  if (png.empty() && !o.on("no-plot") && !c.log_path.empty()) {
    png = c.log_path;
    const size_t dot = png.rfind('.');
    if (dot != std::string::npos && png.find('/', dot) == std::string::npos) png.resize(dot);
    png += ".png";
  }
  if (!one_per_process || world().rank() == 0)  // rank 0 writes them
    check_output_paths({{"save", c.save_path},
                        {"log", c.log_path},
                        {"plot", c.log_path.empty() ? "" : png},
                        {"dump-grads", c.dump_path}});
  run.quiet = o.on("quiet");
  return run;
}

// Trains on the run's ranks; rank 0 prints a line per step and the summary, and draws the
// loss curve.
int run_train(const TrainRun& run) {
  const TrainConfig& c = run.config;
  const bool quiet = run.quiet;
  const bool one_per_process = transport_traits(run.transport).one_rank_per_process;
  const bool tty = isatty(fileno(stderr));
  std::unique_ptr<Progress> bar;
  double sum_tps = 0;
  int64_t counted_steps = 0;
  StepRecord last;
  auto on_step = [&](const StepRecord& r) {
    last = r;
    if (r.step > 1 || counted_steps > 0) sum_tps += r.tokens_per_second, ++counted_steps;
    if (quiet) return;
    if (!bar) bar = std::make_unique<Progress>("train", c.steps);
    if (tty) std::fputs("\r\033[K", stderr);
    std::printf("step %5lld  loss %.4f  acc %.3f  lr %.2e  |g| %.3f  %.0f tok/s  peak %s/rank\n",
                (long long)r.step, r.loss, r.accuracy, r.lr, r.grad_norm, r.tokens_per_second,
                bytes_text(double(r.peak_bytes_max)).c_str());
    std::fflush(stdout);
    bar->set_done(r.step);
  };
  int64_t first_step = 1;
  auto body = [&](Communicator& comm) {
    const bool leader = comm.rank() == 0;
    const TrainResult result = train(comm, c, [&](const StepRecord& r) {
      if (leader) on_step(r);
    });
    if (leader) first_step = result.first_step;
  };
  if (!quiet)
    std::printf(
        "ctxpar train: T=%lld, %d ranks (dp %d x cp %d, %s, %s, %s), model %s, %s\n",
        (long long)c.seq, run.ranks, c.dp, c.cp, strategy_name(c.strategy), layout_name(c.layout),
        transport_name(run.transport), c.model.describe().c_str(),
        c.data_path.empty() ? "built-in copy task"
        : c.separator < 0
            ? c.data_path.c_str()
            : detail::concat(c.data_path, " (documents ended by byte ", c.separator, ")").c_str());
  LaunchOptions launch_options;
  launch_options.gloo = gloo_options(120);
  launch(run.transport, run.ranks, body, launch_options);
  const bool leader = !one_per_process || process_world(run.transport, 120).rank() == 0;
  if (bar) bar->finish();
  if (first_step > c.steps) {
    // Nothing was trained, so there is no loss to report and nothing new to save or plot.
    if (leader)
      std::printf(
          "ctxpar train: checkpoint %s is already at step %lld >= --steps %lld: nothing "
          "to train (raise --steps above %lld to continue)\n",
          c.resume_path.c_str(), (long long)(first_step - 1), (long long)c.steps,
          (long long)(first_step - 1));
    return 0;
  }
  if (leader && !quiet)
    std::printf(
        "done: final loss %.4f (log 256 = %.4f), long-range accuracy %.3f, %.0f tok/s "
        "mean (after step 1), peak %s/rank\n",
        last.loss, std::log(256.0), last.accuracy,
        counted_steps ? sum_tps / double(counted_steps) : last.tokens_per_second,
        bytes_text(double(last.peak_bytes_max)).c_str());
  if (leader && !run.png.empty() && !c.log_path.empty()) plot_loss(c.log_path, run.png);
  return 0;
}

int train_command(int argc, char** argv) {
  Options o = train_options();
  if (!o.parse(argc, argv)) return 0;
  if (!torchrun_job()) refuse_foreign_launcher("train");
  join_mpi_first(o.str("transport"));
  return run_train(train_from_options(o));
}

}  // namespace

}  // namespace ctxpar::cli
