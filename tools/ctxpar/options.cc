#include "options.h"

#include "attention_job.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

namespace ctxpar::cli {

Options::Options(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

Options& Options::add(const std::string& name, const std::string& default_value,
                      const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{default_value, help, false};
  return *this;
}

Options& Options::flag(const std::string& name, const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{"", help, true};
  return *this;
}

Options& Options::example(const std::string& line) {
  examples_.push_back(line);
  return *this;
}

namespace {
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

bool Options::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (arg.rfind("--", 0) != 0)
      throw UsageError("unexpected argument '" + arg + "' (options start with --)");
    std::string name = arg.substr(2), value;
    size_t eq = name.find('=');
    bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    auto it = specs_.find(name);
    if (it == specs_.end()) {
      std::string best;
      size_t best_d = 1000;
      for (const auto& n : order_) {
        size_t d = edit_distance(name, n);
        if (d < best_d) best_d = d, best = n;
      }
      std::string hint = best_d <= 3 ? "; did you mean --" + best + "?" : "";
      throw UsageError("unknown option --" + name + hint);
    }
    if (it->second.is_flag) {
      if (has_value && value != "1" && value != "true")
        throw UsageError("--" + name + " is a flag and takes no value");
      values_[name] = "1";
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) throw UsageError("--" + name + " needs a value (" + it->second.help + ")");
      value = argv[++i];
    }
    values_[name] = value;
  }
  return true;
}

const Options::Spec& Options::spec(const std::string& name) const {
  auto it = specs_.find(name);
  CTXPAR_ASSERT(it != specs_.end(), "option --", name, " was never declared");
  return it->second;
}

bool Options::given(const std::string& name) const {
  spec(name);
  return values_.count(name) > 0;
}

bool Options::on(const std::string& name) const { return given(name) && values_.at(name) == "1"; }

std::string Options::str(const std::string& name) const {
  auto it = values_.find(name);
  return it != values_.end() ? it->second : spec(name).default_value;
}

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

namespace {

std::string range_text(const std::string& lo, const std::string& hi, const std::string& note) {
  return "[" + lo + ", " + hi + "]" + (note.empty() ? "" : " (" + note + ")");
}

// A finite number, or nothing when `text` is not one (NaN, infinite, out of double's range,
// or too close to 0 to be represented: strtod's ERANGE on underflow).
bool parse_finite(const std::string& text, double& value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  value = std::strtod(text.c_str(), &end);
  return *end == '\0' && errno != ERANGE && std::isfinite(value);
}

}  // namespace

bool parse_whole_number(const std::string& text, int64_t& value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || errno == ERANGE) return false;
  // 64K / 1M suffixes: sequence lengths are often written that way.
  long long scale = 1;
  if ((*end == 'K' || *end == 'k') && end[1] == '\0')
    scale = 1024, ++end;
  else if ((*end == 'M' || *end == 'm') && end[1] == '\0')
    scale = 1024 * 1024, ++end;
  if (*end != '\0' || __builtin_mul_overflow(v, scale, &v)) return false;
  value = v;
  return true;
}

int64_t whole_number_in(const std::string& option, const std::string& text, int64_t lo, int64_t hi,
                        const std::string& note) {
  const std::string range = range_text(std::to_string(lo), std::to_string(hi), note);
  int64_t v = 0;
  if (!parse_whole_number(text, v)) {
    // A whole number that does not fit in 64 bits is out of range, not malformed:
    // [+-]digits[K|M].
    const size_t i = (text[0] == '+' || text[0] == '-') ? 1 : 0;
    const size_t end = text.find_first_not_of("0123456789", i);
    const bool digits =
        end > i && i < text.size() &&
        (end == std::string::npos || (end + 1 == text.size() && std::strchr("KkMm", text[end])));
    throw UsageError("--" + option + (digits ? " must be in " : " expects a whole number in ") +
                     range + (digits ? "" : " (64K, 1M suffixes accepted)") + ", got '" + text +
                     "'");
  }
  if (v < lo || v > hi)
    throw UsageError("--" + option + " must be in " + range + ", got '" + text + "'");
  return v;
}

int64_t Options::i64(const std::string& name, int64_t lo, int64_t hi,
                     const std::string& note) const {
  return whole_number_in(name, str(name), lo, hi, note);
}

int Options::i32(const std::string& name, int lo, int hi, const std::string& note) const {
  return static_cast<int>(i64(name, lo, hi, note));
}

int64_t Options::i64(const std::string& name) const {
  return i64(name, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
}

double Options::num(const std::string& name, double lo, double hi, const std::string& note) const {
  const std::string s = str(name);
  double v = 0;
  if (!parse_finite(s, v) || v < lo || v > hi)
    throw UsageError("--" + name + " must be a number in " +
                     range_text(number_text(lo), number_text(hi), note) + ", got '" + s + "'");
  return v;
}

double Options::num(const std::string& name) const {
  return num(name, -std::numeric_limits<double>::max(), std::numeric_limits<double>::max());
}

double Options::num_or_zero(const std::string& name, double lo, double hi,
                            const std::string& note) const {
  const std::string s = str(name);
  double v = 0;
  if (!parse_finite(s, v) || (v != 0 && (v < lo || v > hi)))
    throw UsageError("--" + name + " must be 0 or a number in " +
                     range_text(number_text(lo), number_text(hi), note) + ", got '" + s + "'");
  return v;
}

std::vector<std::string> Options::list(const std::string& name) const {
  std::vector<std::string> out;
  std::stringstream ss(str(name));
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int64_t> Options::list_i64(const std::string& name) const {
  std::vector<int64_t> out;
  for (const auto& item : list(name)) {
    int64_t v = 0;
    if (!parse_whole_number(item, v))
      throw UsageError("--" + name +
                       " expects comma-separated whole numbers (each within 64 "
                       "bits), got '" +
                       item + "'");
    out.push_back(v);
  }
  return out;
}

std::string Options::help() const {
  std::ostringstream out;
  out << "usage: ctxpar " << command_ << " [options]\n\n" << summary_ << "\n\noptions:\n";
  for (const auto& n : order_) {
    const Spec& s = specs_.at(n);
    std::string left = "  --" + n + (s.is_flag ? "" : " VALUE");
    out << left;
    if (left.size() < 28)
      out << std::string(28 - left.size(), ' ');
    else
      out << "\n" << std::string(28, ' ');
    out << s.help;
    if (!s.is_flag && !s.default_value.empty()) out << " (default: " << s.default_value << ")";
    out << "\n";
  }
  out << "  --help                    this text\n";
  if (!examples_.empty()) {
    out << "\nexamples:\n";
    for (const auto& e : examples_) out << "  " << e << "\n";
  }
  return out.str();
}

Options& Options::add_device() {
  return add("device", "cpu",
             "cpu | sim (an asynchronous device simulated on the host: streams on worker threads, "
             "random delays, race checks; the same bits as cpu; threads transport only) | cuda "
             "(an NVIDIA GPU; refused in one line where none is found; docs/cuda.md)")
      .add("sim-seed", "1", "--device sim: seed of its random operation delays");
}

Options& Options::add_job_shape() {
  return add("heads", "8", "query heads Hq")
      .add("kv-heads", "0", "key/value heads Hkv (GQA: Hq % Hkv == 0; 0 = same as --heads)")
      .add("head-dim", "128", "head dimension D, 16..256")
      .add("batch", "1", "batch size B")
      .add("dtype", "fp32", "storage type of q, k, v, o, do: fp32 | bf16")
      .add("bf16-tier", "exact", kBf16TierHelp)
      .add("threads", "1", "OpenMP threads per rank (not given: OMP_NUM_THREADS when set)")
      .add("seed", "0", "seed of the random inputs")
      .add("repeats", "1", "timed repetitions; times are of the fastest");
}

void read_job_shape(const Options& o, AttentionJob& job) {
  job.heads = o.i64("heads", 1, kMaxHeads);
  job.kv_heads = o.i64("kv-heads", 0, kMaxHeads);
  job.head_dim = o.i64("head-dim", 16, 256);
  job.batch = o.i64("batch", 1, kMaxBatch);
  job.threads = threads_option(o);
  job.bf16_tier = bf16_tier_option(o);
  job.seed = static_cast<uint64_t>(o.i64("seed", 0, kMaxSeed));
  job.repeats = o.i32("repeats", 1, kMaxRepeats);
  job.ulysses_groups = ulysses_groups_from_env();
}

int ulysses_groups_from_env() {
  const char* env = std::getenv("CTXPAR_ULYSSES_GROUPS");
  if (!env || !*env) return 0;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(env, &end, 10);
  if (*end != '\0' || errno != 0 || n < 1 || n > kMaxUlyssesGroups)
    throw UsageError(detail::concat(
        "CTXPAR_ULYSSES_GROUPS must be an integer in [1, ", kMaxUlyssesGroups,
        "] (the most head groups Ulysses pipelines its all-to-alls over; 1 = none), got '", env,
        "'; unset it for the default (Ulysses 4, hybrid 1)"));
  return static_cast<int>(n);
}

int threads_option(const Options& o) {
  if (o.given("threads")) return o.i32("threads", 1, kMaxThreads);
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (!env || !*env) return 1;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (end == env || (*end != '\0' && *end != ',') || n < 1 || n > kMaxThreads)
    throw UsageError(std::string("OMP_NUM_THREADS='") + env + "' is not a thread count in [1, " +
                     std::to_string(kMaxThreads) + "]; unset it or give --threads N");
  return static_cast<int>(n);
}

const char* const kBf16TierHelp =
    "--dtype bf16: exact (every product of the stored bf16 values, P and dS fp32) | fast (P and "
    "dS rounded to bf16 before P V, dV, dK and dQ, as GPU flash attention; its own accuracy "
    "rule, docs/kernel.md \"bf16 tiers\"); with fp32 inputs the tier changes nothing";

Bf16Tier bf16_tier_option(const Options& o) {
  const std::string tier = o.str("bf16-tier");
  if (const std::optional<Bf16Tier> t = parse_bf16_tier(tier)) return *t;
  throw UsageError("--bf16-tier " + tier +
                   ": expected exact or fast (fast rounds P and dS to "
                   "bf16 as GPU flash attention does; it applies to --dtype bf16 only)");
}

const char* dtype_label(DType dtype, Bf16Tier tier) {
  return dtype == DType::bf16 && tier == Bf16Tier::fast ? "bf16 (fast tier)" : dtype_name(dtype);
}

}  // namespace ctxpar::cli
