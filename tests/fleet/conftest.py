"""Fixtures of the fleet source tests: a queue fed by the Terraform module's EventBridge rules."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from spotguard.notices.fleet import EVENT_PATTERNS


@pytest.fixture
def fleet_queue(aws_env: str, request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """A fresh queue with the module's three EventBridge rules targeting it."""
    import boto3

    name = f"fleet-{request.node.name[:40].replace('[', '-').replace(']', '')}"
    sqs = boto3.client("sqs")
    events = boto3.client("events")
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    rules = []
    for key, pattern in EVENT_PATTERNS.items():
        rule = f"{name}-{key}"
        events.put_rule(Name=rule, EventPattern=json.dumps(pattern), State="ENABLED")
        events.put_targets(Rule=rule, Targets=[{"Id": "queue", "Arn": arn}])
        rules.append(rule)
    yield url, events
    for rule in rules:
        events.remove_targets(Rule=rule, Ids=["queue"])
        events.delete_rule(Name=rule)
    sqs.delete_queue(QueueUrl=url)
