"""Issue 17.8 and ``spotguard logs``: one image size everywhere, binary units in bars and
summaries alike, log lines printed above a live bar (not into it), and a job's output."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import time
from pathlib import Path

from ops_helpers import clean_env, sg
from rich.console import Console

from spotguard.image.stats import TransferStats
from spotguard.progress import fmt_bytes, fmt_image_size, route_logs, transfer_bar


def test_list_verify_and_pull_print_one_size_for_one_image(tmp_path: Path) -> None:
    """An image whose chunks repeat (zero pages): verify used to print the distinct chunks'
    bytes as the image's size (3.3 MiB against list's and pull's 4.8 MiB)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(3_000_000))
    (src / "pages-2.img").write_bytes(bytes(2_000_000))
    store = tmp_path / "store"
    pushed = sg("images", "push", str(src), str(store), "--job", "j", "--chunk-size", "262144")
    assert pushed.returncode == 0, pushed.stderr
    listed = json.loads(sg("images", "list", str(store), "--json").stdout)[0]
    size = fmt_image_size(listed["bytes"], listed["stored_bytes"])
    url = listed["url"]
    outputs = {
        "push": pushed.stdout,
        "list": sg("images", "list", str(store)).stdout,
        "verify": sg("images", "verify", url).stdout,
        "pull": sg("images", "pull", url, str(tmp_path / "dst")).stdout,
    }
    for cmd, out in outputs.items():
        assert size in out, f"{cmd} prints another size: {out!r} (want {size})"
        assert " MB" not in out and " GB" not in out, f"{cmd}: decimal units in {out!r}"


def test_binary_units() -> None:
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(5 << 30) == "5.0 GiB"


def test_log_lines_print_above_a_live_bar_in_binary_units() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    handler = logging.StreamHandler(io.StringIO())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with transfer_bar("upload", False, console=console) as update:
            assert update is not None
            st = TransferStats()
            st.bytes, st.total = 3 << 20, 6 << 20
            update(st)
            logging.getLogger("spotguard.test").warning("store slow; retrying")
        assert handler.stream is not console.file, "the handler got its stream back"
    finally:
        root.removeHandler(handler)
    text = out.getvalue()
    assert "store slow; retrying\n" in text, "the log line is a line of its own"
    assert "MiB" in text and " MB" not in text
    with route_logs(console):
        pass  # nothing buffered: nothing printed, nothing left behind


def test_logs_prints_and_follows_a_jobs_output(tmp_path: Path) -> None:
    job = tmp_path / "jobs" / "train"
    job.mkdir(parents=True)
    (job / "job.json").write_text(
        json.dumps({"name": "train", "pid": 1, "dir": str(job), "argv": ["x"]})
    )
    (job / "stdout").write_text("step 1\nstep 2\nstep 3\n")
    (job / "stderr").write_text("warning: slow\n")
    last = sg("logs", "train", "-n", "1", "--state-dir", str(tmp_path))
    assert last.returncode == 0
    assert last.stdout == "step 3\n" and last.stderr == "warning: slow\n"
    follow = subprocess.Popen(
        [
            *("spotguard", "logs", "train", "-f", "--until-exit"),
            *("--stream", "stdout", "--state-dir", str(tmp_path)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    time.sleep(1.0)
    # a restore replaces the file with one that carries the old output, then more
    replaced = job / ".stdout.new"
    replaced.write_text("step 1\nstep 2\nstep 3\nstep 4 (restored)\n")
    os.replace(replaced, job / "stdout")
    time.sleep(0.5)
    with (job / "stdout").open("a") as f:
        f.write("step 5\n")
    (job / "exit_status").write_text("0\n")
    out, err = follow.communicate(timeout=20)
    assert follow.returncode == 0, err
    assert out == "step 1\nstep 2\nstep 3\nstep 4 (restored)\nstep 5\n"
