"""A job whose listener accepted a connection and closed it first, as NCCL's bootstrap root
does at start: the closed connection stays in TIME_WAIT on the listener's own port for 60 s.
The listener stays open (no SO_REUSEADDR); every step prints its number.

    python listener_closed.py STEPS STEP_SECONDS
"""

import socket
import sys
import time

steps, pause = int(sys.argv[1]), float(sys.argv[2])
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
cli = socket.create_connection(srv.getsockname())
conn, _ = srv.accept()
conn.close()  # the accepting side closes first: TIME_WAIT on the listener's port
time.sleep(0.1)
cli.close()
for step in range(steps):
    print(f"step {step}", flush=True)
    time.sleep(pause)
