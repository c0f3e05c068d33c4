# %% [markdown]
# # Smoke: the runbook machinery end to end
#
# A fast runbook without torch: it records one deterministic number (any change is drift) and one timing, so
# `runbook verify` on CI exercises execution, recording and comparison in a second or two.
#
# ```yaml
# title: Smoke test of the runbook machinery
# reproduces: [checksum, loop_ms]
# feeds: []
# depends: []
# profiles:
#   cpu: {}
# timeout: 120
# cell_timeout: 60
# ```

# %% tags=["parameters"]
n = 200_000  # terms of the deterministic sum
repeats = 5  # timing repeats; the median is recorded

# %%
import statistics
import time

from specbook import record


def checksum(n: int) -> float:
    # sum of 1/k^2, a fixed float computation: the same n gives the same bits on every IEEE machine
    return sum(1.0 / (k * k) for k in range(1, n + 1))


# %%
times_ms = []
for _ in range(repeats):
    t0 = time.process_time()  # CPU time: another process sharing the cores does not change it
    value = checksum(n)
    times_ms.append((time.process_time() - t0) * 1e3)

record("checksum", value, unit="", direction="none", description="sum of 1/k^2 for k = 1..n")
# the tolerance comes from the spread of the samples (specbook.record: at least 10%, at most 25%)
record("loop_ms", statistics.median(times_ms), unit="ms", direction="lower", samples=times_ms,
       description="median CPU time of the sum")
