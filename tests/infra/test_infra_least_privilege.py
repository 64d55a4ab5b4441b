"""One VM's credentials and the controller's role (issue 27, item 6), from the Terraform
modules as deployed with two jobs: values resolved by tfparse, the controller's launch limits
evaluated by ``terraform console`` from the module's own expressions.

Before: every agent role's policy granted the fleet's one private signing key
(``ReadImageSigningKey``), so a VM of any job could sign images every host of every job
trusted; the controller could run any AMI into any subnet and security group and decrypt with
the module's KMS key through any service. On GCP the controller held
``roles/compute.instanceAdmin.v1`` on the whole project: any VM, any image, any network.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from spotguard.contracts import LABEL_JOB, TAG_JOB

ROOT = Path(__file__).resolve().parents[2]
AWS_MODULE = ROOT / "terraform" / "aws" / "modules" / "spotguard"
GCP_MODULE = ROOT / "terraform" / "gcp" / "modules" / "spotguard"
JOBS = ("train-a", "train-b")

AWS_ROOT = """
provider "aws" {
  region = "us-east-1"
}

module "spotguard" {
  source             = "%s"
  name               = "sg-two"
  ami_id             = "ami-0123456789abcdef0"
  subnet_ids         = ["subnet-0123456789abcdef0"]
  security_group_ids = ["sg-0123456789abcdef0"]
  controller_url     = "https://controller.example:8700"
  job_tokens         = { "train-a" = "sgvm1.train-a.0.x", "train-b" = "sgvm1.train-b.0.y" }
  jobs = {
    "train-a" = { command = "python3 a.py" }
    "train-b" = { command = "python3 b.py" }
  }
}
"""

GCP_ROOT = """
provider "google" {
  project = "my-project-123"
}

module "spotguard" {
  source         = "%s"
  project_id     = "my-project-123"
  name           = "sg-two"
  image          = "projects/my-project-123/global/images/family/spotguard"
  controller_url = "https://controller.example:8700"
  job_tokens     = { "train-a" = "sgvm1.train-a.0.x", "train-b" = "sgvm1.train-b.0.y" }
  jobs = {
    "train-a" = { command = "python3 a.py" }
    "train-b" = { command = "python3 b.py" }
  }
}
"""


def load_two_jobs(tmp: Path, module: Path, text: str) -> dict[str, Any]:
    """tfparse of a root module using ``module`` with two jobs (tfparse follows relative
    module sources only)."""
    from tfparse import load_from_path

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "main.tf").write_text(text % os.path.relpath(module, tmp))
    return dict(load_from_path(str(tmp)))


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return load_two_jobs(tmp_path_factory.mktemp("aws"), AWS_MODULE, AWS_ROOT)


@pytest.fixture(scope="module")
def gcp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return load_two_jobs(tmp_path_factory.mktemp("gcp"), GCP_MODULE, GCP_ROOT)


def key_of(block: dict[str, Any]) -> str | None:
    """The for_each key of a block (``a`` of ``module.x.aws_iam_role.agent["a"]``)."""
    m = re.search(r'\["([^"]+)"\]$', block["__tfmeta"]["path"])
    return m.group(1) if m else None


def label_of(block: dict[str, Any]) -> str:
    m = re.search(r"\.([A-Za-z0-9_-]+)(\[[^\]]*\])?$", block["__tfmeta"]["path"])
    assert m
    return m.group(1)


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return as_list(doc.get("statement"))


def by_label(blocks: list[dict[str, Any]], label: str) -> dict[str | None, dict[str, Any]]:
    return {key_of(b): b for b in blocks if label_of(b) == label}


# ----- AWS: the private signing key --------------------------------------------------------------


def test_no_agent_role_policy_grants_the_fleets_or_another_jobs_signing_key(
    aws: dict[str, Any],
) -> None:
    secrets = by_label(aws["aws_secretsmanager_secret"], "image_signing")
    params = by_label(aws["aws_ssm_parameter"], "image_verify_key")
    assert set(secrets) == set(JOBS) and set(params) == set(JOBS), "one key pair per job"
    for job, secret in secrets.items():
        assert secret["name"] == f"sg-two/image-signing-key/{job}"
        assert secret["tags"][TAG_JOB] == job
    keys = by_label(aws["tls_private_key"], "image_signing")
    assert set(keys) == set(JOBS) and all(k["algorithm"] == "ED25519" for k in keys.values())
    # the policy every agent role shares names no secret, parameter or secret decryption
    (shared,) = by_label(aws["aws_iam_policy_document"], "agent").values()
    for st in statements(shared):
        assert not any(a.startswith(("secretsmanager:", "ssm:")) for a in st["actions"]), st
        cond = json.dumps(st.get("condition", {}))
        assert "secretsmanager." not in cond, st
    # each role's own key policy names its own job's secret and parameter, nothing else
    docs = by_label(aws["aws_iam_policy_document"], "agent_keys")
    attached = by_label(aws["aws_iam_role_policy"], "agent_keys")
    roles = by_label(aws["aws_iam_role"], "agent")
    assert set(docs) == set(attached) == set(JOBS)
    all_secret_ids = {s["id"] for s in secrets.values()}
    for job in JOBS:
        assert attached[job]["role"] == roles[job]["id"]
        assert attached[job]["policy"] == docs[job]["id"]
        sts = {st["sid"]: st for st in statements(docs[job])}
        assert set(sts) == {
            "ReadOwnJobSigningKey",
            "ReadOwnJobVerifyKey",
            "DecryptOwnJobSigningKey",
        }
        assert sts["ReadOwnJobSigningKey"]["actions"] == ["secretsmanager:GetSecretValue"]
        assert as_list(sts["ReadOwnJobSigningKey"]["resources"]) == [secrets[job]["id"]]
        assert as_list(sts["ReadOwnJobVerifyKey"]["resources"]) == [params[job]["id"]]
        conds = {
            c["variable"]: as_list(c["values"])
            for c in as_list(sts["DecryptOwnJobSigningKey"]["condition"])
        }
        assert conds["kms:EncryptionContext:SecretARN"] == [secrets[job]["id"]]
        assert conds["kms:ViaService"][0].startswith("secretsmanager.")
        granted = {r for st in sts.values() for r in as_list(st["resources"])}
        assert granted & all_secret_ids == {secrets[job]["id"]}, "another job's key granted"
    # the controller is granted no secret at all (it holds the public keys only)
    (ctl,) = by_label(aws["aws_iam_policy_document"], "controller").values()
    for st in statements(ctl):
        assert not any(a.startswith(("secretsmanager:", "ssm:")) for a in st["actions"]), st


def test_aws_vms_are_told_only_their_own_jobs_key_sources(aws: dict[str, Any]) -> None:
    """First-boot user-data of each job names that job's sources (keys.tf, launch_template.tf);
    the controller config hands each job's VMs that job's sources (outputs.tf)."""
    keys_tf = (AWS_MODULE / "keys.tf").read_text()
    assert (
        'job => "aws-secretsmanager:${local.job_signing_secret_arn[job]}"' in keys_tf
        and 'job => "aws-ssm:${aws_ssm_parameter.image_verify_key[job].arn}"' in keys_tf
    )
    lt = (AWS_MODULE / "launch_template.tf").read_text()
    assert "signing = local.signing_key_source[each.key]" in lt and "private_key" not in lt
    assert "verify  = local.verify_key_source[each.key]" in lt
    outputs = (AWS_MODULE / "outputs.tf").read_text()
    assert "signing_key_sources = local.signing_key_source" in outputs


# ----- AWS: the controller's role ----------------------------------------------------------------


def test_controller_passrole_is_limited_to_the_agent_roles(aws: dict[str, Any]) -> None:
    (ctl,) = by_label(aws["aws_iam_policy_document"], "controller").values()
    sts = {st["sid"]: st for st in statements(ctl)}
    roles = {r["id"] for r in by_label(aws["aws_iam_role"], "agent").values()}
    passes = [st for st in statements(ctl) if "iam:PassRole" in st["actions"]]
    assert [st["sid"] for st in passes] == ["PassOnlyAgentRoles"]
    assert set(as_list(sts["PassOnlyAgentRoles"]["resources"])) == roles
    cond = sts["PassOnlyAgentRoles"]["condition"]
    assert (cond["variable"], cond["values"]) == ("iam:PassedToService", ["ec2.amazonaws.com"])
    # every RunInstances comes from one of spotguard's templates (which name the job's profile)
    templates = {t["id"] for t in aws["aws_launch_template"]}
    run = {c["variable"]: c for c in as_list(sts["RunOnlyTaggedInstances"]["condition"])}
    assert run["ec2:LaunchTemplate"]["test"] == "ArnEquals"
    assert set(run["ec2:LaunchTemplate"]["values"]) == templates
    assert run["aws:RequestTag/spotguard:managed"]["values"] == ["true"]
    # the module's KMS key only through S3 and SQS: never to read a secret
    dec = sts["DecryptImagesAndEvents"]["condition"]
    assert dec["variable"] == "kms:ViaService"
    assert sorted(v.split(".")[0] for v in dec["values"]) == ["s3", "sqs"]


def _controller_locals(tmp: Path, tfvars: dict[str, Any]) -> dict[str, Any]:
    """The controller's launch-resource locals of iam_controller.tf, evaluated by
    ``terraform console`` with ``tfvars`` (no provider needed: ARN parts given as locals)."""
    text = (AWS_MODULE / "iam_controller.tf").read_text()
    m = re.search(r"\nlocals \{\n(  ec2_arn .*?)\n\}\n", text, re.S)
    assert m, "iam_controller.tf has no locals block with ec2_arn"
    tmp.mkdir(parents=True)
    body = m.group(1).replace("[for lt in aws_launch_template.job : lt.arn]", '["lt-arn"]')
    variables = "\n".join(
        f'variable "{k}" {{\n  default = {json.dumps(v)}\n}}' for k, v in tfvars.items()
    )
    (tmp / "main.tf").write_text(
        f'{variables}\nlocals {{\n  partition = "aws"\n  region = "us-east-1"\n'
        f'  account = "123456789012"\n{body}\n}}\n'
    )
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not installed")
    names = ["launch_subnets", "launch_groups", "launch_key_pairs"]
    expr = "jsonencode({" + ", ".join(f"{n} = local.{n}" for n in names) + "})"
    out = subprocess.run(
        [terraform, "console"], input=expr, cwd=tmp, capture_output=True, text=True, check=True
    )
    return dict(json.loads(json.loads(out.stdout.strip())))


def test_controller_launches_only_the_given_ami_subnets_groups_and_key(tmp_path: Path) -> None:
    text = (AWS_MODULE / "iam_controller.tf").read_text()
    (run,) = re.findall(r'sid     = "RunFromSpotguardTemplates".*?\n  \}\n', text, re.S)
    assert 'image/${var.ami_id}"' in run and "image/*" not in run
    for wildcard in ("subnet/*", "security-group/*", "key-pair/*"):
        assert wildcard not in run, f"{wildcard} named directly in RunFromSpotguardTemplates"
    arn = "arn:aws:ec2:us-east-1:123456789012"
    given = _controller_locals(
        tmp_path / "given",
        {
            "subnet_ids": ["subnet-0123456789abcdef0"],
            "security_group_ids": ["sg-0123456789abcdef0"],
            "key_name": "ops",
        },
    )
    assert given == {
        "launch_subnets": [f"{arn}:subnet/subnet-0123456789abcdef0"],
        "launch_groups": [f"{arn}:security-group/sg-0123456789abcdef0"],
        "launch_key_pairs": [f"{arn}:key-pair/ops"],
    }
    # without subnets or groups named, the account's own in the region (EC2's defaults);
    # no key pair at all
    default = _controller_locals(
        tmp_path / "default", {"subnet_ids": [], "security_group_ids": [], "key_name": None}
    )
    assert default["launch_key_pairs"] == []
    assert default["launch_subnets"] == [f"{arn}:subnet/*"]


# ----- GCP -------------------------------------------------------------------------------------


def test_gcp_each_jobs_signing_key_is_readable_by_that_jobs_account_only(
    gcp: dict[str, Any],
) -> None:
    secrets = by_label(gcp["google_secret_manager_secret"], "image_signing")
    assert {s["secret_id"] for s in secrets.values()} == {
        f"sg-two-image-signing-key-{job}" for job in JOBS
    }
    assert all(s["labels"][LABEL_JOB] == key for key, s in secrets.items())
    accounts = by_label(gcp["google_service_account"], "agent")
    for label in ("agent_signing_key", "agent_verify_key"):
        members = by_label(gcp["google_secret_manager_secret_iam_member"], label)
        assert set(members) == set(JOBS)
        for m in members.values():
            assert m["role"] == "roles/secretmanager.secretAccessor"
    signing = by_label(gcp["google_secret_manager_secret_iam_member"], "agent_signing_key")
    for job in JOBS:
        assert signing[job]["secret_id"] == secrets[job]["id"], "another job's secret bound"
    # each binding's member is its own job's account (for_each over the jobs, each.key)
    keys_tf = (GCP_MODULE / "keys.tf").read_text()
    bound = re.findall(r'member\s+= "serviceAccount:\$\{([^}]+)\}"', keys_tf)
    assert bound == ["google_service_account.agent[each.key].email"] * 2
    assert set(accounts) == set(JOBS)
    # the controller's account is bound to no secret
    assert "google_service_account.controller" not in keys_tf


# ----- GCP: the controller's roles ---------------------------------------------------------------

CATALOG = {
    "compute.acceleratorTypes.list",
    "compute.instances.list",
    "compute.machineTypes.list",
    "compute.zoneOperations.get",
}
LAUNCH = {
    "compute.disks.create",
    "compute.disks.setLabels",
    "compute.images.useReadOnly",
    "compute.instances.create",
    "compute.instances.delete",
    "compute.instances.get",
    "compute.instances.setLabels",
    "compute.instances.setMetadata",
    "compute.instances.setScheduling",
    "compute.instances.setServiceAccount",
    "compute.networks.use",
    "compute.subnetworks.use",
}


class _Name(str):
    """A resource name with the two CEL string functions the condition uses."""

    def startsWith(self, prefix: str) -> bool:
        return self.startswith(prefix)

    def extract(self, template: str) -> _Name:
        """CEL ``extract("/kind/{name}")``: what follows ``/kind/`` (to the end), or ""."""
        fixed = template.removesuffix("{name}")
        i = self.find(fixed)
        return _Name(self[i + len(fixed) :] if i >= 0 else "")


class _Resource:
    def __init__(self, kind: str, name: str) -> None:
        self.type = f"compute.googleapis.com/{kind}"
        self.name = _Name(name)


def allows(expression: str, kind: str, name: str) -> bool:
    """Evaluate the binding's condition (CEL: ==, !=, &&, ||, startsWith, extract) for one
    resource: the operators spelled as Python's, the functions by :class:`_Name` (no name in
    it holds ``&&`` or ``||``)."""
    py = expression.replace("&&", " and ").replace("||", " or ")
    return bool(eval(py, {"__builtins__": {}}, {"resource": _Resource(kind, name)}))


def test_gcp_controller_roles_are_custom_and_its_launch_role_is_limited_to_the_fleets_vms(
    gcp: dict[str, Any], tmp_path: Path
) -> None:
    """Before: roles/compute.instanceAdmin.v1 on the whole project (any VM, any image)."""
    roles = by_label(gcp["google_project_iam_custom_role"], "controller_catalog") | {
        "launch": by_label(gcp["google_project_iam_custom_role"], "controller_launch")[None]
    }
    catalog, launch = roles[None], roles["launch"]
    assert set(catalog["permissions"]) == CATALOG
    assert all(p.endswith((".list", ".get")) for p in catalog["permissions"]), "reads only"
    assert set(launch["permissions"]) == LAUNCH
    # the module's project-wide bindings: the controller's two roles, nothing predefined
    bound = {label_of(m): m for m in gcp["google_project_iam_member"]}
    assert set(bound) == {"controller_catalog", "controller_launch"}
    assert bound["controller_catalog"]["role"] == catalog["id"]
    assert bound["controller_launch"]["role"] == launch["id"]
    assert bound["controller_catalog"]["member"] == bound["controller_launch"]["member"]
    assert not bound["controller_catalog"].get("condition")
    cond = bound["controller_launch"]["condition"]["expression"]
    assert cond["__attribute__"] == "local.controller_launch_condition"
    # its value for GCP_ROOT's variables (the module's defaults for the others)
    expr = _gcp_condition(
        tmp_path / "two",
        {
            "jobs": {job: {} for job in JOBS},
            "project_id": "my-project-123",
            "region": "us-central1",
            "image": "projects/my-project-123/global/images/family/spotguard",
            "network": "default",
            "subnetwork": None,
        },
    )["condition"]
    from spotguard.providers.gcp import instance_name

    zone = "projects/my-project-123/zones/us-central1-a"
    for job in JOBS:
        vm = instance_name(job, "c7f3e2a1-round-2")
        assert allows(expr, "Instance", f"{zone}/instances/{vm}"), vm
        assert allows(expr, "Disk", f"{zone}/disks/{vm}"), vm  # the boot disk takes its name
    for kind, name in [
        ("Instance", f"{zone}/instances/{instance_name('train-c', 'x')}"),  # not a fleet job
        ("Instance", f"{zone}/instances/database-1"),
        ("Instance", "projects/other-project/zones/us-central1-a/instances/sg-train-a-x"),
        ("Disk", f"{zone}/disks/database-1-data"),
        ("Image", "projects/someone-else/global/images/backdoored"),
        ("Network", "projects/my-project-123/global/networks/admin"),
        ("Subnetwork", "projects/other-project/regions/us-central1/subnetworks/default"),
    ]:
        assert not allows(expr, kind, name), (kind, name)
    assert allows(expr, "Image", "projects/my-project-123/global/images/spotguard-20261125")
    assert allows(expr, "Network", "projects/my-project-123/global/networks/default")
    assert allows(expr, "Subnetwork", "projects/my-project-123/regions/us-central1/subnetworks/d")


def _gcp_condition(tmp: Path, tfvars: dict[str, Any]) -> dict[str, Any]:
    """iam.tf's controller locals, evaluated by ``terraform console`` with ``tfvars``."""
    text = (GCP_MODULE / "iam.tf").read_text()
    m = re.search(r"\nlocals \{\n((?:  #.*\n)*  controller_vm_prefixes .*?)\n\}\n", text, re.S)
    assert m, "iam.tf has no locals block with controller_vm_prefixes"
    tmp.mkdir(parents=True)
    variables = "\n".join(
        f'variable "{k}" {{\n  default = {json.dumps(v)}\n}}' for k, v in tfvars.items()
    )
    (tmp / "main.tf").write_text(f"{variables}\nlocals {{\n{m.group(1)}\n}}\n")
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not installed")
    expr = (
        "jsonencode({prefixes = local.controller_vm_prefixes,"
        " condition = local.controller_launch_condition})"
    )
    out = subprocess.run(
        [terraform, "console"], input=expr, cwd=tmp, capture_output=True, text=True, check=True
    )
    return dict(json.loads(json.loads(out.stdout.strip())))


def test_gcp_controller_condition_follows_the_names_spotguard_gives_and_the_given_places(
    tmp_path: Path,
) -> None:
    from spotguard.providers.gcp import instance_name

    jobs = ["train-a", "train_b", "a-job-name-longer-than-twenty-eight-characters", "x"]
    base = {"jobs": {j: {} for j in jobs}, "project_id": "p-123456", "region": "europe-west4"}
    got = _gcp_condition(
        tmp_path / "named",
        base
        | {
            "image": "projects/img-proj/global/images/spotguard-20261125",
            "network": "https://www.googleapis.com/compute/v1/projects/host-p/global/networks/n",
            "subnetwork": "sub-1",
        },
    )
    expr = got["condition"]
    for job in jobs:
        vm = instance_name(job, "8c1d1f9e-0b3a-4c1e-a2f4-77e0a0c1b2d3")
        assert [p for p in got["prefixes"] if vm.startswith(p)], (job, vm, got["prefixes"])
        assert allows(expr, "Instance", f"projects/p-123456/zones/europe-west4-b/instances/{vm}")
    assert not allows(expr, "Instance", "projects/p-123456/zones/europe-west4-b/instances/sg-y-1")
    img = "projects/img-proj/global/images/spotguard-20261125"
    assert allows(expr, "Image", img) and not allows(expr, "Image", img + "-other")
    assert allows(expr, "Network", "projects/host-p/global/networks/n")
    sub = "projects/p-123456/regions/europe-west4/subnetworks/sub-1"
    assert allows(expr, "Subnetwork", sub) and not allows(expr, "Subnetwork", sub + "x")
    # an image family: that project's images; the default network and any subnetwork of the
    # project (the network's own in each zone's region)
    fam = _gcp_condition(
        tmp_path / "family",
        base
        | {
            "image": "projects/img-proj/global/images/family/spotguard",
            "network": "default",
            "subnetwork": None,
        },
    )["condition"]
    assert allows(fam, "Image", "projects/img-proj/global/images/spotguard-20261126")
    assert not allows(fam, "Image", "projects/other/global/images/spotguard-20261126")
    assert allows(fam, "Network", "projects/p-123456/global/networks/default")
    assert allows(fam, "Subnetwork", "projects/p-123456/regions/us-east1/subnetworks/default")
    assert not allows(fam, "Subnetwork", "projects/other/regions/us-east1/subnetworks/default")


# ----- the images bucket: what the controller may do with objects ---------------------------


def test_gcp_controller_reads_and_deletes_images_and_nothing_more(gcp: dict[str, Any]) -> None:
    """As on AWS (GetObject, DeleteObject, ListBucket): the controller reads images and
    deletes what gc collects. Before: roles/storage.objectUser on the bucket, which also
    creates and overwrites objects — a controller's credentials could write images."""
    members = [
        m for m in gcp["google_storage_bucket_iam_member"] if label_of(m).startswith("controller")
    ]
    assert len(members) == 1, [label_of(m) for m in members]
    (member,) = members
    role = by_label(gcp["google_project_iam_custom_role"], "controller_images")[None]
    assert member["role"] == role["id"] and not member.get("condition")
    assert set(role["permissions"]) == {
        "storage.objects.delete",
        "storage.objects.get",
        "storage.objects.list",
    }
    assert not any(p.endswith((".create", ".update", ".setIamPolicy")) for p in role["permissions"])


# ----- tokens: the admin token never reaches a VM, each VM gets its own job's -------------------

MODULES = {"aws": AWS_MODULE, "gcp": GCP_MODULE}


def _block(text: str, head: str) -> str:
    """The HCL block or object literal that starts at the first ``{`` after ``head``."""
    start = text.index("{", text.index(head) + len(head))
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    raise AssertionError(f"unbalanced block after {head!r}")


def _console(tmp: Path, main_tf: str, expr: str, *args: str) -> str:
    """``terraform console`` of ``expr`` in a root module of ``main_tf``: its output and its
    diagnostics (a failed variable validation is printed there, the exit status stays 0)."""
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not installed")
    tmp.mkdir(parents=True)
    (tmp / "main.tf").write_text(main_tf)
    out = subprocess.run(
        [terraform, "console", "-no-color", *args],
        input=expr,
        cwd=tmp,
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout + out.stderr


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_the_admin_token_and_another_jobs_token_are_refused_by_the_module(
    cloud: str, tmp_path: Path
) -> None:
    """The module's own variable rules (variables.tf), evaluated by terraform: a non-null
    ``controller_token`` (the admin token in every VM's user data, before) and a
    ``job_tokens`` value that is not ``sgvm1.<that job>.`` are refused."""
    text = (MODULES[cloud] / "variables.tf").read_text()
    heads = [f'variable "{n}"' for n in ("controller_token", "job_tokens")]
    main_tf = "".join(f"{head} {_block(text, head)}\n" for head in heads)
    refused = "Invalid value for variable"
    cases = {
        "admin": ["-var", "controller_token=the-admin-token"],
        "b-for-a": ["-var", 'job_tokens={"train-a"="sgvm1.train-b.0.x"}'],
        "prefix": ["-var", 'job_tokens={"train-a"="sgvm1.train-ab.0.x"}'],
        "plain": ["-var", 'job_tokens={"train-a"="the-admin-token"}'],
    }
    for case, args in cases.items():
        out = _console(tmp_path / case, main_tf, "1", *args)
        assert refused in out, (case, out)
        assert "never the admin token" in out or "no longer accepted" in out, (case, out)
    ok = ["-var", 'job_tokens={"train-a"="sgvm1.train-a.0.x","train-b"="sgvm1.train-b.0.y"}']
    out = _console(tmp_path / "ok", main_tf, "1", *ok)
    assert refused not in out and "Error" not in out, out


def _user_data(cloud: str, tmp: Path, tokens: dict[str, str]) -> dict[str, str]:
    """Each job's first-boot script as the module renders it: the module's own
    ``templatefile`` call (its argument object, ``each.key`` / ``each.value`` bound per job)
    of its own template, by ``terraform console``, with sample values for the locals the
    call reads (the store URL and key sources) and the module's ``local.spotguard``."""
    module = MODULES[cloud]
    tf = "launch_template.tf" if cloud == "aws" else "instance_template.tf"
    call = 'templatefile("${path.module}/templates/first-boot.sh.tftpl",'
    args = _block((module / tf).read_text(), call)
    args = args.replace("each.key", "k").replace("each.value", "v")
    spotguard = _block((module / "main.tf").read_text(), "  spotguard = ")
    tpl = json.dumps(str(module / "templates" / "first-boot.sh.tftpl"))
    main_tf = (
        'variable "jobs" {\n  default = {"train-a" = {command = "a"}, "train-b" = '
        '{command = "b"}}\n}\n'
        f'variable "job_tokens" {{\n  default = {json.dumps(tokens)}\n}}\n'
        'variable "controller_url" {\n  default = "https://controller.example:8700"\n}\n'
        'variable "controller_tls" {\n  default = true\n}\n'
        "locals {\n"
        f"  spotguard = {spotguard}\n"
        '  store_url = "s3://bucket-x"\n'
        '  signing_key_source = {for k in keys(var.jobs) : k => "sign-${k}"}\n'
        '  verify_key_source = {for k in keys(var.jobs) : k => "verify-${k}"}\n'
        f"  user_data = {{for k, v in var.jobs : k => base64encode(templatefile({tpl}, {args}))}}\n"
        "}\n"
    )
    out = _console(tmp / "render", main_tf, "jsonencode(local.user_data)")
    assert "Error" not in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith('"'))
    return {k: base64.b64decode(v).decode() for k, v in json.loads(json.loads(line)).items()}


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_each_jobs_user_data_holds_its_own_token_and_no_other(cloud: str, tmp_path: Path) -> None:
    tokens = {"train-a": "sgvm1.train-a.0.TOKEN-OF-A", "train-b": "sgvm1.train-b.0.TOKEN-OF-B"}
    scripts = _user_data(cloud, tmp_path, tokens)
    assert set(scripts) == set(JOBS)
    for job, other in (("train-a", "train-b"), ("train-b", "train-a")):
        assert tokens[job] in scripts[job]
        assert tokens[other] not in scripts[job] and "TOKEN-OF" not in scripts[job].replace(
            tokens[job], ""
        )
