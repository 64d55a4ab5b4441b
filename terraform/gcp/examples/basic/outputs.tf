output "store_url" {
  description = "Image store URL."
  value       = module.spotguard.store_url
}

output "instance_templates" {
  description = "Instance template per job."
  value       = module.spotguard.instance_templates
}

output "controller_service_account" {
  description = "Service account to run the controller as."
  value       = module.spotguard.controller_service_account
}

output "controller_keys_config" {
  description = "Key settings for the controller's config file."
  value       = module.spotguard.controller_keys_config
}

output "controller_config" {
  description = "The controller's whole /etc/spotguard/spotguard.toml."
  value       = module.spotguard.controller_config
}
