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
  description = "Every job's public image verify key, each bound to its job (job=<job> ssh-ed25519 …), and previous_verify_keys: [image] verify_key on any host that verifies every job's images, the controller included."
  value       = local.image_verify_key
}

output "image_key_sources" {
  description = "Key sources of each job for `spotguard fetch-keys` ([keys] signing_key_source / verify_key_source on that job's VMs), by job."
  value = {
    for job in keys(var.jobs) : job => {
      signing_key_source = local.signing_key_source[job]
      verify_key_source  = local.verify_key_source[job]
    }
  }
}

output "controller_keys_config" {
  description = "TOML to add to the controller's /etc/spotguard/spotguard.toml: each job's key sources it hands that job's VMs ([controller]) and the public keys, each bound to its job, it checks image metadata with ([image])."
  value       = <<-EOT
    [controller]
    vm_signing_key_sources = { ${join(", ", [for job, src in local.signing_key_source : "${jsonencode(job)} = ${jsonencode(src)}"])} }
    vm_verify_key_sources  = { ${join(", ", [for job, src in local.verify_key_source : "${jsonencode(job)} = ${jsonencode(src)}"])} }

    [image]
    verify_key = ${jsonencode(local.image_verify_key)}
  EOT
}

output "controller_config" {
  description = "TOML for the controller's /etc/spotguard/spotguard.toml: [controller] (provider gcp, listen, the store, the token file, the VMs' key sources), [image] (the fleet's public key) and [gcp] (project, zones, boot image, network, each job's agent service account)."
  value = templatefile("${path.module}/templates/controller.toml.tftpl", {
    listen              = var.controller_listen
    advertise_url       = var.controller_url
    store_url           = local.store_url
    token_path          = local.spotguard.token_path
    tls                 = var.controller_tls
    credentials_dir     = local.spotguard.credentials_dir
    signing_key_sources = local.signing_key_source
    verify_key_sources  = local.verify_key_source
    verify_key          = local.image_verify_key
    project             = var.project_id
    zones               = var.zones != null ? var.zones : [for z in ["a", "b", "c"] : "${var.region}-${z}"]
    image               = var.image
    network             = length(split("/", var.network)) > 1 ? var.network : "global/networks/${var.network}"
    subnetwork          = var.subnetwork == null ? null : (length(split("/", var.subnetwork)) > 1 ? var.subnetwork : "regions/${var.region}/subnetworks/${var.subnetwork}")
    disk_gb             = var.boot_disk_size_gb
    termination_action  = var.termination_action
    job_accounts        = { for job, sa in google_service_account.agent : job => sa.email }
  })
}
