// --out DIR of `ctxpar attention`: the result files (out, lse and, with the backward, dq, dk,
// dv) are one set. Written file by file, a kill left a mix of new and old files (and a run
// without the backward left the old gradients beside the new output). So the set is written
// into a fresh folder beside DIR and put in DIR's place in one rename: a reader, a crash or a
// kill sees the old set or the new one, never a mix. See docs/cli.md, "Your own tensors".
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/tensor.h"

namespace ctxpar::cli {

// The file that marks a folder as ctxpar's output, so that the next run may replace it.
inline constexpr const char* kOutMarker = ".ctxpar-out";

class OutFolder {
 public:
  // Before any computing: DIR must be absent, an empty folder, or a previous ctxpar output
  // (it holds kOutMarker) — any other folder is refused, as replacing it would delete files
  // ctxpar did not write; and its parent (created if missing) must take a new folder.
  // DIR given as a symbolic link to a folder stands for that folder (the link stays); a link
  // to nothing is refused. Removes the hidden folders that killed runs left beside DIR
  // (of this host, this user, a dead pid). Throws UsageError naming the problem.
  explicit OutFolder(std::string dir);

  // Writes the files (name, tensor) and the marker into a new folder beside DIR, syncs them to
  // disk, and swaps it with DIR in one rename (renameat2 RENAME_EXCHANGE; on a filesystem
  // without it, DIR is moved aside first, a moment in which DIR is absent). Then deletes the
  // old set. Throws ctxpar::Error (a run-time failure) when a write fails; DIR is then as it
  // was.
  void replace_with(const std::vector<std::pair<std::string, TensorView>>& files) const;

 private:
  std::string dir_, parent_;
};

}  // namespace ctxpar::cli
