# The fleet's image signing key (docs/security.md, "Delivering the keys"). Agents sign every
# image with the private key; every restoring host and the controller trust the public key, so
# restore refuses unsigned, altered, mixed or rolled-back images by default.
#
# By default Terraform generates an Ed25519 pair: the private key is then also in the Terraform
# state (keep the state bucket private and encrypted). To keep it out of the state, generate it
# elsewhere (`spotguard images keygen fleet.key`), store it in a secret yourself and set
# image_signing_key_secret and image_verify_key.
# VMs never receive key material in metadata: the first-boot config and each assignment name
# the secrets, and `spotguard fetch-keys` (ExecStartPre of the agent unit) reads them with the
# VM's service account.
locals {
  generate_signing_key = var.image_signing_key_secret == null
  signing_key_secret = (
    local.generate_signing_key ? google_secret_manager_secret.image_signing[0].id : var.image_signing_key_secret
  )
  image_verify_key   = local.generate_signing_key ? trimspace(tls_private_key.image_signing[0].public_key_openssh) : var.image_verify_key
  signing_key_source = "gcp-secretmanager:${local.signing_key_secret}"
  verify_key_source  = "gcp-secretmanager:${google_secret_manager_secret.image_verify_key.id}"
}

resource "tls_private_key" "image_signing" {
  count = local.generate_signing_key ? 1 : 0

  algorithm = "ED25519"
}

resource "google_secret_manager_secret" "image_signing" {
  count = local.generate_signing_key ? 1 : 0

  project   = var.project_id
  secret_id = "${var.name}-image-signing-key"
  labels    = local.labels

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "image_signing" {
  count = local.generate_signing_key ? 1 : 0

  secret      = google_secret_manager_secret.image_signing[0].id
  secret_data = tls_private_key.image_signing[0].private_key_openssh
}

# Only the agents' service accounts may read the private key (the controller never needs it).
resource "google_secret_manager_secret_iam_member" "agent_signing_key" {
  for_each = var.jobs

  project   = var.project_id
  secret_id = local.signing_key_secret
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.agent[each.key].email}"
}

# The public key is not secret; a secret gives it versions and per-account read access.
resource "google_secret_manager_secret" "image_verify_key" {
  project   = var.project_id
  secret_id = "${var.name}-image-verify-key"
  labels    = local.labels

  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_version" "image_verify_key" {
  secret      = google_secret_manager_secret.image_verify_key.id
  secret_data = local.image_verify_key
}

resource "google_secret_manager_secret_iam_member" "agent_verify_key" {
  for_each = var.jobs

  project   = var.project_id
  secret_id = google_secret_manager_secret.image_verify_key.id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.agent[each.key].email}"
}
