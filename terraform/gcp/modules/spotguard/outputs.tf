output "bucket_name" {
  description = "Image bucket."
  value       = google_storage_bucket.images.name
}

output "store_url" {
  description = "Store URL for agents and the controller ([agent] store / SPOTGUARD_STORE)."
  value       = local.store_url
}

output "agent_service_accounts" {
  description = "Agent service account of each job."
  value       = { for job, sa in google_service_account.agent : job => sa.email }
}

output "controller_service_account" {
  description = "Service account of the controller."
  value       = google_service_account.controller.email
}

output "instance_templates" {
  description = "Instance template of each job (self link)."
  value       = { for job, t in google_compute_instance_template.job : job => t.self_link }
}

output "image_verify_key" {
  description = "The fleet's public image verify key ([image] verify_key on any host that restores or verifies images, the controller included)."
  value       = local.image_verify_key
}

output "image_key_sources" {
  description = "Key sources for `spotguard fetch-keys` ([keys] signing_key_source / verify_key_source)."
  value = {
    signing_key_source = local.signing_key_source
    verify_key_source  = local.verify_key_source
  }
}

output "controller_keys_config" {
  description = "TOML to add to the controller's /etc/spotguard/spotguard.toml: the key sources it hands every VM it launches ([controller]) and the public key it checks image metadata with ([image])."
  value       = <<-EOT
    [controller]
    vm_signing_key_source = ${jsonencode(local.signing_key_source)}
    vm_verify_key_source  = ${jsonencode(local.verify_key_source)}

    [image]
    verify_key = ${jsonencode(local.image_verify_key)}
  EOT
}
