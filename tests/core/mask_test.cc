#include "ctxpar/mask.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/error.h"

namespace ctxpar {
namespace {

TEST(Mask, Parse) {
  EXPECT_FALSE(parse_mask("none").any());
  EXPECT_TRUE(parse_mask("causal").causal);
  Mask w = parse_mask("causal+window:128,0");
  EXPECT_TRUE(w.causal);
  EXPECT_EQ(w.window_left, 128);
  EXPECT_EQ(w.window_right, 0);
  EXPECT_TRUE(parse_mask("documents:3,5").documents);
  EXPECT_EQ(parse_mask("causal+documents").describe(), "causal+documents");
  EXPECT_THROW(parse_mask("casual"), Error);
  EXPECT_THROW(parse_mask("window:12"), Error);
  EXPECT_THROW(parse_mask("window:a,b"), Error);
}

// The grammar is strict: any rule starting with "documents" was taken
// ("documentsXYZ"), a second documents rule was ignored, strtoll took leading spaces and '+'
// and clamped out-of-range numbers to INT64_MAX without a word. Each is refused naming the
// part and showing the grammar.
TEST(Mask, StrictGrammar) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"documentsXYZ", "unknown mask 'documentsXYZ'"},
      {"causal+documentsXYZ", "unknown mask 'documentsXYZ'"},
      {"documents:", "document length ''"},
      {"documents:512,,512", "document length ''"},
      {"documents:4+documents:8", "'documents' is given twice"},
      {"documents+documents:8", "'documents' is given twice"},
      {"causal+causal", "'causal' is given twice"},
      {"window:1,1+window:2,2", "'window' is given twice"},
      {" causal", "unknown mask ' causal'"},
      {"documents: 512", "document length ' 512'"},
      {"documents:+512", "document length ''"},  // '+' joins rules: "documents:" and "512"
      {"documents:0", "document length '0'"},
      {"documents:-5", "document length '-5'"},
      {"documents:9223372036854775808",
       "document length '9223372036854775808' is not a whole "
       "number in [1, 9223372036854775807]"},
      {"window: 5,0", "window bound ' 5'"},
      {"window:+5,0", "window needs two bounds"},  // "window:" and "5,0"
      {"window:5,0x", "window bound '0x'"},
      {"window:-2,0", "window bound '-2'"},
      {"window:5,99999999999999999999", "window bound '99999999999999999999'"},
      {"window:-,0", "window bound '-'"},
  };
  for (const auto& [text, what] : bad) {
    try {
      parse_mask(text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(what), std::string::npos) << text << ": " << m;
      EXPECT_NE(m.find("the grammar is RULE or RULE+RULE+..."), std::string::npos) << m;
    }
    EXPECT_THROW(parse_document_lengths(text), Error) << text;
  }
  // What was accepted stays accepted, with the same meaning.
  EXPECT_EQ(parse_mask("none+causal+window:-1,0+documents:3,5").describe(),
            "causal+window:-1,0+documents");
  EXPECT_EQ(parse_document_lengths("causal+documents:3,5"), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(parse_document_lengths("documents:9223372036854775807,1"),
            (std::vector<int64_t>{INT64_MAX, 1}));
  EXPECT_TRUE(parse_document_lengths("causal+documents").empty());
  EXPECT_TRUE(parse_document_lengths("causal").empty());
  EXPECT_EQ(parse_mask("window:9223372036854775807,-1").window_left, INT64_MAX);
}

TEST(Mask, VisibleRules) {
  Mask c = Mask::causal_mask();
  EXPECT_TRUE(c.visible(5, 5));
  EXPECT_TRUE(c.visible(5, 0));
  EXPECT_FALSE(c.visible(5, 6));
  Mask w = parse_mask("window:2,1");
  EXPECT_TRUE(w.visible(10, 8));
  EXPECT_FALSE(w.visible(10, 7));
  EXPECT_TRUE(w.visible(10, 11));
  EXPECT_FALSE(w.visible(10, 12));
  Mask d = parse_mask("documents");
  EXPECT_TRUE(d.visible(0, 100, 3, 3));
  EXPECT_FALSE(d.visible(0, 1, 3, 4));
}

// Tile verdicts must agree with the element rule by brute force: a "masked" tile has no visible
// pair, a "full" tile has no hidden pair. (Independent check of the skip logic the kernel uses.)
TEST(Mask, TileVerdictsAgreeWithElements) {
  const Mask masks[] = {parse_mask("none"),       parse_mask("causal"),
                        parse_mask("window:3,2"), parse_mask("causal+window:4,0"),
                        parse_mask("documents"),  parse_mask("causal+documents")};
  int checked = 0;
  for (const Mask& m : masks)
    for (int qlo = 0; qlo < 12; qlo += 3)
      for (int qn = 1; qn <= 4; ++qn)
        for (int klo = 0; klo < 12; klo += 2)
          for (int kn = 1; kn <= 4; ++kn)
            for (int doc_split = 0; doc_split < 3; ++doc_split) {
              // document id of a position: changes at position 6 (split 1) or never (0, 2).
              auto doc = [&](int p) { return doc_split == 1 ? (p >= 6 ? 1 : 0) : doc_split; };
              int qhi = qlo + qn - 1, khi = klo + kn - 1;
              bool any = false, all = true;
              for (int q = qlo; q <= qhi; ++q)
                for (int k = klo; k <= khi; ++k) {
                  bool v = m.visible(q, k, doc(q), doc(k));
                  any |= v;
                  all &= v;
                }
              if (m.tile_masked(qlo, qhi, klo, khi, doc(qlo), doc(qhi), doc(klo), doc(khi))) {
                EXPECT_FALSE(any) << m.describe() << " q[" << qlo << "," << qhi << "] k[" << klo
                                  << "," << khi << "]";
              }
              if (m.tile_full(qlo, qhi, klo, khi, doc(qlo), doc(qhi), doc(klo), doc(khi))) {
                EXPECT_TRUE(all) << m.describe();
              }
              ++checked;
            }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace ctxpar

namespace ctxpar {
namespace {

std::string error_of(const std::string& text) {
  try {
    parse_mask(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::FILE* f = std::fopen(path.c_str(), "w");
  std::fputs(text.c_str(), f);
  std::fclose(f);
  return path;
}

TEST(MaskSlices, PrefixTreeIsItsSlices) {
  const Mask m = parse_mask("prefix-tree:4,2,3");
  ASSERT_TRUE(m.sliced);
  EXPECT_EQ(mask_length_total("prefix-tree:4,2,3"), 9);
  // By the definition: prompt causal; each response sees the whole prompt and itself causally.
  auto seen = [](int64_t q, int64_t k) {
    const int64_t part_q = q < 4 ? 0 : q < 6 ? 1 : 2, part_k = k < 4 ? 0 : k < 6 ? 1 : 2;
    if (part_k == 0) return part_q == 0 ? k <= q : true;
    return part_q == part_k && k <= q;
  };
  for (int64_t q = 0; q < 9; ++q)
    for (int64_t k = 0; k < 9; ++k) EXPECT_EQ(m.visible(q, k), seen(q, k)) << q << "," << k;
}

TEST(MaskSlices, SliceFileIsReadAndCheckedAndDescribedByItsContent) {
  const std::string ok = write_file(
      "ok.json",
      R"([{"q": [0, 8], "k": [0, 8], "type": "causal"}, {"q": [8, 16], "k": [0, 4], "type": "full"}])");
  const Mask m = parse_mask("slices:" + ok);
  ASSERT_EQ(m.slice_list().size(), 2u);
  EXPECT_TRUE(m.visible(9, 3));
  EXPECT_FALSE(m.visible(9, 4));
  EXPECT_FALSE(m.visible(3, 4));
  const std::string other = write_file(
      "other.json",
      R"([{"q": [0, 8], "k": [0, 8], "type": "causal"}, {"q": [8, 16], "k": [0, 5], "type": "full"}])");
  EXPECT_NE(m.describe(), parse_mask("slices:" + other).describe());  // agreement sees the content
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"[]", "non-empty list of slices"},
      {R"([{"q": [0, 8], "k": [0, 8]}])", "\"type\": \"full\" or \"causal\""},
      {R"([{"q": [0, 8], "k": [0, 8], "type": "diagonal"}])", "\"type\": \"full\" or \"causal\""},
      {R"([{"q": [8, 8], "k": [0, 8], "type": "full"}])", "not two non-empty ranges"},
      {R"([{"q": [-1, 8], "k": [0, 8], "type": "full"}])", "not two non-empty ranges"},
      {R"([{"q": [0, 8], "k": [0, 8], "type": "full", "w": 1}])", "unknown field \"w\""},
      {R"([{"q": [0], "k": [0, 8], "type": "full"}])", "needs \"q\": [start, end]"},
      {R"([{"q": [0, 8], "k": [0, 8], "type": "full")", "malformed"},
  };
  for (const auto& [text, what] : bad) {
    const std::string e = error_of("slices:" + write_file("bad.json", text));
    EXPECT_NE(e.find(what), std::string::npos) << text << " -> " << e;
  }
  EXPECT_NE(error_of("slices:/nonexistent/m.json").find("cannot open the slice file"),
            std::string::npos);
  EXPECT_NE(error_of("prefix-tree:8").find("a prompt and at least one response"),
            std::string::npos);
  EXPECT_NE(error_of("prefix-tree:8,0").find("prefix-tree length '0'"), std::string::npos);
  EXPECT_NE(error_of("prefix-tree:4,4+slices:" + ok).find("given twice"), std::string::npos);
  // describe() prints the list as a digest (reports, agreement); fed back, it is refused by name.
  const std::string printed = parse_mask("causal+prefix-tree:4,2,2").describe();
  ASSERT_EQ(printed.rfind("causal+slices:5@", 0), 0u) << printed;
  EXPECT_NE(error_of(printed).find("is the digest a report prints"), std::string::npos);
}

}  // namespace
}  // namespace ctxpar
