// How ctxpar makes every file it writes (write_file_atomic for .npy, safetensors checkpoints
// and results; the --log of `ctxpar train` and its --plot): a temporary created exclusively
// beside the target (mkstemp: never an existing file, never through a planted link), renamed
// over the target when done. A link at the target's name is replaced, its target untouched.
// Before a run, output_path_problem says what would stop the write, so a command can refuse
// a bad path before computing instead of after.
#pragma once
#include <string>

namespace ctxpar {

// The empty string when `path` can be written; otherwise what is wrong, as the rest of a
// sentence that starts with the path ("is a symbolic link; ...", "its folder ... does not
// exist; ..."). Refused: an existing target that is not a regular file (a symbolic link, a
// folder, a device such as /dev/null, a FIFO), a missing folder, a folder where no file can be
// created (checked by creating one and removing it: access() says yes to root on a read-only
// filesystem).
std::string output_path_problem(const std::string& path);

// Creates "<path>.tmp.XXXXXX" exclusively (mkstemp) and returns its descriptor, its name in
// *temp; -1 with errno set when it cannot.
int open_temp_beside(const std::string& path, std::string* temp);

// mkstemp makes 0600: gives the temporary behind `fd` the mode a file the user creates gets
// (0666 less the umask).
void match_umask(int fd);

}  // namespace ctxpar
