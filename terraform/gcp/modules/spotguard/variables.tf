variable "project_id" {
  description = "GCP project to deploy into."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a valid GCP project id."
  }
}

variable "region" {
  description = "Region of the bucket and the instance templates."
  type        = string
  default     = "us-central1"
}

variable "name" {
  description = "Prefix of every resource name (bucket, service accounts, instance templates)."
  type        = string
  default     = "spotguard"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,18}$", var.name))
    error_message = "name must be 2-19 characters of a-z, 0-9 and '-', starting with a letter (service account ids are short)."
  }
}

variable "jobs" {
  description = <<-EOT
    Jobs to protect, by job name (the spotguard job name: also the image prefix in the bucket and
    the spotguard-job label). Each job gets its own agent service account (which can reach only its
    own prefix) and its own instance template whose startup script starts `command` under spotguard
    on first boot. machine_type / gpu_type / gpu_count override the defaults for that job.
  EOT
  type = map(object({
    command      = string
    machine_type = optional(string)
    gpu_type     = optional(string)
    gpu_count    = optional(number)
  }))

  validation {
    condition     = alltrue([for job in keys(var.jobs) : can(regex("^[a-z0-9][a-z0-9_-]{0,62}$", job))])
    error_message = "GCP job names are 1-63 characters of a-z 0-9 _ - (label values allow no '.')."
  }

  validation {
    condition     = alltrue([for job in values(var.jobs) : length(trimspace(job.command)) > 0])
    error_message = "Every job needs a non-empty command."
  }
}

variable "image" {
  description = "Boot image built from ami/spotguard.pkr.hcl: projects/<project>/global/images/<name> or .../images/family/<family>."
  type        = string
}

variable "machine_type" {
  description = "Default machine type (A3/A2/G2 types come with their GPUs attached; N1 types take gpu_type/gpu_count)."
  type        = string
  default     = "g2-standard-8"
}

variable "gpu_type" {
  description = "Accelerator type attached to each VM (nvidia-l4, nvidia-tesla-a100, nvidia-h100-80gb, ...)."
  type        = string
  default     = "nvidia-l4"
}

variable "gpu_count" {
  description = "Number of GPUs per VM."
  type        = number
  default     = 1

  validation {
    condition     = var.gpu_count >= 1 && var.gpu_count <= 16
    error_message = "gpu_count must be between 1 and 16."
  }
}

variable "network" {
  description = "VPC network of the GPU VMs."
  type        = string
  default     = "default"
}

variable "subnetwork" {
  description = "Subnetwork of the GPU VMs (null = the network's subnet in var.region). The VMs get no external IP: use Cloud NAT or Private Google Access."
  type        = string
  default     = null
}

variable "boot_disk_size_gb" {
  description = "Boot disk size in GB."
  type        = number
  default     = 200

  validation {
    condition     = var.boot_disk_size_gb >= 30
    error_message = "boot_disk_size_gb must be at least 30."
  }
}

variable "boot_disk_type" {
  description = "Boot disk type."
  type        = string
  default     = "pd-balanced"
}

variable "kms_key_name" {
  description = "Cloud KMS key (projects/.../cryptoKeys/...) for the bucket's default encryption (CMEK). null = Google-managed keys. The Cloud Storage service agent needs roles/cloudkms.cryptoKeyEncrypterDecrypter on it."
  type        = string
  default     = null
}

variable "enable_secure_boot" {
  description = "Shielded VM secure boot. Needs signed NVIDIA kernel modules (the image ami/ builds installs Ubuntu's signed ones)."
  type        = bool
  default     = true
}

variable "termination_action" {
  description = "What GCP does to a preempted SPOT VM: DELETE (the controller launches a new one) or STOP."
  type        = string
  default     = "DELETE"

  validation {
    condition     = contains(["DELETE", "STOP"], var.termination_action)
    error_message = "termination_action must be DELETE or STOP."
  }
}

variable "controller_url" {
  description = "URL the agents report to (POST {url}/v1/events). null = agents work alone."
  type        = string
  default     = null
}

variable "job_tokens" {
  description = "VM token of each job's first VM, by job name: `spotguard controller --issue-token JOB` on the controller host prints it (scoped to that one job; the controller gives every VM it relaunches a new one). Written to /etc/spotguard/controller-token (mode 0600) by that job's startup script only. Required for every job when controller_url is set. Never the admin token."
  type        = map(string)
  default     = {}
  sensitive   = true

  validation {
    condition     = alltrue([for job, token in var.job_tokens : startswith(token, "sgvm1.${job}.")])
    error_message = "Each job_tokens value must be that job's VM token (sgvm1.<job>.<epoch>.<mac>, from `spotguard controller --issue-token <job>`), never the admin token."
  }
}

variable "controller_token" {
  description = "Removed: one admin token in every VM's user data let any VM act for every job. Set job_tokens instead. Must stay null."
  type        = string
  default     = null
  sensitive   = true

  validation {
    condition     = var.controller_token == null
    error_message = "controller_token is no longer accepted (the admin token must not reach the VMs): issue one token per job with `spotguard controller --issue-token <job>` and set job_tokens."
  }
}

variable "controller_tls" {
  description = "Serve the controller over HTTPS (controller_config names the certificate and key the unit loads from /etc/spotguard/controller.crt and controller.key as credentials). false = private-network mode: plain HTTP with insecure_listen = true, only on a network you trust or behind a TLS proxy."
  type        = bool
  default     = true
}

variable "bucket_name" {
  description = "Image bucket name (null = \"<project>-<name>-images\")."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Let terraform destroy delete a non-empty bucket (and every checkpoint image in it)."
  type        = bool
  default     = false
}

variable "noncurrent_version_days" {
  description = "Days a replaced or deleted object version is kept."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1
    error_message = "noncurrent_version_days must be at least 1."
  }
}

variable "abort_multipart_days" {
  description = "Days after which an unfinished multipart upload (a checkpoint cut off mid-stream) is removed."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_multipart_days >= 1
    error_message = "abort_multipart_days must be at least 1."
  }
}

variable "chunk_expiration_days" {
  description = "Delete image chunks (<job>/chunks/) this many days after upload; 0 = never. Only when every older image is disposable: `spotguard images gc` removes unreferenced chunks safely."
  type        = number
  default     = 0

  validation {
    condition     = var.chunk_expiration_days >= 0
    error_message = "chunk_expiration_days must be 0 (off) or more."
  }
}

variable "access_log_bucket" {
  description = "Bucket receiving usage logs of the image bucket (null = none)."
  type        = string
  default     = null
}

variable "labels" {
  description = "Labels added to every resource that takes labels."
  type        = map(string)
  default     = {}
}

variable "job_signing_keys" {
  description = "Image signing keys made outside Terraform (`spotguard images keygen job.key`), by job: secret = the Secret Manager secret (projects/<p>/secrets/<s>) holding the job's Ed25519 private key, verify_key = its public key(s) (ssh-ed25519 lines). Jobs not named get a pair generated by Terraform (the private key is then in the state too). The module binds the job's service account to the secret."
  type = map(object({
    secret     = string
    verify_key = string
  }))
  default = {}

  validation {
    condition     = alltrue([for k in values(var.job_signing_keys) : can(regex("^projects/[^/]+/secrets/[^/]+$", k.secret))])
    error_message = "job_signing_keys secret values must look like projects/<project>/secrets/<secret>."
  }

  validation {
    condition = alltrue([for k in values(var.job_signing_keys) : alltrue([
      for line in split("\n", k.verify_key) : startswith(trimspace(line), "ssh-ed25519 ") if trimspace(line) != ""
    ]) && length(trimspace(k.verify_key)) > 0])
    error_message = "job_signing_keys verify_key must be ssh-ed25519 public key lines."
  }
}

variable "previous_verify_keys" {
  description = "Public key(s) of an earlier fleet-wide signing key (ssh-ed25519 lines or PEM), still trusted for every job's images until the images it signed are gone: set it to `terraform output image_verify_key` from before the upgrade to per-job keys. null = none."
  type        = string
  default     = null
}

variable "image_signing_key_secret" {
  description = "Removed: one fleet-wide signing key readable by every job's VMs let one VM sign images of every job. Each job now has its own key (job_signing_keys for keys made outside Terraform). Must stay null."
  type        = string
  default     = null

  validation {
    condition     = var.image_signing_key_secret == null
    error_message = "image_signing_key_secret is no longer accepted (one key for every job let any VM sign any job's images): name each job's secret in job_signing_keys, and keep the old public key in previous_verify_keys until its images are gone."
  }
}

variable "image_verify_key" {
  description = "Removed with image_signing_key_secret: set job_signing_keys (per job) and previous_verify_keys (the old fleet key) instead. Must stay null."
  type        = string
  default     = null

  validation {
    condition     = var.image_verify_key == null
    error_message = "image_verify_key is no longer accepted: each job's public key goes in job_signing_keys, an earlier fleet key in previous_verify_keys."
  }
}

variable "controller_listen" {
  description = "HOST:PORT the controller listens on, written to controller_config ([controller] listen)."
  type        = string
  default     = "0.0.0.0:8700"
}

variable "zones" {
  description = "Zones the controller launches the GPU VMs in, in failover order (controller_config [gcp] gcp_zones). null = <region>-a, -b and -c."
  type        = list(string)
  default     = null
}
