import os

import pytest
import torch

# Tests record into throwaway repositories, often several processes at once: a record refused because the machine is
# busy (specbook/cpuload.py) is what tests/test_specbook_cpuload.py checks, with this variable taken out there.
os.environ["SPECBOOK_ALLOW_BUSY"] = "1"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only contend, and run far slower than one.
    Opt in per module with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """This repository's site, built once for the docs and browser tests: (site folder, the records it was built
    from)."""
    from docs_testing import build_site

    out = tmp_path_factory.mktemp("site")
    return out, build_site(out)


def pytest_terminal_summary(terminalreporter) -> None:
    """A skip for want of Chromium is named at the end, in words: `-q` shows it only as an `s`, and CI runs those
    tests (README: how to install it)."""
    reasons = {r.longrepr[2].removeprefix("Skipped: ") for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and "Chromium" in r.longrepr[2]}
    for reason in sorted(reasons):
        terminalreporter.write_line(f"browser tests skipped: {reason}; CI runs them", yellow=True, bold=True)
