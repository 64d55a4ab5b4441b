variable "name" {
  description = "Prefix of every resource name (bucket, roles, queue, launch templates)."
  type        = string
  default     = "spotguard"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 characters of a-z, 0-9 and '-', starting with a letter."
  }
}

variable "jobs" {
  description = <<-EOT
    Jobs to protect, by job name (the spotguard job name: also the image prefix in the bucket and
    the spotguard:job tag). Each job gets its own agent role (which can reach only its own prefix)
    and its own launch template whose user-data starts `command` under spotguard on first boot.
    instance_type overrides var.instance_type for that job.
  EOT
  type = map(object({
    command       = string
    instance_type = optional(string)
  }))

  validation {
    condition     = alltrue([for job in keys(var.jobs) : can(regex("^[a-z0-9][a-z0-9._-]{0,62}$", job))])
    error_message = "Job names are 1-63 characters of a-z 0-9 . _ - starting with a letter or digit."
  }

  validation {
    condition     = alltrue([for job in values(var.jobs) : length(trimspace(job.command)) > 0])
    error_message = "Every job needs a non-empty command."
  }
}

variable "ami_id" {
  description = "Machine image built from ami/spotguard.pkr.hcl (NVIDIA driver >= 570, CRIU >= 4.2.1, spotguard)."
  type        = string

  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "ami_id must look like ami-0123456789abcdef0."
  }
}

variable "instance_type" {
  description = "Default GPU instance type of the launch templates (the controller may pick another matching type)."
  type        = string
  default     = "g6.xlarge"
}

variable "security_group_ids" {
  description = "Security groups of the GPU instances. The agent needs outbound HTTPS (S3, controller) only."
  type        = list(string)
  default     = []
}

variable "subnet_ids" {
  description = "Subnets the controller may launch GPU instances into (its role may use no other; controller_config maps each subnet's zone to it). [] = any subnet of the account in the region (the default VPC's, as EC2 picks by zone)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for id in var.subnet_ids : can(regex("^subnet-[0-9a-f]{8,17}$", id))])
    error_message = "subnet_ids must look like subnet-0123456789abcdef0."
  }
}

variable "key_name" {
  description = "EC2 key pair for SSH to the GPU instances (null = none; use SSM Session Manager instead)."
  type        = string
  default     = null
}

variable "root_volume_size_gb" {
  description = "Root volume size in GiB (holds the OS, CUDA libraries and, without enough RAM, the staging area)."
  type        = number
  default     = 200

  validation {
    condition     = var.root_volume_size_gb >= 30 && var.root_volume_size_gb <= 16384
    error_message = "root_volume_size_gb must be between 30 and 16384."
  }
}

variable "metadata_hop_limit" {
  description = "IMDSv2 PUT response hop limit. 1 keeps tokens on the host (the agent runs on the host); 2 only if the agent runs in a container."
  type        = number
  default     = 1

  validation {
    condition     = var.metadata_hop_limit >= 1 && var.metadata_hop_limit <= 2
    error_message = "metadata_hop_limit must be 1 or 2."
  }
}

variable "controller_url" {
  description = "URL the agents report to (POST {url}/v1/events). null = agents work alone."
  type        = string
  default     = null
}

variable "controller_listen" {
  description = "HOST:PORT the controller listens on, written to controller_config ([controller] listen)."
  type        = string
  default     = "0.0.0.0:8700"
}

variable "job_tokens" {
  description = "VM token of each job's first VM, by job name: `spotguard controller --issue-token JOB` on the controller host prints it (scoped to that one job; the controller gives every VM it relaunches a new one). Written to /etc/spotguard/controller-token (mode 0600) by that job's first-boot user-data only. Required for every job when controller_url is set. Never the admin token."
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

variable "controller_trusted_principal_arns" {
  description = "IAM principals (besides EC2 instances) allowed to assume the controller role, e.g. an operator role."
  type        = list(string)
  default     = []
}

variable "bucket_name" {
  description = "Image bucket name (null = \"<name>-images-<account id>-<region>\")."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Let terraform destroy delete a non-empty bucket (and every checkpoint image in it)."
  type        = bool
  default     = false
}

variable "noncurrent_version_days" {
  description = "Days an overwritten or deleted object version is kept before it expires."
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
  description = "Expire image chunks (<job>/chunks/) this many days after upload; 0 = never. Only set it when every image older than that is disposable: `spotguard images gc` removes unreferenced chunks safely."
  type        = number
  default     = 0

  validation {
    condition     = var.chunk_expiration_days >= 0
    error_message = "chunk_expiration_days must be 0 (off) or more."
  }
}

variable "access_log_bucket" {
  description = "Bucket receiving S3 server access logs of the image bucket (null = no access logging)."
  type        = string
  default     = null
}

variable "kms_deletion_window_days" {
  description = "Waiting period before the KMS key is deleted after terraform destroy."
  type        = number
  default     = 30

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30
    error_message = "kms_deletion_window_days must be between 7 and 30."
  }
}

variable "queue_retention_seconds" {
  description = "How long an interruption event waits in the fleet queue for the controller."
  type        = number
  default     = 86400

  validation {
    condition     = var.queue_retention_seconds >= 60 && var.queue_retention_seconds <= 1209600
    error_message = "queue_retention_seconds must be between 60 and 1209600."
  }
}

variable "max_receive_count" {
  description = "Deliveries of one event before it moves to the dead-letter queue."
  type        = number
  default     = 5

  validation {
    condition     = var.max_receive_count >= 1 && var.max_receive_count <= 1000
    error_message = "max_receive_count must be between 1 and 1000."
  }
}

variable "health_events" {
  description = "Also route AWS Health scheduled changes for EC2 (instance retirement, maintenance) to the fleet queue."
  type        = bool
  default     = true
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}

variable "root_device_name" {
  description = "Root device name of the machine image (/dev/sda1 for the Ubuntu images ami/ builds on)."
  type        = string
  default     = "/dev/sda1"
}

variable "job_signing_keys" {
  description = "Image signing keys made outside Terraform (`spotguard images keygen job.key`), by job: secret_arn = the Secrets Manager secret holding the job's Ed25519 private key, verify_key = its public key(s) (ssh-ed25519 lines; several during a rotation). Jobs not named get a pair generated by Terraform (the private key is then in the state too). A secret under another KMS key needs kms:Decrypt for the job's role."
  type = map(object({
    secret_arn = string
    verify_key = string
  }))
  default = {}

  validation {
    condition     = alltrue([for k in values(var.job_signing_keys) : can(regex("^arn:[^:]+:secretsmanager:[^:]+:[0-9]+:secret:.+$", k.secret_arn))])
    error_message = "job_signing_keys secret_arn values must be Secrets Manager secret ARNs."
  }

  validation {
    condition = alltrue([for k in values(var.job_signing_keys) : alltrue([
      for line in split("\n", k.verify_key) : startswith(trimspace(line), "ssh-ed25519 ") if trimspace(line) != ""
    ]) && length(trimspace(k.verify_key)) > 0])
    error_message = "job_signing_keys verify_key must be ssh-ed25519 public key lines (the .pub file `spotguard images keygen` writes, or ssh-keygen -y)."
  }
}

variable "previous_verify_keys" {
  description = "Public key(s) of an earlier fleet-wide signing key (ssh-ed25519 lines or PEM), still trusted for every job's images until the images it signed are gone: set it to `terraform output image_verify_key` from before the upgrade to per-job keys. null = none."
  type        = string
  default     = null
}

variable "image_signing_key_secret_arn" {
  description = "Removed: one fleet-wide signing key readable by every job's VMs let one VM sign images of every job. Each job now has its own key (job_signing_keys for keys made outside Terraform). Must stay null."
  type        = string
  default     = null

  validation {
    condition     = var.image_signing_key_secret_arn == null
    error_message = "image_signing_key_secret_arn is no longer accepted (one key for every job let any VM sign any job's images): name each job's secret in job_signing_keys, and keep the old public key in previous_verify_keys until its images are gone."
  }
}

variable "image_verify_key" {
  description = "Removed with image_signing_key_secret_arn: set job_signing_keys (per job) and previous_verify_keys (the old fleet key) instead. Must stay null."
  type        = string
  default     = null

  validation {
    condition     = var.image_verify_key == null
    error_message = "image_verify_key is no longer accepted: each job's public key goes in job_signing_keys, an earlier fleet key in previous_verify_keys."
  }
}
