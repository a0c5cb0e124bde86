// A user's own tensors: NumPy writes q, k, v, dO (PyTorch's [B, H, T, D] order), ctxpar runs
// them sharded over 4 ranks with the zigzag ring and writes out, lse, dq, dk, dv; NumPy then
// computes the same attention in float64 (and in naive float32, for the tolerance rule) and
// compares. Needs /usr/bin/python3 with numpy.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cli/cli_support.h"

namespace ctxpar::test {
namespace {

// argv: dir, then "write" or "compare". Causal GQA attention, [B, H, T, D].
const char* kScript = R"PY(
import sys, numpy as np
d, mode = sys.argv[1], sys.argv[2]
B, H, HKV, T, D = 2, 4, 2, 64, 16
if mode == "write":
    rng = np.random.default_rng(7)
    for name, h in (("q", H), ("k", HKV), ("v", HKV), ("do", H)):
        np.save(f"{d}/{name}.npy", rng.standard_normal((B, h, T, D)).astype(np.float32))
    np.save(f"{d}/docs.npy", np.array([0] * 40 + [1] * 24, dtype=np.int64))
    sys.exit(0)
def attention(dt):
    q, k, v, do = (np.load(f"{d}/{n}.npy").astype(dt) for n in ("q", "k", "v", "do"))
    docs = np.load(f"{d}/docs.npy")
    k = np.repeat(k, H // HKV, axis=1); v = np.repeat(v, H // HKV, axis=1)
    scale = dt(1 / np.sqrt(D))
    i = np.arange(T)
    visible = (i[None, :] <= i[:, None]) & (docs[None, :] == docs[:, None])
    s = np.where(visible, q @ k.transpose(0, 1, 3, 2) * scale, -np.inf).astype(dt)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m); l = p.sum(-1, keepdims=True); p /= l
    o = p @ v
    lse = (m + np.log(l))[..., 0]
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    dq = ds @ k * scale
    dk = ds.transpose(0, 1, 3, 2) @ q * scale
    g = H // HKV
    dk = dk.reshape(B, HKV, g, T, D).sum(2); dv = dv.reshape(B, HKV, g, T, D).sum(2)
    return dict(out=o, lse=lse, dq=dq, dk=dk, dv=dv)
# The kernel tests' rule: max|ctxpar - fp64| <= 2 * max|naive fp32 - fp64| + 1e-5 * max(1, |fp64|),
# where naive fp32 is this same computation in float32 (a fixed limit would hold on one CPU only).
ref, naive = attention(np.float64), attention(np.float32)
ok = True
for name in ("out", "lse", "dq", "dk", "dv"):
    got = np.load(f"{d}/out/{name}.npy")
    assert got.shape == ref[name].shape, (name, got.shape, ref[name].shape)
    err = np.abs(got - ref[name]).max()
    bound = 2 * np.abs(naive[name] - ref[name]).max() + 1e-5 * max(1.0, np.abs(ref[name]).max())
    print(name, "error", err, "bound", bound)
    ok = ok and err <= bound
sys.exit(0 if ok else 1)
)PY";

TEST(CliAttentionNpy, ShardedRunOfUserTensorsMatchesNumpy) {
  if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3";
  const std::string dir = temp_dir("npy");
  std::ofstream(dir + "/ref.py") << kScript;
  CommandResult w = run_shell("/usr/bin/python3 " + dir + "/ref.py " + dir + " write");
  if (w.exit_code != 0 && w.err.find("numpy") != std::string::npos)
    GTEST_SKIP() << "python3-numpy missing: " << w.err;
  ASSERT_EQ(w.exit_code, 0) << w.err;

  CommandResult r = run_ctxpar("attention --q " + dir + "/q.npy --k " + dir + "/k.npy --v " + dir +
                               "/v.npy --do " + dir + "/do.npy --documents " + dir +
                               "/docs.npy --layout-in bhtd --mask causal --ranks 4 --layout "
                               "zigzag --strategy ring --out " +
                               dir + "/out");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  for (const char* f : {"out.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"})
    EXPECT_TRUE(std::filesystem::exists(dir + "/out/" + f)) << f;
  // Files are written whole or not at all: no temporary names left behind (the marker that
  // lets the next run replace the folder is the one other file).
  for (const auto& e : std::filesystem::directory_iterator(dir + "/out"))
    EXPECT_TRUE(e.path().extension() == ".npy" || e.path().filename() == ".ctxpar-out") << e.path();

  CommandResult c = run_shell("/usr/bin/python3 " + dir + "/ref.py " + dir + " compare");
  EXPECT_EQ(c.exit_code, 0) << "max |ctxpar - numpy fp64| per output against its bound:\n"
                            << c.out << c.err;
  std::filesystem::remove_all(dir);
}

// One query row near FLT_MAX: its fp32 scores overflow (inf - inf = NaN in the softmax) while
// every input is finite. Without --check the run said nothing and exited 0 (the row came out
// as if masked, or its LSE inf and its output off by 4); with --check it said "check: FAILED".
// Now the run itself fails, exit 1 (a run-time failure: the files are well formed; the scores
// they give do not fit fp32), naming the global token and head, with or without --check.
TEST(CliAttentionNpy, OverflowingScoresFailNamingTokenAndHead) {
  if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3";
  const std::string dir = temp_dir("nan");
  CommandResult w = run_shell(
      "/usr/bin/python3 -c \"import numpy as np; r = np.random.default_rng(1); "
      "[np.save('" +
      dir +
      "/' + n + '.npy', r.standard_normal((1, 32, 2, 16)).astype(np.float32)) "
      "for n in 'kv']; q = r.standard_normal((1, 32, 2, 16)).astype(np.float32); "
      "q[0, 5, 1, :] = 3e38; q[0, 5, 1, ::2] = -3e38; np.save('" +
      dir + "/q.npy', q)\"");
  if (w.exit_code != 0) GTEST_SKIP() << "numpy unavailable: " << w.err;
  for (const char* extra : {"", " --check", " --strategy ulysses --layout contiguous"}) {
    CommandResult r = run_ctxpar("attention --q " + dir + "/q.npy --k " + dir + "/k.npy --v " +
                                 dir + "/v.npy --ranks 2" + extra);
    EXPECT_EQ(r.exit_code, 1) << extra << ": " << r.err << r.out;
    EXPECT_NE(r.err.find("forward: non-finite output"), std::string::npos)
        << extra << ": " << r.err;
    EXPECT_NE(r.err.find("at token position 5, batch 0, head 1"), std::string::npos)
        << extra << ": " << r.err;
    EXPECT_NE(r.err.find("beyond the fp32 range"), std::string::npos) << r.err;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ctxpar::test
