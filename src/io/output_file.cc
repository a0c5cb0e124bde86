#include "io/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace ctxpar {

std::string output_path_problem(const std::string& path) {
  if (path.empty()) return "is empty; give a file name";
  struct stat st = {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode))
      return "is a symbolic link; ctxpar never writes through a link (it would overwrite the "
             "link's target): give the target's own path or a new file name";
    if (S_ISDIR(st.st_mode)) return "is a folder; give a file name";
    if (!S_ISREG(st.st_mode))
      return "exists and is not a regular file (a device such as /dev/null, a FIFO or a "
             "socket); ctxpar replaces the file it writes, so give a regular file's name";
  }
  const std::filesystem::path p(path);
  const std::string folder = p.has_parent_path() ? p.parent_path().string() : ".";
  struct stat fs = {};
  if (::stat(folder.c_str(), &fs) != 0)
    return "cannot be written: its folder " + folder + " " +
           (errno == ENOENT ? std::string("does not exist; create it first")
                            : std::string("cannot be reached: ") + std::strerror(errno));
  if (!S_ISDIR(fs.st_mode)) return "cannot be written: " + folder + " is not a folder";
  std::string temp;
  const int fd = open_temp_beside(path, &temp);
  if (fd < 0)
    return "cannot be written: no file can be created in " + folder + " (" + std::strerror(errno) +
           "); give a path in a folder you can write";
  ::close(fd);
  ::unlink(temp.c_str());
  return "";
}

int open_temp_beside(const std::string& path, std::string* temp) {
  // The temporary lives in the same folder so that rename() is atomic (same filesystem).
  *temp = path + ".tmp.XXXXXX";
  return ::mkstemp(temp->data());
}

void match_umask(int fd) {
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd, 0666 & ~mask);
}

}  // namespace ctxpar
