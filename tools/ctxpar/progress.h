// Progress for long commands, and a clean Ctrl-C.
//
// Progress writes to stderr (stdout stays clean for tables and --json). On a terminal it
// redraws one line: label, bar, done/total, elapsed time, ETA and a note for the current
// item. When stderr is not a terminal (CI logs, pipes, files) it prints a plain line at most
// every few seconds, plus one at the end, so logs stay short.
//
//   install_interrupt_handler();
//   Progress bar("bench cp", rows.size());
//   for (auto& row : rows) {
//     if (interrupted()) break;          // keep what finished
//     bar.note(row.name());
//     run(row);
//     bar.advance();
//   }
//   bar.finish();
//
// Thread-safe: advance() may be called from several threads.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace ctxpar::cli {

// ---- Ctrl-C -----------------------------------------------------------------------------
// Installs a SIGINT handler that only sets a flag, so loops can stop after the current item
// and keep the results already finished. A second Ctrl-C restores the default action and
// kills the process at once (for a user who does not want to wait). Idempotent.
void install_interrupt_handler();
// True once SIGINT arrived after install_interrupt_handler().
bool interrupted();
// Forgets an earlier SIGINT (tests; a command that handled it and continues).
void clear_interrupt();

// ---- Progress bar -----------------------------------------------------------------------
struct ProgressOptions {
  enum class Mode { automatic, terminal, plain, quiet };
  Mode mode = Mode::automatic;     // automatic: terminal if `out` is a TTY, else plain
  double plain_interval_s = 5;     // plain mode: at most one line per this many seconds
  double redraw_interval_s = 0.1;  // terminal mode: at most this often
  int width = 0;                   // terminal columns; 0: ask the terminal ($COLUMNS, then 80)
};

class Progress {
 public:
  Progress(std::string label, int64_t total, FILE* out = stderr, ProgressOptions options = {});
  ~Progress();  // finish()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void advance(int64_t n = 1);
  // Items of unequal cost (a sweep's runs grow as T^2): give the total estimated work once and
  // each item's work as it finishes; the bar, percentage and ETA then follow the work, the
  // done/total figures still count items.
  void set_work(double total_work);
  void advance_work(double work, int64_t n = 1);
  void set_done(int64_t done);
  void set_total(int64_t total);
  // Short text shown after the figures (e.g. the item being run); kept until replaced.
  void note(const std::string& text);
  // Prints a whole line of its own (a note, a warning) without garbling the bar: on a terminal
  // the bar is cleared, the line printed, and the bar drawn again below it.
  void print(const std::string& text);
  // Prints the final state (also when interrupted) and ends the line; later calls do nothing.
  void finish();

  int64_t done() const;
  int64_t total() const;
  bool terminal() const { return mode_ == ProgressOptions::Mode::terminal; }
  // The line as it would be printed now (without the terminal control characters).
  std::string line() const;

  // "0:07", "12:03", "1:02:03" — shared with the tables that print durations.
  static std::string format_duration(double seconds);

 private:
  using Clock = std::chrono::steady_clock;
  void maybe_print_locked(bool force);
  std::string line_locked(int width) const;
  double elapsed_locked() const;

  std::string label_;
  FILE* out_;
  ProgressOptions options_;
  ProgressOptions::Mode mode_;
  int width_ = 80;
  mutable std::mutex mu_;
  int64_t done_ = 0, total_ = 0;
  double work_total_ = 0, work_done_ = 0;
  std::string note_;
  Clock::time_point start_, last_print_;
  bool printed_ = false, finished_ = false;
};

}  // namespace ctxpar::cli
