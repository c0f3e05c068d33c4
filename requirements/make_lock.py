"""Write requirements/lock.txt from pip's resolution of `.[test]` on Python 3.11 and on Python 3.10.

    python3.11 -m venv /tmp/v311 && /tmp/v311/bin/pip install --dry-run --ignore-installed --report /tmp/r311.json \
        torch==2.13.0 -e '.[test]'
    python3.10 -m venv /tmp/v310 && /tmp/v310/bin/pip install --dry-run ... --report /tmp/r310.json ...
    python requirements/make_lock.py /tmp/r311.json /tmp/r310.json > requirements/lock.txt

Resolve on the oldest 3.11 in use (a release may need e.g. 3.11.5): what installs there installs on later ones.
A package both resolutions agree on is pinned plainly; otherwise each version gets a python_version marker.
torch loses its local label (+cpu / +cuXXX: the same release for every machine); the CUDA runtime packages are left
out (torch's CUDA builds pin them exactly), and triton is pinned to the release torch's CUDA builds require.
"""
from __future__ import annotations

import json
import re
import sys

TORCH_TRITON = "3.7.1"  # the triton torch 2.13.0's CUDA wheels require; the CPU test extra accepts it too

HEADER = """\
# Exact versions of every package the project installs (`.[test]`: the base dependencies, serve, docs, test), as pip
# resolved them on Python 3.11 (and, where 3.10 needs other releases, on 3.10: the python_version markers). Use it as
# a constraints file, so pip installs these versions on CI, a developer's machine and a GPU machine alike:
#   pip install -c requirements/lock.txt torch==2.13.0 -e '.[test]'
# Regenerate with requirements/make_lock.py (its docstring says how).
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(report: str) -> dict[str, tuple[str, str]]:
    out = {}
    for item in json.load(open(report))["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        key = norm(name)
        if key == "specbook" or key.startswith(("nvidia-", "cuda-")):
            continue
        if key == "torch":
            version = version.split("+")[0]
        if key == "triton":
            version = TORCH_TRITON
        out[key] = (name, version)
    return out


def lock(new: dict[str, tuple[str, str]], old: dict[str, tuple[str, str]]) -> list[str]:
    lines = []
    for key in sorted(set(new) | set(old)):
        a, b = new.get(key), old.get(key)
        if a and b and a[1] == b[1]:
            lines.append(f"{a[0]}=={a[1]}")
            continue
        if a:
            lines.append(f'{a[0]}=={a[1]}; python_version >= "3.11"')
        if b:
            lines.append(f'{b[0]}=={b[1]}; python_version < "3.11"')
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make_lock.py REPORT_3.11.json REPORT_3.10.json")
    sys.stdout.write(HEADER + "\n".join(lock(resolved(sys.argv[1]), resolved(sys.argv[2]))) + "\n")
