"""Store URLs checked without opening them (:func:`spotguard.store.check_url`): what the CLI,
the operations and the image URL parser ask before anything is done to a job. A destination
written as a URL is never read as a directory path named after its scheme, and bad input
met where the store is opened never makes the checkpoint try its next path."""

from __future__ import annotations

import pytest

from spotguard.errors import ConfigError, MissingExtra, StoreUnavailable
from spotguard.image.manifest import ImageRef
from spotguard.modes import Mode
from spotguard.operations.paths import falls_back
from spotguard.store import check_url, looks_like_url, open_store


@pytest.mark.parametrize(
    ("url", "parts"),
    [
        ("s3://bucket/a/b/", ("s3", "bucket", "a/b")),
        ("GS://bucket", ("gs", "bucket", "")),
        ("file:///var/lib/images", ("file", "/var/lib/images", "")),
        ("file://localhost/x", ("file", "/x", "")),
        ("/var/lib/images", ("file", "/var/lib/images", "")),
        ("relative/dir", ("file", "relative/dir", "")),
        ("odd:name", ("file", "odd:name", "")),  # a colon alone does not make a URL
    ],
)
def test_stores_and_paths_are_told_apart(url: str, parts: tuple[str, str, str]) -> None:
    assert check_url(url) == parts
    assert looks_like_url(url) == ("://" in url)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://host/x", "unsupported store URL 'ftp://host/x'"),
        ("gcs://bucket", "unsupported store URL"),
        ("s3:/bucket/x", "names no bucket"),  # one slash short: a URL mistyped, not a path
        ("s3://", "names no bucket"),
        ("gs:///prefix", "names no bucket"),
        ("file://host/x", "must be file:///absolute/path"),
        ("file://", "names no directory"),
        ("", "names no directory"),
        # no store takes a query or a fragment: read as given they were dropped in silence
        ("file:///tmp/store?region=eu", "has a query or a fragment"),
        ("s3://bucket/prefix?versionId=3", "has a query or a fragment"),
        ("gs://bucket/p#frag", "has a query or a fragment"),
    ],
)
def test_what_names_no_store_is_refused_typed(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        check_url(url)
    with pytest.raises(ConfigError, match=says):
        open_store(url)


@pytest.mark.parametrize("url", ["ftp://h/x/j/images/latest", "s3:/j/images/latest"])
def test_an_image_url_on_no_store_is_refused_as_it_is_parsed(url: str) -> None:
    with pytest.raises(ConfigError):
        ImageRef.parse(url)


@pytest.mark.parametrize(
    ("exc", "step", "mode", "next_path"),
    [
        (StoreUnavailable("the store is down"), "prepare", Mode.EXIT, True),
        (StoreUnavailable("the store is down"), "run", Mode.EXIT, True),
        (StoreUnavailable("the store is down"), "run", Mode.RESUME, False),
        # bad input met where the store is opened (a URL that passed the first look, an
        # extra not installed): the staged path would only fail the same way after
        # stopping the job
        (ConfigError("store URL 's3://' names no bucket"), "prepare", Mode.EXIT, False),
        (MissingExtra("no aws extra", extra="aws"), "prepare", Mode.EXIT, False),
    ],
)
def test_bad_input_never_falls_back_to_the_staged_path(
    exc: Exception, step: str, mode: Mode, next_path: bool
) -> None:
    assert falls_back(step, exc, mode) is next_path
