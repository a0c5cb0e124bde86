#include "out_folder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "ctxpar/npy.h"
#include "options.h"

namespace ctxpar::cli {
namespace {

namespace fs = std::filesystem;

// Absent, empty, or holding the marker. Throws UsageError otherwise.
void check_replaceable(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (!fs::exists(st)) return;
  if (!fs::is_directory(fs::status(dir, ec)))
    throw UsageError("--out " + dir + " is a file, not a folder; give a folder for the results");
  if (fs::exists(fs::path(dir) / kOutMarker)) return;
  fs::directory_iterator it(dir, ec);
  if (ec) throw UsageError("--out " + dir + ": cannot list the folder: " + ec.message());
  if (it != fs::directory_iterator())
    throw UsageError("--out " + dir + " holds files that ctxpar did not write (no " + kOutMarker +
                     " in it); the results replace the whole folder, so give a new or empty "
                     "folder");
}

std::string this_host() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) return "unknown";
  return host;
}

// The hidden folders a run makes beside DIR: ".<name>.ctxpar-new.<pid>-<host>.XXXXXX" (and
// "....old" while the old set is moved aside). The pid and host say whose it is, so that a
// later run can tell one left by a killed run from one a running ctxpar is filling.
std::string temp_prefix(const std::string& name) { return "." + name + ".ctxpar-new."; }

std::string new_folder_beside(const std::string& parent, const std::string& name) {
  std::string tmpl = (fs::path(parent) / (temp_prefix(name) + std::to_string(getpid()) + "-" +
                                          this_host() + ".XXXXXX"))
                         .string();
  if (!mkdtemp(tmpl.data()))
    throw Error("--out: cannot create a folder in " + parent + ": " + std::strerror(errno));
  // mkdtemp makes 0700; the results folder gets the mode any folder the user makes gets.
  const mode_t mask = umask(0);
  umask(mask);
  chmod(tmpl.c_str(), 0777 & ~mask);
  return tmpl;
}

// Removes the hidden folders of killed runs for this DIR: ours by name, on this host, owned
// by this user, and whose pid is no longer running. Anything else is left alone.
void remove_stale_temps(const std::string& parent, const std::string& name) {
  const std::string prefix = temp_prefix(name), host = this_host();
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    std::string rest = entry.path().filename().string();
    if (rest.rfind(prefix, 0) != 0) continue;
    rest = rest.substr(prefix.size());
    if (rest.size() > 4 && rest.compare(rest.size() - 4, 4, ".old") == 0)
      rest.resize(rest.size() - 4);
    const size_t dash = rest.find('-'), dot = rest.rfind('.');
    if (dash == std::string::npos || dot == std::string::npos || dot < dash || dash == 0) continue;
    const std::string pid_text = rest.substr(0, dash);
    if (pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9)
      continue;
    if (rest.substr(dash + 1, dot - dash - 1) != host) continue;
    struct stat st = {};
    if (lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid())
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to ask
    fs::remove_all(entry.path(), ec);
  }
}

void sync_folder(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  fsync(fd);
  close(fd);
}

// Test hook (the test build ctxpar-faults only): CTXPAR_OUT_FAULT=before-swap | after-swap
// kills the process (SIGKILL, as kill -9 would) at that point of replace_with.
void fault_point([[maybe_unused]] const char* where) {
#ifdef CTXPAR_FAULT_HOOKS
  const char* fault = std::getenv("CTXPAR_OUT_FAULT");
  if (fault && std::strcmp(fault, where) == 0) std::raise(SIGKILL);
#endif
}

}  // namespace

OutFolder::OutFolder(std::string dir) : dir_(std::move(dir)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  if (dir_.empty()) throw UsageError("--out needs a folder name");
  const fs::path p(dir_);
  if (p.filename() == "." || p.filename() == "..")
    throw UsageError("--out " + dir_ + ": give the folder by its name (it is replaced as a whole)");
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(dir_, ec))) {
    // A link to a folder: the results go to the folder it points to (that folder is replaced,
    // the link stays). A link to nothing or to a file is refused.
    const fs::path target = fs::canonical(dir_, ec);
    if (ec || !fs::is_directory(fs::status(target, ec)))
      throw UsageError("--out " + dir_ +
                       " is a symbolic link to no folder; give a folder, or a "
                       "link to an existing folder");
    dir_ = target.string();
  }
  const fs::path q(dir_);
  parent_ = q.has_parent_path() ? q.parent_path().string() : ".";
  check_replaceable(dir_);
  fs::create_directories(parent_, ec);
  if (ec || !fs::is_directory(parent_))
    throw UsageError("--out " + dir_ + ": cannot create its parent folder " + parent_ + ": " +
                     (ec ? ec.message() : "not a folder"));
  // The one sure test of "can make a folder here" (access() says yes to root on a read-only
  // filesystem): make one, and remove it.
  std::string probe = (fs::path(parent_) / ".ctxpar-probe.XXXXXX").string();
  if (!mkdtemp(probe.data()))
    throw UsageError("--out " + dir_ + ": cannot write in " + parent_ + " (" +
                     std::strerror(errno) + "); give a folder where you can write");
  rmdir(probe.c_str());
  remove_stale_temps(parent_, q.filename().string());
}

void OutFolder::replace_with(const std::vector<std::pair<std::string, TensorView>>& files) const {
  check_replaceable(dir_);  // again: the folder may have changed during the run
  const std::string fresh = new_folder_beside(parent_, fs::path(dir_).filename().string());
  try {
    for (const auto& [name, t] : files) write_npy((fs::path(fresh) / name).string(), t);
    write_file_atomic((fs::path(fresh) / kOutMarker).string(),
                      std::string("ctxpar attention --out: the next run replaces this folder "
                                  "as a whole\n"));
    sync_folder(fresh);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(fresh, ec);
    throw;
  }
  fault_point("before-swap");
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir_, ec))) {
    if (std::rename(fresh.c_str(), dir_.c_str()) != 0) {
      const int err = errno;
      fs::remove_all(fresh, ec);
      throw Error("--out " + dir_ + ": rename failed: " + std::strerror(err));
    }
  } else if (renameat2(AT_FDCWD, fresh.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) != 0) {
    // No exchange on this filesystem: move the old set aside, then the new one in.
    const std::string aside = fresh + ".old";
    if (std::rename(dir_.c_str(), aside.c_str()) != 0 ||
        std::rename(fresh.c_str(), dir_.c_str()) != 0) {
      const int err = errno;
      if (!fs::exists(dir_, ec)) std::rename(aside.c_str(), dir_.c_str());
      fs::remove_all(fresh, ec);
      throw Error("--out " + dir_ + ": rename failed: " + std::strerror(err));
    }
    fs::remove_all(aside, ec);
  } else {
    fault_point("after-swap");
    fs::remove_all(fresh, ec);  // now the old set
  }
  sync_folder(parent_);
}

}  // namespace ctxpar::cli
