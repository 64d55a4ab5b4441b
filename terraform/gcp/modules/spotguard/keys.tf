# Image signing keys, one pair per job (docs/security.md, "One VM's credentials"). A job's
# agents sign its images with the job's private key, a secret only that job's service account
# may access; restoring hosts of the job trust the job's public key, bound to the job
# ("job=<job> ssh-ed25519 …"), and the controller trusts every job's public key, each for its
# own job. A VM taken over can sign images of its own job only — as its account could already
# write them — and no host of another job, nor the controller, accepts them as another job's.
#
# By default Terraform generates each job's Ed25519 pair: the private keys are then also in the
# Terraform state (keep the state bucket private and encrypted). To keep a job's key out of the
# state, make it elsewhere (`spotguard images keygen job.key`), store it in a secret yourself
# and name it in job_signing_keys.
# VMs never receive key material in metadata: the first-boot config and each assignment name
# the job's secrets, and `spotguard fetch-keys` (ExecStartPre of the agent unit) reads them with
# the VM's service account.
locals {
  generated_key_jobs = toset([for job in keys(var.jobs) : job if !contains(keys(var.job_signing_keys), job)])

  job_signing_secret = merge(
    { for job in local.generated_key_jobs : job => google_secret_manager_secret.image_signing[job].id },
    { for job, k in var.job_signing_keys : job => k.secret if contains(keys(var.jobs), job) },
  )
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

  signing_key_source = { for job in keys(var.jobs) : job => "gcp-secretmanager:${local.job_signing_secret[job]}" }
  verify_key_source  = { for job in keys(var.jobs) : job => "gcp-secretmanager:${google_secret_manager_secret.image_verify_key[job].id}" }
}

resource "tls_private_key" "image_signing" {
  for_each = local.generated_key_jobs

  algorithm = "ED25519"
}

resource "google_secret_manager_secret" "image_signing" {
  for_each = local.generated_key_jobs

  project   = var.project_id
  secret_id = "${var.name}-image-signing-key-${each.key}"
  labels    = merge(local.labels, { "${local.spotguard.label_job}" = each.key })

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "image_signing" {
  for_each = local.generated_key_jobs

  secret      = google_secret_manager_secret.image_signing[each.key].id
  secret_data = tls_private_key.image_signing[each.key].private_key_openssh
}

# Only the job's own service account may read the job's private key (the controller never
# needs it; no other job's account is bound).
resource "google_secret_manager_secret_iam_member" "agent_signing_key" {
  for_each = var.jobs

  project   = var.project_id
  secret_id = local.job_signing_secret[each.key]
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.agent[each.key].email}"
}

# The public keys are not secret; a secret gives them versions and per-account read access.
resource "google_secret_manager_secret" "image_verify_key" {
  for_each = var.jobs

  project   = var.project_id
  secret_id = "${var.name}-image-verify-key-${each.key}"
  labels    = merge(local.labels, { "${local.spotguard.label_job}" = each.key })

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "image_verify_key" {
  for_each = var.jobs

  secret      = google_secret_manager_secret.image_verify_key[each.key].id
  secret_data = local.job_verify_key[each.key]
}

resource "google_secret_manager_secret_iam_member" "agent_verify_key" {
  for_each = var.jobs

  project   = var.project_id
  secret_id = google_secret_manager_secret.image_verify_key[each.key].id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.agent[each.key].email}"
}
