"""One launch template per job: ``aws_launch_template = "spotguard-{job}"`` names the template
terraform/aws/modules/spotguard creates for each job (checked against the module's HCL), and
RunInstances on moto (server mode) uses the job's own template."""

from __future__ import annotations

from pathlib import Path

import boto3
import hcl2
import pytest

from spotguard.config import load
from spotguard.contracts import Assignment
from spotguard.errors import ConfigError, PrecheckError
from spotguard.providers.aws import JOB_PLACEHOLDER, AwsProvider, AwsSettings
from spotguard.providers.base import Market, Offer

MODULE = Path(__file__).resolve().parents[2] / "terraform" / "aws" / "modules" / "spotguard"
PATTERN = "spotguard-{job}"


def module_template_pattern() -> str:
    """The module's template name with var.name at its default and each.key as ``{job}``."""
    with (MODULE / "launch_template.tf").open() as f:
        lt = hcl2.load(f)["resource"][0]["aws_launch_template"]["job"]
    with (MODULE / "variables.tf").open() as f:
        variables = {k: v for d in hcl2.load(f)["variable"] for k, v in d.items()}
    name = lt["name"][0] if isinstance(lt["name"], list) else lt["name"]
    default = variables["name"]["default"]
    default = default[0] if isinstance(default, list) else default
    return str(name).replace("${var.name}", default).replace("${each.key}", JOB_PLACEHOLDER)


def test_pattern_matches_the_terraform_module() -> None:
    assert module_template_pattern() == PATTERN


def offer() -> Offer:
    return Offer("aws", "us-east-1", "us-east-1a", "g5.xlarge", "a10g", 1, Market.ON_DEMAND)


def assignment(job: str) -> Assignment:
    return Assignment(job=job, image_url=f"file:///s/{job}/images/x", store="file:///s")


def provider(endpoint: str, template: str) -> AwsProvider:
    return AwsProvider(
        AwsSettings(
            aws_regions=["us-east-1"],
            aws_launch_template=template,
            aws_endpoint_url=endpoint,
            aws_max_attempts=1,
        )
    )


async def test_each_job_launches_from_its_own_template(aws_env: str) -> None:
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=aws_env)
    images = [i["ImageId"] for i in ec2.describe_images(Owners=["amazon"])["Images"][:2]]
    assert len(set(images)) == 2
    ids = {}
    for job, image in zip(("alpha", "beta"), images, strict=True):
        name = PATTERN.replace(JOB_PLACEHOLDER, job)
        created = ec2.create_launch_template(
            LaunchTemplateName=name, LaunchTemplateData={"ImageId": image}
        )
        ids[job] = created["LaunchTemplate"]["LaunchTemplateId"]
    by_pattern = provider(aws_env, module_template_pattern())
    try:
        for job, image in zip(("alpha", "beta"), images, strict=True):
            ref = await by_pattern.launch(offer(), assignment(job), client_token=f"tpl{job}-0")
            got = ec2.describe_instances(InstanceIds=[ref.instance_id])
            assert got["Reservations"][0]["Instances"][0]["ImageId"] == image
        with pytest.raises(PrecheckError, match="launch template spotguard-gamma"):
            await by_pattern.launch(offer(), assignment("gamma"), client_token="tplgamma-0")
    finally:
        await by_pattern.aclose()
    # A fixed name and a template id still work as before.
    for fixed in ("spotguard-beta", ids["beta"]):
        p = provider(aws_env, fixed)
        try:
            ref = await p.launch(offer(), assignment("alpha"), client_token=f"fx{fixed}-0")
        finally:
            await p.aclose()
        got = ec2.describe_instances(InstanceIds=[ref.instance_id])
        assert got["Reservations"][0]["Instances"][0]["ImageId"] == images[1]


def test_unknown_placeholder_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTGUARD_AWS_LAUNCH_TEMPLATE", "spotguard-{name}")
    with pytest.raises(ConfigError, match="only placeholder"):
        load(AwsSettings)
