"""``spotguard fetch-keys``: fetch the fleet's image keys onto this VM before the agent starts.

Run by ``spotguard-agent.service`` as ``ExecStartPre`` on every start: on a job's first boot
the key sources come from ``[keys]`` in the config Terraform wrote; on a VM the controller
relaunched (whose user-data is an assignment) from the assignment's ``keys``. Settings and
flags win over the assignment. What is fetched and how: :mod:`spotguard.image.delivery`.

Exit status: 0 keys written, or no source configured (a warning: images are then neither
signed nor checked here); 1 a source cannot be read; 2 a source holds something that is not
the expected key, or the two keys do not belong together.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click

from spotguard import cli, config
from spotguard.contracts import ASSIGNMENT_PATH, KeySources
from spotguard.image.delivery import KeySource, KeysSettings, fetch_keys

log = logging.getLogger(__name__)


def _from_assignment(path: Path) -> KeySources | None:
    from spotguard.agent.restore import read_assignment

    got = read_assignment(path)
    return got.keys if got is not None else None


@click.command("fetch-keys")
@config.options(KeysSettings)
@click.option(
    "--assignment",
    "assignment_path",
    envvar="SPOTGUARD_ASSIGNMENT",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path(ASSIGNMENT_PATH),
    show_default=True,
    help="Assignment whose key sources apply when [keys] names none. [env: SPOTGUARD_ASSIGNMENT]",
)
def fetch_keys_cmd(assignment_path: Path, **flags: Any) -> None:
    """Fetch the image signing key (0600) and verify key (0644) into keys_dir, and name them
    to the agent in keys_env_file. See docs/security.md, "Delivering the keys"."""
    s = config.load(KeysSettings, flags, config_file=cli.config(click.get_current_context()))
    signing, verify = s.signing_key_source, s.verify_key_source
    if signing is None and verify is None:
        sources = _from_assignment(assignment_path)
        if sources is not None:
            signing, verify = sources.signing_key, sources.verify_key
    if signing is None and verify is None:
        s.keys_env_file.unlink(missing_ok=True)
        log.warning(
            "no image key source configured: images are neither signed nor authenticated here",
            extra={"file": str(assignment_path)},
        )
        click.echo("no key source configured ([keys] or the assignment): no keys fetched")
        return
    got = fetch_keys(
        s,
        KeySource.parse(signing, "signing_key_source") if signing else None,
        KeySource.parse(verify, "verify_key_source") if verify else None,
    )
    log.info(
        "image keys fetched",
        extra={
            "key_id": ", ".join(filter(None, [got.signing_key_id, *got.verify_key_ids])),
            "file": str(got.env_file),
        },
    )
    if got.signing_key_file is not None:
        click.echo(f"signing key {got.signing_key_id} → {got.signing_key_file}")
    if got.verify_key_file is not None:
        click.echo(f"verify key {', '.join(got.verify_key_ids)} → {got.verify_key_file}")
