output "store_url" {
  description = "Image store URL."
  value       = module.spotguard.store_url
}

output "queue_url" {
  description = "Fleet event queue for the controller."
  value       = module.spotguard.queue_url
}

output "launch_template_names" {
  description = "Launch template per job."
  value       = module.spotguard.launch_template_names
}

output "controller_instance_profile" {
  description = "Instance profile for the controller VM."
  value       = module.spotguard.controller_instance_profile
}

output "controller_config" {
  description = "TOML for the controller's config file."
  value       = module.spotguard.controller_config
}

output "image_verify_key" {
  description = "Every job's public image verify key, each bound to its job (job=<job> ssh-ed25519 …)."
  value       = module.spotguard.image_verify_key
}
