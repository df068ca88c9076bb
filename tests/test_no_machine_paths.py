"""No tracked file names a machine's folders: the repository reads nothing outside itself.

A results file, a doc or a config that carries an absolute path of the machine it was written
on (a work folder, someone's home, root's home) or a relative path into a shared folder
beside the checkout points a reader at files they do not have. Every tracked text file is
read from the working tree (binary files are skipped: images, and anything holding a NUL
byte); untracked files are not looked at.
"""
import os
import re
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".pdf", ".ico", ".npz", ".npy", ".pkl",
                   ".gz", ".zip", ".tar", ".bin", ".so", ".pyc", ".whl", ".ttf", ".woff")
SKIPPED_DIRS = (".venv",)

# An absolute path starts at the beginning of a line or after a character that cannot be part
# of a path (so `runs/work/x` is not one). The folder names are split so that this file does
# not match itself.
_START = r"(?<![\w.~/-])"
FORBIDDEN = {
    "an absolute path under /" + "work/": re.compile(_START + "/" + "work/"),
    "an absolute path under a home folder": re.compile(_START + "/" + r"home/[A-Za-z_][\w.-]*/"),
    "an absolute path under /" + "root/": re.compile(_START + "/" + "root/"),
    "a path into ../" + "shared": re.compile(r"\.\./" + "shared" + r"\b"),
}


def _tracked_files():
  try:
    result = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                            check=True)
  except (OSError, subprocess.CalledProcessError) as e:
    pytest.skip(f"not a git checkout with git available: {e}")
  return [p for p in result.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def _text(path):
  """The file's text, or None for a binary file, a missing one (deleted, not yet committed)
  or a submodule."""
  if path.lower().endswith(BINARY_SUFFIXES):
    return None
  full = os.path.join(REPO_ROOT, path)
  if not os.path.isfile(full):
    return None
  with open(full, "rb") as f:
    data = f.read()
  if b"\0" in data[:8192]:
    return None
  return data.decode("utf-8", "replace")


def test_no_tracked_text_file_names_a_machine_path():
  files = [p for p in _tracked_files() if not p.startswith(tuple(d + "/" for d in SKIPPED_DIRS))]
  assert files, "git ls-files listed nothing"
  found = []
  for path in files:
    text = _text(path)
    if text is None:
      continue
    for number, line in enumerate(text.splitlines(), 1):
      for what, pattern in FORBIDDEN.items():
        if pattern.search(line):
          found.append(f"{path}:{number}: {what}: {line.strip()[:160]}")
  assert not found, ("tracked files name a machine's folders (write a path relative to the "
                     "repository, or leave it out):\n" + "\n".join(found))


@pytest.mark.parametrize("line, hit", [
    ("wrote /" + "root/out/x.json", True),
    ("--root=/" + "work/runs/claims", True),
    ("see /" + "home/alice/notes.md", True),
    ("cp ../" + "shared/data .", True),
    ("--root=runs/claims", False),
    ("runs/" + "work/seed0 and results/" + "root/x", False),
    ("$RUNS/geo125m", False),
])
def test_the_patterns(line, hit):
  assert any(p.search(line) for p in FORBIDDEN.values()) == hit
