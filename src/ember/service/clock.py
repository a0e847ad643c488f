"""The service's one clock: wall-clock seconds since the epoch (`time.time`'s).

`Service(clock=...)` passes the same clock to every manager that stamps or expires
something by time -- sessions (heartbeats, idleness), `CheckpointStore` (TTLs, `expires_at`),
`FutureTable` (created/finished times, the pending deadline, orphaned rows), `RunManager`,
`SamplerManager`, `StabilityRecords` (sliding expiry), `MetricHistory` and the housekeeping
sweep -- so a test drives every TTL by advancing one manual clock instead of sleeping.
Durations of work (how long a load or a retry took, when to give up retrying a database
write) are measured with `time.monotonic`, not with this clock: they are real time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]  # () -> wall-clock seconds since the epoch

SYSTEM_CLOCK: Clock = time.time
