"""Static checks of the Terraform modules: providers cannot be downloaded here, so
``terraform validate`` cannot run. These stand in for it: ``terraform fmt``, a parse of every
file, values resolved by tfparse (variables, locals, for_each) asserted, and checkov."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest

from spotguard.contracts import LABEL_JOB, LABEL_MANAGED, TAG_JOB, TAG_MANAGED
from spotguard.notices.fleet import EVENT_PATTERNS

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM = ROOT / "terraform"
AWS_MODULE = TERRAFORM / "aws" / "modules" / "spotguard"
AWS_EXAMPLE = TERRAFORM / "aws" / "examples" / "basic"
GCP_EXAMPLE = TERRAFORM / "gcp" / "examples" / "basic"
HCL_FILES = sorted([*TERRAFORM.rglob("*.tf"), *(ROOT / "ami").rglob("*.pkr.hcl")])


def terraform_bin() -> str:
    path = shutil.which("terraform")
    if path is None:
        pytest.fail("terraform is not installed (the infra checks need terraform >= 1.5 on PATH)")
    return path


def test_terraform_fmt_is_clean() -> None:
    out = subprocess.run(
        [terraform_bin(), "fmt", "-check", "-recursive", "-diff", "-no-color", str(TERRAFORM)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", [p for p in HCL_FILES if p.suffixes[-2:] == [".pkr", ".hcl"]])
def test_packer_template_is_formatted(path: Path) -> None:
    """``terraform fmt -`` formats any HCL, including Packer's (packer itself is not here)."""
    out = subprocess.run(
        [terraform_bin(), "fmt", "-no-color", "-"],
        input=path.read_text(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == path.read_text(), f"{path} is not formatted"


def test_every_hcl_file_parses() -> None:
    assert len(HCL_FILES) >= 15
    for path in HCL_FILES:
        with path.open() as f:
            doc = hcl2.load(f)
        assert doc, f"{path} holds no blocks"


def _blocks(doc: dict[str, Any], kind: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for item in doc.get(kind, []):
        for rtype, named in item.items():
            for name, body in named.items():
                yield rtype.strip('"'), name.strip('"'), body


def test_every_variable_and_output_is_described_and_typed() -> None:
    for path in HCL_FILES:
        if path.suffix != ".tf":
            continue
        with path.open() as f:
            doc = hcl2.load(f)
        for var in doc.get("variable", []):
            for name, body in var.items():
                assert body.get("description"), f"{path}: variable {name} has no description"
                assert body.get("type"), f"{path}: variable {name} has no type"
        for out in doc.get("output", []):
            for name, body in out.items():
                assert body.get("description"), f"{path}: output {name} has no description"


def _module_dirs() -> list[Path]:
    return sorted({p.parent for p in TERRAFORM.rglob("*.tf")})


def test_every_var_and_local_reference_is_declared() -> None:
    """What ``terraform validate`` would catch first: ``var.X`` and ``local.X`` naming nothing
    declared in the same module (templates' arguments included, since outputs pass them)."""
    for d in _module_dirs():
        variables: set[str] = set()
        local_names: set[str] = set()
        texts = []
        for path in sorted(d.glob("*.tf")):
            with path.open() as f:
                doc = hcl2.load(f)
            for var in doc.get("variable", []):
                variables |= {name.strip('"') for name in var}
            for block in doc.get("locals", []):
                local_names |= set(block)
            texts.append((path, path.read_text()))
        for path, text in texts:
            for name in set(re.findall(r"\bvar\.([A-Za-z_][A-Za-z0-9_-]*)", text)):
                assert name in variables, f"{path}: var.{name} is not declared in {d}"
            for name in set(re.findall(r"\blocal\.([A-Za-z_][A-Za-z0-9_-]*)", text)):
                assert name in local_names, f"{path}: local.{name} is not declared in {d}"


# ----- values resolved by tfparse -------------------------------------------------------------


@pytest.fixture(scope="module")
def aws() -> dict[str, Any]:
    from tfparse import load_from_path

    return dict(load_from_path(str(AWS_EXAMPLE)))


@pytest.fixture(scope="module")
def gcp() -> dict[str, Any]:
    from tfparse import load_from_path

    return dict(load_from_path(str(GCP_EXAMPLE)))


def name_of(block: dict[str, Any]) -> str:
    """The block's name in its module (``job`` of ``module.x.aws_launch_template.job["a"]``)."""
    m = re.search(r"\.([A-Za-z0-9_-]+)(\[[^\]]*\])?$", block["__tfmeta"]["path"])
    assert m, block["__tfmeta"]
    return m.group(1)


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def test_aws_launch_template_requires_imdsv2_and_encrypts_root(aws: dict[str, Any]) -> None:
    templates = aws["aws_launch_template"]
    assert templates
    for lt in templates:
        meta = lt["metadata_options"]
        assert meta["http_tokens"] == "required"
        assert meta["http_endpoint"] == "enabled"
        assert meta["http_put_response_hop_limit"] == 1
        for bdm in as_list(lt["block_device_mappings"]):
            assert bdm["ebs"]["encrypted"] is True
        assert lt["iam_instance_profile"]["arn"], "no instance profile"
        tags = {k: v for spec in as_list(lt["tag_specifications"]) for k, v in spec["tags"].items()}
        assert tags[TAG_MANAGED] == "true"
        assert tags[TAG_JOB] in lt["for_each"]
        assert "instance_market_options" not in lt, "spot/on-demand is the controller's choice"


def test_aws_bucket_encrypted_versioned_and_never_public(aws: dict[str, Any]) -> None:
    (sse,) = aws["aws_s3_bucket_server_side_encryption_configuration"]
    rule = sse["rule"]["apply_server_side_encryption_by_default"]
    assert rule["sse_algorithm"] == "aws:kms"
    assert rule["kms_master_key_id"] == aws["aws_kms_key"][0]["id"]
    (pab,) = aws["aws_s3_bucket_public_access_block"]
    for flag in ("block_public_acls", "block_public_policy", "ignore_public_acls"):
        assert pab[flag] is True
    assert pab["restrict_public_buckets"] is True
    (ver,) = aws["aws_s3_bucket_versioning"]
    assert ver["versioning_configuration"]["status"] == "Enabled"
    (life,) = aws["aws_s3_bucket_lifecycle_configuration"]
    actions = {key for r in as_list(life["rule"]) for key in r}
    assert {"abort_incomplete_multipart_upload", "noncurrent_version_expiration"} <= actions
    (own,) = aws["aws_s3_bucket_ownership_controls"]
    assert own["rule"]["object_ownership"] == "BucketOwnerEnforced"
    assert all(k["enable_key_rotation"] is True for k in aws["aws_kms_key"])


def test_aws_queues_encrypted_with_dead_letter(aws: dict[str, Any]) -> None:
    queues = {q["name"]: q for q in aws["aws_sqs_queue"]}
    assert set(queues) == {"spotguard-demo-events", "spotguard-demo-events-dlq"}
    key = aws["aws_kms_key"][0]["id"]
    assert all(q["kms_master_key_id"] == key for q in queues.values())
    redrive = json.loads(queues["spotguard-demo-events"]["redrive_policy"])
    assert redrive["deadLetterTargetArn"] == queues["spotguard-demo-events-dlq"]["id"]


def policy_statements(aws: dict[str, Any], label: str) -> list[dict[str, Any]]:
    (doc,) = [d for d in aws["aws_iam_policy_document"] if name_of(d) == label]
    return as_list(doc["statement"])


def test_no_wildcard_actions_on_wildcard_resources(aws: dict[str, Any]) -> None:
    """No Allow of ``*`` or ``service:*`` on ``*``; anything on ``*`` is a read-only Describe
    (EC2 Describe calls accept no other resource). The KMS key policy is the one exception:
    there, ``*`` names the key itself and the account-root statement is AWS's default."""
    for doc in aws["aws_iam_policy_document"]:
        label = name_of(doc)
        for st in as_list(doc["statement"]):
            if st.get("effect", "Allow") != "Allow" or "*" not in as_list(st.get("resources")):
                continue
            if label == "kms":
                continue
            for action in st["actions"]:
                assert action != "*" and not action.endswith(":*"), (label, st)
                assert action.split(":")[1].startswith("Describe"), (label, st)


def test_aws_agent_reaches_only_its_job_prefix(aws: dict[str, Any]) -> None:
    prefix_var = f"${{aws:PrincipalTag/{TAG_JOB}}}"
    for st in policy_statements(aws, "agent"):
        actions = st["actions"]
        if any(a.startswith("s3:") for a in actions):
            if actions == ["s3:ListBucket"]:
                assert st["condition"]["variable"] == "s3:prefix"
                assert as_list(st["condition"]["values"]) == [f"{prefix_var}/*"]
            else:
                assert all(r.endswith(f"/{prefix_var}/*") for r in st["resources"]), st
            assert "s3:DeleteObject" not in actions
    roles = [r for r in aws["aws_iam_role"] if name_of(r) == "agent"]
    assert roles and all(r["tags"][TAG_JOB] in r["for_each"] for r in roles)


def test_aws_controller_acts_only_on_managed_instances(aws: dict[str, Any]) -> None:
    by_sid = {st["sid"]: st for st in policy_statements(aws, "controller")}
    run = {
        c["variable"]: c["values"] for c in as_list(by_sid["RunOnlyTaggedInstances"]["condition"])
    }
    assert run[f"aws:RequestTag/{TAG_MANAGED}"] == ["true"]
    term = by_sid["TerminateOnlyManaged"]
    assert term["actions"] == ["ec2:TerminateInstances"]
    assert term["condition"]["variable"] == f"ec2:ResourceTag/{TAG_MANAGED}"
    tag = by_sid["TagOnlyAtLaunch"]["condition"]
    assert (tag["variable"], tag["values"]) == ("ec2:CreateAction", ["RunInstances"])
    pass_role = by_sid["PassOnlyAgentRoles"]
    assert pass_role["actions"] == ["iam:PassRole"]
    assert "*" not in as_list(pass_role["resources"])
    assert pass_role["condition"]["values"] == ["ec2.amazonaws.com"]


def test_aws_event_rules_match_the_fleet_source(aws: dict[str, Any]) -> None:
    on_disk = json.loads((AWS_MODULE / "event-patterns.json").read_text())
    assert on_disk == EVENT_PATTERNS
    rules = {r["name"]: json.loads(r["event_pattern"]) for r in aws["aws_cloudwatch_event_rule"]}
    assert rules == {f"spotguard-demo-{k}": v for k, v in EVENT_PATTERNS.items()}
    targets = aws["aws_cloudwatch_event_target"]
    queue = next(q for q in aws["aws_sqs_queue"] if q["name"] == "spotguard-demo-events")
    assert len(targets) == 3 and all(t["arn"] == queue["id"] for t in targets)
    (st,) = policy_statements(aws, "queue")
    assert st["principals"]["identifiers"] == ["events.amazonaws.com"]
    assert st["actions"] == ["sqs:SendMessage"]
    assert st["condition"]["variable"] == "aws:SourceArn"


def test_gcp_instance_template_is_spot_shielded_and_private(gcp: dict[str, Any]) -> None:
    templates = gcp["google_compute_instance_template"]
    assert templates
    for t in templates:
        sched = t["scheduling"]
        assert sched["provisioning_model"] == "SPOT"
        assert sched["preemptible"] is True
        assert sched["automatic_restart"] is False
        assert sched["on_host_maintenance"] == "TERMINATE"
        shield = t["shielded_instance_config"]
        assert shield["enable_secure_boot"] and shield["enable_vtpm"]
        assert shield["enable_integrity_monitoring"]
        for nic in as_list(t["network_interface"]):
            assert "access_config" not in nic, "GPU VMs get no external IP"
        assert t["metadata"]["block-project-ssh-keys"] == "TRUE"
        assert t["metadata"]["serial-port-enable"] == "FALSE"
        assert t["labels"][LABEL_MANAGED] == "true"
        assert t["labels"][LABEL_JOB] in t["for_each"]
        family = t["machine_type"].split("-")[0]
        assert family in ("a2", "a3", "a4", "g2", "g4") or t.get("guest_accelerator"), t
        assert "startup-script" in t["metadata"]


def test_gcp_bucket_uniform_private_versioned(gcp: dict[str, Any]) -> None:
    (bucket,) = gcp["google_storage_bucket"]
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert bucket["versioning"]["enabled"] is True
    actions = {r["action"]["type"] for r in as_list(bucket["lifecycle_rule"])}
    assert actions == {"AbortIncompleteMultipartUpload", "Delete"}


def test_gcp_agent_bindings_are_limited_to_the_job_prefix(gcp: dict[str, Any]) -> None:
    agent = [
        b
        for b in gcp["google_storage_bucket_iam_member"]
        if name_of(b) in ("agent_objects", "agent_list")
    ]
    assert len(agent) == 2
    for b in agent:
        (job,) = b["for_each"]
        expr = b["condition"]["expression"]
        assert f'/objects/{job}/")' in expr or f'startsWith("{job}/")' in expr, expr
    admins = [m for m in gcp["google_project_iam_member"] if "owner" in m["role"]]
    assert not admins


# ----- checkov ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkov_report() -> list[dict[str, Any]]:
    """One offline checkov run over terraform/, ami/ and packaging/ (~5 s on 2 cores)."""
    exe = shutil.which("checkov")
    if exe is None:
        pytest.fail("checkov is not installed (pip install -e '.[dev]')")
    out = subprocess.run(
        [
            exe,
            *("-d", str(TERRAFORM), "-d", str(ROOT / "ami"), "-d", str(ROOT / "packaging")),
            *("--framework", "terraform", "secrets"),
            "--skip-download",
            *("-o", "json"),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": str(Path(exe).parent) + ":/usr/bin:/bin", "HOME": "/tmp"},
        timeout=240,
    )
    assert out.stdout.strip(), out.stderr[-2000:]
    # One JSON document per framework (a list or an object), printed one after another.
    reports: list[dict[str, Any]] = []
    decoder, text, pos = json.JSONDecoder(), out.stdout, 0
    while text[pos:].strip():
        doc, end = decoder.raw_decode(text[pos:].lstrip())
        pos = len(text) - len(text[pos:].lstrip()) + end
        reports.extend(doc if isinstance(doc, list) else [doc])
    return reports


def test_checkov_finds_no_failed_check(checkov_report: list[dict[str, Any]]) -> None:
    summary = {r["check_type"]: r["summary"] for r in checkov_report}
    assert summary["terraform"]["resource_count"] >= 30
    assert summary["terraform"]["passed"] >= 100
    for r in checkov_report:
        assert r["summary"]["parsing_errors"] == 0, r["summary"]
        failed = [
            (c["check_id"], c["resource"], c["file_path"]) for c in r["results"]["failed_checks"]
        ]
        assert not failed, failed


def test_every_checkov_skip_is_justified_in_place(checkov_report: list[dict[str, Any]]) -> None:
    skipped = [c for r in checkov_report for c in r["results"].get("skipped_checks", [])]
    for c in skipped:
        reason = c["check_result"].get("suppress_comment", "")
        assert len(reason) >= 40, f"{c['check_id']} on {c['resource']}: justify the skip"


# ----- the image keys (issue 15.1; one per job since issue 27.6) -----------------------------


def test_aws_generates_an_ed25519_key_per_job_readable_by_its_role_only(
    aws: dict[str, Any],
) -> None:
    (key,) = aws["tls_private_key"]
    assert key["algorithm"] == "ED25519"
    (secret,) = aws["aws_secretsmanager_secret"]
    assert secret["kms_key_id"] == aws["aws_kms_key"][0]["id"]
    assert secret["name"] == "spotguard-demo/image-signing-key/train-llm"
    (param,) = aws["aws_ssm_parameter"]
    assert param["type"] == "String"
    assert param["name"] == "/spotguard-demo/image-verify-key/train-llm"
    (doc,) = [d for d in aws["aws_iam_policy_document"] if name_of(d) == "agent_keys"]
    agent = {st["sid"]: st for st in as_list(doc["statement"])}
    assert agent["ReadOwnJobSigningKey"]["actions"] == ["secretsmanager:GetSecretValue"]
    assert as_list(agent["ReadOwnJobSigningKey"]["resources"]) == [secret["id"]]
    assert agent["ReadOwnJobVerifyKey"]["actions"] == ["ssm:GetParameter"]
    assert as_list(agent["ReadOwnJobVerifyKey"]["resources"]) == [param["id"]]
    kms = agent["DecryptOwnJobSigningKey"]
    assert kms["actions"] == ["kms:Decrypt"]
    conds = {c["variable"]: as_list(c["values"]) for c in as_list(kms["condition"])}
    assert conds["kms:ViaService"][0].startswith("secretsmanager.")
    # Nobody else is granted the secret: the controller's policy does not name it.
    for st in policy_statements(aws, "controller"):
        assert not any(a.startswith(("secretsmanager:", "ssm:")) for a in st["actions"]), st


def test_aws_vms_are_told_where_the_keys_are_never_the_keys(aws: dict[str, Any]) -> None:
    """The first-boot user-data names the job's key sources (keys.tf locals), never key
    material."""
    keys_tf = (AWS_MODULE / "keys.tf").read_text()
    assert '"aws-secretsmanager:${local.job_signing_secret_arn[job]}"' in keys_tf
    assert '"aws-ssm:${aws_ssm_parameter.image_verify_key[job].arn}"' in keys_tf
    lt = (AWS_MODULE / "launch_template.tf").read_text()
    assert "signing = local.signing_key_source[each.key]" in lt and "private_key" not in lt


def test_gcp_secrets_readable_by_each_agent_account_only(gcp: dict[str, Any]) -> None:
    (key,) = gcp["tls_private_key"]
    assert key["algorithm"] == "ED25519"
    secrets = {s["secret_id"]: s for s in gcp["google_secret_manager_secret"]}
    assert set(secrets) == {
        "spotguard-demo-image-signing-key-train-llm",
        "spotguard-demo-image-verify-key-train-llm",
    }
    members = gcp["google_secret_manager_secret_iam_member"]
    assert sorted(name_of(m) for m in members) == ["agent_signing_key", "agent_verify_key"]
    jobs = {job for m in members for job in m["for_each"]}
    assert jobs == {"train-llm"}
    for m in members:
        assert m["role"] == "roles/secretmanager.secretAccessor"
        assert m["member"].startswith("serviceAccount:")
    # the members are the agents' accounts, one binding per job; never the controller's
    keys_tf = (TERRAFORM / "gcp" / "modules" / "spotguard" / "keys.tf").read_text()
    bound = re.findall(r'member\s+= "serviceAccount:\$\{([^}]+)\}"', keys_tf)
    assert bound == ["google_service_account.agent[each.key].email"] * 2
