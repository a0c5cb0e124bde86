#include "progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>

namespace ctxpar::cli {

// ---- Ctrl-C -----------------------------------------------------------------------------
namespace {
// A lock-free atomic is async-signal-safe; anything more (printing, allocating) is not, so
// the handler does only this.
std::atomic<bool> g_interrupted{false};
std::atomic<bool> g_installed{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_sigint(int) {
  if (g_interrupted.exchange(true)) {
    // Second Ctrl-C: the user does not want to wait for the current item.
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
  }
  static const char kMsg[] =
      "\ninterrupted: stopping after the current item (Ctrl-C again to abort)\n";
  ssize_t ignored = write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
  (void)ignored;
}
}  // namespace

void install_interrupt_handler() {
  if (g_installed.exchange(true)) return;
  struct sigaction sa = {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking reads and waits continue; loops poll interrupted()
  sigaction(SIGINT, &sa, nullptr);
}

bool interrupted() { return g_interrupted.load(std::memory_order_relaxed); }
void clear_interrupt() { g_interrupted.store(false); }

// ---- Progress bar -----------------------------------------------------------------------
namespace {
int terminal_width(FILE* out) {
  struct winsize ws = {};
  if (ioctl(fileno(out), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    int w = std::atoi(c);
    if (w > 0) return w;
  }
  return 80;
}
}  // namespace

std::string Progress::format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e8) return "--:--";
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  return buf;
}

Progress::Progress(std::string label, int64_t total, FILE* out, ProgressOptions options)
    : label_(std::move(label)), out_(out), options_(options), total_(std::max<int64_t>(total, 0)) {
  mode_ = options.mode;
  if (mode_ == ProgressOptions::Mode::automatic)
    mode_ = out_ && isatty(fileno(out_)) ? ProgressOptions::Mode::terminal
                                         : ProgressOptions::Mode::plain;
  if (!out_) mode_ = ProgressOptions::Mode::quiet;
  width_ = options.width > 0                          ? options.width
           : mode_ == ProgressOptions::Mode::terminal ? terminal_width(out_)
                                                      : 100;
  start_ = last_print_ = Clock::now();
}

Progress::~Progress() { finish(); }

double Progress::elapsed_locked() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

void Progress::advance(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ += n;
  maybe_print_locked(false);
}

void Progress::set_work(double total_work) {
  std::lock_guard<std::mutex> lock(mu_);
  work_total_ = total_work > 0 ? total_work : 0;
}

void Progress::advance_work(double work, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  work_done_ += work > 0 ? work : 0;
  done_ += n;
  maybe_print_locked(false);
}

void Progress::set_done(int64_t done) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ = done;
  maybe_print_locked(false);
}

void Progress::set_total(int64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  total_ = std::max<int64_t>(total, 0);
  maybe_print_locked(false);
}

void Progress::note(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  note_ = text;
  // A new item starting is worth showing at once on a terminal; plain logs stay throttled.
  maybe_print_locked(false);
}

int64_t Progress::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

int64_t Progress::total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

std::string Progress::line() const {
  std::lock_guard<std::mutex> lock(mu_);
  return line_locked(width_);
}

std::string Progress::line_locked(int width) const {
  const double elapsed = elapsed_locked();
  const int64_t done = std::min(done_, total_ > 0 ? total_ : done_);
  // ETA from the mean time per finished unit: of work when the caller has a cost model
  // (set_work), else of items.
  const bool by_work = work_total_ > 0;
  double frac = by_work      ? work_done_ / work_total_
                : total_ > 0 ? static_cast<double>(done) / static_cast<double>(total_)
                             : 0;
  frac = std::clamp(frac, 0.0, 1.0);
  std::string eta = "--:--";
  if (done >= total_ && total_ > 0)
    eta = "0:00";
  else if (frac > 0)
    eta = format_duration(elapsed / frac * (1 - frac));
  char figures[160];
  std::snprintf(figures, sizeof figures, "%lld/%lld %3d%%  elapsed %s  eta %s",
                static_cast<long long>(done), static_cast<long long>(total_),
                static_cast<int>(frac * 100), format_duration(elapsed).c_str(), eta.c_str());
  std::string line = label_;
  line += ' ';
  if (mode_ == ProgressOptions::Mode::terminal) {
    // The bar takes what the figures and the note leave of the line: 10 to 30 cells.
    const int rest = static_cast<int>(label_.size() + std::strlen(figures) + note_.size()) + 7;
    int cells = std::clamp(width - 1 - rest, 10, 30);
    int filled = static_cast<int>(frac * cells);
    line += '[';
    line.append(filled, '#');
    line.append(cells - filled, '.');
    line += "] ";
  } else {
    line.back() = ':';
    line += ' ';
  }
  line += figures;
  if (!note_.empty()) {
    line += "  ";
    line += note_;
  }
  // Never wrap on a terminal: a wrapped line cannot be redrawn with a carriage return.
  if (mode_ == ProgressOptions::Mode::terminal && width > 1 &&
      line.size() >= static_cast<size_t>(width))
    line.resize(width - 1);
  return line;
}

void Progress::maybe_print_locked(bool force) {
  if (finished_ || mode_ == ProgressOptions::Mode::quiet) return;
  const auto now = Clock::now();
  const double since = std::chrono::duration<double>(now - last_print_).count();
  if (mode_ == ProgressOptions::Mode::terminal) {
    if (!force && printed_ && since < options_.redraw_interval_s) return;
    // \r returns to column 0, \x1b[K clears what a longer previous line left behind.
    std::fprintf(out_, "\r%s\x1b[K", line_locked(width_).c_str());
  } else {
    // The first plain line also waits an interval: a command that ends quickly prints only
    // its final line.
    if (!force && since < options_.plain_interval_s) return;
    std::fprintf(out_, "%s\n", line_locked(width_).c_str());
  }
  std::fflush(out_);
  printed_ = true;
  last_print_ = now;
}

void Progress::print(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!out_) return;
  const bool redraw = mode_ == ProgressOptions::Mode::terminal && printed_ && !finished_;
  if (redraw) std::fputs("\r\x1b[K", out_);
  std::fprintf(out_, "%s\n", text.c_str());
  if (redraw) std::fprintf(out_, "%s", line_locked(width_).c_str());
  std::fflush(out_);
}

void Progress::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  note_.clear();  // the last item's name would read as still running
  if (mode_ != ProgressOptions::Mode::quiet) {
    maybe_print_locked(true);
    if (mode_ == ProgressOptions::Mode::terminal) std::fputc('\n', out_);
    std::fflush(out_);
  }
  finished_ = true;
}

}  // namespace ctxpar::cli
