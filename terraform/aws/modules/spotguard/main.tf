data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  account   = data.aws_caller_identity.current.account_id
  partition = data.aws_partition.current.partition
  region    = data.aws_region.current.name

  # What the machine image (ami/, packaging/) and the agent (src/spotguard) agree on.
  # These names appear nowhere else in this module: change them here only.
  spotguard = {
    etc_dir       = "/etc/spotguard"
    config_path   = "/etc/spotguard/spotguard.toml"
    token_path    = "/etc/spotguard/controller-token"
    tls_cert_path = "/etc/spotguard/controller.crt"
    tls_key_path  = "/etc/spotguard/controller.key"
    # where systemd puts the controller unit's credentials (LoadCredential=)
    credentials_dir = "/run/credentials/spotguard-controller.service"
    job_script_path = "/etc/spotguard/job.sh"
    assignment_path = "/etc/spotguard/assignment.json"
    signing_key     = "/etc/spotguard/signing.key"
    verify_key      = "/etc/spotguard/signing.pub"
    state_dir       = "/var/lib/spotguard"
    agent_service   = "spotguard-agent.service"
    run_command     = "spotguard run --name %s -- /bin/bash %s"
    tag_managed     = "spotguard:managed"
    tag_job         = "spotguard:job"
  }

  bucket_name = coalesce(var.bucket_name, "${var.name}-images-${local.account}-${local.region}")
  store_url   = "s3://${local.bucket_name}"

  # IAM names are at most 64 characters; long job names are shortened with a hash suffix.
  job_slug = {
    for job in keys(var.jobs) : job => (
      length("${var.name}-agent-${job}") <= 64
      ? "${var.name}-agent-${job}"
      : "${substr("${var.name}-agent-${job}", 0, 55)}-${substr(sha1(job), 0, 8)}"
    )
  }

  event_patterns = {
    for key, pattern in jsondecode(file("${path.module}/event-patterns.json")) :
    key => pattern if var.health_events || key != "health-scheduled"
  }
  event_rule_arns = [
    for key in keys(local.event_patterns) :
    "arn:${local.partition}:events:${local.region}:${local.account}:rule/${var.name}-${key}"
  ]

  tags = merge(var.tags, { "${local.spotguard.tag_managed}" = "true" })
}
