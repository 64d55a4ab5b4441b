# One instance template per job: SPOT provisioning, shielded VM, no external IP, the job's own
# service account, and a startup script for the job's FIRST boot (write the agent config, start
# the command under spotguard, start the agent). When the controller relaunches the job it sets
# the startup-script metadata to contracts.Assignment.user_data() instead (write
# /etc/spotguard/assignment.json, restart the agent): the agent restores the last image.
locals {
  # Machine families whose GPUs come with the machine type (no guest_accelerator block).
  bundled_gpu_families = ["a2", "a3", "a4", "g2", "g4"]
}

resource "google_compute_instance_template" "job" {
  for_each = var.jobs

  project      = var.project_id
  region       = var.region
  name_prefix  = "${substr("${var.name}-${each.key}", 0, 36)}-"
  description  = "spotguard GPU VM for job ${each.key}"
  machine_type = coalesce(each.value.machine_type, var.machine_type)
  labels       = merge(local.labels, { "${local.spotguard.label_job}" = each.key })

  disk {
    source_image = var.image
    boot         = true
    auto_delete  = true
    disk_size_gb = var.boot_disk_size_gb
    disk_type    = var.boot_disk_type
    labels       = merge(local.labels, { "${local.spotguard.label_job}" = each.key })
  }

  network_interface {
    network    = var.network
    subnetwork = var.subnetwork
  }

  dynamic "guest_accelerator" {
    for_each = contains(local.bundled_gpu_families, split("-", coalesce(each.value.machine_type, var.machine_type))[0]) ? [] : [1]

    content {
      type  = coalesce(each.value.gpu_type, var.gpu_type)
      count = coalesce(each.value.gpu_count, var.gpu_count)
    }
  }

  scheduling {
    provisioning_model          = "SPOT"
    preemptible                 = true
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE"
    instance_termination_action = var.termination_action
  }

  shielded_instance_config {
    enable_secure_boot          = var.enable_secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  service_account {
    email  = google_service_account.agent[each.key].email
    scopes = ["cloud-platform"]
  }

  metadata = {
    block-project-ssh-keys = "TRUE"
    enable-oslogin         = "TRUE"
    serial-port-enable     = "FALSE"
    startup-script = templatefile("${path.module}/templates/first-boot.sh.tftpl", {
      job                 = each.key
      store_url           = local.store_url
      controller_url      = var.controller_url
      insecure_controller = !var.controller_tls
      job_token           = lookup(var.job_tokens, each.key, null)
      key_sources = {
        signing = local.signing_key_source[each.key]
        verify  = local.verify_key_source[each.key]
      }
      command     = each.value.command
      paths       = local.spotguard
      run_command = format(local.spotguard.run_command, each.key, local.spotguard.job_script_path)
    })
  }

  lifecycle {
    create_before_destroy = true

    precondition {
      condition     = var.controller_url == null || contains(nonsensitive(keys(var.job_tokens)), each.key)
      error_message = "controller_url is set but job_tokens has no token for this job: run `spotguard controller --issue-token <job>` on the controller host and add it to job_tokens."
    }
  }
}
