"""A small HTTP server job (stdlib): it holds a secret made at start-up and a request
counter in memory, so answers after a restore prove the same process came back.

``python http_job.py PORT_FILE``: listens on 127.0.0.1 (port chosen by the kernel), writes
the port to PORT_FILE, then prints one line per request: ``served N PATH``. ``GET /x``
answers ``SECRET N /x``; ``GET /quit`` answers and ends the job.
"""

from __future__ import annotations

import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

SECRET = os.urandom(8).hex()
COUNT = 0


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        global COUNT
        COUNT += 1
        body = f"{SECRET} {COUNT} {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        print(f"served {COUNT} {self.path}", flush=True)
        if self.path == "/quit":
            self.server.shutdown_request(self.request)
            os._exit(0)

    def log_message(self, format: str, *args: object) -> None:
        return None


def main() -> int:
    server = HTTPServer(("127.0.0.1", 0), Handler)
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, sys.argv[1])
    print("listening", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
