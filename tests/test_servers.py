"""The shared moto server fixture answers real HTTP."""

from __future__ import annotations

import boto3


def test_moto_server_serves_s3(aws_env: str) -> None:
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="probe")
    s3.put_object(Bucket="probe", Key="k", Body=b"v")
    assert s3.get_object(Bucket="probe", Key="k")["Body"].read() == b"v"
