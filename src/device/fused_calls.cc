// The block -> fused-call decomposition (fused_calls.h has the why and the invariants).
#include "device/fused_calls.h"

#include <algorithm>
#include <sstream>

#include "ctxpar/error.h"

namespace ctxpar::fused {
namespace {

using i128 = __int128;
// Stand-ins for "no bound": beyond any index difference of int64 positions.
constexpr i128 kNoLow = -(i128(1) << 100);
constexpr i128 kNoHigh = i128(1) << 100;

i128 floor_div(i128 x, i128 s) { return x >= 0 ? x / s : -((-x + s - 1) / s); }
i128 ceil_div(i128 x, i128 s) { return -floor_div(-x, s); }

// The call of query run `q` against key run `k` sharing stride s >= 1 (nothing when no pair
// is visible).
void add_band(const Run& q, const Run& k, int64_t s, const Mask& mask, std::vector<Call>& out) {
  const i128 delta = i128(q.first) - i128(k.first);
  // d = delta + s*(i - j) must lie in [dmin, dmax].
  i128 dmin = kNoLow, dmax = kNoHigh;
  if (mask.causal) dmin = 0;
  if (mask.window_right >= 0) dmin = std::max(dmin, -i128(mask.window_right));
  if (mask.window_left >= 0) dmax = i128(mask.window_left);
  const i128 e_lo = dmin == kNoLow ? kNoLow : ceil_div(dmin - delta, s);     // i - j >= e_lo
  const i128 e_hi = dmax == kNoHigh ? kNoHigh : floor_div(dmax - delta, s);  // i - j <= e_hi
  if (e_lo > e_hi) return;
  const i128 nq = q.size(), nk = k.size();
  // Row i sees keys [max(0, i - e_hi), min(nk - 1, i - e_lo)]: non-empty for i in [a, b).
  const i128 a = std::max<i128>(0, e_lo);
  const i128 b = std::min<i128>(nq - 1, nk - 1 + e_hi) + 1;
  if (a >= b) return;
  const i128 ka = std::max<i128>(0, a - e_hi);
  const i128 kb = std::min<i128>(nk - 1, b - 1 - e_lo) + 1;
  CTXPAR_CHECK(ka < kb, "fused decompose: empty key range for non-empty rows");
  Call c;
  c.q_begin = q.begin + static_cast<int64_t>(a);
  c.q_end = q.begin + static_cast<int64_t>(b);
  c.k_begin = k.begin + static_cast<int64_t>(ka);
  c.k_end = k.begin + static_cast<int64_t>(kb);
  // j <= i - e_lo binds where the first row's last key is inside the call's keys.
  c.has_upper = a - e_lo < kb - 1;
  if (c.has_upper) c.upper = static_cast<int64_t>(a - e_lo - ka);
  // j >= i - e_hi binds where the last row's first key is past the call's first key.
  c.has_lower = b - 1 - e_hi > ka;
  if (c.has_lower) c.lower = static_cast<int64_t>(e_hi - a + ka);
  out.push_back(c);
}

// A run of one token, for pairs whose strides differ.
Run token_run(const Run& r, int64_t t) {
  return Run{t, t + 1, static_cast<int64_t>(r.first + (t - r.begin) * r.stride), 0, r.document};
}

}  // namespace

std::vector<Run> split_runs(const Tokens& tokens, bool documents) {
  const int64_t n = static_cast<int64_t>(tokens.positions.size());
  CTXPAR_CHECK(!documents || static_cast<int64_t>(tokens.documents.size()) == n,
               "fused split_runs: ", tokens.documents.size(), " document ids for ", n, " tokens");
  std::vector<Run> runs;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = tokens.positions[t];
    if (pos == kPaddingPosition) continue;
    const int32_t doc = documents ? tokens.documents[t] : 0;
    if (!runs.empty()) {
      Run& r = runs.back();
      const i128 step = i128(pos) - i128(r.first);
      const bool adjacent = r.end == t && r.document == doc;
      if (adjacent && r.size() == 1 && step >= 1 && step <= i128(INT64_MAX)) {
        r.stride = static_cast<int64_t>(step);
        r.end = t + 1;
        continue;
      }
      if (adjacent && r.size() > 1 && step == i128(r.stride) * r.size()) {
        r.end = t + 1;
        continue;
      }
    }
    runs.push_back(Run{t, t + 1, pos, 0, doc});
  }
  return runs;
}

std::vector<Call> decompose(const Tokens& q_tokens, const Tokens& k_tokens, const Mask& mask) {
  CTXPAR_CHECK(!mask.sliced, "fused decompose: a slice mask (", mask.describe(),
               ") is not a union of bands per document; run it through the tile kernel");
  const std::vector<Run> qr = split_runs(q_tokens, mask.documents);
  const std::vector<Run> kr = split_runs(k_tokens, mask.documents);
  std::vector<Call> calls;
  for (const Run& q : qr) {
    for (const Run& k : kr) {
      if (mask.documents && q.document != k.document) continue;
      if (q.stride == 0 || k.stride == 0 || q.stride == k.stride) {
        add_band(q, k, std::max<int64_t>({q.stride, k.stride, 1}), mask, calls);
      } else {  // strides differ: each query token on its own (it pairs with any stride)
        for (int64_t t = q.begin; t < q.end; ++t)
          add_band(token_run(q, t), k, k.stride, mask, calls);
      }
    }
  }
  return calls;
}

std::string Call::describe() const {
  if (!has_upper && !has_lower) return "none";
  if (has_upper && !has_lower && upper == 0) return "causal top-left";
  if (has_upper && !has_lower && upper == keys() - rows()) return "causal bottom-right";
  std::ostringstream s;
  s << "band(upper=" << (has_upper ? std::to_string(upper) : "none")
    << ", lower=" << (has_lower ? std::to_string(lower) : "none") << ")";
  return s.str();
}

Mask Call::local_mask() const {
  Mask m;
  if (has_upper) m.window_right = upper;
  if (has_lower) m.window_left = lower;
  return m;
}

std::vector<std::vector<size_t>> batch_calls(const std::vector<Call>& calls) {
  std::vector<std::vector<size_t>> batches;
  std::vector<std::string> forms;
  for (size_t c = 0; c < calls.size(); ++c) {
    // Bottom-right alignment is relative to each sequence's own lengths, so it batches as a
    // form of its own; every other form carries its numbers.
    const std::string form = calls[c].describe();
    bool placed = false;
    for (size_t b = 0; b < batches.size() && !placed; ++b) {
      if (forms[b] != form) continue;
      const bool overlaps = std::any_of(batches[b].begin(), batches[b].end(), [&](size_t o) {
        return calls[o].q_begin < calls[c].q_end && calls[c].q_begin < calls[o].q_end;
      });
      if (!overlaps) {
        batches[b].push_back(c);
        placed = true;
      }
    }
    if (!placed) {
      batches.push_back({c});
      forms.push_back(form);
    }
  }
  return batches;
}

}  // namespace ctxpar::fused
