output "bucket_name" {
  description = "Image bucket."
  value       = aws_s3_bucket.images.bucket
}

output "store_url" {
  description = "Store URL for agents and the controller ([agent] store / SPOTGUARD_STORE)."
  value       = local.store_url
}

output "kms_key_arn" {
  description = "KMS key encrypting the bucket and the queues."
  value       = aws_kms_key.this.arn
}

output "queue_url" {
  description = "Fleet event queue the controller reads ([fleet] queue_url / SPOTGUARD_FLEET_QUEUE_URL)."
  value       = aws_sqs_queue.events.url
}

output "queue_arn" {
  description = "ARN of the fleet event queue."
  value       = aws_sqs_queue.events.arn
}

output "dead_letter_queue_url" {
  description = "Events the controller failed to process max_receive_count times."
  value       = aws_sqs_queue.events_dlq.url
}

output "event_rule_arns" {
  description = "EventBridge rules forwarding interruption events, by kind."
  value       = { for key, rule in aws_cloudwatch_event_rule.interruptions : key => rule.arn }
}

output "agent_role_arns" {
  description = "Agent role of each job."
  value       = { for job, role in aws_iam_role.agent : job => role.arn }
}

output "agent_instance_profiles" {
  description = "Agent instance profile of each job."
  value       = { for job, profile in aws_iam_instance_profile.agent : job => profile.name }
}

output "launch_template_names" {
  description = "Launch template of each job ([aws] aws_launch_template of the controller)."
  value       = { for job, lt in aws_launch_template.job : job => lt.name }
}

output "launch_template_ids" {
  description = "Launch template id of each job."
  value       = { for job, lt in aws_launch_template.job : job => lt.id }
}

output "controller_role_arn" {
  description = "Role of the controller."
  value       = aws_iam_role.controller.arn
}

output "controller_instance_profile" {
  description = "Instance profile for a controller running on EC2."
  value       = aws_iam_instance_profile.controller.name
}

output "controller_config" {
  description = "TOML for the controller's /etc/spotguard/spotguard.toml: [controller] (provider aws, listen, the store, the token file, the VMs' key sources), [image] (the fleet's public key), [fleet] (the queue) and [aws] (region, each job's template as the {job} pattern)."
  value = templatefile("${path.module}/templates/controller.toml.tftpl", {
    listen              = var.controller_listen
    advertise_url       = var.controller_url
    store_url           = local.store_url
    token_path          = local.spotguard.token_path
    tls                 = var.controller_tls
    credentials_dir     = local.spotguard.credentials_dir
    queue_url           = aws_sqs_queue.events.url
    region              = local.region
    launch_template     = "${var.name}-{job}"
    signing_key_sources = local.signing_key_source
    verify_key_sources  = local.verify_key_source
    verify_key          = local.image_verify_key
    subnets             = { for id, subnet in data.aws_subnet.launch : subnet.availability_zone => id }
  })
}

output "image_signing_key_secret_arns" {
  description = "Secrets Manager secret holding each job's image signing key, by job (each readable by that job's role only)."
  value       = local.job_signing_secret_arn
}

output "image_verify_key_parameters" {
  description = "SSM parameter holding each job's public image verify key(s), by job."
  value       = { for job, p in aws_ssm_parameter.image_verify_key : job => p.name }
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
