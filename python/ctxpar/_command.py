"""The `ctxpar` command of a pip install (pyproject.toml's [project.scripts]): the C++ command
(tools/ctxpar: attention, bench, train, decode, plan), built with the extension and shipped
inside the package as ctxpar/bin/ctxpar; this entry point replaces its process with it, so its
exit status, signals and output are the command's own (docs/install.md)."""
import os
import sys


def path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "ctxpar")


def main():
    command = path()
    if not os.access(command, os.X_OK):
        sys.stderr.write(f"ctxpar: this install has no command ({command} is missing or not "
                         "executable); reinstall the package (pip install ctxpar-*.whl, or "
                         "pip install . from a clone), or build the command with CMake "
                         "(bash scripts/build.sh --cxx ctxpar_cli)\n")
        return 1
    os.execv(command, ["ctxpar", *sys.argv[1:]])
