"""Reserve, run, settle: the README's example, runnable against an agent.

python quickstart.py /run/reservoir-agent/agent.sock tenant-7 chat.generate
"""

import sys
import uuid

from reservoir_client import Client, Rejected

socket_path, subject, route = sys.argv[1:4]
with Client(socket_path) as agent:
    try:
        # One key per logical request: a retry of it never reserves twice.
        with agent.lease(f"req-{uuid.uuid4()}", subject, route, units=600) as lease:
            lease.start()  # right before the work begins
            used = 200  # ... run the work, at most lease.granted_units
            lease.actual_units = used  # settled on exit; 400 refunded
        print("settled:", lease.reservation.state if lease.reservation else None)
    except Rejected as rejected:
        print(f"not admitted ({rejected.dimension}); retry in {rejected.retry_after} s")
