# Image signing keys, one pair per job (docs/security.md, "One VM's credentials"). A job's
# agents sign its images with the job's private key, which only that job's role may read
# (iam_agent.tf, agent_keys); restoring hosts of the job trust the job's public key, bound to
# the job ("job=<job> ssh-ed25519 …"), and the controller trusts every job's public key, each
# for its own job. A VM taken over can sign images of its own job only — as its role could
# already write them — and no host of another job, nor the controller, accepts them as another
# job's.
#
# By default Terraform generates each job's Ed25519 pair: the private keys are then also in the
# Terraform state (keep the state encrypted and access-controlled, as for any secret Terraform
# manages). To keep a job's key out of the state, make it elsewhere (`spotguard images keygen
# job.key`), put it in a secret yourself and name it in job_signing_keys.
# VMs never receive key material in user-data: the first-boot config and each assignment name
# the job's secret and parameter, and `spotguard fetch-keys` (ExecStartPre of the agent unit)
# reads them with the instance role.
locals {
  generated_key_jobs = toset([for job in keys(var.jobs) : job if !contains(keys(var.job_signing_keys), job)])

  job_signing_secret_arn = merge(
    { for job in local.generated_key_jobs : job => aws_secretsmanager_secret.image_signing[job].arn },
    { for job, k in var.job_signing_keys : job => k.secret_arn if contains(keys(var.jobs), job) },
  )
  # Each job's public key(s), one OpenSSH line each.
  job_public_keys = merge(
    { for job in local.generated_key_jobs : job => [trimspace(tls_private_key.image_signing[job].public_key_openssh)] },
    {
      for job, k in var.job_signing_keys : job => [for line in split("\n", k.verify_key) : trimspace(line) if trimspace(line) != ""]
      if contains(keys(var.jobs), job)
    },
  )
  # Public keys of an earlier fleet-wide key, trusted for every job's images until they are gone.
  previous_verify_keys = [for line in split("\n", coalesce(var.previous_verify_keys, " ")) : trimspace(line) if trimspace(line) != ""]

  # What a VM of the job trusts: its own job's key(s), bound to the job, and the earlier keys.
  job_verify_key = {
    for job in keys(var.jobs) : job => join("\n", concat(
      [for line in local.job_public_keys[job] : "job=${job} ${line}"],
      local.previous_verify_keys,
    ))
  }
  # What the controller (and any host verifying every job's images) trusts.
  image_verify_key = join("\n", concat(
    flatten([for job in sort(keys(var.jobs)) : [for line in local.job_public_keys[job] : "job=${job} ${line}"]]),
    local.previous_verify_keys,
  ))

  signing_key_source = { for job in keys(var.jobs) : job => "aws-secretsmanager:${local.job_signing_secret_arn[job]}" }
  verify_key_source  = { for job in keys(var.jobs) : job => "aws-ssm:${aws_ssm_parameter.image_verify_key[job].arn}" }
}

resource "tls_private_key" "image_signing" {
  for_each = local.generated_key_jobs

  algorithm = "ED25519"
}

resource "aws_secretsmanager_secret" "image_signing" {
  #checkov:skip=CKV2_AWS_57:An image signing key cannot be rotated by a Lambda alone: hosts must trust the new public key before agents sign with it. Rotate by replacing the job's tls_private_key (terraform apply -replace), which updates the secret, the job's verify parameter and controller_config together (docs/security.md).
  for_each = local.generated_key_jobs

  name                    = "${var.name}/image-signing-key/${each.key}"
  description             = "${var.name}: Ed25519 key the agents of job ${each.key} sign its checkpoint images with"
  kms_key_id              = aws_kms_key.this.arn
  recovery_window_in_days = 7
  tags                    = merge(local.tags, { "${local.spotguard.tag_job}" = each.key })
}

resource "aws_secretsmanager_secret_version" "image_signing" {
  for_each = local.generated_key_jobs

  secret_id     = aws_secretsmanager_secret.image_signing[each.key].id
  secret_string = tls_private_key.image_signing[each.key].private_key_openssh
}

# The public keys are not secret: plain parameters, each readable by its job's role.
resource "aws_ssm_parameter" "image_verify_key" {
  #checkov:skip=CKV2_AWS_34:This parameter holds public keys (not secret); its integrity is what matters, and only this module writes it.
  for_each = var.jobs

  name        = "/${var.name}/image-verify-key/${each.key}"
  description = "${var.name}: Ed25519 public key(s) the hosts of job ${each.key} verify its checkpoint images with"
  type        = "String"
  value       = local.job_verify_key[each.key]
  tags        = merge(local.tags, { "${local.spotguard.tag_job}" = each.key })
}
