"""A command line reads its config file once: every settings group a command loads (park's
checkpoint, park, image and notify settings; ``images list``'s image and agent settings)
comes from the one file read at the CLI edge (``cli.config``), not from a fresh read each.

Counted with a real interpreter audit hook on ``open`` of the config file, around the real
``spotguard`` entry point."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ops_helpers import clean_env

_COUNT = textwrap.dedent(
    """
    import atexit, os, sys
    cfg = os.path.realpath(sys.argv[1])
    opened = 0
    def hook(event, args):
        global opened
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            if os.path.realpath(os.fsdecode(args[0])) == cfg:
                opened += 1
    sys.addaudithook(hook)
    atexit.register(lambda: print(f"config opened {opened}", file=sys.stderr))
    from spotguard.cli import main
    main(args=["--config", cfg, *sys.argv[2:]], prog_name="spotguard")
    """
)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    (tmp_path / "store").mkdir()
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        f'[checkpoint]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[agent]\nstore = "file://{tmp_path / "store"}"\n'
    )
    return cfg


def _run(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _COUNT, str(config), *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("park", "nosuchjob"), "no job at"),
        (("unpark", "nosuchjob"), "is not parked"),
        (("images", "list"), "no images in file://"),
    ],
)
def test_config_read_once(config: Path, args: tuple[str, ...], says: str) -> None:
    done = _run(config, *args)
    assert says in done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == "config opened 1", done.stderr
