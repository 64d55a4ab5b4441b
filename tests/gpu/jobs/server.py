"""An HTTP inference server holding a model on the GPU.

    python server.py PORT MB      (MB: extra GPU memory the "model" holds)

GET /infer?x=N answers the checksum of the model's output for input N; /ready answers ok.
"""

import hashlib
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse

import torch

torch.manual_seed(0)
DEV = torch.device("cuda")
MODEL = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 1024)).to(DEV).eval()  # fmt: skip
BALLAST = torch.ones(int(sys.argv[2]) << 18, device=DEV)  # MB of weights-like state


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/ready":
            body = b"ok"
        else:
            n = int(parse_qs(url.query)["x"][0])
            g = torch.Generator(device=DEV).manual_seed(n)
            with torch.no_grad():
                out = MODEL(torch.randn(8, 1024, device=DEV, generator=g))
            digest = hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()
            body = f"{n} {digest} {float(BALLAST.sum().item())}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
