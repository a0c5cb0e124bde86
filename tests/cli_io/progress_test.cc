// The progress bar and the Ctrl-C flag (tools/ctxpar/progress.h).
#include "progress.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <string>

namespace ctxpar::cli {
namespace {

std::string read_all(FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}

TEST(Progress, PlainModePrintsWholeLinesWithCountsAndFinalLine) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressOptions o;
    o.mode = ProgressOptions::Mode::plain;
    o.plain_interval_s = 0;  // every update prints, so the test sees each one
    Progress p("sweep", 4, f, o);
    EXPECT_FALSE(p.terminal());
    p.note("ring zigzag T=4096");
    p.advance();
    p.advance(2);
  }  // destructor finishes
  std::string s = read_all(f);
  std::fclose(f);
  EXPECT_EQ(s.find('\r'), std::string::npos) << "plain logs must not contain carriage returns";
  EXPECT_EQ(s.find("\x1b"), std::string::npos) << "plain logs must not contain escapes";
  EXPECT_NE(s.find("sweep: 1/4  25%"), std::string::npos) << s;
  EXPECT_NE(s.find("3/4  75%"), std::string::npos) << s;
  EXPECT_NE(s.find("ring zigzag T=4096"), std::string::npos) << s;
  EXPECT_NE(s.find("elapsed 0:00"), std::string::npos) << s;
  EXPECT_EQ(s.back(), '\n');
}

TEST(Progress, PlainModeIsThrottled) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressOptions o;
    o.mode = ProgressOptions::Mode::plain;
    o.plain_interval_s = 3600;
    Progress p("loop", 1000, f, o);
    for (int i = 0; i < 1000; ++i) p.advance();
  }
  std::string s = read_all(f);
  std::fclose(f);
  // Only the final line: 1000 updates within the interval print nothing until finish().
  EXPECT_EQ(std::count(s.begin(), s.end(), '\n'), 1) << s;
  EXPECT_NE(s.find("1000/1000 100%"), std::string::npos) << s;
}

TEST(Progress, TerminalModeRedrawsOneLineWithinWidth) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressOptions o;
    o.mode = ProgressOptions::Mode::terminal;
    o.redraw_interval_s = 0;
    o.width = 60;
    Progress p("bench cp", 10, f, o);
    EXPECT_TRUE(p.terminal());
    p.set_done(5);
    // The bar: 10 to 30 cells, half of them filled at 5/10.
    auto bar_of = [](const std::string& line) {
      size_t a = line.find('['), b = line.find(']');
      return a != std::string::npos && b != std::string::npos ? line.substr(a + 1, b - a - 1) : "";
    };
    std::string bar = bar_of(p.line());
    EXPECT_GE(bar.size(), 10u) << p.line();
    EXPECT_LE(bar.size(), 30u) << p.line();
    EXPECT_EQ(static_cast<size_t>(std::count(bar.begin(), bar.end(), '#')), bar.size() / 2) << bar;
    p.note(std::string(200, 'x'));  // a long note must be cut, not wrapped
    std::string line = p.line();
    EXPECT_LT(line.size(), 60u);
    EXPECT_EQ(bar_of(line), "#####.....") << line;
    EXPECT_NE(line.find("5/10  50%"), std::string::npos) << line;
  }
  std::string s = read_all(f);
  std::fclose(f);
  EXPECT_NE(s.find('\r'), std::string::npos);
  EXPECT_NE(s.find("\x1b[K"), std::string::npos);
  EXPECT_EQ(std::count(s.begin(), s.end(), '\n'), 1) << "one line, ended once at finish";
}

TEST(Progress, EtaFromMeanTimePerItem) {
  EXPECT_EQ(Progress::format_duration(0), "0:00");
  EXPECT_EQ(Progress::format_duration(7.4), "0:07");
  EXPECT_EQ(Progress::format_duration(723), "12:03");
  EXPECT_EQ(Progress::format_duration(3723), "1:02:03");
  EXPECT_EQ(Progress::format_duration(-1), "--:--");
  ProgressOptions o;
  o.mode = ProgressOptions::Mode::quiet;
  Progress p("x", 4, nullptr, o);
  EXPECT_NE(p.line().find("eta --:--"), std::string::npos) << "no ETA before the first item";
}

TEST(Progress, EtaFollowsWorkWhenItemsDiffer) {
  ProgressOptions o;
  o.mode = ProgressOptions::Mode::quiet;
  Progress p("x", 3, nullptr, o);
  p.set_work(100);
  p.advance_work(10);  // the cheap first item: 1/3 of the items, a tenth of the work
  std::string line = p.line();
  EXPECT_NE(line.find("1/3  10%"), std::string::npos) << line;
  p.advance_work(90, 2);
  EXPECT_NE(p.line().find("3/3 100%"), std::string::npos) << p.line();
  EXPECT_NE(p.line().find("eta 0:00"), std::string::npos) << p.line();
}

TEST(Interrupt, SigintSetsTheFlagInsteadOfKilling) {
  install_interrupt_handler();
  clear_interrupt();
  EXPECT_FALSE(interrupted());
  std::raise(SIGINT);
  EXPECT_TRUE(interrupted());
  clear_interrupt();
  EXPECT_FALSE(interrupted());
}

}  // namespace
}  // namespace ctxpar::cli
