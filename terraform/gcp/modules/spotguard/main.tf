locals {
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
    first_boot_done = "/var/lib/spotguard/first-boot.done"
    agent_service   = "spotguard-agent.service"
    run_command     = "spotguard run --name %s -- /bin/bash %s"
    label_managed   = "spotguard-managed"
    label_job       = "spotguard-job"
  }

  bucket_name = coalesce(var.bucket_name, "${var.project_id}-${var.name}-images")
  store_url   = "gs://${local.bucket_name}"

  # Service account ids are 6-30 characters: the job name goes into the display name instead.
  agent_account_id = { for job in keys(var.jobs) : job => "${var.name}-${substr(sha1(job), 0, 10)}" }

  labels = merge(var.labels, { "${local.spotguard.label_managed}" = "true" })
}
