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
